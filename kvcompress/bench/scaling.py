"""Speed and memory against context length: every method at several budgets, 1k to 8k tokens.

**Workload.** The random-weight mlx-lm Llama of :mod:`kvcompress.bench.speed` (default 8
layers, hidden 1024, 16 query / 4 KV heads, head_dim 64, float32 weights) reads one seeded
random prompt. For each budget ``C`` every cache kind -- each method (``make_prompt_cache(model,
name, budget=C)``), ``rotating`` (``RotatingKVCache(C, keep)``) and, in the pass of
``full_budget`` only, ``full`` (``KVCache``; it has no budget) -- advances in lockstep through
the context checkpoints ``n_1 < n_2 < ...`` (default 1024, 2048, 4096, 8192):

1. *prefill* from the previous checkpoint to ``n_i`` in chunks of ``prefill_step_size`` tokens
   (``model(chunk, cache)``, then ``mx.eval`` of the cache state, as ``mlx_lm.generate`` does),
   then one decode step, which carries out the eviction the last chunk deferred; ``prefill_s``
   at ``n_i`` is the cumulative time, i.e. the time to the first token of an ``n_i``-token
   prompt with chunk boundaries at the same positions;
2. *decode* ``decode_tokens`` greedy steps pipelined as ``mlx_lm.generate`` runs them (step
   ``n + 1`` is built while step ``n`` computes), timed in blocks of ``decode_block`` steps
   interleaved kind by kind, the order rotated every block, so load from other processes hits
   every kind alike; then one block of ``sync_tokens`` synchronous steps (``mx.eval`` of each
   token before the next step is built), which exposes the Python/graph-building cost of a
   cache that pipelining hides. The decoded tokens stay in the context, so the context at
   checkpoint ``i`` is ``n_i + i + (i - 1) * (decode_tokens + sync_tokens)`` tokens (recorded as
   ``tokens_seen``).

**Measurements** at each checkpoint: ``decode_ms`` (median ms per token over the pipelined
blocks), ``decode_ms_sync``,
``prefill_s``, ``cache_bytes`` (``sum(c.nbytes)`` over the layers: allocated buffers,
positions, scores and quantized blocks included), ``live_bytes`` (the bytes of the tokens
actually held), ``stored_tokens`` (layer 0) and ``peak_bytes``: the largest
``mx.get_peak_memory()`` the process would reach running this kind alone -- model weights
plus this kind's cache plus the transient buffers of its prefill chunks and decode steps
(peak counter reset before each of the kind's segments; the other kinds' caches, idle during
the segment, are subtracted). Ratios are paired against ``rotating`` of the same budget from the
same pass: ``decode_ratio`` = rotating ms / kind ms per (checkpoint, block), median (higher is
better; target >= 0.9), ``decode_ratio_sync`` the same for the synchronous blocks; ``prefill_ratio`` = kind s / rotating s per chunk segment summed to
the checkpoint (lower is better).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Any, Callable, Optional

import attrs
import mlx.core as mx

from ._report import int_list, machine_info, name_list
from .speed import _rotate

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
class ScalingSettings:
    """Contexts, budgets, methods and the model shape (defaults: the committed run)."""

    contexts: tuple = attrs.field(default=(1024, 2048, 4096, 8192), converter=int_list)
    budgets: tuple = attrs.field(default=(256, 512, 1024), converter=int_list)
    #: None = every registered method
    methods: Optional[tuple] = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    #: the budget whose pass also runs the full KVCache (None: budgets' middle one; 0: no full)
    full_budget: Optional[int] = None
    keep: int = 4
    decode_tokens: int = 24
    decode_block: int = 8
    #: synchronous decode steps per checkpoint (one block; 0 = none)
    sync_tokens: int = 4
    prefill_step_size: int = 512
    dtype: str = "float32"
    n_layers: int = 8
    hidden: int = 1024
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 2816
    vocab: int = 32000
    seed: int = 0
    warmup: bool = True

    def __attrs_post_init__(self):
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)) or self.contexts[0] < 1:
            raise ValueError(f"contexts must be increasing positive token counts, got {self.contexts}")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be positive token counts, got {self.budgets}")
        if self.decode_block < 2 or self.decode_tokens < self.decode_block:
            raise ValueError("need decode_block >= 2 and decode_tokens >= decode_block")
        if self.sync_tokens < 0:
            raise ValueError(f"sync_tokens must be >= 0, got {self.sync_tokens}")
        if self.full_budget not in (None, 0) and self.full_budget not in self.budgets:
            raise ValueError(f"full_budget {self.full_budget} is not one of the budgets {self.budgets}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}; choose from float32, bfloat16, float16")

    @property
    def full_pass(self) -> Optional[int]:
        if self.full_budget == 0:
            return None
        return self.full_budget or self.budgets[len(self.budgets) // 2]

    def to_dict(self) -> dict:
        return attrs.asdict(self)


#: Small sizes for smoke tests and ``--quick`` (seconds).
QUICK = dict(
    contexts=(128, 256), budgets=(64, 96), decode_tokens=4, decode_block=2, sync_tokens=2, prefill_step_size=64, n_layers=2,
    hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate=256, vocab=500,
)


def _speed_settings(s: ScalingSettings):
    from .speed import SpeedSettings

    return SpeedSettings(
        context=max(s.contexts[-1], max(s.budgets) + 1), budget=min(s.budgets), keep=s.keep,
        prefill_step_size=s.prefill_step_size, dtype=s.dtype, n_layers=s.n_layers, hidden=s.hidden,
        n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, intermediate=s.intermediate,
        vocab=s.vocab, seed=s.seed, methods=(), profile=False, dtype_probe=False,
    )


def _cache_bytes(cache: list) -> int:
    return int(sum(c.nbytes for c in cache))


class _Runner:
    """One kind's cache advancing through the prompt, with its timings and memory."""

    def __init__(self, kind: str, model, cache: list, prompt: mx.array, decode_ids: mx.array, weights: int):
        self.kind, self.model, self.cache = kind, model, cache
        self.prompt, self.decode_ids, self.weights = prompt, decode_ids, weights
        self.pos = 0          # prompt tokens consumed
        self.decoded = 0      # decode steps taken
        self.prefill_s = 0.0
        self.peak = 0         # running peak of this kind alone (bytes)
        self.y = None

    def _track(self, fn: Callable[[], None]) -> float:
        """Run ``fn`` timed; fold its peak memory (others' idle caches removed) into ``peak``."""
        gc.collect()
        own_before = _cache_bytes(self.cache)
        active_before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        transient = mx.get_peak_memory() - active_before
        self.peak = max(self.peak, self.weights + own_before + transient, self.weights + _cache_bytes(self.cache))
        return dt

    def prefill_to(self, n: int, step: int) -> None:
        """Feed the prompt up to token ``n`` in chunks, then take the first decode step (which
        carries out the eviction the last chunk deferred): the time to the first token, as
        ``mlx_lm.generate`` counts it."""
        def go():
            while self.pos < n:
                end = min(n, (self.pos // step + 1) * step)
                self.model(self.prompt[None, self.pos:end], cache=self.cache)
                mx.eval([c.state for c in self.cache])
                self.pos = end
            self.y = self._step(self._input())
            mx.eval(self.y)

        self.prefill_s += self._track(go)

    def _step(self, y: mx.array) -> mx.array:
        logits = self.model(y, cache=self.cache)
        self.decoded += 1
        return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)

    def _input(self) -> mx.array:
        if self.y is None:
            return self.decode_ids[self.decoded % self.decode_ids.shape[0]].reshape(1, 1)
        return self.y

    def decode(self, k: int) -> float:
        """``k`` greedy steps pipelined as ``mlx_lm.generate_step`` runs them (step ``n + 1`` is
        built while step ``n`` computes: ``mx.async_eval``); seconds per step, timed from a
        synchronised start to the last token."""
        def go():
            nxt = self._step(self._input())
            mx.async_eval(nxt)
            for i in range(k):
                cur = nxt
                if i + 1 < k:
                    nxt = self._step(cur)
                    mx.async_eval(nxt)
                mx.eval(cur)
            self.y = cur

        return self._track(go) / k

    def decode_sync(self, k: int) -> float:
        """``k`` synchronous greedy steps (``mx.eval`` of each token before the next is built):
        the cache's graph-building overhead fully exposed; seconds per step."""
        def go():
            for _ in range(k):
                self.y = self._step(self._input())
                mx.eval(self.y)

        return self._track(go) / k


def _kinds(s: ScalingSettings, registry) -> list[str]:
    names = list(s.methods) if s.methods else sorted(registry.methods)
    unknown = [n for n in names if n not in registry.methods]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; registered: {sorted(registry.methods)}")
    return names


def run_scaling(settings: Optional[ScalingSettings] = None, *, progress: Optional[Callable[[str], None]] = None,
                registry=None, bar: bool = False) -> dict:
    """Run every budget pass; return the JSON payload (``results``: one record per kind, budget
    and checkpoint; ``summary``: per kind and budget, at the largest context).

    ``progress`` receives a line per checkpoint; ``bar`` shows a tqdm bar of prompt tokens
    prefilled (when tqdm is installed)."""
    from mlx.utils import tree_flatten

    from kvcompress import get_registry, install

    from .retrieval import live_kv_bytes
    from .speed import build_model, make_cache

    s = settings or ScalingSettings()
    say = progress or (lambda m: None)
    reg = registry or get_registry()
    methods = _kinds(s, reg)
    t_start = time.perf_counter()
    speed_s = _speed_settings(s)
    model = build_model(speed_s)
    install(model)
    weights = int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))
    prompt = mx.random.randint(0, s.vocab, (s.contexts[-1],), key=mx.random.key(s.seed + 1)).astype(mx.uint32)
    decode_ids = mx.random.randint(0, s.vocab, (64,), key=mx.random.key(s.seed + 2)).astype(mx.uint32)
    payload: dict[str, Any] = {
        "benchmark": "scaling", "machine": machine_info(), "settings": {**s.to_dict(), "methods": methods},
        "weights_bytes": weights, "results": [], "errors": [],
    }
    n_blocks = s.decode_tokens // s.decode_block
    warmed: set = set()
    n_kinds = len(methods) + 1
    total = s.contexts[-1] * (n_kinds * len(s.budgets) + (1 if s.full_pass else 0))
    pbar = _bar(total) if bar else None
    if pbar is not None:
        say = pbar.write
    for budget in s.budgets:
        kinds = [*methods, "rotating"] + (["full"] if budget == s.full_pass else [])
        pass_s = attrs.evolve(speed_s, budget=budget)
        if s.warmup:
            for kind in kinds:
                if kind in warmed:
                    continue
                try:
                    w = _Runner(kind, model, make_cache(kind, model, pass_s), prompt, decode_ids, weights)
                    w.prefill_to(min(s.contexts[-1], budget + s.prefill_step_size + 1), s.prefill_step_size)
                    w.decode(2)
                except Exception:  # reported by the measured pass below
                    pass
                warmed.add(kind)
                w = None
            gc.collect()
            mx.clear_cache()
        runners: dict[str, _Runner] = {}
        for kind in kinds:
            try:
                runners[kind] = _Runner(kind, model, make_cache(kind, model, pass_s), prompt, decode_ids, weights)
            except Exception as exc:
                payload["errors"].append({"kind": kind, "budget": budget, "error": f"{type(exc).__name__}: {exc}"})
                say(f"budget {budget} {kind}: cannot build ({exc})")
        for ci, n in enumerate(s.contexts):
            order = _rotate(list(runners), ci)
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
            times: dict[str, list[float]] = {k: [] for k in runners}
            for b in range(n_blocks):
                for kind in _rotate(list(runners), b + ci):
                    times[kind].append(runners[kind].decode(s.decode_block))
            sync: dict[str, float] = {}
            if s.sync_tokens:
                for kind in _rotate(list(runners), ci + 1):
                    sync[kind] = runners[kind].decode_sync(s.sync_tokens)
            for kind, r in runners.items():
                payload["results"].append({
                    "kind": kind, "budget": None if kind == "full" else budget, "pass_budget": budget,
                    "context": n, "tokens_seen": r.pos + r.decoded,
                    "prefill_s": r.prefill_s, "decode_ms": 1e3 * statistics.median(times[kind]),
                    "decode_ms_blocks": [1e3 * t for t in times[kind]],
                    "decode_ms_sync": 1e3 * sync[kind] if kind in sync else None,
                    "cache_bytes": _cache_bytes(r.cache), "live_bytes": live_kv_bytes(r.cache),
                    "stored_tokens": int(r.cache[0].size()), "peak_bytes": r.peak,
                })
            rot = times.get("rotating")
            say(f"budget {budget} context {n}: " + ", ".join(
                f"{k} {1e3 * statistics.median(v):.0f}ms" for k, v in times.items())
                + f" ({time.perf_counter() - t_start:.0f}s)")
            if rot:
                for rec in payload["results"][-len(runners):]:
                    rec["decode_ratio_blocks"] = [a / b for a, b in zip(
                        [1e3 * t for t in rot], rec["decode_ms_blocks"])]
                    if rec["decode_ms_sync"]:
                        rec["decode_ratio_sync"] = 1e3 * sync["rotating"] / rec["decode_ms_sync"]
        del runners
        gc.collect()
        mx.clear_cache()
    if pbar is not None:
        pbar.close()
    payload["summary"] = _summarise(payload, s)
    payload["seconds_total"] = time.perf_counter() - t_start
    return payload


