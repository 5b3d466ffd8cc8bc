"""The four component kinds, the records plugins register, and the contexts components receive.

A *method* is one Scorer, one Selector, one Disposition and one Budget:

* **Scorer** keeps a float32 score per stored slot, ``[B, H_kv, T]``, updated after every
  attention step from the step's real queries (:class:`Observation`).
* **Selector** picks which slots leave when the cache is over budget (:class:`Selection`).
* **Disposition** decides what happens to the leaving slots before their storage is reused
  (dropped, merged into survivors, quantized) (:class:`Eviction`).
* **Budget** turns a model's shape into a per-layer number of kept tokens (:class:`ModelInfo`).

Components are frozen attrs classes whose fields are their parameters, so a component *is* its
configuration. Each declares capability strings: ``requires`` must be met by the other components
of the method or by the cache (:data:`CACHE_PROVIDES`), which is checked when a method is built.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Protocol, runtime_checkable

import attrs
import mlx.core as mx

__all__ = [
    "KINDS",
    "CACHE_PROVIDES",
    "ComponentSpec",
    "MethodSpec",
    "Scorer",
    "Selector",
    "Disposition",
    "Budget",
    "Observation",
    "Selection",
    "Eviction",
    "ModelInfo",
]

Kind = Literal["scorer", "selector", "disposition", "budget"]
KINDS: tuple[str, ...] = ("scorer", "selector", "disposition", "budget")

#: Capabilities every :class:`~kvcompress.CompressedKVCache` offers its components.
CACHE_PROVIDES = frozenset({"keys", "values", "positions", "queries"})


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
# Contexts handed to components
# --------------------------------------------------------------------------------------------


@attrs.define(slots=True)
class Observation:
    """What a scorer sees after one attention step of one layer.

    queries: ``[B, H_q, N, D]`` post-RoPE queries of the step, or key-as-query proxies
        (``[B, H_kv, N, D]``) when ``proxy`` is true.
    keys: ``[B, H_kv, T, D]`` every stored key the step attended, new ones last.
    positions: ``[B, H_kv, T]`` int32 token position of each slot.
    n_new: N, the number of tokens this step added (the last N slots).
    scale: the softmax scale the model used.
    mask: what the model passed to attention (None, "causal" or an array).
    """

    queries: mx.array
    keys: mx.array
    positions: mx.array
    n_new: int
    scale: float
    mask: Any
    layer: int
    offset: int
    proxy: bool = False
    shared: dict = attrs.field(factory=dict, repr=False)
    _cache: dict = attrs.field(factory=dict, repr=False, init=False)

    def seed_attention_mass(self, mass: mx.array) -> None:
        """Provide the all-queries mass already computed with the step's attention."""
        self._cache[("mass", None)] = mass

    def attention_mass(self, last: Optional[int] = None) -> mx.array:
        """Attention weights summed over the step's queries, ``[B, H_kv, T]`` float32.

        ``A_j = sum_i softmax_j(q_i . k_j * scale)`` over the step's queries ``i`` (or only
        the ``last`` ones), averaged over the query heads sharing each KV head. Causal
        masking inside the step is applied; the weights are computed in query blocks so a
        long prefill never materialises a full ``N x T`` matrix.
        """
        from ._attention_math import attention_mass

        key = ("mass", None if last is not None and last >= self.n_new else last)
        if key not in self._cache:
            self._cache[key] = attention_mass(
                self.queries, self.keys, self.scale, self.mask, last=last
            )
        return self._cache[key]


@attrs.define(slots=True)
class Selection:
    """What a selector sees: choose ``n_evict`` slots per (batch, head) to leave.

    scores/positions are ``[B, H_kv, T]``; ``budget`` is this layer's kept-token budget.
    A selector may return *more* than ``n_evict`` slots (e.g. whole chunks); the cache then
    holds fewer tokens until they refill. ``shared`` is one dict per model (per
    :func:`~kvcompress.make_prompt_cache` call) for cross-layer decisions such as index reuse.
    """

    scores: mx.array
    positions: mx.array
    n_evict: int
    budget: int
    offset: int
    layer: int
    shared: dict = attrs.field(factory=dict, repr=False)
    #: the selector's own ``protected(...)`` mask, computed once by the cache (may be None)
    protected: Optional[mx.array] = None


