"""The four component kinds, the records plugins register, and the hooks a component may define.

A *method* is one Scorer, one Selector, one Disposition and one Budget:

* **Scorer** keeps a float32 score per stored slot, ``[B, H, T]``, updated after every attention
  step from the step's real queries (:class:`~kvcompress.Observation`).
* **Selector** picks which slots leave when the cache is over budget (:class:`~kvcompress.Selection`).
* **Disposition** decides what happens to the leaving slots before their storage is reused
  (dropped, merged into survivors, quantized) (:class:`~kvcompress.Eviction`).
* **Budget** turns the model's shape into a per-layer number of kept tokens
  (:class:`~kvcompress.ModelInfo`).

Components are frozen attrs classes whose fields are their parameters, so a component *is* its
configuration. Each declares capability strings: ``requires`` must be met by the other components
of the method or by the cache (:data:`CACHE_PROVIDES`); this is checked when a method is built.

Besides its kind's required methods, a component may define the *optional hooks* listed in
:data:`OPTIONAL_HOOKS` -- and nothing that merely resembles one: a method named ``init_sate`` or
``view_key`` is rejected when the plugin registers, instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

import attrs
import mlx.core as mx

from .contexts import Eviction, LayerInfo, ModelInfo, Observation, Selection

__all__ = [
    "KINDS", "CACHE_PROVIDES", "REQUIRED_HOOKS", "OPTIONAL_HOOKS", "ComponentSpec", "MethodSpec", "Scorer",
    "Selector", "Disposition", "Budget", "check_hook_names", "component_hooks", "method_hooks", "MethodHooks",
    "KindHooks", "ScorerHookSet", "SelectorHookSet", "DispositionHookSet", "BudgetHookSet",
]

KINDS: tuple[str, ...] = ("scorer", "selector", "disposition", "budget")

#: What every cache offers its components. ``queries``: the step's real post-RoPE queries;
#: ``step_mass``: the attention mass of all of a step's queries, computed together with the
#: step's attention (only done when a scorer requires it); ``last_mass``: the same for a one-token
#: step only (decode), where it is the last query's mass; ``layer_io``: the layer's input and
#: attention output during a prompt's first forward (see :meth:`BudgetHooks.observe_layer`);
#: ``tokens``: the step's input ids (:attr:`Observation.tokens`) and ``predictions``: the model's
#: next-token log-probabilities over each call (:class:`~kvcompress.Predictions`, see
#: :meth:`ScorerHooks.observe_predictions`), from the model hook :func:`kvcompress.install`
#: gives; ``pass_weights``: a scoring pass's attention probabilities (:attr:`Observation.weights`).
CACHE_PROVIDES = frozenset({"keys", "values", "positions", "queries", "step_mass", "last_mass", "layer_io", "tokens",
                            "predictions", "pass_weights"})


# --------------------------------------------------------------------------------------------
# Records returned by plugin hooks
# --------------------------------------------------------------------------------------------


def _check_name(_inst, attribute, value):
    if not isinstance(value, str) or not value or not value.replace("_", "").isalnum():
        raise ValueError(
            f"{attribute.name} must be a non-empty identifier of letters, digits and '_', "
            f"got {value!r}"
        )
    if value != value.lower():
        raise ValueError(f"{attribute.name} must be lower case, got {value!r}")


@attrs.frozen
class ComponentSpec:
    """A named component a plugin provides.

    ``cls`` is a frozen attrs class; its fields are the component's parameters and must all
    have defaults, so ``cls()`` is the component with default parameters.
    """

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    name: str = attrs.field(validator=_check_name)
    cls: type = attrs.field()
    summary: str = attrs.field(validator=attrs.validators.instance_of(str))
    paper: str = ""

    @cls.validator
    def _check_cls(self, attribute, value):
        if not (isinstance(value, type) and attrs.has(value)):
            raise ValueError(f"component {self.name!r}: cls must be an attrs class, got {value!r}")
        missing = [f.name for f in attrs.fields(value) if f.default is attrs.NOTHING]
        if missing:
            raise ValueError(f"component {self.name!r}: parameters without a default: {missing}")
        check_hook_names(self.kind, value, self.name)

    def params(self) -> dict[str, Any]:
        """Parameter names and their defaults."""
        out = {}
        for f in attrs.fields(self.cls):
            if not f.init:
                continue
            d = f.default
            out[f.name] = d.factory() if isinstance(d, attrs.Factory) else d
        return out


@attrs.frozen
class MethodSpec:
    """A named composition: one component of each kind plus default parameters.

    ``params`` maps a parameter name to its default for this method; each name is routed to
    every component of the method that has a parameter of that name.
    """

    name: str = attrs.field(validator=_check_name)
    scorer: str
    selector: str
    disposition: str
    budget: str
    summary: str
    params: dict = attrs.field(factory=dict, converter=dict)
    paper: str = ""


# --------------------------------------------------------------------------------------------
# Component protocols (required members)
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Scorer(Protocol):
    """Keeps a float32 importance score per stored slot (higher = more worth keeping)."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def observe(self, scores: mx.array, obs: Observation) -> mx.array:
        """Return the new ``[B, H, T]`` float32 scores after a step (new slots enter as 0)."""


