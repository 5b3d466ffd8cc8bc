"""KIVI: evicted tokens are quantized to 2/4 bits (keys per channel, values per token), not dropped.

Component: disposition ``kivi_quant`` (packed store + attention over it). Methods: ``kivi`` (the
paper: full-precision recent window of ``budget`` = residual tokens, older tokens quantized;
the oldest token leaves first through the ``recency`` scorer of ``kvcompress_streaming_llm`` and
the ``lowest`` selector of ``kvcompress_basic``) and ``h2o_kivi`` (H2O chooses the losers; they
are quantized instead of dropped).
"""

from kvcompress import ComponentSpec, MethodSpec, hookimpl

from .quant import KiviQuant
from .store import KiviState, kivi_quantize, quantize_keys, quantize_values

__all__ = ["KiviQuant", "KiviState", "kivi_quantize", "quantize_keys", "quantize_values"]

PAPER = "https://arxiv.org/abs/2402.02750"


@hookimpl
def kvcompress_dispositions():
    return [
        ComponentSpec(
            "disposition", "kivi_quant", KiviQuant,
            "evicted tokens quantized (keys per channel, values per token, asymmetric, packed); "
            "attention runs on the packed store",
            PAPER,
        )
    ]


@hookimpl
def kvcompress_methods():
    return [
        MethodSpec(
            name="kivi",
            scorer="recency",
            selector="lowest",
            disposition="kivi_quant",
            budget="uniform",
            summary="KIVI: the last `budget` (residual) tokens in full precision, older ones 2-bit",
            params={"budget": 128, "n_sink": 0, "bits": 2, "group": 32},
            paper=PAPER,
        ),
        MethodSpec(
            name="h2o_kivi",
            scorer="h2o",
            selector="lowest",
            disposition="kivi_quant",
            budget="uniform",
            summary="H2O's losers quantized KIVI-style instead of dropped (evict or quantize)",
            params={"budget": 128, "n_sink": 4, "recent_ratio": 0.5, "bits": 2, "group": 32},
            paper=PAPER,
        ),
    ]
