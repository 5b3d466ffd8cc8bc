"""Expected Attention: score each key by the attention future queries are expected to pay it
(Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636; kvpress ``ExpectedAttentionPress``).

Future queries are modelled as Gaussian, ``q ~ N(mu, Sigma)``, from the statistics of recent
*pre-RoPE* queries (Sec. 3.1), rotated to the next ``n`` positions (Sec. 3.2). For a key ``k``
the expected unnormalised attention is (Eq. 5, the Gaussian moment-generating function)::

    E[exp(s q . k)] = exp(s mu_f . k + s^2 k^T Sigma_f k / 2)

with ``s`` the softmax scale (``1 / sqrt(d)``: the paper's ``mu.k/sqrt(d) + k^T Sigma k/(2d)``).
The rotated statistics use the RoPE matrix averaged over the future positions (Eq. 6)::

    R_bar = (1/n) sum_{t=o}^{o+n-1} R_t = R_o A,   A = (1/n) sum_{t=0}^{n-1} R_t
    mu_f = R_bar mu,   Sigma_f = R_bar Sigma R_bar^T

(``o`` the row's tokens seen; rotations of one RoPE share their planes, so ``R_{o+t} = R_o R_t``).
``A`` is built once per layer by applying the layer's RoPE to the identity. Scores are the
softmax over the held keys, averaged over the query heads of a GQA group, optionally times the
value norm (Eq. 8)::

    s_j = (softmax_j(z)_j + eps) * ||v_j||,   z_j = s mu_f . k_j + s^2 k_j^T Sigma_f k_j / 2

The covariance term is never formed as a ``D x D`` matrix per key: with ``c_i`` the centred
window queries (``Sigma = (1/m) sum_i c_i c_i^T``) and ``f_i = R_bar c_i`` the *covariance
factor*, ``k^T Sigma_f k = (1/m) sum_i (f_i . k)^2``: one attention-shaped product.

Window and re-scoring (ours; kvpress scores once per prefill from the prompt's queries): the
scorer keeps the last ``query_window`` post-RoPE queries and their positions per row
(:class:`QueryWindow`), un-rotates them to pre-RoPE with the layer's RoPE at re-scoring, and
excludes positions ``< n_sink`` (outliers, as kvpress drops the first ``n_sink`` queries).
A row re-scores on every step that brings it more than one real token (prefill chunks) and, if
``interval > 0``, on decode steps at an offset that is a multiple of ``interval``; in between,
scores stay and new tokens enter at 0 (the ``lowest`` selector's ``recent >= interval`` keeps
them until they are scored).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of

from kvcompress import ConfigError, rows_field
from kvcompress.ops import grouped_matmul, owner_mask
from kvcompress_streaming_llm import RopeParams, rope_params

__all__ = ["ExpectedAttentionScorer", "QueryWindow", "averaged_rotation", "DEFAULT_ROPE"]

#: the rotation assumed before :meth:`ExpectedAttentionScorer.bind` read the model's (Llama's)
DEFAULT_ROPE = RopeParams(dims=0, traditional=False, base=10000.0, scale=1.0)


@attrs.define
class QueryWindow:
    """Per cache: the layer's RoPE (set by ``bind``; ``None`` = :data:`DEFAULT_ROPE`, no RoPE
    when ``rotary`` is false), whether the layer is an MLA latent cache (``latent``: its queries
    carry no RoPE and its stored "values" are the RoPE keys, so neither rotation nor value norm
    apply), the averaged rotation ``A^T`` ``[D, D]`` (built on first use), and per row the last
    ``w`` post-RoPE queries ``[B, H_q, w, D]`` with positions ``[B, 1, w]`` (``-1``: not filled
    yet)."""

    rope: Optional[RopeParams] = None
    rotary: bool = True
    latent: bool = False
    rotation: Optional[mx.array] = None
    queries: Optional[mx.array] = rows_field()
    positions: Optional[mx.array] = rows_field(fill=-1)


def _rope_of(state: QueryWindow, d: int) -> Optional[RopeParams]:
    if not state.rotary:
        return None
    rope = state.rope or DEFAULT_ROPE
    return rope if rope.dims else attrs.evolve(rope, dims=d)


def averaged_rotation(rope: Optional[RopeParams], d: int, n: int) -> mx.array:
    """``A^T = (1/n) sum_{t<n} R_t^T`` ``[d, d]`` float32: RoPE applied to the identity's rows
    (``rope(e_i, t) = R_t e_i``) at positions ``0 .. n-1``, averaged. ``x @ A^T = (A x)^T``."""
    if rope is None:
        return mx.eye(d, dtype=mx.float32)
    eye = mx.broadcast_to(mx.eye(d, dtype=mx.float32)[None], (n, d, d))
    delta = mx.broadcast_to(mx.arange(n, dtype=mx.int32)[:, None], (n, d))
    return rope.rotate(eye, delta).mean(axis=0)


def _append(state: Optional[QueryWindow], queries, qpos, n_valid: tuple, w: int):
    """The window after a step: each row's last ``w`` filled entries of old + new real queries."""
    b, hq, n, d = queries.shape
    ragged = any(v != n for v in n_valid)
    m = n if ragged else min(n, w)
    new_q, new_p = queries[:, :, n - m :], qpos[..., n - m :]
    if ragged:  # right padding: each row's padding queries are empty entries
        new_p = mx.where(mx.arange(n).reshape(1, 1, n) < mx.array(n_valid).reshape(-1, 1, 1), new_p, -1)
        new_q = mx.where((new_p >= 0)[..., None], new_q, mx.zeros((), new_q.dtype))
    old_ok = state is not None and state.queries is not None and state.queries.shape[1:] == (hq, w, d) \
        and state.queries.dtype == queries.dtype
    if old_ok:
        q, p = mx.concatenate([state.queries, new_q], axis=2), mx.concatenate([state.positions, new_p], axis=2)
    else:
        q = mx.concatenate([mx.zeros((b, hq, w, d), queries.dtype), new_q], axis=2)
        p = mx.concatenate([mx.full((b, 1, w), -1, mx.int32), new_p], axis=2)
    if not ragged:  # filled entries stay right-aligned: keep the last w columns
        return q[:, :, -w:], p[..., -w:]
    t = p.shape[-1]
    order = mx.argsort(mx.where(p >= 0, t + mx.arange(t), mx.arange(t)), axis=-1)[..., t - w :]
    q = mx.take_along_axis(q, mx.broadcast_to(order[..., None], (b, 1, w, 1)), axis=2)
    return q, mx.take_along_axis(p, order, axis=-1)


