"""Resolve a :class:`~kvcompress.config.MethodConfig` into a validated composition."""

from __future__ import annotations

import inspect
from typing import Any, Optional, Union

import attrs

from .components import CACHE_PROVIDES, KINDS, Budget, Disposition, MethodHooks, Scorer, Selector, component_hooks, method_hooks
from .config import ComponentConfig, MethodConfig, did_you_mean, structure_component
from .errors import CompositionError, ConfigError
from .registry import Registry, get_registry
from .storage import KVStorage

__all__ = ["Method", "build_method"]

_PROTOCOLS = {"scorer": Scorer, "selector": Selector, "disposition": Disposition, "budget": Budget}


@attrs.frozen
class Method:
    """One scorer, selector, disposition and budget, validated to work together."""

    name: str
    scorer: Any
    selector: Any
    disposition: Any
    budget: Any
    config: MethodConfig
    #: how caches of this method hold their kept slots (float, or low-bit codes)
    storage: KVStorage = attrs.field(factory=KVStorage)

    def component(self, kind: str) -> Any:
        return getattr(self, kind)

    def hooks(self) -> dict:
        """``{kind: {hook name: bound method}}`` of the optional hooks each component defines
        (only the names declared in :data:`~kvcompress.components.OPTIONAL_HOOKS`)."""
        return {kind: component_hooks(kind, self.component(kind)) for kind in KINDS}

    def hook_set(self) -> MethodHooks:
        """The same hooks as typed records with their defaults filled in (what the cache calls)."""
        return method_hooks({kind: self.component(kind) for kind in KINDS})

    def with_tokenizer(self, tokenizer: Any) -> "Method":
        """This method with each component's ``with_tokenizer(tokenizer)`` applied (symbolic
        token-id parameters resolved; ``tokenizer`` None when there is none), or ``self`` when
        nothing changes. :func:`kvcompress.make_prompt_cache` and :func:`kvcompress.attach` call
        it with their ``tokenizer=``; the caches record the resolved config."""
        comps = {}
        for kind in KINDS:
            comp = self.component(kind)
            hook = component_hooks(kind, comp).get("with_tokenizer")
            new = comp if hook is None else hook(tokenizer)
            if type(new) is not type(comp):
                raise CompositionError(f"{kind} {type(comp).__name__}.with_tokenizer returned a "
                                       f"{type(new).__name__}; return the component itself (attrs.evolve)")
            comps[kind] = new
        if all(comps[k] is self.component(k) for k in KINDS):
            return self
        config = attrs.evolve(self.config, **{k: ComponentConfig(self.config.component(k).name, _init_params(comps[k]))
                                              for k in KINDS})
        return attrs.evolve(self, config=config, **comps)

    def describe(self) -> str:
        parts = []
        for kind in KINDS:
            comp = self.component(kind)
            c = self.config.component(kind)
            parts.append(f"{kind}={c.name}({_fmt_params(comp)})")
        held = f"; storage {self.storage.describe()}" if self.storage.quantized else ""
        return f"{self.name}: " + ", ".join(parts) + held


def _fmt_params(comp) -> str:
    return ", ".join(f"{f.name}={_short(getattr(comp, f.name))}" for f in attrs.fields(type(comp)) if f.init)


def _short(value) -> str:
    """``repr``, a long tuple (a tokenizer's ids) cut to its ends and its length."""
    if isinstance(value, tuple) and len(value) > 12:
        return f"({', '.join(map(repr, value[:3]))}, ..., {value[-1]!r}: {len(value)} values)"
    return repr(value)


