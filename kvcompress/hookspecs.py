"""pluggy hook specifications: one hook per component kind, plus one for named methods.

A plugin is a module (or object) registered under the entry-point group ``kvcompress``; it
implements any subset of these hooks with :data:`hookimpl`. Each hook returns a list of
records; the registry tags every record with the plugin that returned it, so a name claimed
twice is reported with both providers.
"""

from __future__ import annotations

import pluggy

from .components import ComponentSpec, MethodSpec

__all__ = ["PROJECT", "hookspec", "hookimpl", "ComponentSpecs"]

PROJECT = "kvcompress"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class ComponentSpecs:
    """The hooks a kvcompress plugin may implement."""

    @hookspec
    def kvcompress_scorers(self) -> list[ComponentSpec]:
        """Return the Scorer components this plugin provides (``kind="scorer"``)."""

    @hookspec
    def kvcompress_selectors(self) -> list[ComponentSpec]:
        """Return the Selector components this plugin provides (``kind="selector"``)."""

    @hookspec
    def kvcompress_dispositions(self) -> list[ComponentSpec]:
        """Return the Disposition components this plugin provides (``kind="disposition"``)."""

    @hookspec
    def kvcompress_budgets(self) -> list[ComponentSpec]:
        """Return the Budget components this plugin provides (``kind="budget"``)."""

    @hookspec
    def kvcompress_methods(self) -> list[MethodSpec]:
        """Return named methods: compositions of registered components with default params."""


#: hook name -> component kind (``None`` for methods)
HOOK_KINDS = {
    "kvcompress_scorers": "scorer",
    "kvcompress_selectors": "selector",
    "kvcompress_dispositions": "disposition",
    "kvcompress_budgets": "budget",
    "kvcompress_methods": None,
}