def _bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="scaling", unit="tok", unit_scale=True, file=sys.stderr)


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
            rec["prefill_ratio"] = r["prefill_s"] / rot["prefill_s"]
            rec["decode_ratio"] = statistics.median(ratios) if ratios else None
            rec["decode_ratio_sync"] = statistics.median(sync) if sync else None
            rec["cache_ratio"] = r["cache_bytes"] / rot["cache_bytes"]
            rec["peak_ratio"] = r["peak_bytes"] / rot["peak_bytes"]
            if kind != "full" and rec["decode_ratio"] is not None:
                rec["decode_target_met"] = rec["decode_ratio"] >= 0.9
        out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------


def summary_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
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
    from ._report import machine_summary, settings_summary

    keys = ("contexts", "budgets", "keep", "decode_tokens", "decode_block", "sync_tokens", "prefill_step_size", "dtype",
            "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")
    return (f"Settings: {settings_summary(payload['settings'], keys)}; weights "
            f"{payload['weights_bytes'] / 2**20:.0f} MB. Machine: {machine_summary(payload['machine'])}")


def plot_scaling(payload: dict, path, budget: Optional[int] = None):
    """Three panels against context length at one budget (default: the pass with ``full``):
    decode ms/token, cache MB and peak MB over the weights, one line per cache kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._report import save_figure

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
    fig.tight_layout()
    save_figure(fig, path, caption(payload))
    plt.close(fig)
    return path


def markdown_report(payload: dict) -> str:
    from ._report import markdown_table

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
    from ._report import add_output_arguments

    parser.add_argument("--quick", action="store_true", help="tiny model and contexts (seconds)")
    parser.add_argument("--contexts", type=int_list, help="context checkpoints (default 1024,2048,4096,8192)")
    parser.add_argument("--budgets", type=int_list, help="tokens per layer (default 256,512,1024)")
    parser.add_argument("--methods", type=name_list,
                        help="comma list of methods (default: every registered method)")
    parser.add_argument("--full-budget", type=int, help="the budget pass that also runs the full KVCache "
                        "(default: the middle budget; 0: none)")
    parser.add_argument("--decode-tokens", type=int, help="pipelined decode tokens per checkpoint (default 24)")
    parser.add_argument("--prefill-step-size", type=int, help="prefill chunk (default 512)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="weights (default float32)")
    parser.add_argument("--n-layers", type=int, help="model layers (default 8)")
    add_output_arguments(parser, "scaling.json / scaling.png")


def settings_from_args(args) -> ScalingSettings:
    kw = dict(QUICK) if getattr(args, "quick", False) else {}
    for name in ("contexts", "budgets", "methods", "full_budget", "decode_tokens", "prefill_step_size", "dtype",
                 "n_layers"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    return ScalingSettings(**kw)


def run(args) -> dict:
    """Run from parsed arguments; write ``<out>/scaling.json`` (+ .png); print the table."""
    from pathlib import Path

    from ._report import finish, print_table, warn_openblas, write_json

    settings = settings_from_args(args)
    warn_openblas()
    payload = run_scaling(settings, progress=lambda m: print(m, file=sys.stderr, flush=True), bar=True)
    out = Path(getattr(args, "out", "docs/results"))
    write_json(out / "scaling.json", payload)
    print_table(f"Speed and memory at {payload['settings']['contexts'][-1]} tokens "
                "(ratios against RotatingKVCache of the same budget, same pass)",
                *summary_table(payload), plain=getattr(args, "plain", False))
    for e in payload["errors"]:
        print(f"error: {e}", file=sys.stderr)
    if getattr(args, "markdown", False):
        print(markdown_report(payload))
    finish(payload, out / 'scaling.json', plot_scaling, args)
    return payload