@attrs.define(slots=True)
class Eviction:
    """What a disposition sees: the stored slots and the slots about to be freed.

    keys/values ``[B, H_kv, T, D]``, scores/positions ``[B, H_kv, T]``, evict ``[B, H_kv, E]``
    int32 slot indices, protected ``[B, H_kv, T]`` bool (the selector's never-evict mask: sinks
    and any recent window; a merging disposition decides itself which of them may be targets). ``draw_id`` is unique per (layer, eviction round)
    for seeded randomness.
    """

    keys: mx.array
    values: mx.array
    scores: mx.array
    positions: mx.array
    evict: mx.array
    protected: mx.array
    layer: int
    draw_id: int
    state: Any = None
    shared: dict = attrs.field(factory=dict, repr=False)
    #: tokens seen before this step: a slot at position p has been attended by offset - p queries
    offset: int = 0


@attrs.frozen
class ModelInfo:
    """What a budget may know about the model: its shape."""

    n_layers: int
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    model_type: str = ""


# --------------------------------------------------------------------------------------------
# Component protocols
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Scorer(Protocol):
    """Keeps a float32 importance score per stored slot."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def observe(self, scores: mx.array, obs: Observation) -> mx.array:
        """Return the new ``[B, H_kv, T]`` float32 scores after a step (new slots enter as 0)."""


@runtime_checkable
class Selector(Protocol):
    """Chooses the slots that leave."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def reserved(self, budget: int) -> int:
        """Slots this selector always keeps (sinks, recent window); must stay below budget."""

    def protected(self, positions: mx.array, offset: int, budget: int) -> mx.array:
        """``[B, H_kv, T]`` bool: slots that may never leave."""

    def select(self, sel: Selection) -> mx.array:
        """Return ``[B, H_kv, n_evict]`` int32 slot indices to evict.

        A selector that frees more than ``n_evict`` slots (whole chunks) must also define
        ``evict_count(n_evict) -> int``, the exact count it returns, so the cache can size the
        step's mask before the step (``make_mask(N, return_array=True)``).
        """


@runtime_checkable
class Disposition(Protocol):
    """Decides what happens to evicted slots before their storage is reused."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def dispose(self, ev: Eviction) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Return ``(keys, values, scores, n_merged)`` after folding in the evicted slots.

        ``n_merged`` is an int32 scalar array counting merges, or None for a disposition that
        never merges (which spares the cache an op per step).

        Optional methods a disposition that keeps evicted tokens elsewhere (e.g. quantized)
        may define; the cache calls them when present:

        * ``init_state() -> state``: per-cache mutable state, passed back as ``ev.state``.
        * ``attend(state, queries, keys, values, scale, mask, sinks, sdpa) -> out``: the layer's
          attention over the stored slots *and* whatever the state holds (``sdpa`` is mlx-lm's
          original function for the plain part).
        * ``state_arrays(state) -> list[mx.array]`` / ``restore_state(arrays) -> state``: for
          ``cache.state``, save/load and ``nbytes``.
        * ``view_keys(state, keys, positions, offset) -> keys``: the keys a step attends (and
          scorers observe), derived from the stored ones after every update (e.g. re-rotated
          to contiguous positions for StreamingLLM's position shift); storage is unchanged.
        """


@runtime_checkable
class Budget(Protocol):
    """Turns the model shape into a per-layer kept-token budget."""

    requires: ClassVar[frozenset]
    provides: ClassVar[frozenset]

    def layer_budgets(self, info: ModelInfo) -> list[int]:
        """Kept tokens for each of ``info.n_layers`` layers.

        Any component may also define ``bind(model, caches)``; :func:`~kvcompress.make_prompt_cache`
        calls it once per model after the caches exist (e.g. a data-driven budget installs its
        prompt observers there and later sets ``cache.budget``).
        """
