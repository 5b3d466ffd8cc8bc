"""Retrieval under a bounded KV cache, on the small model shipped with kvcompress.

The embedded model (``kvcompress/assets/retrieval``, trained by
``scripts/train_retrieval_model.py``) reads a haystack of filler sentences that hides facts
(:mod:`kvcompress.bench.retrieval_data`): one pass key (``passkey``) or several
key-value facts (``mqar``). For every registered method, plus mlx-lm's ``KVCache``
(``full``) and ``RotatingKVCache`` (``rotating``: attention sinks + the most recent tokens,
StreamingLLM's policy) at several budgets ``C = context / ratio``:

1. **Prefill** the context and the first question, in chunks of ``prefill_chunk`` tokens
   (default 64). Every eviction made while reading the haystack is then blind to the
   question; only the last chunk holds it. ``0`` = the whole prompt in one step, so the
   cache compresses only after reading the question (the setting of SnapKV-style
   evaluations).
2. **Decode** the answer greedily, one token per step, with the cache held at its budget;
   later questions (``mqar``) are fed as chunks after the previous answer.
3. **Score** exact match: a question counts as answered when every answer token is right.
   ``accuracy = answered / asked`` over all samples and questions. Each run also records its
   *measured* memory compression, ``bytes_ratio`` = full-cache live bytes / live bytes.

All samples of a task have the same length, so each (task, cache, budget) runs as one batch.
A method that fails for a setting is recorded with its error; the sweep goes on.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from ._caches import entries, live_kv_bytes, make_cache, stored_tokens
from ._options import DEFAULT_OUT, NameList, add_output_arguments, check_at_least, check_minimums, int_list, name_list
from ._options import settings_from_args as _settings_from_args
from ._report import caption as _caption
from ._report import machine_info, progress_bar, pyplot, report_sweep, result_labels, save_plot, warn_openblas
from .retrieval_data import WordTokenizer, make_sample

__all__ = [
    "DEFAULTS",
    "ASSET_DIR",
    "load_retrieval_model",
    "check_settings",
    "make_samples",
    "evaluate",
    "run_retrieval",
    "add_arguments",
    "run",
    "plot_retrieval",
    "results_table",
    "settings_from_args",
]

ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "retrieval"

#: The committed run (docs/results/retrieval.json); a couple of minutes on 2 CPU cores.
DEFAULTS: dict[str, Any] = {
    "model": None,  # None = the embedded model
    "tasks": ("passkey", "mqar"),
    "context": 512,
    "ratios": (2, 4, 8),
    "samples": 32,
    "n_pairs": 8,
    "n_queries": 4,
    "prefill_chunks": (64,),
    "n_sink": 4,
    "methods": None,  # None = every registered method
    #: extra (method, params) variants, labelled "method:k=v". Default: SnapKV with a window of 8
    #: and a pooling kernel of 11, wide enough to keep a 5-token answer span around the token
    #: the question attends to (chosen on seed 0 from recent 4/8/16 x kernel 9/11/13, confirmed on
    #: seed 1; see docs/bench_models.md)
    "extra": (("snapkv", {"recent": 8, "kernel": 11}),),
    "seed": 0,
    "out": DEFAULT_OUT,  # the folder --out names; recorded with the results
}


# --------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------


def load_retrieval_model(path: Optional[str | Path] = None):
    """``(model, tokenizer)`` of the retrieval model: mlx-lm weights + the word tokenizer."""
    from mlx_lm.utils import load_model

    p = Path(path) if path is not None else ASSET_DIR
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"no retrieval model at {p} (config.json missing); the package ships one in "
            f"{ASSET_DIR} -- train a new one with scripts/train_retrieval_model.py"
        )
    model, _ = load_model(p)
    return model, WordTokenizer.from_file(p / "tokenizer.json")


def check_settings(s: dict) -> None:
    """Raise ``ValueError`` for impossible settings (before anything runs)."""
    from .retrieval_data import TASKS

    if s.get("model") is not None and not (Path(s["model"]).expanduser() / "config.json").is_file():
        raise ValueError(f"--model {s['model']}: no retrieval model folder there (config.json missing); leave "
                         f"--model out for the one shipped in {ASSET_DIR}, or train one with "
                         "scripts/train_retrieval_model.py")
    check_at_least("ratios", s["ratios"], 1, " (budget = context // ratio)")
    check_minimums(s, {"context": 1, "samples": 1, "n_pairs": 1, "n_queries": 1, "prefill_chunks": 0,
                                "n_sink": 0, "seed": 0})
    if not s["tasks"] or set(s["tasks"]) - set(TASKS):
        raise ValueError(f"tasks must be among {', '.join(sorted(TASKS))}, got {','.join(s['tasks']) or 'nothing'}")


def make_samples(task: str, n: int, context: int, seed: int, n_pairs: int = 8, n_queries: int = 4):
    """``n`` seeded samples of ``task``; the same for every cache so comparisons are paired."""
    rng = np.random.default_rng([seed, context, 0 if task == "passkey" else 1])
    kw = {"n_pairs": n_pairs, "n_queries": n_queries} if task == "mqar" else {}
    return [make_sample(task, rng, context, **kw) for _ in range(n)]


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def _forward(model, cache, tokens: np.ndarray, chunk: int) -> mx.array:
    """Feed ``tokens`` ``[B, S]`` in chunks of ``chunk`` (0 = one step); last logits ``[B, V]``."""
    S = tokens.shape[1]
    step = S if chunk <= 0 else chunk
    logits = None
    for s in range(0, S, step):
        logits = model(mx.array(tokens[:, s : s + step]), cache=cache)[:, -1, :]
        mx.eval(logits)
    return logits


def evaluate(model, samples: Sequence, cache, prefill_chunk: int = 0) -> dict:
    """Run one batch of equal-length samples through ``cache``; exact match per question.

    Returns ``answered`` ``[n_samples, n_rounds]`` bool and ``kept``, the mean tokens stored
    per layer once the first answer is decoded (eviction is deferred to the first decode step).
    """
    ctx = np.array([s.context for s in samples], dtype=np.int32)
    n_rounds = len(samples[0].rounds)
    answered = np.zeros((len(samples), n_rounds), dtype=bool)
    pending = None  # the last generated token, not yet fed
    kept = None
    for r in range(n_rounds):
        q = np.array([s.rounds[r][0] for s in samples], dtype=np.int32)
        a = np.array([s.rounds[r][1] for s in samples], dtype=np.int32)
        if r == 0:
            logits = _forward(model, cache, np.concatenate([ctx, q], axis=1), prefill_chunk)
        else:
            logits = _forward(model, cache, np.concatenate([pending[:, None], q], axis=1), 0)
        got = []
        for j in range(a.shape[1]):
            tok = mx.argmax(logits, axis=-1)
            got.append(np.array(tok))
            if j + 1 < a.shape[1]:
                logits = model(tok[:, None], cache=cache)[:, -1, :]
        if kept is None:
            kept = float(np.mean([stored_tokens(c) for c in cache]))
        pending = got[-1].astype(np.int32)
        answered[:, r] = np.all(np.stack(got, axis=1) == a, axis=1)
    return {"answered": answered, "kept": kept}


def run_retrieval(settings: Optional[dict] = None, *, model=None, registry=None, progress=True) -> dict:
    """The sweep; returns ``{"benchmark", "machine", "settings", "results", ...}``.

    One record per (task, prefill_chunk, cache, budget) with ``accuracy`` (fraction of
    questions answered exactly), ``accuracy_by_round``, ``answered`` (per sample and round;
    ``fact_depths`` gives each asked fact's relative depth), ``kept`` (mean tokens stored per
    layer), ``kv_bytes`` and ``bytes_ratio`` (full-cache live bytes over these bytes,
    measured at the end), ``seconds``; or ``error``. ``full`` is run once per task and chunk
    with ``budget`` null and ratio 1.
    """
    from kvcompress import get_registry

    s = {**DEFAULTS, **(settings or {})}
    check_settings(s)
    reg = registry or get_registry()
    todo = entries(s["methods"], reg, s["extra"])
    if model is None:
        model, _ = load_retrieval_model(s["model"])
    grid = []
    for task in s["tasks"]:
        for chunk in s["prefill_chunks"]:
            for kind, name, params, label in todo:
                ratios = [1] if name == "full" else list(s["ratios"])
                grid += [(task, chunk, kind, name, params, label, ratio) for ratio in ratios]
    samples = {
        t: make_samples(t, s["samples"], s["context"], s["seed"], s["n_pairs"], s["n_queries"])
        for t in s["tasks"]
    }
    results: list[dict] = []
    full_bytes: dict = {}
    t_start = time.perf_counter()
    for task, chunk, kind, name, params, label, ratio in (
            progress_bar(grid, desc="retrieval", unit="run", leave=False) if progress else grid):
        budget = None if name == "full" else max(1, s["context"] // ratio)
        rec: dict[str, Any] = {"task": task, "prefill_chunk": chunk, "kind": kind, "method": name,
                               "label": label, "params": params, "ratio": ratio, "budget": budget}
        t0 = time.perf_counter()
        try:
            cache = make_cache(model, name, budget or 0, keep=s["n_sink"], seed=s["seed"], params=params,
                               registry=reg)
            out = evaluate(model, samples[task], cache, chunk)
        except Exception as exc:  # one method failing at one setting must not end the sweep
            rec["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"retrieval: {label} ({task}, chunk={chunk}, C={budget}): {exc}",
                          RuntimeWarning, stacklevel=2)
            results.append(rec)
            continue
        nbytes = live_kv_bytes(cache)
        if name == "full":
            full_bytes[(task, chunk)] = nbytes
        ans = out["answered"]
        rec.update(
            accuracy=float(ans.mean()),
            accuracy_by_round=[float(x) for x in ans.mean(axis=0)],
            answered=ans.astype(int).tolist(),  # [sample][round]; pairs with fact_depths
            n_questions=int(ans.size),
            kept=out["kept"],
            kv_bytes=nbytes,
            bytes_ratio=full_bytes.get((task, chunk), float("nan")) / nbytes if nbytes else None,
            seconds=round(time.perf_counter() - t0, 3),
        )
        if kind == "method":
            c0 = next(c for c in cache if hasattr(c, "diagnostics"))
            rec["score_source"] = c0.diagnostics.get("score_source")
        results.append(rec)
    depths = {t: [list(x.depths) for x in samples[t]] for t in s["tasks"]}
    return {
        "benchmark": "retrieval",
        "machine": machine_info(),
        "settings": {**s, "model": str(s["model"] or "embedded:" + str(ASSET_DIR.name)),
                     "extra": [[n, dict(p)] for n, p in (s["extra"] or ())],
                     "methods": sorted({r["method"] for r in results if r["kind"] == "method"})},
        "results": results,
        "fact_depths": depths,
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }


# --------------------------------------------------------------------------------------------
# Presentation
# --------------------------------------------------------------------------------------------


def _chunk_label(chunk: int) -> str:
    return "one-shot prefill (question seen before compressing)" if chunk <= 0 else (
        f"prefill chunks of {chunk} (compression blind to the question)")


def results_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per (task, chunk, method); one accuracy column per ratio."""
    ratios = list(payload["settings"]["ratios"])
    top = max(ratios)
    cols = ["task", "prefill", "method", *[f"{x}x" for x in ratios], f"bytes ratio at {top}x"]
    cells: dict[tuple, dict] = {}
    for r in payload["results"]:
        key = (r["task"], r["prefill_chunk"], r["label"])
        cells.setdefault(key, {})[r["ratio"]] = r.get("accuracy", "error" if "error" in r else None)
        cells[key][("bytes", r["ratio"])] = r.get("bytes_ratio")
    rows = []
    for (task, chunk, m), by in cells.items():
        prefill = "one-shot" if chunk <= 0 else f"chunk {chunk}"
        if m == "full":  # one run, no budget: the reference for every column
            rows.append([task, prefill, m, *[by.get(1)] * len(ratios), 1.0])
        else:
            rows.append([task, prefill, m, *[by.get(x) for x in ratios], by.get(("bytes", top))])
    return cols, rows


