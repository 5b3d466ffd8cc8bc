"""Model-free output perturbation of every registered compression method (synthetic K/V).

The harness generalises the CaM design note's offline benchmark to every method the registry
knows. One *configuration* is (sequence length ``T``, budget ``C``, method variant):

1. **Data** (seeded, :func:`make_data`). Per (batch, KV head), keys come from ``n_clusters``
   Gaussian centres plus noise, ``k_t = c_{z_t} + sigma * eps_t`` (``z_t`` uniform), values are
   ``N(0, I)``. A fraction ``hot_frac`` of positions are *heavy hitters*. The query of token ``i``
   (one per query head) aims at a key it may attend, ``q_i = g * (k_j + tau * eps)``, with ``j``
   a heavy hitter ``<= i`` (probability ``p_hot``), one of the last ``recent_window`` tokens
   (``p_recent``) or any token ``<= i`` (the rest). Attention is therefore peaked on ``j`` and
   its cluster, as in a trained model, and some tokens matter much more than others.
2. **Feed** (:func:`feed`). The keys/values enter a cache through ``update_and_fetch``: the first
   ``T - n_decode`` tokens as prefill chunks of ``prefill_step`` tokens (default 512), then
   ``n_decode`` single-token decode steps. After every step the step's queries are given to
   ``cache.observe(queries, scale, mask)`` -- the call the SDPA wrapper makes in a real model --
   so the real scoring path runs (``score_source == "queries"``).
3. **Probe** (:func:`perturbation`). ``n_probe`` fresh queries per head, drawn like the queries
   of a token at position ``T``, attend (a) every key/value (the full cache) and (b) the
   keys/values the compressed cache returned on its last step. The *output perturbation* is the
   mean cosine distance ``1 - cos(o_full, o_comp)`` over batch, query heads and probes, with
   ``o = softmax(q K^T / sqrt(d)) V`` computed in float32 (lower is better; 0 = identical).

Methods come from :func:`kvcompress.get_registry` (so a newly installed plugin's methods appear
without touching this file); a method whose disposition takes ``merge``/``merge_gate`` (CaM's
gated merge) is swept over ``merge_modes x gates``. Two references from mlx-lm run alongside:
``full`` (``KVCache``, perturbation 0 by construction) and ``rotating``
(``RotatingKVCache(C, keep=n_sink)``: attention sinks plus the most recent tokens, StreamingLLM's
policy).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional

import attrs
import mlx.core as mx
import numpy as np

from ._report import machine_info, result_labels

__all__ = [
    "SyntheticSettings",
    "SyntheticData",
    "make_data",
    "feed",
    "attention_output",
    "perturbation",
    "method_variants",
    "probe_stats",
    "caption",
    "run_synthetic",
    "results_table",
    "markdown_tables",
    "plot_synthetic",
    "QUICK",
    "add_arguments",
    "run",
    "settings_from_args",
]

_MODE_ABBREV = {"sim_weighted": "sw", "mean": "mean", "drop": "drop"}


def _tuple(x):
    return tuple(x) if x is not None else None


@attrs.frozen
class SyntheticSettings:
    """Sweep and generator parameters (defaults: the committed run, < 2 minutes on 2 cores)."""

    seq_lens: tuple = attrs.field(default=(512, 1024, 2048), converter=tuple)
    budgets: tuple = attrs.field(default=(64, 128, 256), converter=tuple)
    merge_modes: tuple = attrs.field(default=("sim_weighted", "mean", "drop"), converter=tuple)
    gates: tuple = attrs.field(default=(True, False), converter=tuple)
    #: method names to run; None = every registered method
    methods: Optional[tuple] = attrs.field(default=None, converter=_tuple)
    baselines: tuple = attrs.field(default=("full", "rotating"), converter=tuple)
    #: methods swept over ``merge_modes x gates`` (their disposition must take ``merge`` and
    #: ``merge_gate``); every other method runs once with its registered defaults
    sweep: tuple = attrs.field(default=("cam",), converter=tuple)
    #: extra ``(method, params)`` variants, labelled ``method:k=v``, e.g.
    #: ``(("h2o", {"recent_ratio": 0.0}),)``
    extra: tuple = attrs.field(
        default=(),
        converter=lambda x: tuple((m, tuple(sorted(dict(p).items()))) for m, p in x),
    )
    #: data generators: "structured" (clusters, heavy hitters, peaked queries) and/or "iid"
    #: (i.i.d. Gaussian keys, values and queries: diffuse attention, the design note's setting)
    scenarios: tuple = attrs.field(default=("structured", "iid"), converter=tuple)
    n_decode: int = 128
    #: prefill chunk size (mlx-lm's chunked prefill); None = the whole prefill as one chunk
    prefill_step: Optional[int] = 512
    batch: int = 1
    n_kv_heads: int = 4
    n_q_heads: int = 8
    head_dim: int = 64
    n_clusters: int = 16
    key_noise: float = 0.6
    hot_frac: float = 0.05
    p_hot: float = 0.6
    p_recent: float = 0.2
    recent_window: int = 32
    query_gain: float = 1.0
    query_noise: float = 0.3
    n_probe: int = 64
    n_sink: int = 4
    dtype: str = "float16"
    seeds: tuple = attrs.field(default=(0,), converter=tuple)

    def __attrs_post_init__(self):
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError("n_q_heads must be a multiple of n_kv_heads")
        if self.p_hot + self.p_recent > 1:
            raise ValueError("p_hot + p_recent must be <= 1")
        bad = set(self.baselines) - {"full", "rotating"}
        if bad:
            raise ValueError(f"unknown baselines {sorted(bad)}; choose from full, rotating")
        bad = set(self.scenarios) - {"structured", "iid"}
        if bad:
            raise ValueError(f"unknown scenarios {sorted(bad)}; choose from structured, iid")

    def to_dict(self) -> dict:
        return attrs.asdict(self)


#: Tiny sizes for smoke tests and ``--quick`` (a few seconds).
QUICK = dict(seq_lens=(128, 256), budgets=(32, 64), n_decode=48, n_probe=16, n_clusters=8)


@attrs.frozen
class SyntheticData:
    """One seeded stream: keys/values and step queries ``[B, H_kv|H_q, T, D]`` in the storage
    dtype (as a model would pass them), probe queries ``[B, H_q, P, D]`` float32, softmax
    ``scale`` and the heavy-hitter positions ``hot`` ``[B, H_kv, n_hot]``."""

    keys: mx.array
    values: mx.array
    queries: mx.array
    probes: mx.array
    scale: float
    hot: np.ndarray


def _targets(rng, pos: np.ndarray, hot: np.ndarray, s: SyntheticSettings) -> np.ndarray:
    """Target key index for a query at each position in ``pos`` (see module docstring)."""
    u = rng.random(pos.shape)
    r = rng.random(pos.shape)
    n_hot = np.searchsorted(hot, pos, side="right")
    hot_pick = hot[np.minimum((r * n_hot).astype(np.int64), max(len(hot) - 1, 0))]
    window = np.minimum(s.recent_window, pos + 1)
    recent_pick = pos - (r * window).astype(np.int64)
    any_pick = (r * (pos + 1)).astype(np.int64)
    use_hot = (u < s.p_hot) & (n_hot > 0)
    use_recent = ~use_hot & (u < s.p_hot + s.p_recent)
    return np.where(use_hot, hot_pick, np.where(use_recent, recent_pick, any_pick))


def make_data(s: SyntheticSettings, seq_len: int, seed: int, scenario: str = "structured") -> SyntheticData:
    """Seeded K/V and queries (numpy ``default_rng(seed)``; see module docstring).

    ``scenario="iid"``: keys, values, step queries and probes all i.i.d. ``N(0, I)``.
    """
    rng = np.random.default_rng(seed)
    B, H, Hq, D, T = s.batch, s.n_kv_heads, s.n_q_heads, s.head_dim, seq_len
    g = Hq // H
    dt = getattr(mx, s.dtype)
    if scenario == "iid":
        keys = rng.standard_normal((B, H, T, D), dtype=np.float32)
        values = rng.standard_normal((B, H, T, D), dtype=np.float32)
        queries = rng.standard_normal((B, Hq, T, D), dtype=np.float32)
        probes = rng.standard_normal((B, Hq, s.n_probe, D), dtype=np.float32)
        return SyntheticData(
            keys=mx.array(keys).astype(dt),
            values=mx.array(values).astype(dt),
            queries=mx.array(queries).astype(dt),
            probes=mx.array(probes),
            scale=D**-0.5,
            hot=np.zeros((B, H, 0), dtype=np.int64),
        )
    centers = rng.standard_normal((B, H, s.n_clusters, D), dtype=np.float32)
    z = rng.integers(0, s.n_clusters, size=(B, H, T))
    keys = np.take_along_axis(centers, z[..., None], axis=2)
    keys = keys + s.key_noise * rng.standard_normal((B, H, T, D), dtype=np.float32)
    values = rng.standard_normal((B, H, T, D), dtype=np.float32)
    n_hot = max(1, int(round(s.hot_frac * T)))
    hot = np.stack(
        [np.sort(rng.choice(T, size=n_hot, replace=False)) for _ in range(B * H)]
    ).reshape(B, H, n_hot)

    def draw(positions: np.ndarray) -> np.ndarray:
        out = np.empty((B, Hq, len(positions), D), dtype=np.float32)
        for b in range(B):
            for hq in range(Hq):
                h = hq // g
                tgt = _targets(rng, positions, hot[b, h], s)
                noise = s.query_noise * rng.standard_normal((len(positions), D), dtype=np.float32)
                out[b, hq] = s.query_gain * (keys[b, h, tgt] + noise)
        return out

    queries = draw(np.arange(T))
    probes = draw(np.full(s.n_probe, T - 1))
    return SyntheticData(
        keys=mx.array(keys).astype(dt),
        values=mx.array(values).astype(dt),
        queries=mx.array(queries).astype(dt),
        probes=mx.array(probes),
        scale=D**-0.5,
        hot=hot,
    )


def _state_arrays(cache) -> list:
    return [x for x in cache.state if isinstance(x, mx.array)]


def feed(cache, data: SyntheticData, n_decode: int, prefill_step: Optional[int] = None,
         observe: bool = True):
    """Run ``data`` through ``cache`` (prefill chunk(s), then decode steps); return the K/V the
    last step attended. ``observe`` calls ``cache.observe`` after every step (compressed caches)."""
    T = data.keys.shape[2]
    n_dec = min(n_decode, T - 1)
    P = T - n_dec
    step = prefill_step or P
    k = v = None

    def one(s: int, e: int):
        nonlocal k, v
        k, v = cache.update_and_fetch(data.keys[..., s:e, :], data.values[..., s:e, :])
        if observe:
            cache.observe(data.queries[..., s:e, :], data.scale, "causal" if e - s > 1 else None)
        mx.eval(k, v, _state_arrays(cache))

    for s in range(0, P, step):
        one(s, min(s + step, P))
    for t in range(P, T):
        one(t, t + 1)
    return k, v


def attention_output(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """``softmax(q K^T * scale) V`` in float32 with GQA: q ``[B,Hq,P,D]``, k/v ``[B,H,T,D]``."""
    B, Hq, P, D = q.shape
    H = k.shape[1]
    qg = q.astype(mx.float32).reshape(B, H, Hq // H, P, D)
    kf = mx.expand_dims(k.astype(mx.float32), 2)
    vf = mx.expand_dims(v.astype(mx.float32), 2)
    w = mx.softmax((qg * scale) @ kf.swapaxes(-1, -2), axis=-1)
    return (w @ vf).reshape(B, Hq, P, v.shape[-1])


def perturbation(probes, full_kv, comp_kv, scale: float) -> float:
    """Mean cosine distance ``1 - cos(o_full, o_comp)`` over batch, query heads and probes."""
    a = attention_output(probes, *full_kv, scale)
    b = attention_output(probes, *comp_kv, scale)
    cos = (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1) + 1e-12)
    # 1 - cos >= 0; clamp float rounding (identical outputs give ~ -1e-8)
    return max(0.0, float(mx.mean(1.0 - cos).item()))


def probe_stats(data: SyntheticData) -> dict:
    """How peaked full-cache probe attention is: mean top-1 weight and effective support
    ``1 / sum_j p_j^2`` (tokens), averaged over heads and probes."""
    B, Hq, P, D = data.probes.shape
    H = data.keys.shape[1]
    qg = data.probes.reshape(B, H, Hq // H, P, D)
    k = mx.expand_dims(data.keys.astype(mx.float32), 2)
    w = mx.softmax((qg * data.scale) @ k.swapaxes(-1, -2), axis=-1)
    return {
        "top1_weight": float(w.max(-1).mean().item()),
        "effective_support": float((1.0 / (w * w).sum(-1)).mean().item()),
    }


# ------------------------------------------------------------------------------------------------
# Methods and variants
# ------------------------------------------------------------------------------------------------


def _label(method: str, params: dict) -> str:
    """``cam:sw+g`` (merge mode, gate on/off), ``h2o:recent_ratio=0.5`` (other parameters)."""
    parts = []
    if "merge" in params:
        mode = _MODE_ABBREV.get(params["merge"], params["merge"])
        parts.append(mode + ("+g" if params.get("merge_gate", True) else "-g"))
    parts += [f"{k}={v}" for k, v in params.items() if k not in ("merge", "merge_gate")]
    return f"{method}:{','.join(parts)}" if parts else method


def method_variants(s: SyntheticSettings, registry=None) -> list[tuple[str, dict]]:
    """``(method name, extra params)`` for every method to run.

    Every registered method (or ``s.methods``) once; a method in ``s.sweep`` whose disposition
    has ``merge`` and ``merge_gate`` parameters once per (merge mode, gate); then ``s.extra``
    (skipping methods that are not registered).
    """
    from kvcompress import get_registry

    reg = registry or get_registry()
    names = list(s.methods) if s.methods is not None else sorted(reg.methods)
    out = []
    for name in names:
        spec = reg.method(name)
        disp_params = reg.component("disposition", spec.disposition).params()
        if name in s.sweep and {"merge", "merge_gate"} <= set(disp_params):
            for mode in s.merge_modes:
                for gate in s.gates:
                    out.append((name, {"merge": mode, "merge_gate": bool(gate)}))
        else:
            out.append((name, {}))
    for name, params in s.extra:
        if name in reg.methods:
            out.append((name, dict(params)))
    return out


def _build_cache(name: str, params: dict, budget: int, s: SyntheticSettings, seed: int, registry):
    from kvcompress import CompressedKVCache, ModelInfo, build_method

    method = build_method(name, registry=registry, budget=budget, seed=seed, **params)
    info = ModelInfo(n_layers=1, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim)
    layer_budget = int(method.budget.layer_budgets(info)[0])
    return CompressedKVCache(method, layer_budget, layer=0)


def _baseline_cache(name: str, budget: int, s: SyntheticSettings):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if name == "full":
        return KVCache()
    return RotatingKVCache(max_size=budget, keep=s.n_sink)


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------


def run_synthetic(
    settings: Optional[SyntheticSettings] = None,
    *,
    registry=None,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Run the sweep; return ``{"benchmark", "machine", "settings", "data_stats", "results"}``.

    ``results`` has one record per (seq_len, budget, method variant): ``perturbation`` (mean over
    seeds), ``perturbation_by_seed``, ``tokens_kept``, ``evictions``, ``merges``,
    ``score_source``, ``seconds``; or ``error`` when the method could not be built at that
    budget (e.g. the budget is below its protected tokens).
    """
    from kvcompress import get_registry

    s = settings or SyntheticSettings()
    reg = registry or get_registry()
    variants = method_variants(s, reg)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    warned: set = set()
    results: list[dict] = []
    data_stats: dict = {}
    grid = [(sc, t) for sc in s.scenarios for t in s.seq_lens]
    for scenario, seq_len in grid:
        datas = [make_data(s, seq_len, seed, scenario) for seed in s.seeds]
        data_stats[f"{scenario}/{seq_len}"] = [probe_stats(d) for d in datas]
        full_kv = [(d.keys, d.values) for d in datas]
        for budget in s.budgets:
            entries = [("baseline", b, {}) for b in s.baselines] + [
                ("method", n, p) for n, p in variants
            ]
            for kind, name, params in entries:
                rec: dict[str, Any] = {
                    "scenario": scenario,
                    "seq_len": seq_len,
                    "budget": budget,
                    "kind": kind,
                    "method": name,
                    "label": _label(name, params) if kind == "method" else name,
                    "params": params,
                }
                t0 = time.perf_counter()
                per_seed, last = [], None
                try:
                    for seed, data, fkv in zip(s.seeds, datas, full_kv):
                        if kind == "baseline":
                            cache = _baseline_cache(name, budget, s)
                        else:
                            cache = _build_cache(name, params, budget, s, seed, reg)
                        kv = feed(cache, data, s.n_decode, s.prefill_step, observe=kind == "method")
                        per_seed.append(perturbation(data.probes, fkv, kv, data.scale))
                        last = cache
                except Exception as exc:  # a method that cannot run here is reported, not fatal
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                    if (rec["label"], rec["error"]) not in warned:
                        warned.add((rec["label"], rec["error"]))
                        warnings.warn(
                            f"synthetic: {rec['label']} ({scenario}, T={seq_len}, C={budget}): {exc}",
                            RuntimeWarning, stacklevel=2,
                        )
                    results.append(rec)
                    continue
                rec["perturbation"] = float(np.mean(per_seed))
                rec["perturbation_by_seed"] = per_seed
                rec["seconds"] = time.perf_counter() - t0
                if kind == "method":
                    d = last.diagnostics
                    rec.update(
                        cache_budget=last.budget,
                        tokens_kept=d["tokens_kept"],
                        evictions=d["evictions"],
                        merges=d["merges"],
                        score_source=d["score_source"],
                    )
                else:
                    rec["tokens_kept"] = int(kv[0].shape[2])
                results.append(rec)
            if progress:
                progress(f"{scenario} T={seq_len} C={budget} done ({time.perf_counter() - t_start:.1f}s)")
    return {
        "benchmark": "synthetic_perturbation",
        "machine": machine_info(),
        "settings": s.to_dict(),
        "methods": sorted({r["method"] for r in results if r["kind"] == "method"}),
        "data_stats": data_stats,
        "results": results,
        "seconds_total": time.perf_counter() - t_start,
        "cpu_seconds_total": time.process_time() - cpu_start,
    }


