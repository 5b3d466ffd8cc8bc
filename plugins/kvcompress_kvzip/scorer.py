"""KVzip's context-reconstruction score (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv 2505.23416, Sec. 3 / Algorithm 1).

KVzip asks the model to *reconstruct* its context from the cache and keeps the slots the
reconstruction needs. The context is reconstructed in pieces ``c`` of ``chunk`` tokens: a
*scoring pass* (``kvcompress.engine.passes``) runs the whole model on::

    input = prompt + (last 8 ids of the previous piece) + suffix + c         (after the cache)

against the stored slots, nothing stored or evicted. Each stored slot ``j`` of the piece gets
(Eq. 2 with Algorithm 1's chunked softmax)::

    s_j = max_{h in group(j's KV head)} max_{i in pass} softmax_{j' in K_c}(q_{h,i} . k_{j'} * scale)_j

where the softmax runs only over ``K_c`` = the first ``n_sink`` positions, the piece's own slots
and the pass's own tokens (causal), so pieces score independently of the cache's length. The
pass's own attention (over every slot) already holds ``p_{ij} = softmax_j(q_i . k_j * scale)``;
the restricted softmax is its renormalisation, ``p_{ij} / sum_{j' in K_c} p_{ij'}``, so the score
is read from those probabilities (``pass_weights``) instead of a second attention product (a
restricted set below float32's range of the row's maximum, ~87 nats, would score 0; the
direct :func:`pass_score` serves models whose attention bypasses the cache).

Head-wise budgets (``selector="adaptive"``, capability ``head_groups``): a row of slots holds
several KV heads, each slot tagged with its owner; the pass's attention is owner-masked, so
every (head, token) scores what it scores with one head per row, and the layer's heads are then
ranked together (closer to the paper's global ranking than equal per-head counts).

When pieces are reconstructed (each step's token ids wait in the scorer state, as provisional
score 1, so they are never evicted unscored):

* after a multi-token step (prefill chunk): every waiting id, in pieces of ``chunk``, before
  the next model call -- a chunked prefill scores chunk ``t`` against the bounded cache before
  chunk ``t + 1`` evicts;
* in decoding: when ``interval`` generated ids wait (``interval = 0``: never; generated tokens
  then keep the provisional 1 and leave only as the selector's oldest-first fallback).

A step without the model hook (no ids) is refused by the cache before anything changes.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of

from kvcompress import rows_field
from kvcompress.ops import attention

__all__ = ["KVzipScorer", "KVzipState", "chat_reconstruction", "pass_score", "repeat_prompt", "PREV", "REPEAT_TEXT"]

#: ids of the previous piece that open the next piece's reconstruction (kvpress: 8)
PREV = 8
#: the instruction kvpress's KVzipPress puts before every piece after the first
REPEAT_TEXT = "\n\nRepeat the part of the previous context exactly, starting with"


def _encode(tokenizer, text: str) -> tuple:
    enc = getattr(tokenizer, "encode")
    try:
        ids = enc(text, add_special_tokens=False)
    except TypeError:
        ids = enc(text)
    return tuple(int(i) for i in ids)


def repeat_prompt(tokenizer) -> tuple:
    """kvpress's repeat instruction as token ids, for ``KVzipScorer(prompt=...)``."""
    return _encode(tokenizer, REPEAT_TEXT)


def chat_reconstruction(tokenizer) -> dict:
    """``{"prompt": ..., "suffix": ...}`` for ``make_prompt_cache(model, "kvzip", **...)``: the
    reconstruction as kvpress asks it of a chat model -- the repeat instruction closes the user's
    turn (the context), the previous piece's last ids follow, then the template's end of the user
    turn and the assistant's header (``suffix``), after which the piece is "repeated". The suffix
    is what the tokenizer's chat template puts between a user message and the generation prompt
    (``"\n"`` without a template)."""
    marker = "\n" + "#" * 13
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return {"prompt": repeat_prompt(tokenizer), "suffix": _encode(tokenizer, "\n")}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "dummy context" + marker}], add_generation_prompt=True, tokenize=False)
    if marker not in text:
        raise ValueError("the tokenizer's chat template does not keep the user message verbatim; "
                         "pass KVzipScorer(prompt=..., suffix=...) token ids instead")
    return {"prompt": repeat_prompt(tokenizer), "suffix": _encode(tokenizer, text.split(marker, 1)[1])}


