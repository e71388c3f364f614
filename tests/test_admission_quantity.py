"""
Kubernetes quantities as the webhook reads them (L{hostpid.admission.quantity}):
a pod qualifies only for a positive amount, so zero in any spelling must read
as zero, and every suffix and exponent form as its value.

The expected values are worked out from apimachinery's grammar
(C{resource.Quantity}): decimal SI suffixes are powers of ten, binary ones
powers of 1024, C{e}/C{E} a decimal exponent; a bare JSON number is parsed as
its text.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostpid.admission.quantity import is_positive, parse

ZEROS = ["0", "0.0", "00", "000.000", "0Gi", "0Ki", "0e3", "0E-3", "-0", "+0", ".0", "0.",
         "0m", "0n", "0k", "0E", 0, 0.0, -0.0]


@pytest.mark.parametrize("text", ZEROS, ids=repr)
def test_zero_in_every_spelling_is_zero(text: Any) -> None:
    assert parse(text) == 0 and not is_positive(text)


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("2", 2), ("1.5", Fraction(3, 2)), (".5", Fraction(1, 2)), ("1.", 1),
    ("500m", Fraction(1, 2)), ("1n", Fraction(1, 10**9)), ("3u", Fraction(3, 10**6)),
    ("1k", 1000), ("1M", 10**6), ("1G", 10**9), ("1T", 10**12), ("1P", 10**15),
    ("1E", 10**18), ("1Ki", 1024), ("2Mi", 2 * 1024**2), ("1Gi", 1024**3), ("1Ti", 1024**4),
    ("1Pi", 1024**5), ("1Ei", 1024**6), ("1e3", 1000), ("1E3", 1000), ("1e+3", 1000),
    ("1e-3", Fraction(1, 1000)), ("1.5e3", 1500), ("+1", 1), ("-1", -1), ("007", 7),
    (1, 1), (2.5, Fraction(5, 2)), (1e-05, Fraction(1, 100000)),
], ids=repr)
def test_suffixes_and_exponents(text: Any, value: Fraction) -> None:
    assert parse(text) == value


@pytest.mark.parametrize("text", ["", " 1", "1 ", "1e", "1Ki1", "1KB", "one", "1.2.3", "--1",
                                  "+", "-", ".", "1e1.5", "0x10", "1_000", "١", True, False,
                                  None, [], {}, "1" * 65, "1e99999"], ids=repr)
def test_what_kubernetes_refuses_is_not_positive(text: Any) -> None:
    assert parse(text) is None and not is_positive(text)


@given(st.decimals(min_value=Decimal("-1e12"), max_value=Decimal("1e12"), places=6,
                   allow_nan=False, allow_infinity=False),
       st.sampled_from(["", "m", "k", "Ki", "Mi", "e2", "e-2", "E1"]))
def test_a_decimal_with_any_suffix_has_its_sign(number: Decimal, suffix: str) -> None:
    text = f"{number:f}{suffix}"
    assert is_positive(text) == (number > 0), text
