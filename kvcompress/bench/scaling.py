"""Speed and memory against context length: every method at several budgets, 1k to 8k tokens.

**Workload.** The random-weight mlx-lm Llama of :mod:`kvcompress.bench._model` (default 8
layers, hidden 1024, 16 query / 4 KV heads, head_dim 64, float32 weights) reads one seeded
random prompt. For each budget ``C`` every cache kind -- each method (``make_prompt_cache(model,
name, budget=C)``), ``rotating`` (``RotatingKVCache(C, keep)``) and, in the pass of
``full_budget`` only, ``full`` (``KVCache``; it has no budget) and, when named in ``methods``,
mlx-lm's ``QuantizedKVCache`` (``quantized2`` / ``quantized4`` / ``quantized8``: no budget either,
see :mod:`kvcompress.bench._caches`) -- advances in lockstep through the context checkpoints ``n_1 < n_2 < ...`` (default 1024, 2048, 4096, 8192):

1. *prefill* from the previous checkpoint to ``n_i`` in chunks of ``prefill_step_size`` tokens
   (``model(chunk, cache)``, then ``mx.eval`` of the cache state, as ``mlx_lm.generate`` does),
   then one decode step, which carries out the eviction the last chunk deferred; ``prefill_s``
   at ``n_i`` is the cumulative time, i.e. the time to the first token of an ``n_i``-token
   prompt with chunk boundaries at the same positions;
2. *decode* ``decode_tokens`` greedy steps pipelined as ``mlx_lm.generate`` runs them (step
   ``n + 1`` is built while step ``n`` computes), timed in blocks of ``decode_block`` steps,
   each kind's block next to a block of ``rotating`` (before it and after it on alternate
   rounds, the order of the kinds rotated every round: a ratio compares blocks seconds apart,
   however many kinds run, so load from other processes hits both alike); then one block of
   ``sync_tokens`` synchronous steps (``mx.eval`` of each token before the next step is built),
   next to one of ``rotating``'s the same way, which exposes the Python/graph-building cost of a
   cache that pipelining hides. The decoded tokens stay in the context, so the context at
   checkpoint ``i`` is ``n_i + i + (i - 1) * (decode_tokens + sync_tokens)`` tokens (recorded as
   ``tokens_seen``; ``rotating``, timed beside every other kind, decodes that many per kind).

With ``fill="synthetic"`` (``--fill synthetic``) step 1 feeds each layer's cache seeded random
keys, values and queries through the cache protocol instead of the model (:mod:`._fill`): the
decode ratios of every method at an 8k-token context on a 30-layer model in minutes instead of
minutes per method; methods that need the model's forward (``kvzip``, ``selfinfo``) are refused.

**Measurements** at each checkpoint: ``decode_ms`` (median ms per token over the pipelined
blocks), ``decode_ms_sync``,
``prefill_s``, ``cache_bytes`` (``sum(c.nbytes)`` over the layers: allocated buffers,
positions, scores and quantized blocks included), ``live_bytes`` (the bytes of the tokens
actually held), ``stored_tokens`` (layer 0) and ``peak_bytes``: the largest
``mx.get_peak_memory()`` the process would reach running this kind alone -- model weights
plus this kind's cache plus the transient buffers of its prefill chunks and decode steps
(peak counter reset before each of the kind's segments; the other kinds' caches, idle during
the segment, are subtracted). Ratios are paired against ``rotating`` of the same budget from the
same pass: ``decode_ratio`` = rotating ms / kind ms per (checkpoint, block), the rotating block
the one timed next to it, median (higher is better; target >= 0.9), ``decode_ratio_sync`` the
same for the synchronous blocks; ``prefill_ratio`` = kind s / rotating s per chunk segment summed to
the checkpoint (lower is better).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import attrs

from ._caches import QUANTIZED, cache_bytes, live_kv_bytes, make_cache, method_names, stored_tokens
from ._fill import synthetic_fill
from ._harness import Runner, median, paired, release, rotate, time_beside
from ._model import DTYPES, SHAPE_KEYS, ModelShape, model_and_shape, random_tokens
from ._options import NameList, add_output_arguments, check_minimums, int_list, one_of, options_given, out_dir
from ._report import caption as _caption
from ._report import (finish, machine_info, markdown_table, print_table, progress_bar, pyplot, save_plot,
                      warn_openblas, write_json)

__all__ = [
    "ScalingSettings",
    "QUICK",
    "run_scaling",
    "summary_table",
    "plot_scaling",
    "markdown_report",
    "add_arguments",
    "settings_from_args",
    "run",
]


@attrs.frozen
class ScalingSettings(ModelShape):
    """Contexts, budgets, methods and the protocol on top of the model shape (defaults: the
    committed run)."""

    contexts: tuple = attrs.field(default=(1024, 2048, 4096, 8192), converter=int_list)
    budgets: tuple = attrs.field(default=(256, 512, 1024), converter=int_list)
    #: None = every registered method
    methods: Optional[tuple] = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    #: the budget whose pass also runs the full KVCache (None: budgets' middle one; 0: no full)
    full_budget: Optional[int] = None
    decode_tokens: int = 24
    decode_block: int = 8
    #: synchronous decode steps per checkpoint (one block; 0 = none)
    sync_tokens: int = 4
    #: an mlx-lm model folder or Hugging Face id instead of the random Llama (dequantized after
    #: loading, as the long-context workloads do); the shape settings then do not apply
    model: Optional[str] = None
    #: "prompt": the model prefills the prompt; "synthetic": each layer's cache is filled with
    #: seeded random keys, values and queries through the cache protocol (:mod:`._fill`, no
    #: forward: decode speed at long contexts in minutes; ``prefill_s`` is then the fill's time)
    fill: str = attrs.field(default="prompt", validator=one_of(("prompt", "synthetic")))

    def __attrs_post_init__(self):
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)) or self.contexts[0] < 1:
            raise ValueError(f"contexts must be increasing positive token counts, got {self.contexts}")
        check_minimums(self.to_dict(), {"budgets": 1, "full_budget": 0, "decode_block": 2, "sync_tokens": 0})
        if self.decode_tokens < self.decode_block:
            raise ValueError(f"decode_tokens must be >= decode_block ({self.decode_block}), got {self.decode_tokens}")
        if self.full_budget not in (None, 0) and self.full_budget not in self.budgets:
            raise ValueError(f"full_budget {self.full_budget} is not one of the budgets {self.budgets}")

    @property
    def full_pass(self) -> Optional[int]:
        if self.full_budget == 0:
            return None
        return self.full_budget or self.budgets[len(self.budgets) // 2]


#: Small sizes for smoke tests and ``--quick`` (seconds).
QUICK = dict(
    contexts=(128, 256), budgets=(64, 96), decode_tokens=4, decode_block=2, sync_tokens=2, prefill_step_size=64, n_layers=2,
    hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate=256, vocab=500,
)


def run_scaling(settings: Optional[ScalingSettings] = None, *, progress: Optional[Callable[[str], None]] = None,
                registry=None, bar: bool = False) -> dict:
    """Run every budget pass; return the JSON payload (``results``: one record per kind, budget
    and checkpoint; ``summary``: per kind and budget, at the largest context).

    ``progress`` receives a line per checkpoint; ``bar`` shows a tqdm bar of prompt tokens
    prefilled (when tqdm is installed)."""
    from mlx.utils import tree_flatten

    from kvcompress import get_registry, install

    s = settings or ScalingSettings()
    say = progress or (lambda m: None)
    methods = method_names(s.methods, registry or get_registry(), allow=tuple(QUANTIZED))
    # mlx-lm's QuantizedKVCache keeps every token (no budget): it runs once, in the full pass
    quantized = [m for m in methods if m in QUANTIZED]
    methods = [m for m in methods if m not in QUANTIZED]
    t_start = time.perf_counter()
    model, shape, tokenizer = model_and_shape(s, s.model)  # (a method's token ids resolve with the model's)
    install(model)
    weights = int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))
    prompt = random_tokens(shape, s.contexts[-1])
    decode_ids = random_tokens(shape, 64, stream=2)
    fill = synthetic_fill(shape, s.seed) if s.fill == "synthetic" else None
    payload: dict[str, Any] = {
        "benchmark": "scaling", "machine": machine_info(), "settings": {**s.to_dict(), "methods": methods + quantized},
        "weights_bytes": weights, "results": [], "errors": [],
    }
    if s.model:
        payload["model_shape"] = {k: getattr(shape, k) for k in SHAPE_KEYS}
    n_blocks = s.decode_tokens // s.decode_block
    warmed: set = set()
    n_kinds = len(methods) + 1
    total = s.contexts[-1] * (n_kinds * len(s.budgets) + ((1 + len(quantized)) if s.full_pass else 0))
    pbar = progress_bar(total=total, desc="scaling", unit="tok", unit_scale=True) if bar else None
    if pbar is not None:
        say = pbar.write
    for budget in s.budgets:
        kinds = [*methods, "rotating"] + (["full", *quantized] if budget == s.full_pass else [])

        def runner(kind):
            return Runner(kind, model, make_cache(model, kind, budget, keep=s.keep, tokenizer=tokenizer), prompt,
                          decode_ids, weights, fill)

        if s.warmup:
            for kind in kinds:
                if kind in warmed:
                    continue
                try:
                    w = runner(kind)
                    w.prefill_to(min(s.contexts[-1], budget + s.prefill_step_size + 1), s.prefill_step_size)
                    w.decode(2)
                except Exception:  # reported by the measured pass below
                    pass
                warmed.add(kind)
                w = None
            release()
        runners: dict[str, Runner] = {}
        for kind in kinds:
            try:
                runners[kind] = runner(kind)
            except Exception as exc:
                payload["errors"].append({"kind": kind, "budget": budget, "error": f"{type(exc).__name__}: {exc}"})
                say(f"budget {budget} {kind}: cannot build ({exc})")
        for ci, n in enumerate(s.contexts):
            order = rotate(list(runners), ci)
            for kind in order:
                try:
                    before = runners[kind].pos
                    runners[kind].prefill_to(n, s.prefill_step_size)
                    if pbar is not None:
                        pbar.update(n - before)
                except Exception as exc:
                    payload["errors"].append({"kind": kind, "budget": budget, "context": n,
                                              "error": f"{type(exc).__name__}: {exc}"})
                    say(f"budget {budget} {kind}: failed at {n} ({exc})")
                    del runners[kind]
            times, beside = time_beside(runners, "rotating", n_blocks, lambda r: r.decode(s.decode_block), ci)
            sync, sync_beside = time_beside(runners, "rotating", 1, lambda r: r.decode_sync(s.sync_tokens),
                                            ci + 1) if s.sync_tokens else ({}, {})
            for kind, r in runners.items():
                payload["results"].append({
                    "kind": kind, "budget": None if kind in ("full", *QUANTIZED) else budget, "pass_budget": budget,
                    "context": n, "tokens_seen": r.pos + r.decoded,
                    "prefill_s": r.prefill_s, "decode_ms": 1e3 * median(times[kind]),
                    "decode_ms_blocks": [1e3 * t for t in times[kind]],
                    "decode_ms_sync": 1e3 * median(sync[kind]) if sync.get(kind) else None,
                    "cache_bytes": cache_bytes(r.cache), "live_bytes": live_kv_bytes(r.cache),
                    "stored_tokens": stored_tokens(r.cache[0]), "peak_bytes": r.peak,
                })
            say(f"budget {budget} context {n}: " + ", ".join(
                f"{k} {1e3 * median(v):.0f}ms" for k, v in times.items())
                + f" ({time.perf_counter() - t_start:.0f}s)")
            for rec in payload["results"][-len(runners):]:
                if beside.get(rec["kind"]):  # each block against the rotating block timed next to it
                    rec["decode_ratio_blocks"] = paired(times[rec["kind"]], beside[rec["kind"]], invert=True)
                if sync_beside.get(rec["kind"]):
                    rec["decode_ratio_sync"] = median(paired(sync[rec["kind"]], sync_beside[rec["kind"]], invert=True))
        del runners
        release()
    if pbar is not None:
        pbar.close()
    payload["summary"] = _summarise(payload, s)
    payload["seconds_total"] = time.perf_counter() - t_start
    return payload


def _summarise(payload: dict, s: ScalingSettings) -> list[dict]:
    """Per (kind, pass budget) at the largest context, with ratios against rotating."""
    res = payload["results"]
    by = {(r["kind"], r["pass_budget"], r["context"]): r for r in res}
    out = []
    for (kind, budget, n), r in by.items():
        if n != s.contexts[-1]:
            continue
        rot = by.get(("rotating", budget, n))
        first = by.get((kind, budget, s.contexts[0]))
        ratios = [x for c in s.contexts for x in by.get((kind, budget, c), {}).get("decode_ratio_blocks", [])]
        sync = [by[(kind, budget, c)]["decode_ratio_sync"] for c in s.contexts
                if "decode_ratio_sync" in by.get((kind, budget, c), {})]
        rec = {
            "kind": kind, "budget": r["budget"], "pass_budget": budget, "context": n,
            "prefill_s": r["prefill_s"], "decode_tok_s": 1e3 / r["decode_ms"],
            "cache_mb": r["cache_bytes"] / 2**20, "peak_mb": r["peak_bytes"] / 2**20,
            "decode_ms_growth": r["decode_ms"] / first["decode_ms"] if first else None,
        }
        if rot and kind != "rotating":
            if s.fill == "prompt":  # a synthetic fill is no prefill: its time is not compared
                rec["prefill_ratio"] = r["prefill_s"] / rot["prefill_s"]
            rec["decode_ratio"] = median(ratios)
            rec["decode_ratio_sync"] = median(sync)
            rec["cache_ratio"] = r["cache_bytes"] / rot["cache_bytes"]
            rec["peak_ratio"] = r["peak_bytes"] / rot["peak_bytes"]
            if kind not in ("full", *QUANTIZED) and rec["decode_ratio"] is not None:
                rec["decode_target_met"] = rec["decode_ratio"] >= 0.9
        out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------


def summary_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per (budget, cache) at the largest context, ratios against rotating."""
    n = payload["settings"]["contexts"][-1]
    cols = ["budget", "cache", f"prefill s @{n}", "/ rotating", "decode tok/s", "/ rotating", "(sync)",
            f"decode ms {n} / {payload['settings']['contexts'][0]}", "cache MB", "peak MB", "peak / rotating"]
    rows = []
    for r in payload["summary"]:
        one = 1.0 if r["kind"] == "rotating" else None
        rows.append([
            "-" if r["budget"] is None else r["budget"], r["kind"], r["prefill_s"], r.get("prefill_ratio", one),
            r["decode_tok_s"], r.get("decode_ratio", one), r.get("decode_ratio_sync", one), r["decode_ms_growth"],
            r["cache_mb"], r["peak_mb"], r.get("peak_ratio", one),
        ])
    return cols, rows


