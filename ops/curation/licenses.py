"""Licenses as SPDX expressions, judged against a configured allow-list.

A license value is an SPDX license expression: one identifier (``CC-BY-4.0``), or several joined
by ``AND`` / ``OR`` (``MIT OR Apache-2.0``), with ``WITH`` exceptions. Identifiers come from the
SPDX license list that ships with the ``license-expression`` package (read once, offline); a
lab's own terms are ``LicenseRef-<name>``, valid by the SPDX specification and accepted only
when the allow-list names them.

An expression is allowed when it can be honoured with allowed licenses alone: every side of an
``AND`` must be allowed, one side of an ``OR`` is enough. Anything that is not an SPDX
expression is ``unknown_license``, never a pass: "any non-empty string" is not a license.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

MISSING_LICENSE = "missing_license"
UNKNOWN_LICENSE = "unknown_license"
LICENSE_NOT_ALLOWED = "license_not_allowed"

DEFAULT_ALLOWED_LICENSES: tuple[str, ...] = (
    "CC0-1.0", "PDDL-1.0", "CC-BY-3.0", "CC-BY-4.0", "CC-BY-SA-3.0", "CC-BY-SA-4.0", "ODC-By-1.0",
    "MIT", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause",
)
"""Attribution and share-alike terms a lab can train on; non-commercial and no-derivatives
licenses (``CC-BY-NC-*``, ``CC-BY-ND-*``) are left out on purpose. A deployment names its own."""

_LICENSE_REF = re.compile(r"^(DocumentRef-[A-Za-z0-9.\-]+:)?LicenseRef-[A-Za-z0-9.\-]+$")


@dataclass(frozen=True, slots=True)
class Verdict:
    code: str
    """"" when allowed; else MISSING_LICENSE, UNKNOWN_LICENSE or LICENSE_NOT_ALLOWED."""
    detail: str
    normalized: str
    """The expression in SPDX's canonical spelling ("" when it does not parse)."""


@functools.cache
def _licensing():
    from license_expression import get_spdx_licensing  # reads the bundled SPDX list (~40 ms), once

    return get_spdx_licensing()


def _parse(expression: str):
    """(parsed expression, error): unknown identifiers other than LicenseRef-* are an error."""
    from license_expression import ExpressionError, ExpressionParseError

    licensing = _licensing()
    try:
        parsed = licensing.parse(expression, validate=False, strict=True)
    except (ExpressionError, ExpressionParseError, TypeError, ValueError) as error:
        return None, f"{expression!r} is not an SPDX license expression ({error})"
    if parsed is None:
        return None, f"{expression!r} is not an SPDX license expression"
    unknown = [key for key in licensing.unknown_license_keys(parsed) if not _LICENSE_REF.match(key)]
    if unknown:
        return None, (f"{expression!r} names {', '.join(map(repr, unknown))}, not an SPDX license identifier "
                      "(https://spdx.org/licenses/; a lab's own terms are LicenseRef-<name>)")
    return parsed, ""


def normalize(expression: str) -> str:
    """The canonical spelling of a valid expression; raises ValueError naming what is wrong."""
    parsed, error = _parse(expression)
    if parsed is None:
        raise ValueError(error)
    return str(parsed)


def check_allow_list(licenses) -> tuple[str, ...]:
    """The allow-list in canonical spelling; raises ValueError for an entry that is no SPDX identifier
    (a typo in the allow-list would otherwise refuse, or admit, data silently)."""
    if isinstance(licenses, str):
        raise ValueError(f"the license allow-list is a list of SPDX identifiers, not the string {licenses!r}")
    normalized = []
    for entry in licenses:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"license allow-list entry {entry!r} is not an SPDX identifier")
        single = normalize(entry.strip())
        if any(f" {word} " in f" {single} " for word in ("AND", "OR")):
            raise ValueError(f"license allow-list entry {entry!r} is an expression; list each SPDX identifier "
                             "on its own (an expression is allowed when the list can satisfy it)")
        normalized.append(single)
    return tuple(sorted(set(normalized)))


def _allowed(node, allowed: frozenset[str]) -> bool:
    from license_expression import AND, OR

    if isinstance(node, AND):
        return all(_allowed(arg, allowed) for arg in node.args)
    if isinstance(node, OR):
        return any(_allowed(arg, allowed) for arg in node.args)
    # A symbol, or "X WITH exception": allowed when listed whole or, for WITH, when X itself is listed.
    rendered = str(node)
    return rendered in allowed or str(getattr(node, "license_symbol", node)) in allowed


@functools.lru_cache(maxsize=65_536)
def judge(value, allowed: tuple[str, ...] = DEFAULT_ALLOWED_LICENSES) -> Verdict:
    """The verdict on one license value (cached: a million rows hold few distinct licenses)."""
    if not isinstance(value, str) or not value.strip():
        return Verdict(MISSING_LICENSE, "no license is stated", "")
    parsed, error = _parse(value.strip())
    if parsed is None:
        return Verdict(UNKNOWN_LICENSE, error, "")
    normalized = str(parsed)
    if not _allowed(parsed, frozenset(allowed)):
        return Verdict(LICENSE_NOT_ALLOWED, f"license {normalized} is not in the allow-list {list(allowed)}",
                       normalized)
    return Verdict("", "", normalized)