# ------------------------------------------------------------------------------------------------
# Presentation
# ------------------------------------------------------------------------------------------------


def results_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """Wide table: one row per (scenario, seq_len, budget), one column per method variant."""
    labels = result_labels(payload)
    cols = ["data", "T", "C", "T/C", *labels]
    cells: dict[tuple, dict] = {}
    for r in payload["results"]:
        key = (r["scenario"], r["seq_len"], r["budget"])
        cells.setdefault(key, {})[r["label"]] = r.get("perturbation")
    rows = []
    for (sc, t, c), by in cells.items():
        rows.append([sc, t, c, f"{t / c:g}x", *[by.get(lbl) for lbl in labels]])
    return cols, rows


def caption(payload: dict) -> str:
    from ._report import machine_summary, settings_summary

    s = payload["settings"]
    keys = ("batch", "n_kv_heads", "n_q_heads", "head_dim", "dtype", "n_decode", "n_probe",
            "n_clusters", "hot_frac", "p_hot", "p_recent", "seeds", "scenarios")
    return (
        "Output perturbation = mean cosine distance between full-cache and compressed-cache "
        "attention outputs over probe queries (lower is better). Settings: "
        + settings_summary(s, keys)
        + ". Machine: "
        + machine_summary(payload["machine"])
    )


