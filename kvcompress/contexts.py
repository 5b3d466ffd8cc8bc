"""What the cache hands its components: the layer, one step's observation, a selection, an eviction.

Shapes: ``B`` batch rows, ``H`` KV heads held by this cache (this rank's heads under tensor
parallelism), ``T`` stored slots, ``N`` the step's tokens, ``D`` head size. Rows may hold
different numbers of tokens: a slot whose position is ``-1`` is empty (padding, or freed and not
yet reused) and is never selected, scored into a decision or merged into. ``offset`` is always an
int32 array broadcastable to ``[B, H, T]`` (``[B, 1, 1]``): the tokens each row has seen.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import mlx.core as mx

__all__ = ["ModelInfo", "LayerInfo", "Observation", "Predictions", "Selection", "Eviction"]


@attrs.frozen
class ModelInfo:
    """What a budget may know about the whole model (every layer, every rank): its shape."""

    n_layers: int
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    model_type: str = ""


@attrs.frozen
class LayerInfo:
    """The identity of one cache's layer in the whole model.

    ``layer`` is the global index among the model's compressed layers (the same on every rank
    and under pipeline parallelism), ``n_layers`` their global count; ``head_offset`` is the
    global index of this cache's first KV head (rank r holds heads ``r*H .. r*H+H-1`` under
    tensor parallelism). Seeds and budgets follow these global identities.
    """

    layer: int = 0
    n_layers: int = 1
    head_offset: int = 0
    n_kv_heads: Optional[int] = None
    model_type: str = ""
    #: index of the layer's block in this process's ``model.layers`` (local, for binding)
    block: Optional[int] = None
    #: ranks of the tensor-parallel group (1: not sharded by heads)
    tp_size: int = 1
    #: the KV heads are the same on every rank (MLA's latent cache) while query heads are split
    kv_replicated: bool = False
    #: ranks of the pipeline (1: this process runs every layer)
    pp_size: int = 1

    def head_ids(self, h: int) -> mx.array:
        """Global KV-head indices ``[1, h, 1]`` uint32 of a cache holding ``h`` heads."""
        return mx.arange(self.head_offset, self.head_offset + h, dtype=mx.uint32).reshape(1, h, 1)


#: the first ``n`` steps at most whose per-token log-probabilities :class:`Predictions` keep
#: (a trimmed step is re-observed from them)
KEEP_STEPS = 16


def _last_real(n_valid: tuple) -> mx.array:
    """``[B, 1, 1]`` int32: the index of each row's last real token in a call."""
    return mx.array([max(v - 1, 0) for v in n_valid], dtype=mx.int32).reshape(-1, 1, 1)