@runtime_checkable
class Selector(Protocol):
    """Chooses the slots that leave."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def reserved(self, budget: int) -> int:
        """Slots this selector always keeps (sinks, recent window); must stay below budget."""

    def protected(self, positions: mx.array, offset: mx.array, budget: mx.array) -> mx.array:
        """``[B, H, T]`` bool: slots that may never leave (``offset``/``budget`` ``[B, 1, 1]``)."""

    def select(self, sel: Selection) -> mx.array:
        """``[B, H, evict_count(sel.n_evict, budget)]`` int32 distinct unprotected slots to free
        (in priority order when ``sel.row_counts`` is given)."""


@runtime_checkable
class Disposition(Protocol):
    """Decides what happens to evicted slots before their storage is reused."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def dispose(self, ev: Eviction) -> tuple[mx.array, mx.array, mx.array]:
        """Return ``(keys, values, scores)`` after folding in the slots ``ev.evict`` frees
        (only the entries ``ev.real`` marks; never into protected or empty slots)."""


@runtime_checkable
class Budget(Protocol):
    """Turns the model shape into a per-layer kept-token budget."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def layer_budgets(self, info: ModelInfo) -> list[int]:
        """Kept tokens for each of the model's ``info.n_layers`` compressed layers (all ranks)."""


# --------------------------------------------------------------------------------------------
# Optional hooks (documentation classes; the cache calls only these names)
# --------------------------------------------------------------------------------------------


class CommonHooks:
    """Optional hooks any component may define."""

    def init_state(self, layer: LayerInfo) -> Any:
        """Per-cache state (an attrs instance of arrays and scalars) kept in the cache: it travels
        with deep copies, ``cache.state``, save/load and batching. Arrays with a leading batch
        axis are per row when their field is declared with :func:`kvcompress.rows_field`."""

    def diagnostics(self, state: Any) -> dict:
        """Extra entries for ``cache.diagnostics`` (e.g. a merge counter), from the state."""

    def take_rows(self, state: Any, rows: list) -> Any:
        """The state of the given batch rows (default: index every rows field)."""

    def stack_rows(self, states: list, rows: list) -> Any:
        """One state from per-row-group states, in order (``rows[i]`` batch rows in
        ``states[i]``, which may be a fresh state that has not seen a step yet; default:
        concatenate rows fields)."""

    def bind(self, model: Any, layers: list, states: list) -> Optional[list]:
        """Read static facts from the model, once at build: ``layers`` are the
        :class:`~kvcompress.LayerInfo` of this process's compressed layers and ``states`` this
        component's state in each (from ``init_state``), in order. Return the new states, one per
        layer (e.g. ``attrs.evolve(state, rope=...)``), or None to keep them; raise
        :class:`~kvcompress.ConfigError` to refuse the model."""

    def with_tokenizer(self, tokenizer: Any) -> Any:
        """The component to build with, given the model's tokenizer (None when the caller has
        none): parameters that name token ids symbolically (e.g. ``"digits"``) resolved to ids,
        or ``self``. Called when a cache is built, before ``init_state``; the resolved
        component is what the cache's config records and saves. Raise
        :class:`~kvcompress.ConfigError` when a parameter needs the tokenizer it did not get."""