def plot_synthetic(payload: dict, path) -> Any:
    """One panel per (scenario, sequence length): perturbation vs budget, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._report import save_figure

    st = payload["settings"]
    seq_lens, scenarios, budgets = st["seq_lens"], st["scenarios"], st["budgets"]
    labels = [lbl for lbl in result_labels(payload) if lbl != "full"]
    fig, axes = plt.subplots(
        len(scenarios), len(seq_lens),
        figsize=(3.8 * len(seq_lens) + 2.6, 3.3 * len(scenarios) + 1.2), squeeze=False,
    )
    cmap = plt.get_cmap("tab20")
    markers = "osD^v<>pPXh*"
    styles = {}
    for i, lbl in enumerate(labels):
        styles[lbl] = dict(
            color=cmap((2 * i) % 20 + (i // 10) % 2),
            linestyle="--" if lbl.endswith("-g") else ("-." if "=" in lbl else "-"),
            marker=markers[i % len(markers)],
            markersize=4,
        )
    for row, scenario in enumerate(scenarios):
        for col, t in enumerate(seq_lens):
            ax = axes[row][col]
            for lbl in labels:
                pts = sorted(
                    (r["budget"], r["perturbation"])
                    for r in payload["results"]
                    if r["scenario"] == scenario and r["seq_len"] == t and r["label"] == lbl
                    and r.get("perturbation") is not None
                )
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=lbl, **styles[lbl])
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets)
            ax.set_xticklabels([str(b) for b in budgets])
            ax.set_title(f"{scenario}, seq_len = {t}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(scenarios) - 1:
                ax.set_xlabel("budget (tokens kept)")
            if col == 0:
                ax.set_ylabel("perturbation (1 - cos)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("Synthetic output perturbation, lower is better (sw = sim_weighted; +g/-g = merge gate on/off)",
                 fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, caption(payload))
    plt.close(fig)
    return path


def markdown_tables(payload: dict) -> str:
    """Per scenario, a markdown table: one row per method variant, one column per (T, C);
    the lowest perturbation of each column in bold, ``n/a`` where the method could not run."""
    from ._report import markdown_table

    out = []
    labels = result_labels(payload)
    for scenario in payload["settings"]["scenarios"]:
        recs = [r for r in payload["results"] if r["scenario"] == scenario]
        configs = sorted({(r["seq_len"], r["budget"]) for r in recs})
        val = {(r["label"], r["seq_len"], r["budget"]): r.get("perturbation") for r in recs}
        best = {}
        for t, c in configs:
            vals = [val.get((lbl, t, c)) for lbl in labels if lbl != "full"]
            vals = [v for v in vals if v is not None]
            best[(t, c)] = min(vals) if vals else None
        rows = []
        for lbl in labels:
            row = [lbl]
            for t, c in configs:
                v = val.get((lbl, t, c))
                if v is None:
                    row.append("n/a")
                elif lbl != "full" and best[(t, c)] is not None and v == best[(t, c)]:
                    row.append(f"**{v:.3f}**")
                else:
                    row.append(f"{v:.3f}")
            rows.append(row)
        cols = ["method", *[f"T={t} C={c} ({t // c}x)" for t, c in configs]]
        out.append(f"**{scenario}**\n\n" + markdown_table(cols, rows))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------------------
# Command line (``kvcompress bench synthetic`` and ``benchmarks/synthetic_perturbation.py``)
# ------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """Options of the synthetic workload (defaults: :class:`SyntheticSettings`)."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths T")
    parser.add_argument("--budgets", type=int, nargs="+", help="budgets C")
    parser.add_argument("--methods", nargs="+", help="registered method names (default: all)")
    parser.add_argument("--scenarios", nargs="+", choices=("structured", "iid"))
    parser.add_argument("--n-decode", type=int, help="decode steps after the prefill")
    parser.add_argument("--prefill-step", type=int, help="prefill chunk size (default 512)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="K/V storage dtype")
    from ._report import add_output_arguments

    add_output_arguments(parser, "synthetic.json/.png")


def settings_from_args(args) -> SyntheticSettings:
    kw = dict(QUICK) if getattr(args, "quick", False) else {}
    for name in ("seq_lens", "budgets", "methods", "scenarios", "n_decode", "prefill_step", "seeds",
                 "batch", "dtype"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    return SyntheticSettings(**kw)


def run(args) -> dict:
    """Run the sweep from parsed arguments; write ``<out>/synthetic.json`` (+ .png); print tables."""
    import sys
    from pathlib import Path

    from ._report import finish, print_table, warn_openblas, write_json

    settings = settings_from_args(args)
    warn_openblas()
    payload = run_synthetic(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(getattr(args, "out", "docs/results"))
    write_json(out / "synthetic.json", payload)
    cols, rows = results_table(payload)
    print_table("Output perturbation (1 - cos, lower is better)", cols, rows,
                plain=getattr(args, "plain", False))
    skipped: dict = {}
    for r in payload["results"]:
        if "error" in r:
            where = f"{r['scenario']}/T={r['seq_len']}/C={r['budget']}"
            skipped.setdefault((r["label"], r["error"]), []).append(where)
    for (label, err), where in skipped.items():
        more = ", ..." if len(where) > 3 else ""
        print(f"skipped {label} in {len(where)} configuration(s) ({', '.join(where[:3])}{more}): {err}")
    if getattr(args, "markdown", False):
        print(markdown_tables(payload))
    finish(payload, out / 'synthetic.json', plot_synthetic, args)
    return payload
