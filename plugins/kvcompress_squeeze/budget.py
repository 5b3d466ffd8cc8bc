"""The ``squeeze`` budget: measure layer importance on the prompt, then re-split the budget.

Until the prompt has been seen every layer has the uniform budget ``b``. The budget requires the
cache's ``layer_io`` service: during a prompt's first forward (prefill, or its first chunk) each
compressed layer hands it the block input ``x`` and the attention output ``r``, and it records,
per batch row,

    c_l = mean over the row's tokens of cos(x, x + r)

in the layer's state. When every compressed layer of the prompt has reported, :meth:`rebudget`
returns the budgets of :func:`~kvcompress_squeeze.allocate.squeeze_budgets` for each row. The
first forward never evicts (eviction is deferred to the next update), so the new budgets take
effect before any eviction. The similarities live in each cache's state and the budgets in the
cache itself: both travel with copies, saves and loads. Needs Llama-like blocks
(``h = x + self_attn(input_layernorm(x), mask, cache)``: Llama, Mistral, Qwen2/3, Phi-3, ...).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, gt, instance_of, le

from kvcompress import rows_field

from .allocate import squeeze_budgets

__all__ = ["SqueezeBudget", "SqueezeState"]


@attrs.define
class SqueezeState:
    """``cos``: ``[B]`` float32, the layer's prompt similarity per row (None until observed)."""

    cos: Optional[mx.array] = rows_field()


@attrs.frozen
class SqueezeBudget:
    """SqueezeAttention (Wang et al., 2024): layer budgets from attention's effect on the prompt.

    ``budget``: the mean per-layer budget (total = ``n_layers * budget``); ``squeeze_ratio``: the
    least important cluster's budget as a fraction of ``budget`` (SqueezeAttention's
    ``KV_class3 / ini_size``); ``n_clusters``: k of the k-means; ``seed``: k-means++ starts.
    """

    budget: int = attrs.field(default=512, validator=[instance_of(int), ge(1)])
    squeeze_ratio: float = attrs.field(default=0.4, converter=float, validator=[gt(0.0), le(1.0)])
    n_clusters: int = attrs.field(default=3, validator=[instance_of(int), ge(1)])
    seed: int = attrs.field(default=0, validator=instance_of(int))

    requires: ClassVar[frozenset] = frozenset({"layer_io"})
    provides: ClassVar[frozenset] = frozenset({"layer_budgets"})

    def layer_budgets(self, info) -> list[int]:
        """Uniform until the prompt is observed (see :meth:`rebudget`)."""
        return [self.budget] * info.n_layers

    def allocate(self, similarity, min_budget: int = 1) -> list[int]:
        return squeeze_budgets(similarity, self.budget, self.squeeze_ratio, self.n_clusters, self.seed, min_budget)

    def init_state(self, layer) -> SqueezeState:
        return SqueezeState()

    def observe_layer(self, state, x: mx.array, out: mx.array, weight) -> SqueezeState:
        """``c = mean_t cos(x_t, x_t + r_t)`` per row over its real tokens (``weight`` ``[B, N]``)."""
        x = x.astype(mx.float32)
        h = x + out.astype(mx.float32)
        cos = (x * h).sum(-1) / (mx.sqrt((x * x).sum(-1) * (h * h).sum(-1)) + 1e-12)  # [B, N]
        if weight is None:
            return SqueezeState(cos=cos.mean(axis=-1))
        return SqueezeState(cos=(cos * weight).sum(-1) / mx.maximum(weight.sum(-1), 1.0))

    def rebudget(self, states: list, budgets: list, min_budget: int):
        """Per layer, per row: the squeezed budgets of each row's similarities."""
        if any(s is None or s.cos is None for s in states):
            return None
        sims = mx.stack([s.cos for s in states]).tolist()  # [L][B]
        per_row = [self.allocate([layer[r] for layer in sims], min_budget) for r in range(len(sims[0]))]
        return [[row[layer] for row in per_row] for layer in range(len(states))]

    def diagnostics(self, state) -> dict:
        if state is None or state.cos is None:
            return {}
        return {"squeeze_similarity": [float(c) for c in state.cos.tolist()]}