class ScorerHooks:
    def pass_tokens(self, state) -> Any:
        """Token ids ``[B, M]`` int32 (``-1``: padding) of a *scoring pass* to run through the
        whole model before its next call, or None. The model hook asks until None; each pass
        attends the stored slots plus its own tokens without storing or evicting anything, and
        the scorer sees it as an :class:`~kvcompress.Observation` with ``scoring_pass=True``
        (its observe must then change the state so that the question is eventually answered
        None). Cost: ``scoring_passes``, ``scoring_pass_tokens``, ``scoring_pass_seconds`` in
        ``cache.diagnostics``."""

    def observe_predictions(self, scores: mx.array, obs) -> mx.array:
        """Requires ``predictions``: after the model call whose step :meth:`Scorer.observe` saw,
        the same step's :class:`~kvcompress.Observation` with ``predictions`` (the model's
        log-probabilities over the call, computed once for all layers) and ``tokens``; return
        the new scores ``[B, H, T]`` (assign ``obs.state`` to change the state). Runs before any
        eviction of the next step, so the step's tokens are scored before they can leave."""


class SelectorHooks:
    def evict_count(self, n_evict: int, budget: int) -> int:
        """Slots :meth:`Selector.select` frees when ``n_evict`` are needed in a row of that
        ``budget`` (whole chunks; a step that may grow with the budget)."""

    def head_group(self, layer: LayerInfo, n_kv_heads: int) -> int:
        """KV heads sharing one row of slots (head-wise budgets, AdaKV): the row holds
        ``g * budget`` slots and the selector decides how many each head keeps. Requires the
        ``head_groups`` capability (dispositions that respect slot owners provide it)."""


class DispositionHooks:
    def attend(self, state, queries, keys, values, scale, mask, sinks, sdpa) -> mx.array:
        """The layer's attention over the stored slots *and* whatever the state holds."""

    def view_keys(self, state, keys: mx.array, positions: mx.array, offset: mx.array) -> mx.array:
        """The keys a step attends (and scorers observe), derived from the stored ones."""

    def plan(self, ev: Eviction) -> Optional[tuple]:
        """The reads of ``dispose(ev)`` (a tuple of small arrays), done at the end of the step
        before, while that step's attention reads the same arrays; None: no plan, ``dispose``
        runs. Must not change ``ev.state``. Declaring ``plan`` requires ``apply``."""

    def apply(self, ev: Eviction, plan: tuple) -> tuple:
        """The writes: exactly what ``dispose(ev)`` returns (and the same ``ev.state``), given
        the ``plan`` made for this ``ev``. A disposition that reads and writes the same stored
        arrays in one step makes MLX copy them; split, it only writes
        (:mod:`kvcompress.engine.plan`)."""


class BudgetHooks:
    def observe_layer(self, state, x: mx.array, out: mx.array, weight) -> Any:
        """Requires ``layer_io``: see the layer's input ``x`` and attention output ``out``
        ``[B, N, d]`` during a prompt's first forward; return the new state."""

    def rebudget(self, states: list, budgets: list, min_budget: int):
        """Once every layer observed the prompt: new per-layer, per-row budgets, or None."""


REQUIRED_HOOKS = {
    "scorer": ("observe",),
    "selector": ("reserved", "protected", "select"),
    "disposition": ("dispose",),
    "budget": ("layer_budgets",),
}
_COMMON = ("init_state", "diagnostics", "take_rows", "stack_rows", "bind", "with_tokenizer")
#: Optional hook names per kind (see the *Hooks classes above for their signatures).
OPTIONAL_HOOKS = {
    "scorer": _COMMON + ("pass_tokens", "observe_predictions"),
    "selector": _COMMON + ("evict_count", "head_group"),
    "disposition": _COMMON + ("attend", "view_keys", "plan", "apply"),
    "budget": _COMMON + ("observe_layer", "rebudget"),
}


def component_hooks(kind: str, comp) -> dict:
    """``{hook name: bound method}`` of the optional hooks of :data:`OPTIONAL_HOOKS` ``[kind]``
    that ``comp`` defines: the only way the cache and the contract tests look hooks up."""
    return {name: getattr(comp, name) for name in OPTIONAL_HOOKS[kind] if callable(getattr(type(comp), name, None))}


