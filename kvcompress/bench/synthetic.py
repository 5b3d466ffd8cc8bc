"""Model-free output perturbation of every registered compression method (synthetic K/V).

The CaM design note's offline benchmark, generalised to every method the registry knows. One
*configuration* is (sequence length ``T``, budget ``C``, method variant): a seeded K/V stream
(:func:`make_data`) is fed through the cache as prefill chunks and decode steps, observing the
real queries (:func:`feed`), then fresh probe queries measure how far the attention output over
what the cache kept moves from the full cache's (:func:`perturbation`, lower is better);
:mod:`kvcompress.bench.synthetic_data` has the details.

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
import numpy as np

from ._caches import method_names
from ._options import NameList, add_output_arguments, check_minimums, one_of, options_given, out_dir
from ._report import finish, machine_info, print_table, warn_openblas, write_json
from ._synthetic_report import caption, markdown_tables, plot_synthetic, results_table
from .synthetic_data import SyntheticData, feed, make_data, perturbation, probe_stats

__all__ = [
    "SyntheticSettings",
    "SyntheticData",
    "make_data",
    "feed",
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

SCENARIOS = ("structured", "iid")
_MODE_ABBREV = {"sim_weighted": "sw", "mean": "mean", "drop": "drop"}


@attrs.frozen
class SyntheticSettings:
    """Sweep and generator parameters (defaults: the committed run, < 2 minutes on 2 cores)."""

    seq_lens: tuple = attrs.field(default=(512, 1024, 2048), converter=tuple)
    budgets: tuple = attrs.field(default=(64, 128, 256), converter=tuple)
    merge_modes: tuple = attrs.field(default=("sim_weighted", "mean", "drop"), converter=tuple)
    gates: tuple = attrs.field(default=(True, False), converter=tuple)
    #: method names to run; None = every registered method
    methods: Optional[tuple] = attrs.field(default=None, converter=attrs.converters.optional(tuple))
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
    scenarios: tuple = attrs.field(default=SCENARIOS, converter=tuple, validator=one_of(SCENARIOS))
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
    dtype: str = attrs.field(default="float16", validator=one_of(("float16", "bfloat16", "float32")))
    seeds: tuple = attrs.field(default=(0,), converter=tuple)

    def __attrs_post_init__(self):
        check_minimums(self.to_dict(), {
            "seq_lens": 2, "budgets": 1, "n_decode": 0, "prefill_step": 1, "batch": 1, "n_kv_heads": 1,
            "n_q_heads": 1, "head_dim": 1, "n_clusters": 1, "recent_window": 1, "n_probe": 1, "n_sink": 0,
            "seeds": 0})
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(f"n_q_heads must be a multiple of n_kv_heads, got {self.n_q_heads} and {self.n_kv_heads}")
        for name in ("hot_frac", "p_hot", "p_recent"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)}")
        if self.p_hot + self.p_recent > 1:
            raise ValueError(f"p_hot + p_recent must be <= 1, got {self.p_hot} + {self.p_recent}")
        bad = set(self.baselines) - {"full", "rotating"}
        if bad:
            raise ValueError(f"unknown baselines {sorted(bad)}; choose from full, rotating")

    def to_dict(self) -> dict:
        return attrs.asdict(self)


#: Tiny sizes for smoke tests and ``--quick`` (a few seconds).
QUICK = dict(seq_lens=(128, 256), budgets=(32, 64), n_decode=48, n_probe=16, n_clusters=8)


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
    names = [] if s.methods == () else method_names(s.methods, reg)
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


def _layer_cache(kind: str, name: str, params: dict, budget: int, s: SyntheticSettings, seed: int, registry):
    """One layer's cache: mlx-lm's ``KVCache`` / ``RotatingKVCache`` for a baseline, else the
    method at the first layer budget its budget policy gives a one-layer model."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvcompress import CompressedKVCache, ModelInfo, build_method

    if kind == "baseline":
        return KVCache() if name == "full" else RotatingKVCache(max_size=budget, keep=s.n_sink)
    method = build_method(name, registry=registry, budget=budget, seed=seed, **params)
    info = ModelInfo(n_layers=1, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim)
    return CompressedKVCache(method, int(method.budget.layer_budgets(info)[0]), layer=0)


def _measure(rec: dict, datas: list, s: SyntheticSettings, registry) -> None:
    """Fill ``rec`` (a baseline or method variant at one budget) with the perturbation over the
    seeds' streams ``datas`` and the last cache's diagnostics."""
    kind, t0, per_seed = rec["kind"], time.perf_counter(), []
    for seed, data in zip(s.seeds, datas):
        cache = _layer_cache(kind, rec["method"], rec["params"], rec["budget"], s, seed, registry)
        kv = feed(cache, data, s.n_decode, s.prefill_step, observe=kind == "method")
        per_seed.append(perturbation(data.probes, (data.keys, data.values), kv, data.scale))
    rec.update(perturbation=float(np.mean(per_seed)), perturbation_by_seed=per_seed,
               seconds=time.perf_counter() - t0)
    if kind == "method":
        d = cache.diagnostics
        rec.update(cache_budget=cache.budget, tokens_kept=d["tokens_kept"], evictions=d["evictions"],
                   merges=d.get("merges", 0), score_source=d["score_source"])
    else:
        rec["tokens_kept"] = int(kv[0].shape[2])


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
        for budget in s.budgets:
            for kind, name, params in [("baseline", b, {}) for b in s.baselines] + [
                    ("method", n, p) for n, p in variants]:
                rec: dict[str, Any] = {
                    "scenario": scenario, "seq_len": seq_len, "budget": budget, "kind": kind, "method": name,
                    "label": _label(name, params) if kind == "method" else name, "params": params,
                }
                try:
                    _measure(rec, datas, s, reg)
                except Exception as exc:  # a method that cannot run here is reported, not fatal
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                    if (rec["label"], rec["error"]) not in warned:
                        warned.add((rec["label"], rec["error"]))
                        warnings.warn(f"synthetic: {rec['label']} ({scenario}, T={seq_len}, C={budget}): {exc}",
                                      RuntimeWarning, stacklevel=2)
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
# Command line (``kvcompress bench synthetic`` and ``benchmarks/synthetic_perturbation.py``)
# ------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """Options of the synthetic workload (defaults: :class:`SyntheticSettings`)."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="sequence lengths T")
    parser.add_argument("--budgets", type=int, nargs="+", help="budgets C")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: all)")
    parser.add_argument("--scenarios", nargs="+", choices=("structured", "iid"))
    parser.add_argument("--n-decode", type=int, help="decode steps after the prefill")
    parser.add_argument("--prefill-step", type=int, help="prefill chunk size (default 512)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="K/V storage dtype")
    add_output_arguments(parser, "synthetic.json/.png")


def settings_from_args(args) -> SyntheticSettings:
    return SyntheticSettings(**options_given(args, ("seq_lens", "budgets", "methods", "scenarios", "n_decode",
                                                    "prefill_step", "seeds", "batch", "dtype"), QUICK))


def run(args) -> dict:
    """Run the sweep from parsed arguments; write ``<out>/synthetic.json`` (+ .png); print tables."""
    import sys

    settings = settings_from_args(args)
    warn_openblas()
    payload = run_synthetic(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
    json_path = write_json(out_dir(args) / "synthetic.json", payload)
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
    finish(payload, json_path, plot_synthetic, args)
    return payload