def caption(payload: dict) -> str:
    keys = ("model", "context", "samples", "n_pairs", "n_queries", "n_sink", "seed")
    return _caption(payload, keys, lead="Exact-match accuracy of greedy answers (higher is better); each method "
                    "runs at budgets context / " + "/".join(str(x) for x in payload["settings"]["ratios"])
                    + " tokens per layer, plotted at its measured memory compression. ")


def plot_retrieval(payload: dict, path) -> Path:
    """Save :func:`retrieval_figure` with its caption."""
    return save_plot(retrieval_figure(payload), path, f"{caption(payload)}. {PLOT_NOTE}")


#: What the plot does to keep 20 series readable (said under it).
PLOT_NOTE = ("Legend: best first (mean accuracy over the panels); methods with identical results in every panel "
             "are drawn once, joined by '='; series are dodged sideways by up to +-3% so equal values stay visible.")


def retrieval_figure(payload: dict):
    """One panel per (task, prefill mode): accuracy vs measured memory compression, one line per
    method. Measured, not nominal: a quantizing method (KIVI) run at budget ``context / 8``
    keeps every token in fewer bits and lands near 3x, not 8x; eviction methods land slightly
    below the nominal ratio because positions and scores are stored too. Each series has its
    own colour, marker and line style (:func:`~kvcompress.bench._styles.series_styles`)."""
    from ._styles import dodge, identical_series, series_styles

    plt = pyplot()
    st = payload["settings"]
    tasks, chunks, ratios = st["tasks"], st["prefill_chunks"], list(st["ratios"])
    panels = [(task, chunk) for task in tasks for chunk in chunks]
    labels = [m for m in result_labels(payload) if m != "full"]
    points = {lbl: {p: sorted((r["bytes_ratio"], r["accuracy"]) for r in payload["results"]
                              if (r["task"], r["prefill_chunk"]) == p and r["label"] == lbl
                              and r.get("accuracy") is not None) for p in panels} for lbl in labels}

    def mean_accuracy(group):
        ys = [y for pts in points[group[0]].values() for _, y in pts]
        return sum(ys) / len(ys) if ys else -1.0

    groups = sorted(identical_series(points), key=mean_accuracy, reverse=True)
    names = [" = ".join(g) for g in groups]
    styles, shift = series_styles(names), dodge(len(groups))
    fig, axes = plt.subplots(len(tasks), len(chunks), figsize=(4.6 * len(chunks) + 2.8, 3.4 * len(tasks) + 1.4),
                             squeeze=False)
    handles = {}
    for i, task in enumerate(tasks):
        for j, chunk in enumerate(chunks):
            ax = axes[i][j]
            full = next((r.get("accuracy") for r in payload["results"] if r["label"] == "full"
                         and (r["task"], r["prefill_chunk"]) == (task, chunk)), None)
            if full is not None:
                handles["full (KVCache)"] = ax.axhline(full, color="black", linestyle=":", linewidth=1)
            for k, (group, name) in enumerate(zip(groups, names)):
                pts = points[group[0]][(task, chunk)]
                if pts:
                    (line,) = ax.plot([x * shift[k] for x, _ in pts], [y for _, y in pts], label=name,
                                      markersize=4.5, alpha=0.9, zorder=3 + len(groups) - k, **styles[name])
                    handles.setdefault(name, line)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ratios)
            ax.set_xticklabels([f"{x}x" for x in ratios])
            ax.minorticks_off()
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            ax.set_title(f"{task}: {_chunk_label(chunk)}", fontsize=8)
            if i == len(tasks) - 1:
                ax.set_xlabel("KV memory compression, measured (full-cache bytes / cache bytes)")
            if j == 0:
                ax.set_ylabel("exact-match accuracy")
    order = [n for n in ["full (KVCache)", *names] if n in handles]
    axes[0][-1].legend([handles[n] for n in order], order, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       title="best first", title_fontsize=7, handlelength=3.2)
    fig.suptitle("Needle retrieval with a bounded KV cache (embedded model), higher is better", fontsize=10)
    return fig


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


