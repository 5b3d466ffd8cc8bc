"""Shared by the contract tests that feed deliberately broken components to the checks."""

from __future__ import annotations

from kvcompress import ComponentSpec


def spec(kind, name, cls):
    return ComponentSpec(kind, name, cls, f"deliberately broken {kind} for the contract tests")