def _count_as_asked(n_evict: int, budget: int) -> int:  # evict_count's default
    return n_evict


def _one_head_per_row(layer: LayerInfo, n_kv_heads: int) -> int:  # head_group's default
    return 1


@attrs.frozen(kw_only=True)
class KindHooks:
    """One component's optional hooks (:data:`OPTIONAL_HOOKS`), looked up once: each field is
    the component's bound method, or its default (a function, or None where the cache then
    takes another path). The common ones, for every kind:"""

    init_state: Optional[Callable] = None
    diagnostics: Optional[Callable] = None
    take_rows: Optional[Callable] = None
    stack_rows: Optional[Callable] = None
    bind: Optional[Callable] = None
    with_tokenizer: Optional[Callable] = None


@attrs.frozen(kw_only=True)
class ScorerHookSet(KindHooks):
    pass_tokens: Optional[Callable] = None  #: None: no scoring passes
    observe_predictions: Optional[Callable] = None


@attrs.frozen(kw_only=True)
class SelectorHookSet(KindHooks):
    evict_count: Callable = _count_as_asked  #: default: exactly the slots asked for
    head_group: Callable = _one_head_per_row  #: default: one KV head per row of slots


@attrs.frozen(kw_only=True)
class DispositionHookSet(KindHooks):
    attend: Optional[Callable] = None  #: None: the exact slot attention
    view_keys: Optional[Callable] = None  #: None: the keys as stored
    plan: Optional[Callable] = None  #: None: no planned eviction (``dispose`` runs)
    apply: Optional[Callable] = None


@attrs.frozen(kw_only=True)
class BudgetHookSet(KindHooks):
    observe_layer: Optional[Callable] = None
    rebudget: Optional[Callable] = None


@attrs.frozen
class MethodHooks:
    """A method's optional hooks as typed records, one per kind, defaults filled in once."""

    scorer: ScorerHookSet
    selector: SelectorHookSet
    disposition: DispositionHookSet
    budget: BudgetHookSet

    def of(self, kind: str) -> KindHooks:
        return getattr(self, kind)


def method_hooks(components: dict) -> MethodHooks:
    """:class:`MethodHooks` of ``{kind: component}``, from :func:`component_hooks`."""
    sets = {"scorer": ScorerHookSet, "selector": SelectorHookSet, "disposition": DispositionHookSet, "budget": BudgetHookSet}
    return MethodHooks(**{kind: sets[kind](**component_hooks(kind, comp)) for kind, comp in components.items()})


def _own_methods(cls: type) -> list[str]:
    names = set()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith(("attr", "typing")):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))):
                names.add(name)
    return sorted(names)


_PAIRED = {"plan": "apply", "apply": "plan"}  # disposition hooks that only work together


def check_hook_names(kind: str, cls: type, name: str = "") -> None:
    """Raise ValueError if ``cls`` defines a method that looks like a hook of ``kind`` but is not one."""
    hooks = set(REQUIRED_HOOKS[kind]) | set(OPTIONAL_HOOKS[kind])
    everything = {h for k in KINDS for h in REQUIRED_HOOKS[k] + OPTIONAL_HOOKS[k]}
    own = set(_own_methods(cls)) | {h for h in _PAIRED if callable(getattr(cls, h, None))}
    for a, b in _PAIRED.items():
        if kind == "disposition" and a in own and b not in own:
            raise ValueError(f"{kind} {name or cls.__name__!r}: defines {a!r} but not {b!r}; the two go together")
    for meth in _own_methods(cls):
        if meth in everything:
            continue  # a hook of this kind, or (never called) a helper named like another kind's
        near = difflib.get_close_matches(meth, sorted(everything), n=1, cutoff=0.8)
        if near:
            what = "a hook of this kind" if near[0] in hooks else f"a hook of another kind, not of a {kind}"
            raise ValueError(
                f"{kind} {name or cls.__name__!r}: method {meth!r} looks like {near[0]!r}, which is "
                f"{what}; {kind} hooks are {sorted(hooks)} (rename it, or make it private with a "
                "leading underscore)"
            )
