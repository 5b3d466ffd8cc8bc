"""Plugin discovery and the registry of named components and methods.

Plugins, built-in and third-party alike, are found through the entry-point group
``kvcompress``. A plugin that fails to import or register is reported with its name and skipped
(``KVCOMPRESS_STRICT_PLUGINS=1`` makes that fatal); ``KVCOMPRESS_DISABLE_PLUGINS=a,b`` blocks
plugins by entry-point name (a name no entry point has is warned about); a method that needs a
disabled plugin's component is listed as unavailable, with why. A component or method name
claimed by two plugins is an error that names both providers (``kvcompress plugins`` and
``doctor`` list the second claimant as failed, with that reason, instead).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import threading
import warnings
from typing import Any, Iterable, Optional

import attrs
import pluggy

from .components import KINDS, ComponentSpec, MethodSpec
from .config import did_you_mean
from .errors import PluginError
from .hookspecs import HOOK_KINDS, PROJECT, ComponentSpecs

__all__ = ["Registry", "get_registry", "reset_registry", "PluginInfo", "Provided"]

ENV_DISABLE = "KVCOMPRESS_DISABLE_PLUGINS"
ENV_STRICT = "KVCOMPRESS_STRICT_PLUGINS"


@attrs.frozen
class Provided:
    """A registered record and who provided it."""

    spec: Any
    plugin: str
    dist: str
    version: str

    @property
    def provider(self) -> str:
        return f"plugin {self.plugin!r} ({self.dist} {self.version})".replace(" )", ")")


@attrs.frozen
class PluginInfo:
    """One plugin as the ``kvcompress plugins`` command lists it."""

    name: str
    dist: str
    version: str
    status: str  # "active", "disabled" or "failed"
    components: tuple = ()
    error: str = ""


def _env_list(name: str) -> set[str]:
    return {x.strip() for x in os.environ.get(name, "").split(",") if x.strip()}


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


class Registry:
    """Named components (by kind) and methods collected from plugins.

    Args:
        entry_points: discover plugins from the ``kvcompress`` entry-point group.
        plugins: extra ``(name, plugin_object)`` pairs to register (tests, notebooks).
        disabled: entry-point names to block; defaults to ``$KVCOMPRESS_DISABLE_PLUGINS``.
        strict: raise on a broken plugin instead of warning; defaults to
            ``$KVCOMPRESS_STRICT_PLUGINS``.
        tolerate_collisions: list a plugin whose name, or a component or method name it
            claims, is already taken as failed (with the reason) instead of raising; what the
            listing and diagnostic commands (``kvcompress plugins``, ``doctor``) use.
    """

    def __init__(
        self,
        *,
        entry_points: bool = True,
        plugins: Iterable[tuple[str, Any]] = (),
        disabled: Optional[Iterable[str]] = None,
        strict: Optional[bool] = None,
        tolerate_collisions: bool = False,
    ):
        self.strict = _truthy(ENV_STRICT) if strict is None else bool(strict)
        self.tolerate_collisions = bool(tolerate_collisions)
        self.disabled = set(_env_list(ENV_DISABLE) if disabled is None else disabled)
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(ComponentSpecs)
        self._dists: dict[str, tuple[str, str]] = {}
        self._infos: list[PluginInfo] = []
        #: (kind, name) -> the disabled plugin that provides it (kind None for methods)
        self.disabled_names: dict[tuple[Optional[str], str], str] = {}
        if entry_points:
            self._load_entry_points()
        for name, obj in plugins:
            self._register(name, obj, ("<in-process>", ""))
        self.components: dict[str, dict[str, Provided]] = {k: {} for k in KINDS}
        self.methods: dict[str, Provided] = {}
        self._collect()

    # -- loading -------------------------------------------------------------------------------

    def _fail(self, name: str, dist: tuple[str, str], what: str, exc: BaseException):
        source = " ".join(x for x in dist if x)
        msg = f"kvcompress plugin {name!r} from {source} {what}: {exc!r}"
        if self.strict:
            raise PluginError(msg + f" (unset {ENV_STRICT} to skip broken plugins)") from exc
        warnings.warn(msg + "; it was skipped", RuntimeWarning, stacklevel=4)
        self._infos.append(PluginInfo(name, dist[0], dist[1], "failed", (), repr(exc)))

    def _load_entry_points(self):
        seen = set()
        for ep in md.entry_points(group=PROJECT):
            if (ep.name, ep.value) in seen:
                continue
            seen.add((ep.name, ep.value))
            dist = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("?", "")
            if ep.name in self.disabled:
                self.pm.set_blocked(ep.name)
                self._infos.append(PluginInfo(ep.name, dist[0], dist[1], "disabled"))
                self._note_disabled(ep)
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a third-party import error must not break kvcompress
                self._fail(ep.name, dist, "failed to import", exc)
                continue
            self._register(ep.name, obj, dist)
        unknown = sorted(self.disabled - {name for name, _ in seen})
        if unknown:
            warnings.warn(
                f"{ENV_DISABLE} names unknown plugin(s) {unknown}; known plugins: "
                f"{sorted({name for name, _ in seen})}", RuntimeWarning, stacklevel=3,
            )

    def _note_disabled(self, ep):
        """Record the names a disabled plugin would provide, read in a side plugin manager."""
        side = pluggy.PluginManager(PROJECT)
        side.add_hookspecs(ComponentSpecs)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                side.register(ep.load(), name=ep.name)
                for hook_name, kind in HOOK_KINDS.items():
                    for records in getattr(side.hook, hook_name)():
                        for rec in records or ():
                            self.disabled_names.setdefault((kind, rec.name), ep.name)
        except Exception:  # a plugin may be disabled because it is broken: then we know less
            pass

    def _register(self, name: str, obj: Any, dist: tuple[str, str]):
        if self.pm.has_plugin(name):
            other = self._dists.get(name, ("?", ""))
            msg = (f"two plugins are named {name!r}: one from {other[0]} {other[1]}, "
                   f"one from {dist[0]} {dist[1]}; uninstall one or disable it with {ENV_DISABLE}")
            if not self.tolerate_collisions:
                raise PluginError(msg)
            self._infos.append(PluginInfo(name, dist[0], dist[1], "failed", (), msg))
            return
        try:
            self.pm.register(obj, name=name)
            self.pm.check_pending()  # a misspelled hook name is an error, not silence
        except Exception as exc:
            if self.pm.is_registered(obj):
                self.pm.unregister(obj)
            self._fail(name, dist, "could not be registered", exc)
            return
        self._dists[name] = dist

    # -- collecting records ----------------------------------------------------------------

    def _collect(self):
        provided: dict[str, list[str]] = {}
        entries: list[tuple[Optional[str], Provided]] = []
        for hook_name, kind in HOOK_KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                dist, version = self._dists.get(impl.plugin_name, ("?", ""))
                try:
                    records = list(impl.function() or [])
                    for rec in records:
                        self._check_record(rec, kind, hook_name)
                except Exception as exc:
                    self._fail(impl.plugin_name, (dist, version), f"returned a bad {hook_name}", exc)
                    continue
                entries += [(kind, Provided(rec, impl.plugin_name, dist, version)) for rec in records]
        excluded = self._collisions(entries)
        for kind, entry in entries:
            if entry.plugin in excluded:
                continue
            table = self.methods if kind is None else self.components[kind]
            table[entry.spec.name] = entry
            provided.setdefault(entry.plugin, []).append(f"{kind or 'method'}:{entry.spec.name}")
        for pname, msg in excluded.items():
            dist, version = self._dists[pname]
            self._infos.append(PluginInfo(pname, dist, version, "failed", (), msg))
        known = {(i.name, i.dist) for i in self._infos}  # a same-named failed plugin is another row
        for pname, (dist, version) in self._dists.items():
            if (pname, dist) not in known:
                comps = tuple(provided.get(pname, ()))
                self._infos.append(PluginInfo(pname, dist, version, "active", comps))

    def _collisions(self, entries) -> dict[str, str]:
        """``{plugin: why}`` for each plugin claiming a component or method name an earlier one
        holds (every one of its records is then left out); a PluginError naming both providers
        unless ``tolerate_collisions``."""
        excluded: dict[str, str] = {}
        while True:
            owner: dict[tuple, Provided] = {}
            found = None
            for kind, entry in entries:
                if entry.plugin in excluded:
                    continue
                key = (kind, entry.spec.name)
                if key in owner:
                    what = "method" if kind is None else kind
                    found = (entry.plugin, f"{what} name {entry.spec.name!r} is claimed twice: by "
                                           f"{owner[key].provider} and by {entry.provider}; "
                                           f"disable one with {ENV_DISABLE}=<plugin>")
                    break
                owner[key] = entry
            if found is None:
                return excluded
            if not self.tolerate_collisions:
                raise PluginError(found[1])
            excluded[found[0]] = found[1]

    @staticmethod
    def _check_record(rec, kind, hook_name):
        if kind is None:
            if not isinstance(rec, MethodSpec):
                raise TypeError(f"{hook_name} must return MethodSpec records, got {rec!r}")
            return
        if not isinstance(rec, ComponentSpec):
            raise TypeError(f"{hook_name} must return ComponentSpec records, got {rec!r}")
        if rec.kind != kind:
            raise TypeError(f"{hook_name} returned a {rec.kind} ({rec.name!r}), not a {kind}")

    # -- lookup ----------------------------------------------------------------------------------

    def component(self, kind: str, name: str) -> ComponentSpec:
        """The component of ``kind`` called ``name``; an unknown name lists the registered ones."""
        from .errors import ConfigError

        if kind not in self.components:
            raise ConfigError(f"unknown component kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        table = self.components[kind]
        if name not in table:
            raise ConfigError(self._unknown(kind, name, table))
        return table[name].spec

    def method(self, name: str) -> MethodSpec:
        """The named method; an unknown name lists the registered ones."""
        from .errors import ConfigError

        if name not in self.methods:
            raise ConfigError(self._unknown(None, name, self.methods))
        return self.methods[name].spec

    def _unknown(self, kind: Optional[str], name: str, table: dict) -> str:
        what = kind or "method"
        plugin = self.disabled_names.get((kind, name))
        if plugin is not None:
            return f"{self._disabled_why(kind, name)}; remove {plugin!r} from {ENV_DISABLE} to re-enable it"
        hint = did_you_mean(name, sorted(table)) or ";"
        return f"unknown {what} {name!r}{hint} registered {what}s: {', '.join(sorted(table)) or '(none)'}"

    def _disabled_why(self, kind: Optional[str], name: str) -> str:
        plugin = self.disabled_names[(kind, name)]
        return f"{kind or 'method'} {name!r} comes from plugin {plugin!r}, which is disabled"

    def unavailable(self, name: str) -> Optional[str]:
        """Why the registered method ``name`` cannot be built (a missing component), or None."""
        spec = self.methods[name].spec
        for kind in KINDS:
            comp = getattr(spec, kind)
            if comp not in self.components[kind]:
                if (kind, comp) in self.disabled_names:
                    return self._disabled_why(kind, comp)
                return f"{kind} {comp!r} is not registered"
        return None

    def provider(self, kind: Optional[str], name: str) -> Provided:
        return self.methods[name] if kind is None else self.components[kind][name]

    def plugins(self) -> list[PluginInfo]:
        """Every plugin seen: active, disabled or failed."""
        return sorted(self._infos, key=lambda p: (p.status != "active", p.name))

    def failed(self) -> list[PluginInfo]:
        return [p for p in self._infos if p.status == "failed"]


_LOCK = threading.Lock()
_DEFAULT: Optional[Registry] = None


def get_registry() -> Registry:
    """The process-wide registry, discovered on first use."""
    global _DEFAULT
    with _LOCK:
        if _DEFAULT is None:
            _DEFAULT = Registry()
        return _DEFAULT


def reset_registry() -> None:
    """Forget the process-wide registry so the next :func:`get_registry` rediscovers plugins."""
    global _DEFAULT
    with _LOCK:
        _DEFAULT = None
