"""
Kubernetes resource quantities, read as the API server reads them.

The webhook sees a pod before the API server validates it, and a pod
qualifies only when a container asks for a positive amount of a configured
resource: C{nvidia.com/gpu: "0"} (or C{"0.0"}, C{"00"}, C{"0Gi"}, C{"-0"},
C{0}) asks for none, and such a pod may land on a node without a GPU, where
the broker never prepared its directories.  So the amount is parsed with
the grammar of apimachinery's C{resource.Quantity}
(C{k8s.io/apimachinery/pkg/api/resource/quantity.go}, C{ParseQuantity} and
C{parseQuantityString}; C{suffix.go} for the suffixes), written here from
that grammar, not copied::

    <quantity>     ::= <signedNumber><suffix>
    <signedNumber> ::= <number> | <sign><number>
    <number>       ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>       ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>     ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>    ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>

In JSON a quantity is a string, or a bare number (C{Quantity.UnmarshalJSON}
parses the raw bytes of a non-string).  Anything that does not parse is
refused by the API server after the webhook, so here it is simply not a
positive amount.  Values below the nano precision round up in Kubernetes
(still positive), and an exact L{Fraction} keeps every positive amount
positive here too.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?(.*)", re.S)
_EXPONENT = re.compile(r"[eE]([+-]?[0-9]+)")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15,
            "E": 18}
#: Longer strings are never a quantity a pod means (and bound the work:
#: exponents are applied as exact fractions).
MAX_LENGTH = 64
#: An exponent further from zero than any resource amount (apimachinery's
#: own bound is far lower in practice: C{inf.Dec}'s scale is an int32).
MAX_EXPONENT = 1000


def parse(value: Any) -> Fraction | None:
    """
    The amount C{value} (a decoded JSON string or number) stands for, or
    None when Kubernetes would not parse it.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        value = repr(value)
    if not isinstance(value, str) or not value or len(value) > MAX_LENGTH:
        return None
    match = _NUMBER.fullmatch(value)
    if match is None:
        return None
    sign, whole, fraction, suffix = match.groups()
    if not whole and not fraction:
        return None
    digits = (whole or "0") + (fraction or "")
    amount = Fraction(int(digits), 10 ** len(fraction or ""))
    if suffix in _BINARY:
        amount *= 1024 ** _BINARY[suffix]
    elif suffix in _DECIMAL:
        amount *= Fraction(10) ** _DECIMAL[suffix]
    else:
        exponent = _EXPONENT.fullmatch(suffix)
        if exponent is None or abs(int(exponent.group(1))) > MAX_EXPONENT:
            return None
        amount *= Fraction(10) ** int(exponent.group(1))
    return -amount if sign == "-" else amount


def is_positive(value: Any) -> bool:
    """Whether C{value} is a quantity greater than zero."""
    amount = parse(value)
    return amount is not None and amount > 0
