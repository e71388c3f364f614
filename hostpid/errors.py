"""
The one shape of a refusal that names a path: C{PATH: RULE}.

The broker's startup checks and the allocation side's lock-parent checks
both refuse by naming the path and the rule broken, so an operator reading
one line knows what to fix.  They share this base so the message reads the
same everywhere.
"""

from __future__ import annotations


class PathRuleError(Exception):
    """
    C{path} breaks C{rule}.

    @cvar prefix: what kind of refusal this is, put before the path.
    @ivar path: the path that broke the rule.
    @ivar rule: the rule broken, in words an operator can act on.
    """

    prefix = ""

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(path, rule)
        self.path = path
        self.rule = rule

    def __str__(self) -> str:
        return f"{self.prefix}{self.path}: {self.rule}"


class MissingExtra(ImportError):
    """
    A part of the package needs a dependency that only one of its extras
    installs, and it is missing or of an unusable version; the message names
    the extra.  An C{ImportError}, so that importing that part fails as any
    missing dependency does; C{twistd} says it in one line
    (L{hostpid.servicemaker.ExtraServiceMaker}).
    """