#: Tiny sizes for ``--quick`` (seconds).
QUICK: dict[str, Any] = {"samples": 8, "ratios": (2, 8)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the retrieval workload; omitted options take :data:`DEFAULTS`."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--model", help="retrieval model folder (default: the one shipped in kvcompress/assets)")
    parser.add_argument("--tasks", type=name_list, help="comma list: passkey,mqar (default both)")
    parser.add_argument("--context", type=int, help="context tokens, BOS included (default 512)")
    parser.add_argument("--ratios", type=int_list, help="compression ratios; budget = context // ratio (default 2,4,8)")
    parser.add_argument("--samples", type=int, help="samples per task, run as one batch (default 32)")
    parser.add_argument("--n-pairs", type=int, help="mqar: facts in the haystack, <= 10 (default 8)")
    parser.add_argument("--n-queries", type=int, help="mqar: questions asked (default 4)")
    parser.add_argument("--prefill-chunks", type=int_list,
                        help="prefill chunk sizes to compare; 0 = whole prompt in one step (default 64)")
    parser.add_argument("--n-sink", type=int, help="RotatingKVCache keep, attention sinks (default 4)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: every registered method)")
    parser.add_argument("--seed", type=int, help="seed of the episodes and of seeded methods (default 0)")
    add_output_arguments(parser, "retrieval.json/.png")


def settings_from_args(args) -> dict:
    """The settings the options give, checked (:func:`check_settings`)."""
    s = _settings_from_args(args, DEFAULTS, QUICK)
    check_settings(s)
    return s


def run(args) -> dict:
    """``kvcompress bench retrieval``: run, write ``<out>/retrieval.json`` (+ .png), print a table."""
    warn_openblas()
    payload = run_retrieval(settings_from_args(args), progress=True)
    return report_sweep(payload, args, "retrieval", f"Retrieval exact-match accuracy (context "
                        f"{payload['settings']['context']}, higher is better)", results_table, plot_retrieval,
                        lambda r: f"{r['task']}, chunk {r['prefill_chunk']}, C={r['budget']}")
