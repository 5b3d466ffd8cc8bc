"""Tables of the speed workload's profile (:func:`kvcompress.bench._profile.profile_decode`)."""

from __future__ import annotations

from typing import Any

from ._report import markdown_table


def profile_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per profile variant: model decode step, its excess over rotating, the 1-layer
    step and the MLX ops per layer step."""
    prof = payload["profile"]
    cols = ["variant", "model decode step ms", "vs rotating ms", "1-layer step ms", "ops/layer (update+attention)"]
    base = prof["model_step_ms"]["rotating"]["step_ms_median"]
    rows = []
    for var, r in prof["model_step_ms"].items():
        name = var.partition("[")[0]
        o = prof["ops_per_layer_step"].get(name, {})
        ops = o.get("update_and_fetch", 0) + o.get("attend_observe", 0) if "[" not in var else None
        rows.append([var, r["step_ms_median"], r["step_ms_median"] - base,
                     prof["layer_step_ms"][var]["ms"], ops])
    return cols, rows


def profile_markdown(payload: dict) -> list[str]:
    """Markdown tables of a speed payload's profile (one string per table)."""
    parts = []
    prof = payload["profile"]
    cols, rows = profile_table(payload)
    parts.append(f"Decode profile, context {prof['context']} (model: whole decode step; "
                 "1-layer: update + SDPA + observe of one layer's cache):\n\n" + markdown_table(cols, rows))
    lp = prof.get("layer_prefill_chunk_ms", {})
    if lp:
        base = lp.get("rotating", {}).get("ms")
        parts.append(f"One prefill chunk ({payload['settings']['prefill_step_size']} tokens) on one layer, "
                     "cache in eviction steady state (update + SDPA + observe):\n\n" + markdown_table(
                         ["variant", "ms", "/ rotating"],
                         [[v, r["ms"], r["ms"] / base if base else None] for v, r in lp.items()]))
    pc = prof.get("prefill_component_ms", {})
    if pc:
        parts.append(f"Prefill chunk pieces, one layer ({pc.get('shape', '')}), ms:\n\n" + markdown_table(
            ["piece", "ms"], [[k, v] for k, v in pc.items() if k != "shape"]))
    comp = prof["component_ms"]
    names = sorted({k for v in comp.values() for k in v})
    parts.append("Component calls alone, one layer, ms (median):\n\n" + markdown_table(
        ["method", *names], [[m, *[v.get(n) for n in names]] for m, v in comp.items()]))
    pred = prof.get("predicted_from_layer_overhead", {})
    if pred:
        parts.append("Decode ratio predicted from the 1-layer overhead (n_layers x extra ms per layer "
                     "vs the rotating model step):\n\n" + markdown_table(
                         ["method", "extra ms / token", "predicted decode ratio"],
                         [[m, v["extra_ms_per_token"], v["decode_ratio"]] for m, v in pred.items()]))
    ops = prof["ops_per_layer_step"]
    rows = [[m, o.get("update_and_fetch"), o.get("attend_observe", 0), o.get("decoder_layer_total")]
            for m, o in ops.items()]
    parts.append("MLX primitives per layer per decode step:\n\n" + markdown_table(
        ["cache", "update_and_fetch", "attention + observe", "whole decoder layer"], rows))
    return parts