def _ids_tuple(value) -> tuple:
    return tuple(int(v) for v in value)


def _nonneg_ids(_inst, attribute, value):
    if any(v < 0 for v in value):
        raise ValueError(f"{attribute.name} must be token ids >= 0, got {list(value)}")


@attrs.define
class KVzipState:
    """Ids waiting for reconstruction, per row, left-aligned (``pos = -1``: none): ``ids`` and
    ``pos`` ``[B, P]`` int32 (``P`` whole chunks, grown when needed, never shrunk); ``prev`` ``[B, 8]`` the previous piece's last ids. Host facts per
    row: ``waiting`` (ids held) and ``flush`` (a multi-token step left them), so that a row's
    passes never depend on the batch it is in."""

    ids: Optional[mx.array] = rows_field(fill=-1)
    pos: Optional[mx.array] = rows_field(fill=-1)
    prev: Optional[mx.array] = rows_field(fill=-1)
    waiting: tuple = attrs.field(default=(), converter=tuple)
    flush: tuple = attrs.field(default=(), converter=tuple)

    def rows(self) -> int:
        return len(self.waiting) or (self.ids.shape[0] if self.ids is not None else 1)


def _left_align(ids: mx.array, pos: mx.array):
    """Move each row's entries with ``pos >= 0`` to the left, in order."""
    p = pos.shape[-1]
    ar = mx.arange(p)
    order = mx.argsort(mx.where(pos >= 0, ar, ar + p), axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(pos, order, axis=-1)


def _pad_cols(x: mx.array, width: int) -> mx.array:
    if x.shape[-1] >= width:
        return x
    return mx.pad(x, [(0, 0), (0, width - x.shape[-1])], constant_values=-1)


def pass_score(queries, keys, positions, query_positions, scale, lo, hi, n_sink, first_pass, query_weight=None,
               bias=None, owner=None, heads_per_row=1):
    """``[B, H_kv, T]`` float32: Algorithm 1's score of every slot (meaningful for the piece's
    slots ``lo <= p <= hi``): the largest softmax weight any pass query of the KV head's group
    gives it, the softmax restricted to sinks (``p < n_sink``), the piece and the pass's own
    tokens (``p >= first_pass``). ``lo``/``hi``/``first_pass`` ``[B, 1, 1]`` int32."""
    p = positions
    keep = (p >= 0) & ((p < n_sink) | ((p >= lo) & (p <= hi)) | (p >= first_pass))
    return attention(
        queries, keys, None, scale, mx.where(keep, p, -1), query_positions,
        query_weight=query_weight, mass="max", bias=bias, owner=owner, heads_per_row=heads_per_row,
    )[1]


def _renormalised_max(weights, positions, in_piece, n_sink, first_pass, query_weight=None):
    """:func:`pass_score` from the pass's attention probabilities ``[B, H_kv, G, N, T]``: each
    query's weights renormalised over ``K_c`` (sinks, piece, pass tokens), the largest per slot.

    ``Z_i = sum_{j in K_c} p_ij`` is one matrix-vector product; ``max_i (w_i / Z_i) p_ij`` then
    reads the probabilities once more, and the piece mask is applied to the ``[B, H_kv, T]``
    result (a masked copy of the probabilities cost ~4x more on the CPU)."""
    b, h, g, n, t = weights.shape
    k_c = (positions >= 0) & ((positions < n_sink) | in_piece | (positions >= first_pass))
    flat = weights.reshape(b, h, g * n, t)
    total = flat @ k_c.astype(mx.float32)[..., None]  # [B, H, G*N, 1]
    scale = 1.0 / mx.maximum(total, 1e-38)
    if query_weight is not None:
        qw = mx.broadcast_to(query_weight.astype(mx.float32).reshape(b, 1, 1, n), (b, 1, g, n))
        scale = scale * qw.reshape(b, 1, g * n, 1)
    return mx.where(in_piece, (flat * scale).max(axis=2), 0.0)


@attrs.frozen
class KVzipScorer:
    """KVzip reconstruction score; see the module docstring for the math.

    Parameters: ``chunk`` (ids per reconstruction piece), ``interval`` (generated ids that
    trigger a decode-time reconstruction; 0 = prefill only), ``prompt`` (token ids of the
    reconstruction instruction, empty by default; :func:`repeat_prompt` builds kvpress's),
    ``suffix`` (token ids between the previous piece's tail and the piece, empty by default;
    :func:`chat_reconstruction` builds both from a chat template, as kvpress does),
    ``n_sink`` (first positions every piece's softmax includes; the same name sizes the
    ``lowest`` selector's protected sinks).
    """

    chunk: int = attrs.field(default=128, validator=[instance_of(int), ge(1)])
    interval: int = attrs.field(default=32, validator=[instance_of(int), ge(0)])
    prompt: tuple = attrs.field(default=(), converter=_ids_tuple, validator=_nonneg_ids)
    suffix: tuple = attrs.field(default=(), converter=_ids_tuple, validator=_nonneg_ids)
    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])

    requires: ClassVar[frozenset] = frozenset({"queries", "positions", "tokens", "pass_weights"})
    provides: ClassVar[frozenset] = frozenset({"reconstruction", "head_groups"})

    def init_state(self, layer) -> KVzipState:
        return KVzipState()

    def take_rows(self, state, rows: list) -> KVzipState:
        idx = mx.array(rows, dtype=mx.int32)
        pick = (lambda x: None if x is None else x[idx])
        w, f = state.waiting, state.flush
        return KVzipState(ids=pick(state.ids), pos=pick(state.pos), prev=pick(state.prev),
                          waiting=[w[i] if i < len(w) else 0 for i in rows] if w else (),
                          flush=[bool(f[i]) if i < len(f) else False for i in rows] if f else ())

    def stack_rows(self, states: list, rows: list) -> KVzipState:
        """Rows of several caches (``rows[i]`` in ``states[i]``): ids padded to the widest (``-1``)."""
        states = [s if s is not None else KVzipState() for s in states]
        width = max([s.ids.shape[1] for s in states if s.ids is not None] or [0])
        ids, pos, prev, waiting, flush = [], [], [], [], []
        for s, r in zip(states, rows):
            empty = mx.full((r, max(width, 1)), -1, mx.int32)
            ids.append(_pad_cols(s.ids, width) if s.ids is not None else empty[:, :width])
            pos.append(_pad_cols(s.pos, width) if s.pos is not None else empty[:, :width])
            prev.append(s.prev if s.prev is not None else mx.full((r, PREV), -1, mx.int32))
            waiting += list(s.waiting or (0,) * r)
            flush += list(s.flush or (False,) * r)
        has = width > 0
        if not any(s.waiting for s in states):  # nothing waits yet: only the previous pieces' tails
            return KVzipState(prev=None if all(s.prev is None for s in states) else mx.concatenate(prev))
        return KVzipState(ids=mx.concatenate(ids) if has else None, pos=mx.concatenate(pos) if has else None,
                          prev=mx.concatenate(prev), waiting=waiting, flush=flush)

    def due(self, state) -> list:
        """Per row: whether the row's next piece is reconstructed before the next call."""
        return [w > 0 and (f or (self.interval > 0 and w >= self.interval))
                for w, f in zip(state.waiting, state.flush or (False,) * len(state.waiting))]

    def diagnostics(self, state) -> dict:
        return {"kvzip_waiting": list(state.waiting) if state is not None and state.waiting else 0}

    def pass_tokens(self, state) -> Optional[mx.array]:
        """The next piece's pass ids ``[B, len(prompt) + 8 + len(suffix) + L]`` (``-1``: padding; rows not
        due are all padding), or None when no row is due."""
        if state is None or state.ids is None:
            return None
        due = self.due(state)
        if not any(due):
            return None
        n = min(self.chunk, max(w for w, d in zip(state.waiting, due) if d))
        b = len(due)
        fixed = (lambda ids: mx.broadcast_to(mx.array(ids, dtype=mx.int32)[None], (b, len(ids))))
        parts = [fixed(self.prompt)] if self.prompt else []
        parts += [state.prev] + ([fixed(self.suffix)] if self.suffix else [])
        parts.append(mx.where(state.pos[:, :n] >= 0, state.ids[:, :n], -1))
        ids = mx.concatenate(parts, axis=1)
        return ids if all(due) else mx.where(mx.array(due).reshape(-1, 1), ids, -1)

    def observe(self, scores, obs):
        if obs.scoring_pass:
            return self._reconstruct(scores, obs)
        st = obs.state or KVzipState()
        if obs.tokens is None:
            return scores  # no ids: these tokens stay unscored (0)
        b, n = obs.tokens.shape
        valid = mx.array(obs.n_valid or (n,) * b, dtype=mx.int32).reshape(-1, 1)
        seen = mx.array(obs.offsets, dtype=mx.int32).reshape(-1, 1)
        pos = seen - valid + mx.arange(n, dtype=mx.int32).reshape(1, n)
        pos = mx.where((mx.arange(n).reshape(1, n) < valid) & (pos >= 0), pos, -1)
        new = (obs.positions >= (seen - valid)[:, :, None]) & (obs.positions >= 0)
        scores = mx.where(new, 1.0, scores)  # provisional: waits for its reconstruction
        ids = obs.tokens.astype(mx.int32)
        if st.ids is not None:
            ids, pos = mx.concatenate([st.ids, ids], axis=1), mx.concatenate([st.pos, pos], axis=1)
        ids, pos = _left_align(ids, pos)
        nv = obs.n_valid or (n,) * b
        waiting = [w + v for w, v in zip(st.waiting or (0,) * b, nv)]
        flush = [f or v > 1 for f, v in zip(st.flush or (False,) * b, nv)]
        # fixed width (whole chunks, never shrinking): decode keeps the state's bytes steady
        cap = max(0 if st.ids is None else st.ids.shape[1], -(-max(waiting) // self.chunk) * self.chunk)
        ids, pos = _pad_cols(ids[:, :cap], cap), _pad_cols(pos[:, :cap], cap)
        prev = st.prev if st.prev is not None else mx.full((b, PREV), -1, mx.int32)
        obs.state = KVzipState(ids=ids, pos=pos, prev=prev, waiting=waiting, flush=flush)
        return scores

    def _reconstruct(self, scores, obs):
        st = obs.state
        due = self.due(st)
        n = min(self.chunk, max(w for w, d in zip(st.waiting, due) if d))
        dmask = mx.array(due).reshape(-1, 1)
        piece_pos = mx.where(dmask, st.pos[:, :n], -1)
        big = 2**30
        lo = mx.where(piece_pos >= 0, piece_pos, big).min(axis=-1).reshape(-1, 1, 1)
        hi = piece_pos.max(axis=-1).reshape(-1, 1, 1)
        first_pass = mx.array(obs.offsets, dtype=mx.int32).reshape(-1, 1, 1)  # the pass starts there
        p = obs.positions
        in_piece = (p >= lo) & (p <= hi) & (p < first_pass)
        if obs.weights is not None:
            mass = _renormalised_max(obs.weights, p, in_piece, self.n_sink, first_pass, obs.query_weight)
        else:
            mass = pass_score(obs.queries, obs.keys, obs.positions, obs.query_positions, obs.scale,
                              lo, hi, self.n_sink, first_pass, obs.query_weight, obs.bias, obs.owner,
                              obs.heads_per_row)
        scores = mx.where(in_piece, mass, scores)
        piece = mx.where(piece_pos >= 0, st.ids[:, :n], -1)
        ids_r, pos_r = _left_align(mx.concatenate([st.prev, piece], axis=1),
                                   mx.concatenate([mx.where(st.prev >= 0, 0, -1), piece_pos], axis=1))
        # the last PREV real ids of prev + piece (right-aligned); rows not due keep theirs
        cnt = (pos_r >= 0).sum(axis=1, keepdims=True)
        idx = cnt - PREV + mx.arange(PREV).reshape(1, PREV)
        prev = mx.where(idx >= 0, mx.take_along_axis(ids_r, mx.maximum(idx, 0), axis=1), -1)
        prev = mx.where(dmask, prev, st.prev)
        # due rows drop their piece's n columns
        cols = mx.arange(st.pos.shape[1]).reshape(1, -1)
        ids, pos = _left_align(st.ids, mx.where(dmask & (cols < n), -1, st.pos))
        waiting = [max(w - n, 0) if d else w for w, d in zip(st.waiting, due)]
        flush = [f and w > 0 for f, w in zip(st.flush, waiting)]
        obs.state = KVzipState(ids=ids, pos=pos, prev=prev, waiting=waiting, flush=flush)
        return scores