@attrs.frozen
class Predictions:
    """The model's next-token log-probabilities over one call, computed once for every layer
    (capability ``predictions``, handed over by the model hook after the call).

    surprisal: ``[B, N]`` float32, ``-log p(x_i | x_<i)`` of input token ``i`` given the tokens
        before it in the same call (``i >= 1``); column 0 is NaN (its prediction came from the
        previous call: a scorer keeps what it needs of ``last`` in its state).
    last: ``[B, V]`` float32 log-probabilities after each row's last real input token: the
        distribution the next call's first token is drawn from.
    steps: ``[B, N, V]`` float32 log-probabilities after every input token, kept only for calls
        of at most :data:`KEEP_STEPS` tokens (so that a trimmed step can be re-observed), else None.
    """

    surprisal: mx.array
    last: mx.array
    steps: Optional[mx.array] = None
    _memo: dict = attrs.field(factory=dict, init=False, repr=False, eq=False)

    def once(self, key: tuple, fn):
        """``fn()``, computed once for this call under ``key`` (hashables and arrays; an array
        matches only itself), so layers that ask the same question (the same state arrays, the
        same offsets) share one result instead of repeating it in every layer."""
        arrays = [a for a in key if isinstance(a, mx.array)]
        k = ("once",) + tuple(("array", id(a)) if isinstance(a, mx.array) else a for a in key)
        hit = self._memo.get(k)
        if hit is None or any(x is not y for x, y in zip(hit[0], arrays)):
            hit = self._memo[k] = (arrays, fn())
        return hit[1]

    def top(self, k: int) -> tuple:
        """``(ids [B, k] int32, log_probs [B, k] float32)``: the ``k`` most likely next tokens
        after each row's last real token (in no particular order), computed once for all layers."""
        k = min(k, self.last.shape[-1])
        if k not in self._memo:
            ids = mx.argpartition(-self.last, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
            self._memo[k] = (ids, mx.take_along_axis(self.last, ids, axis=-1))
        return self._memo[k]

    @classmethod
    def from_logits(cls, tokens: mx.array, logits: mx.array, n_valid: tuple) -> "Predictions":
        """From one call's input ids ``[B, N]`` and output logits ``[B, N, V]``; row ``b``'s real
        tokens are its first ``n_valid[b]``."""
        b, n = tokens.shape
        z = logits.astype(mx.float32)
        lse = mx.logsumexp(z, axis=-1, keepdims=True)  # [B, N, 1]
        nxt = mx.take_along_axis(z[:, :-1], mx.maximum(tokens[:, 1:], 0)[..., None].astype(mx.int32), axis=-1)
        surprisal = mx.concatenate([mx.full((b, 1), mx.nan, mx.float32), (lse[:, :-1] - nxt)[..., 0]], axis=1)
        last_i = _last_real(n_valid)
        last = (mx.take_along_axis(z, last_i, axis=1) - mx.take_along_axis(lse, last_i, axis=1))[:, 0]
        return cls(surprisal, last, (z - lse) if n <= KEEP_STEPS else None)

    @classmethod
    def from_head(cls, tokens: mx.array, hidden: mx.array, head, n_valid: tuple, block: int = 128) -> "Predictions":
        """:meth:`from_logits` of ``logits = head(hidden)`` (``hidden`` ``[B, N, d]``, the
        model's output projection ``head``), ``block`` positions at a time: a long call never
        holds its ``[B, N, V]`` logits at once (for calls longer than :data:`KEEP_STEPS`). Each
        block is evaluated before the next is built (MLX allocates an op's output when it
        dispatches it: a lazy graph of blocks would hold every block's logits at once), which
        evaluates the call's forward here; a prefill chunk is evaluated right after anyway."""
        b, n = tokens.shape
        nxt_ids = mx.maximum(tokens[:, 1:], 0).astype(mx.int32)[..., None]  # [B, N - 1, 1]
        parts = [mx.full((b, 1), mx.nan, mx.float32)]
        for i0 in range(0, n - 1, block):
            i1 = min(i0 + block, n - 1)
            z = head(hidden[:, i0:i1]).astype(mx.float32)  # predictions after tokens i0 .. i1 - 1
            lse = mx.logsumexp(z, axis=-1)
            parts.append(lse - mx.take_along_axis(z, nxt_ids[:, i0:i1], axis=-1)[..., 0])
            try:
                mx.eval(parts[-1])
            except ValueError:  # inside mx.compile: the blocks stay one lazy graph (same values)
                pass
        surprisal = mx.concatenate(parts, axis=1)
        last_i = _last_real(n_valid)
        z = head(mx.take_along_axis(hidden, last_i, axis=1)).astype(mx.float32)[:, 0]  # [B, V]
        return cls(surprisal, z - mx.logsumexp(z, axis=-1, keepdims=True), None)

    def truncated(self, keep: int) -> "Predictions":
        """The predictions of the call's first ``keep`` tokens (every row real; needs ``steps``)."""
        if self.steps is None:
            raise ValueError("these predictions keep no per-token log-probabilities to truncate")
        return Predictions(self.surprisal[:, :keep], self.steps[:, keep - 1], self.steps[:, :keep])


@attrs.define(slots=True, kw_only=True)
class Observation:
    """What a scorer sees after one attention step of one layer.

    queries: ``[B, H_q, N, D]`` post-RoPE queries, or key-as-query proxies ``[B, H, N, D]`` when
        ``proxy`` is true (a model that bypassed mlx-lm's attention function).
    keys: ``[B, H, T, D]`` every stored key the step attended, new ones included.
    values: ``[B, H, T, D_v]`` the stored values of the same slots (None where a caller has
        none to give, e.g. a hand-built observation; value-weighted scorers then use norm 1).
    positions: ``[B, H, T]`` int32 position of each slot (``-1``: empty).
    query_positions: ``[B, 1, N]`` int32 position of each query.
    query_weight: ``[B, 1, N]`` 1 for real queries, 0 for padding; None when all are real.
    n_new: N. n_valid: real new tokens per row (host ints; the first ``n_valid[b]`` of the step).
    offset: ``[B, 1, 1]`` tokens seen after the step. offsets: the same, host ints.
    state: the scorer's own state (see :meth:`Scorer.init_state`); assign a new value to
        replace it (never mutate its arrays in place: the cache keeps the old one to undo).
    tokens: ``[B, N]`` int32 input token ids of the step (``-1``: padding), for scorers that
        require ``"tokens"``; None when the model was called without the kvcompress model hook.
    scoring_pass: the step is a scoring pass (see ``pass_tokens``): ``keys``/``positions`` hold
        the stored slots followed by the pass's ``N`` tokens, and only the scores of the stored
        slots are kept.
    predictions: the model's log-probabilities over the call (:class:`Predictions`), only in
        the ``observe_predictions`` hook of scorers that require ``"predictions"``.
    weights: in a scoring pass of a scorer that requires ``"pass_weights"``: the pass's float32
        attention probabilities ``[B, H_kv, G, N, T]`` (query head ``h * G + g`` of KV head
        ``h``; each query's softmax over the slots it saw), computed with the pass's attention.
    written: ``[B, H, W]`` int32, when the cache knows them: the only slots whose key may differ
        from the key the same slot held at this scorer's previous observation (the tokens
        written since); None: any may (new layout, merged keys, a restored state...). A scorer
        may keep per-slot values derived from keys in its state and redo only these.
    """

    queries: mx.array
    keys: mx.array
    positions: mx.array
    query_positions: mx.array
    n_new: int
    scale: float
    offset: mx.array
    offsets: tuple
    layer: LayerInfo
    n_valid: tuple = ()
    query_weight: Optional[mx.array] = None
    proxy: bool = False
    #: every stored slot is visible to every query (a single token, no empty slot): no mask needed
    all_visible: bool = False
    #: the model's own additive attention scores ``[B, H_q, N, T]`` (MLA's RoPE part), or None
    bias: Optional[mx.array] = None
    #: head groups (see :func:`kvcompress.ops.owner_mask`): the head of each slot within its row
    #: ``[B, H, T]`` (``H`` rows of ``heads_per_row`` KV heads), or None
    owner: Optional[mx.array] = None
    heads_per_row: int = 1
    values: Optional[mx.array] = None
    state: Any = None
    written: Optional[mx.array] = None
    tokens: Optional[mx.array] = None
    scoring_pass: bool = False
    predictions: Optional[Predictions] = None
    weights: Optional[mx.array] = None
    group: Any = attrs.field(default=None, repr=False)
    _cache: dict = attrs.field(factory=dict, repr=False, init=False)

    def seed_attention_mass(self, mass: mx.array) -> None:
        """Provide the all-queries mass the cache computed together with the step's attention."""
        self._cache[None] = mass

    def attention_mass(self, last: Optional[int] = None) -> mx.array:
        """``[B, H, T]`` float32: ``A_j = sum_i softmax_j(q_i . k_j * scale)`` over the step's
        real queries (or only the ``last`` ones), mean over each GQA group; see
        :func:`kvcompress.ops.attention`."""
        from .ops import attention_mass

        key = None if last is None or last >= self.n_new else last
        if key not in self._cache:
            self._cache[key] = attention_mass(
                self.queries, self.keys, self.scale, None if self.all_visible else self.positions,
                self.query_positions, query_weight=self.query_weight, last=last, bias=self.bias,
                owner=self.owner, heads_per_row=self.heads_per_row,
            )
        return self._cache[key]


@attrs.define(slots=True, kw_only=True)
class Selection:
    """What a selector sees: choose slots to free, per (row, head).

    ``n_evict`` slots per row, or, when ``row_counts`` (``[B, 1, 1]`` int32) is given, row
    ``b`` frees only ``row_counts[b]``: the selector then returns the ``n_evict`` choice in
    priority order (most evictable first), so that each row's first ``evict_count(row_counts[b],
    budgets[b])`` entries are its choice. ``protected`` ``[B, H, T]`` bool marks slots that may
    not leave: the selector's own :meth:`Selector.protected` mask plus every empty slot.
    ``budget`` is the rows' kept-token budget: an int, or ``[B, 1, 1]`` int32 when rows have
    different budgets; ``budgets`` the same per row as host ints (empty: every row ``budget``).
    """

    scores: mx.array
    positions: mx.array
    protected: mx.array
    n_evict: int
    budget: Any
    offset: mx.array
    offsets: tuple
    layer: LayerInfo
    row_counts: Optional[mx.array] = None
    state: Any = None
    group: Any = attrs.field(default=None, repr=False)
    budgets: tuple = ()
    #: head groups: the head of each slot within its row (a selector may balance heads), or None
    owner: Optional[mx.array] = None
    heads_per_row: int = 1

    def widest_budget(self) -> int:
        """The largest row budget, a host int (what :meth:`SelectorHooks.evict_count` takes)."""
        if self.budgets:
            return max(self.budgets)
        if isinstance(self.budget, int):
            return self.budget
        raise ValueError("Selection: a [B, 1, 1] budget array needs budgets (the same as host ints)")


@attrs.define(slots=True, kw_only=True)
class Eviction:
    """What a disposition sees: the stored slots and those about to be freed.

    keys/values ``[B, H, T, D]``, scores/positions ``[B, H, T]``, ``evict`` ``[B, H, E]`` int32
    slot indices; ``real`` ``[B, H, E]`` bool marks the entries that really leave (None: all of
    them; a row that frees fewer slots than others has entries to ignore); ``protected`` the
    selector's never-evict mask (empty slots included). ``counts`` the real entries per row (host
    ints). ``draw_id`` counts this layer's eviction rounds. ``state`` is the disposition's own
    state (mutate or replace it). ``written`` ``[B, H, W]`` int32: when the cache knows them, the
    only slots whose keys/values changed since its previous eviction (the decode tokens written
    since), so that what a disposition derived from the stored keys then (e.g. their norms) only
    needs those slots redone; None: anything may have changed (a chunk, a load, a batch edit).
    """

    keys: mx.array
    values: mx.array
    scores: mx.array
    positions: mx.array
    evict: mx.array
    protected: mx.array
    offset: mx.array
    offsets: tuple
    layer: LayerInfo
    counts: tuple = ()
    draw_id: int = 0
    real: Optional[mx.array] = None
    state: Any = None
    group: Any = attrs.field(default=None, repr=False)
    #: head groups: the head of each slot within its row (merge only within a head), or None
    owner: Optional[mx.array] = None
    heads_per_row: int = 1
    written: Optional[mx.array] = None
    #: set by a disposition that overwrote only some stored vectors: ``(slots [B, H, W] int32,
    #: key rows [B, H, W, D] or None, value rows [B, H, W, D_v] or None)`` -- exactly what it wrote
    #: into the keys/values it returns (None: unchanged); a low-bit store then re-quantizes only these
    rewritten: Optional[tuple] = None
    #: ``(keys, values)`` as the cache holds them, with low-bit storage only (else None):
    #: :class:`kvcompress.storage.QuantizedSlots`, whose rows a disposition may gather
    #: (``storage.take_slots``) and multiply (``storage.keys_product``) without dequantizing all
    stored: Optional[tuple] = None