def build_method(
    config: Union[str, MethodConfig, dict, None] = None,
    registry: Optional[Registry] = None,
    **params: Any,
) -> Method:
    """Build a method from a name, a dict, or a :class:`MethodConfig`, plus flat parameters.

    ``build_method("cam", budget=64)`` and
    ``build_method(scorer="h2o", selector="lowest", disposition="drop", budget="uniform")`` both
    work. Flat parameters go to every component with a parameter of that name; a name no
    component has is an error listing the valid ones.
    """
    reg = registry or get_registry()
    size = params.get("budget")
    if isinstance(size, str) and size.strip().lstrip("+-").isdigit() and size not in reg.components["budget"]:
        raise ConfigError(
            f"budget {size!r} is a string; the budget size must be an int (budget={size.strip()}); a string "
            f"names a budget component ({', '.join(sorted(reg.components['budget']))})"
        )
    kinds_given = {k: params.pop(k) for k in KINDS if k in params and not _is_budget_number(k, params[k])}
    held = {k: params.pop(k) for k in _STORAGE if k in params}
    if isinstance(config, str) or config is None:
        config = MethodConfig(method=config, **kinds_given)
    elif isinstance(config, dict):
        config = MethodConfig.from_dict(config)
    elif kinds_given:
        config = attrs.evolve(config, **kinds_given)
    if not isinstance(config, MethodConfig):
        raise ConfigError(f"expected a method name, dict or MethodConfig, got {type(config).__name__}")

    flat: dict[str, Any] = {}
    defaults: set = set()  # the named method's own defaults: dropped where a swapped component lacks them
    names: dict[str, str] = {}
    label = config.method or "custom"
    if config.method is not None:
        spec = reg.method(config.method)
        names = {k: getattr(spec, k) for k in KINDS}
        flat.update(spec.params)
        defaults = set(spec.params)
    for kind in KINDS:
        c = config.component(kind)
        if c is not None and c.name:  # a table without a name keeps the method's component
            names[kind] = c.name
    missing = [k for k in KINDS if k not in names]
    if missing == ["budget"] and _is_budget_number("budget", params.get("budget", "")):
        raise ConfigError(
            f"a composed method names its budget component too: budget={params['budget']!r} is only a size. "
            f"Name the component and give the size with it, e.g. budget={{'name': 'uniform', 'budget': "
            f"{params['budget']!r}}} (budgets: {', '.join(sorted(reg.components['budget']))})"
        )
    if missing:
        choices = "; ".join(
            f"{k}s: {', '.join(sorted(reg.components[k])) or '(none)'}" for k in missing
        )
        raise ConfigError(
            f"a composed method needs one component of each kind; missing {missing}. "
            f"Name a method ({', '.join(sorted(reg.methods)) or 'none registered'}) or choose {choices}"
        )
    specs = {k: reg.component(k, names[k]) for k in KINDS}
    flat.update(config.params)
    defaults -= set(config.params)
    held = {**config.storage, **{k: flat.pop(k) for k in _STORAGE if k in flat}, **held}
    unknown = sorted(set(held) - set(_STORAGE))
    if unknown:
        raise ConfigError(f"unknown storage key(s) {unknown}; valid keys: {list(_STORAGE)}")
    storage = KVStorage.of(**held)

    per_kind: dict[str, dict[str, Any]] = {k: {} for k in KINDS}
    explicit = dict(params)  # keyword arguments win over everything a config pins
    for key, value in [*flat.items(), *explicit.items()]:
        owners = [k for k in KINDS if key in specs[k].params()]
        if not owners and (key == "seed" or (key in defaults and key not in explicit)):
            continue  # a seed is offered to seeded components; a replaced component's defaults go with it
        if not owners:
            valid = sorted({p for k in KINDS for p in specs[k].params()})
            raise ConfigError(
                f"unknown parameter {key!r} for method {label!r}{did_you_mean(key, valid) or ';'} "
                f"valid parameters: {valid}"
            )
        for k in owners:
            per_kind[k][key] = value
    for kind in KINDS:
        c = config.component(kind)
        if c is not None:
            per_kind[kind].update(c.params)
        per_kind[kind].update({k: v for k, v in explicit.items() if k in specs[kind].params()})

    comps = {}
    for kind in KINDS:
        comp = structure_component(specs[kind], per_kind[kind])
        if not isinstance(comp, _PROTOCOLS[kind]):
            raise CompositionError(
                f"{kind} {names[kind]!r} ({type(comp).__name__}) does not implement the {kind} protocol"
            )
        comps[kind] = comp

    _check_requirements(comps, names)
    problem = evict_count_problem(comps["selector"])
    if problem:
        raise CompositionError(f"selector {names['selector']!r} ({type(comps['selector']).__name__}): {problem}")
    if storage.quantized:
        _check_low_bit(comps["disposition"], names["disposition"])
    resolved = MethodConfig(
        method=config.method,
        params={},
        storage=storage.to_dict(),
        **{k: ComponentConfig(names[k], _init_params(comps[k])) for k in KINDS},
    )
    return Method(name=label, config=resolved, storage=storage, **comps)


#: the parameters of a method's storage (:class:`kvcompress.storage.KVStorage`)
_STORAGE = ("kv_bits", "kv_group_size")


def _check_low_bit(disposition, name: str) -> None:
    """Low-bit storage needs a disposition that lets the cache attend its slots as stored."""
    hooks = component_hooks("disposition", disposition)
    own = [h for h in ("attend", "view_keys") if h in hooks]
    if own:
        why = ("holds its own low-bit store and attends with its own rule (it already quantizes: "
               "use it without kv_bits)") if "attend" in own else (
               "rewrites every stored key at each step (view_keys), which low-bit slots would have to "
               "dequantize in full per step")
        raise CompositionError(
            f"kv_bits: disposition {name!r} {why}; use kv_bits with a disposition that stores slots "
            "as they are (drop, gated_merge, ...)"
        )


def _is_budget_number(kind: str, value: Any) -> bool:
    # ``budget=64`` is the uniform budget's size, ``budget="pyramid"`` names a component.
    return kind == "budget" and not isinstance(value, (str, dict, ComponentConfig))


def _init_params(comp) -> dict:
    return {f.name: getattr(comp, f.name) for f in attrs.fields(type(comp)) if f.init}


def evict_count_problem(selector) -> Optional[str]:
    """Why the selector's ``evict_count`` hook cannot be called as ``(n_evict, budget)`` (its
    form before the row's budget was passed took one argument), or None: checked when a method
    is built and by the selector contract, not left to the first eviction."""
    count = component_hooks("selector", selector).get("evict_count")
    try:
        count is None or inspect.signature(count).bind(1, 1)
    except TypeError:
        return ("evict_count must take (n_evict, budget): the slots a row frees when n_evict are needed, "
                "and the row's budget in tokens")
    return None


def _check_requirements(comps: dict, names: dict) -> None:
    provided = set(CACHE_PROVIDES)
    for comp in comps.values():
        provided |= set(getattr(comp, "provides", ()))
    for kind, comp in comps.items():
        need = set(getattr(comp, "requires", ())) - provided
        if need:
            offer = ", ".join(f"{k}={names[k]}" for k in KINDS)
            raise CompositionError(
                f"{kind} {names[kind]!r} requires {sorted(need)}, which no component of this "
                f"composition ({offer}) provides"
            )
    if "head_wise_budgets" in getattr(comps["selector"], "provides", ()):
        # heads share a row of slots: every component that reads or rewrites slots must tell
        # the heads apart (declared by providing "head_groups")
        for kind in ("scorer", "disposition"):
            if "head_groups" not in getattr(comps[kind], "provides", ()):
                raise CompositionError(
                    f"selector {names['selector']!r} lets heads share slots, which {kind} "
                    f"{names[kind]!r} does not support (it does not provide 'head_groups')"
                )
