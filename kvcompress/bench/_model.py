"""The random-weight mlx-lm Llama the speed workloads time, and its seeded random tokens.

:class:`ModelShape` holds the model's shape and the settings every speed workload shares
(weight dtype, prefill chunk, ``RotatingKVCache`` sinks, seed, warm-up); the workloads'
settings classes extend it. Random weights give meaningless tokens but the compute of a trained
model of the same shape.
"""

from __future__ import annotations

from typing import Optional

import attrs
import mlx.core as mx

from ._options import at_least, one_of

__all__ = ["DTYPES", "SHAPE_KEYS", "ModelShape", "build_model", "model_and_shape", "random_tokens"]

DTYPES = ("float32", "bfloat16", "float16")
#: the shape settings a loaded model's arguments replace
SHAPE_KEYS = ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab")


@attrs.frozen
class ModelShape:
    """Model shape (defaults: 8 layers, hidden 1024, 16 query / 4 KV heads, head_dim 64, MLP
    2816, vocab 32000, ~154 M parameters) and the shared protocol settings."""

    #: ``RotatingKVCache`` attention sinks of the ``rotating`` reference
    keep: int = attrs.field(default=4, validator=at_least(0))
    #: prefill chunk (``mlx_lm.generate``'s ``prefill_step_size``)
    prefill_step_size: int = attrs.field(default=512, validator=at_least(1))
    dtype: str = attrs.field(default="float32", validator=one_of(DTYPES))
    n_layers: int = attrs.field(default=8, validator=at_least(1))
    hidden: int = attrs.field(default=1024, validator=at_least(1))
    n_heads: int = attrs.field(default=16, validator=[at_least(1), lambda inst, a, v: _hidden_splits(inst.hidden, v)])
    n_kv_heads: int = attrs.field(default=4, validator=[at_least(1), lambda inst, a, v: _divides(inst.n_heads, v)])
    head_dim: int = attrs.field(default=64, validator=at_least(1))
    intermediate: int = attrs.field(default=2816, validator=at_least(1))
    vocab: int = attrs.field(default=32000, validator=at_least(2))
    seed: int = attrs.field(default=0, validator=at_least(0))
    #: one untimed pass per cache kind before the measurements
    warmup: bool = True

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def _hidden_splits(hidden: int, n_heads: int) -> None:
    if isinstance(hidden, int) and hidden % n_heads:  # mlx-lm's Llama checks it when it builds
        raise ValueError(f"hidden must be a multiple of n_heads ({n_heads}), got {hidden}")


def _divides(n_heads: int, n_kv_heads: int) -> None:
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads, got {n_kv_heads}")


def build_model(s: ModelShape, dtype: Optional[str] = None):
    """A seeded random-weight mlx-lm Llama of the settings' shape, weights in ``dtype``."""
    from mlx_lm.models import llama

    mx.random.seed(s.seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=s.hidden,
        num_hidden_layers=s.n_layers,
        intermediate_size=s.intermediate,
        num_attention_heads=s.n_heads,
        num_key_value_heads=s.n_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=1e-5,
        vocab_size=s.vocab,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.set_dtype(getattr(mx, dtype or s.dtype))
    mx.eval(model.parameters())
    return model


def random_tokens(s: ModelShape, n: int, stream: int = 1) -> mx.array:
    """``n`` seeded random token ids (``stream`` picks an independent sequence per use)."""
    return mx.random.randint(0, s.vocab, (n,), key=mx.random.key(s.seed + stream)).astype(mx.uint32)


def model_and_shape(s: ModelShape, model: Optional[str] = None):
    """``(model, shape, tokenizer)``: the random Llama of the settings (no tokenizer), or the
    mlx-lm ``model`` loaded (dequantized) with its tokenizer and the shape read from its
    arguments (random ids are drawn from its vocabulary)."""
    if not model:
        return build_model(s), s, None
    from .longctx import load_chat_model

    loaded, tokenizer = load_chat_model(model)
    a = loaded.args
    heads = a.num_attention_heads
    shape = attrs.evolve(
        s, n_layers=len(loaded.layers), hidden=a.hidden_size, n_heads=heads,
        n_kv_heads=getattr(a, "num_key_value_heads", None) or heads,
        head_dim=getattr(a, "head_dim", None) or a.hidden_size // heads, vocab=a.vocab_size,
    )
    return loaded, shape, tokenizer
