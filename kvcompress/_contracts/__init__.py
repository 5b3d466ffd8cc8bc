"""Implementation of :mod:`kvcompress.testing` (the public entry point); see that module."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["ContractFailure", "ContractReport", "fail", "ensure"]


class ContractFailure(AssertionError):
    """A component or method broke its kind's contract; the message names the check."""


@attrs.define
class ContractReport:
    """What a ``check_*`` call verified: the checks that passed and those that did not apply."""

    subject: str
    passed: list = attrs.field(factory=list)
    skipped: dict = attrs.field(factory=dict)
    details: dict = attrs.field(factory=dict)

    def ok(self, check: str) -> None:
        if check not in self.passed:
            self.passed.append(check)

    def skip(self, check: str, reason: str) -> None:
        self.skipped[check] = reason

    def merge(self, other: "ContractReport", prefix: str = "") -> None:
        for c in other.passed:
            self.ok(prefix + c)
        for c, r in other.skipped.items():
            self.skipped[prefix + c] = r

    def __str__(self) -> str:
        lines = [f"{self.subject}: {len(self.passed)} checks passed"]
        lines += [f"  ok   {c}" for c in self.passed]
        lines += [f"  skip {c}: {r}" for c, r in self.skipped.items()]
        return "\n".join(lines)


def fail(subject: str, check: str, message: str) -> "ContractFailure":
    return ContractFailure(f"{subject}: contract '{check}' broken: {message}")


def ensure(cond: Any, subject: str, check: str, message: str) -> None:
    """Raise :class:`ContractFailure` naming ``check`` unless ``cond`` holds."""
    if not cond:
        raise fail(subject, check, message)