@attrs.frozen
class ExpectedAttentionScorer:
    """Expected attention of future queries; see the module docstring for the math.

    Parameters: ``n_future_positions`` (``n``, positions the rotation averages over),
    ``query_window`` (``w``, recent queries the statistics come from), ``n_sink`` (query
    positions below it are left out of the statistics; the same name sets the ``lowest``
    selector's sinks), ``use_covariance``, ``use_vnorm`` (weight by ``||v_j||``), ``epsilon``
    (added to the softmax before the value weighting) and ``interval`` (decode re-scoring
    period; 0 = prefill chunks only).
    """

    n_future_positions: int = attrs.field(default=32, validator=[instance_of(int), ge(1)])
    query_window: int = attrs.field(default=32, validator=[instance_of(int), ge(1)])
    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])
    use_covariance: bool = attrs.field(default=True, validator=instance_of(bool))
    use_vnorm: bool = attrs.field(default=True, validator=instance_of(bool))
    epsilon: float = attrs.field(default=0.0, converter=float, validator=ge(0.0))
    interval: int = attrs.field(default=16, validator=[instance_of(int), ge(0)])

    requires: ClassVar[frozenset] = frozenset({"queries", "keys", "values", "positions"})
    provides: ClassVar[frozenset] = frozenset({"expected_attention", "head_groups"})

    def init_state(self, layer) -> QueryWindow:
        return QueryWindow()

    def bind(self, model, layers, states) -> list:
        """Each layer's RoPE read into its state (no ``rope``: no rotation)."""
        blocks, out = list(model.layers), []
        for info, state in zip(layers, states):
            block = info.block if info.block is not None else info.layer
            attn = getattr(blocks[block], "self_attn", getattr(blocks[block], "attention", None))
            module = getattr(attn, "rope", None)
            latent = hasattr(attn, "kv_lora_rank")  # MLA: the cache sees q_nope and latent keys
            if module is None or latent:
                rope, rotary = None, False
            else:
                try:
                    rope, rotary = rope_params(module), True
                except ConfigError:
                    raise ConfigError(
                        f"expected_attention cannot rotate query statistics with RoPE module "
                        f"{type(module).__name__!r} of layer {block}: it supports nn.RoPE and mlx-lm "
                        "RoPE modules with fixed frequencies (Llama3, YaRN, SuScaled, Proportional)"
                    ) from None
            out.append(attrs.evolve(state or QueryWindow(), rope=rope, rotary=rotary, latent=latent, rotation=None))
        return out

    def events(self, obs) -> list:
        """Per row: whether this step re-scores the row (its own real tokens, never the batch's)."""
        valid = obs.n_valid or (obs.n_new,) * len(obs.offsets)
        return [v > 1 or (v == 1 and self.interval > 0 and o % self.interval == 0) for v, o in zip(valid, obs.offsets)]

    def observe(self, scores, obs):
        st = obs.state if isinstance(obs.state, QueryWindow) else QueryWindow()
        valid = obs.n_valid or (obs.n_new,) * len(obs.offsets)
        q, qpos = _append(st, obs.queries, obs.query_positions, tuple(valid), self.query_window)
        d = obs.queries.shape[-1]
        rope = _rope_of(st, d)
        rot = st.rotation
        if rot is None or rot.shape != (d, d):
            rot = averaged_rotation(rope, d, self.n_future_positions)
        obs.state = attrs.evolve(st, queries=q, positions=qpos, rotation=rot)
        events = self.events(obs)
        if not any(events):
            return scores
        values = None if st.latent else obs.values
        new = self.expected_scores(q, qpos, obs.keys, values, obs.positions, obs.offset, obs.scale, rope, rot,
                                   obs.owner, obs.heads_per_row)
        if all(events):
            return new
        return mx.where(mx.array(events).reshape(-1, 1, 1), new, scores)

    def expected_scores(self, q, qpos, keys, values, positions, offset, scale, rope, rot, owner=None,
                        heads_per_row: int = 1) -> mx.array:
        """``[B, H, T]`` float32 scores of ``keys`` from the window ``q`` ``[B, H_q, w, D]`` at
        ``qpos`` ``[B, 1, w]``; ``offset`` ``[B, 1, 1]`` the next position; ``rot`` ``A^T``. With
        head groups (``owner``), each slot is scored by its own KV head's query heads only."""
        b, hq, w, d = q.shape
        h = keys.shape[1]
        g = hq // h
        pre = q.astype(mx.float32)
        if rope is not None:  # back to pre-RoPE: rotate by -p_i
            pre = rope.rotate(pre, mx.broadcast_to(-mx.maximum(qpos, 0), (b, hq, w)))
        wt = (qpos >= self.n_sink).astype(mx.float32)[..., None]  # [B, 1, w, 1]
        cnt = mx.maximum(wt.sum(axis=2, keepdims=True), 1.0)
        mu = (pre * wt).sum(axis=2, keepdims=True) / cnt  # [B, H_q, 1, D]
        off = mx.broadcast_to(offset, (b, 1, 1)).astype(mx.int32)

        def future(x):  # R_o A x for rows x [B, H_q, m, D]
            x = x @ rot
            return x if rope is None else rope.rotate(x, mx.broadcast_to(off, x.shape[:3]))

        k = keys.astype(mx.float32)
        kt = k.swapaxes(-1, -2)  # [B, H, D, T]
        z = grouped_matmul(future(mu).reshape(b, h, g, 1, d), kt)[..., 0, :] * scale  # [B, H, g, T]
        if self.use_covariance:
            fac = future((pre - mu) * wt).reshape(b, h, g, w, d)  # covariance factor
            z = z + (mx.square(grouped_matmul(fac, kt)).sum(axis=3) / cnt.reshape(b, 1, 1, 1)) * (scale * scale / 2)
        held = (positions >= 0)[:, :, None, :]
        if owner is not None and heads_per_row > 1:
            held = held & owner_mask(owner, g, heads_per_row)
        z = mx.where(held, z, -mx.inf)
        p = mx.where(held, mx.softmax(z, axis=-1, precise=True), 0.0).mean(axis=2)  # [B, H, T]
        if owner is not None and heads_per_row > 1:
            p = p * heads_per_row  # the mean over each slot's own query heads
        if self.use_vnorm:  # no values (an MLA latent cache, a hand-built observation): norm 1
            p = p + self.epsilon
            if values is not None:
                p = p * mx.linalg.norm(values.astype(mx.float32), axis=-1)
        return mx.where(positions >= 0, p, 0.0)