def caption(payload: dict) -> str:
    keys = ("contexts", "budgets", "keep", "decode_tokens", "decode_block", "sync_tokens", "prefill_step_size", "fill")
    if payload["settings"].get("model"):
        shape = payload["model_shape"]
        extra = f"; model {payload['settings']['model']} ({', '.join(f'{k} {shape[k]}' for k in SHAPE_KEYS)})"
    else:
        keys += ("dtype", "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")
        extra = ""
    return _caption(payload, keys, extra=f"{extra}; weights {payload['weights_bytes'] / 2**20:.0f} MB")


def plot_scaling(payload: dict, path, budget: Optional[int] = None):
    """Three panels against context length at one budget (default: the pass with ``full``):
    decode ms/token, cache MB and peak MB over the weights, one line per cache kind."""
    plt = pyplot()
    s = payload["settings"]
    budget = budget or (s["full_budget"] or s["budgets"][len(s["budgets"]) // 2])
    res = [r for r in payload["results"] if r["pass_budget"] == budget]
    kinds = list(dict.fromkeys(r["kind"] for r in res))
    w = payload["weights_bytes"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2))
    cmap = plt.get_cmap("tab20")
    for i, kind in enumerate(kinds):
        rr = sorted((r for r in res if r["kind"] == kind), key=lambda r: r["context"])
        x = [r["context"] for r in rr]
        style = dict(color="black", lw=2.2, ls="--") if kind == "full" else (
            dict(color="tab:gray", lw=2.2) if kind == "rotating" else dict(color=cmap(i % 20), lw=1.2))
        axes[0].plot(x, [r["decode_ms"] for r in rr], marker="o", ms=3, label=kind, **style)
        axes[1].plot(x, [r["cache_bytes"] / 2**20 for r in rr], marker="o", ms=3, **style)
        axes[2].plot(x, [(r["peak_bytes"] - w) / 2**20 for r in rr], marker="o", ms=3, **style)
    for ax, title in zip(axes, ("decode ms per token (lower is better)", "cache MB (sum of nbytes)",
                                "peak MB above the weights (mx.get_peak_memory)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["contexts"], [f"{c // 1024}k" if c >= 1024 else str(c) for c in s["contexts"]])
        ax.set_xlabel("context tokens")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Speed and memory against context, budget {budget} tokens per layer "
                 "(full KVCache dashed: it grows; bounded caches stay flat)", fontsize=11)
    return save_plot(fig, path, caption(payload))


def markdown_report(payload: dict) -> str:
    """The summary table, then decode ms and cache MB against context at the full pass's budget."""
    cols, rows = summary_table(payload)
    parts = [markdown_table(cols, rows)]
    s = payload["settings"]
    b = s["full_budget"] or s["budgets"][len(s["budgets"]) // 2]
    res = [r for r in payload["results"] if r["pass_budget"] == b]
    kinds = list(dict.fromkeys(r["kind"] for r in res))
    by = {(r["kind"], r["context"]): r for r in res}
    parts.append(f"Decode ms per token against context, budget {b}:\n\n" + markdown_table(
        ["cache", *[str(c) for c in s["contexts"]]],
        [[k, *[by[(k, c)]["decode_ms"] if (k, c) in by else None for c in s["contexts"]]] for k in kinds]))
    parts.append(f"Cache MB against context, budget {b}:\n\n" + markdown_table(
        ["cache", *[str(c) for c in s["contexts"]]],
        [[k, *[by[(k, c)]["cache_bytes"] / 2**20 if (k, c) in by else None for c in s["contexts"]]]
         for k in kinds]))
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------
# Command line (``kvcompress bench scaling``)
# ------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """Options of the scaling workload (defaults: :class:`ScalingSettings`)."""
    parser.add_argument("--quick", action="store_true", help="tiny model and contexts (seconds)")
    parser.add_argument("--contexts", type=int_list, help="context checkpoints (default 1024,2048,4096,8192)")
    parser.add_argument("--budgets", type=int_list, help="tokens per layer (default 256,512,1024)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: every registered method); quantized2, "
                             "quantized4, quantized8 add mlx-lm's QuantizedKVCache to the full pass")
    parser.add_argument("--full-budget", type=int, help="the budget pass that also runs the full KVCache "
                        "(default: the middle budget; 0: none)")
    parser.add_argument("--decode-tokens", type=int, help="pipelined decode tokens per checkpoint (default 24)")
    parser.add_argument("--prefill-step-size", type=int, help="prefill chunk (default 512)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights (default float32)")
    parser.add_argument("--n-layers", type=int, help="model layers (default 8)")
    parser.add_argument("--model", help="an mlx-lm model folder or Hugging Face id instead of the random Llama "
                        "(dequantized after loading; random prompt ids from its vocabulary)")
    parser.add_argument("--fill", choices=("prompt", "synthetic"), help="prompt: the model prefills (default); "
                        "synthetic: random keys/values/queries fed to each layer's cache (decode speed in minutes; "
                        "methods needing the model's forward, kvzip and selfinfo, are refused)")
    add_output_arguments(parser, "scaling.json / scaling.png")


def settings_from_args(args) -> ScalingSettings:
    return ScalingSettings(**options_given(args, ("contexts", "budgets", "methods", "full_budget", "decode_tokens",
                                                  "prefill_step_size", "dtype", "n_layers", "model", "fill"), QUICK))


def run(args) -> dict:
    """Run from parsed arguments; write ``<out>/scaling.json`` (+ .png); print the table."""
    settings = settings_from_args(args)
    warn_openblas()
    payload = run_scaling(settings, progress=lambda m: print(m, file=sys.stderr, flush=True), bar=True)
    json_path = write_json(out_dir(args) / "scaling.json", payload)
    synthetic = " (synthetic fill: 'prefill s' is the fill's time, not compared)" if settings.fill == "synthetic" else ""
    print_table(f"Speed and memory at {payload['settings']['contexts'][-1]} tokens "
                f"(ratios against RotatingKVCache of the same budget, same pass){synthetic}",
                *summary_table(payload), plain=getattr(args, "plain", False))
    for e in payload["errors"]:
        print(f"error: {e}", file=sys.stderr)
    if getattr(args, "markdown", False):
        print(markdown_report(payload))
    finish(payload, json_path, plot_scaling, args)
    return payload
