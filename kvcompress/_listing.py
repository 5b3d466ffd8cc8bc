"""What the listing commands (``methods``, ``components``, ``plugins``, :mod:`doctor
<kvcompress._doctor>`) share: the registry they list and the width of their name column."""

from __future__ import annotations

__all__ = ["_registry", "_width"]


def _registry(listing: bool = False):
    """The process-wide registry; ``listing``: for ``plugins`` and ``doctor``, which must still
    run when two plugins claim one name (the later claimant is listed as failed, with why)."""
    from .errors import PluginError
    from .registry import Registry, get_registry

    try:
        return get_registry()
    except PluginError:
        if not listing:
            raise
        return Registry(tolerate_collisions=True)


def _width(names, least: int = 16) -> int:
    """The name column's width: ``least``, or the longest name (a name never runs into the next
    column)."""
    return max([least, *(len(n) for n in names)])
