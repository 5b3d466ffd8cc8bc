"""Long-text perplexity of a real model with a bounded KV cache held at its budget through decode.

Long windows are read in chunks, then the cache is held at its budget through teacher-forced
decoding.

Windows come from the documents of a text folder (``--text-dir``, default the shared
``longtext``; any folder of ``.txt`` files): each document is encoded in one call (BOS first when
the tokenizer adds one), documents long enough for a window are taken in a seeded order and
each gives the window of ``window`` tokens starting at its beginning. For each cache (every
registered method, ``rotating`` and ``full``) at budgets ``C = window // ratio``:

1. **prefill** the first ``P = window - 1 - decode`` tokens in chunks of ``chunk`` (512), the
   cache compressing as it reads (as ``mlx_lm.generate`` and a chat feed a long prompt);
2. **decode** teacher-forced: feed ``x_t`` for ``t = P .. window - 2``, one token per step, the
   cache held at ``C``; each step's logits give ``-log p(x_{t+1} | cache)``.

Only the ``decode`` predictions are scored. ``nll`` is their mean, ``ppl = exp(nll)``,
``ppl_ratio = ppl / ppl_full`` on the same tokens (the trap test: <= 1.1 at 4x), ``nll_gap_se``
the standard error of the per-window paired NLL differences. Windows are batched (``batch``).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ._caches import live_kv_bytes, make_cache, stored_tokens
from ._options import DEFAULT_OUT, NameList, add_output_arguments, check_at_least, check_minimums, int_list
from ._options import settings_from_args as _settings_from_args
from ._report import caption as _caption
from ._report import machine_info, progress_bar, pyplot, report_sweep, result_labels, save_plot, warn_openblas
from ._variants import cache_entries, variant

__all__ = ["DEFAULTS", "QUICK", "long_windows", "chunked_nll", "run_longppl", "add_arguments", "run",
           "results_table", "plot_longppl"]

#: A documented long run (about 2 hours here for every method at 4x); ``--quick`` for a trial.
DEFAULTS: dict[str, Any] = {
    "model": None,  # None = smollm2-135m-instruct under $KVCOMPRESS_MODELS_DIR (see longctx)
    "text_dir": None,
    "window": 4096,
    "windows": 4,
    "decode": 128,
    "chunk": 512,
    "ratios": (4,),
    "batch": 4,
    "n_sink": 4,
    "methods": None,
    "extra": (),
    "seed": 0,
    "dequantize": True,
    "out": DEFAULT_OUT,
}
QUICK: dict[str, Any] = {"window": 1024, "windows": 2, "decode": 32, "batch": 2}


def check_settings(s: dict) -> None:
    check_minimums(s, {"window": 16, "windows": 1, "decode": 1, "chunk": 0, "batch": 1, "n_sink": 0, "seed": 0})
    check_at_least("ratios", s["ratios"], 1, " (budget = window // ratio)")
    if not s["decode"] < s["window"] - 1:
        raise ValueError(f"decode must be below window - 1 = {s['window'] - 1} so that some tokens are prefilled, "
                         f"got {s['decode']}")


def long_windows(tokenizer, source, window: int, n: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """``[n, window]`` int32: the first ``window`` tokens of ``n`` documents long enough for one
    (seeded order); and the documents' names."""
    from .longctx_text import defuse, encode_long, special_strings

    specials = special_strings(tokenizer)
    order = np.random.default_rng([seed, window, 11]).permutation(len(source.docs))
    rows, names = [], []
    for i in order:
        name, text = source.docs[int(i)]
        ids = encode_long(tokenizer, defuse(text, specials))
        if len(ids) >= window:
            rows.append(ids[:window])
            names.append(name)
            if len(rows) == n:
                break
    if not rows:
        raise ValueError(f"no document of {source.where} holds {window} tokens; give a shorter --window or more text")
    if len(rows) < n:
        warnings.warn(f"longppl: only {len(rows)} documents of {source.where} hold {window} tokens "
                      f"({n} windows asked)", RuntimeWarning, stacklevel=2)
    return np.array(rows, dtype=np.int32), names


def chunked_nll(model, windows: np.ndarray, cache: list, decode: int, chunk: int, advance=None) -> np.ndarray:
    """``[B, decode]`` float32 NLL of the decoded predictions (see the module docstring)."""
    B, W = windows.shape
    P = W - 1 - decode
    x = mx.array(windows)
    step = P if chunk <= 0 else chunk
    for s in range(0, P, step):  # [B, chunk] steps: cache state evaluated, logits never computed
        model(x[:, s : min(P, s + step)], cache=cache)
        mx.eval([c.state for c in cache])
        if advance is not None:
            advance(B * (min(P, s + step) - s))
    out = []
    for t in range(P, W - 1):
        logits = model(x[:, t : t + 1], cache=cache)[:, -1, :].astype(mx.float32)
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, t + 1, None], axis=-1)[:, 0]
        mx.async_eval(nll)
        out.append(nll)
        if advance is not None and (t - P) % 16 == 15:
            advance(B * 16)
    return np.array(mx.stack(out, axis=1))


def run_longppl(settings: Optional[dict] = None, *, model=None, tokenizer=None, registry=None,
                progress: bool = True) -> dict:
    """The sweep; returns ``{"benchmark", "machine", "settings", "full", "results", ...}``: per
    (cache, ratio) ``nll``, ``ppl``, ``ppl_ratio``, ``nll_gap``, ``nll_gap_se``,
    ``nll_by_window``, ``kept``, ``kv_bytes_per_window``, ``bytes_ratio``, ``seconds``; or
    ``error``."""
    from kvcompress import get_registry

    from .longctx import _resolve_model, load_chat_model
    from .longctx_text import TextSource

    s = {**DEFAULTS, **(settings or {})}
    check_settings(s)
    reg = registry or get_registry()
    if model is None:
        s["model"] = _resolve_model(s["model"])
        model, tokenizer = load_chat_model(s["model"], s["dequantize"])
    machine = machine_info()  # the commit and load the run starts with (a long run outlives edits)
    source = TextSource.from_dir(s["text_dir"])
    windows, names = long_windows(tokenizer, source, s["window"], s["windows"], s["seed"])
    batches = [windows[i : i + s["batch"]] for i in range(0, len(windows), s["batch"])]
    todo = cache_entries(s["methods"], reg, s["extra"])
    grid = [("baseline", "full", {}, "full", 1)] + [(*e, r) for r in s["ratios"] for e in todo]
    bar = progress_bar(total=len(grid) * windows.size, desc="longppl", unit="tok", leave=False) if progress else None
    advance = bar.update if bar is not None and hasattr(bar, "update") else None
    results: list[dict] = []
    full_nll = full_bytes = None
    t_start = time.perf_counter()
    for kind, name, params, label, ratio in grid:
        budget = None if name == "full" else max(1, s["window"] // ratio)
        rec: dict[str, Any] = {"kind": kind, "method": name, "label": label, "params": params, "ratio": ratio,
                               "budget": budget}
        t0 = time.perf_counter()
        try:
            nlls, sizes = [], []
            for wb in batches:
                cache = make_cache(model, name, budget or 0, keep=s["n_sink"], seed=s["seed"], params=params,
                                   registry=reg, tokenizer=tokenizer)
                nlls.append(chunked_nll(model, wb, cache, s["decode"], s["chunk"], advance))
                sizes.append((live_kv_bytes(cache) / len(wb), float(np.mean([stored_tokens(c) for c in cache]))))
        except Exception as exc:  # reported, not fatal
            rec["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"longppl: {label} (C={budget}): {exc}", RuntimeWarning, stacklevel=2)
            results.append(rec)
            continue
        nll = np.concatenate(nlls, axis=0)
        nbytes = float(np.mean([b for b, _ in sizes]))
        if name == "full":
            full_nll, full_bytes = nll, nbytes
        m, base = float(nll.mean()), float(full_nll.mean())
        d = nll.mean(axis=1) - full_nll.mean(axis=1)
        rec.update(nll=m, ppl=math.exp(m), ppl_ratio=math.exp(m - base), nll_gap=m - base,
                   nll_gap_se=float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None,
                   nll_by_window=[float(x) for x in nll.mean(axis=1)], kept=float(np.mean([k for _, k in sizes])),
                   kv_bytes_per_window=nbytes, bytes_ratio=full_bytes / nbytes if nbytes else None,
                   seconds=round(time.perf_counter() - t0, 2))
        results.append(rec)
    if bar is not None and hasattr(bar, "close"):
        bar.close()
    return {
        "benchmark": "longppl",
        "machine": {**machine, "load_average_end": machine_info()["load_average"]},
        "settings": {**s, "text_dir": source.where, "windows": int(len(windows)), "documents": names,
                     "methods": sorted({r["method"] for r in results if r["kind"] == "method"}),
                     "extra": [[n, dict(p)] for n, p in (s["extra"] or ())],
                     "scored_tokens": int(len(windows) * s["decode"])},
        "full": {k: results[0].get(k) for k in ("nll", "ppl", "error") if k in results[0]},
        "results": results,
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }


def results_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per cache: ppl ratio to the full cache per ratio, and the measured bytes ratio."""
    ratios = list(payload["settings"]["ratios"])
    top = max(ratios)
    cols = ["method", *[f"ppl ratio {x}x" for x in ratios], f"ppl {top}x", f"nll gap ±se {top}x",
            f"bytes ratio {top}x"]
    by: dict[str, dict] = {}
    for r in payload["results"]:
        by.setdefault(r["label"], {})[r["ratio"]] = r
    rows = []
    for label, rs in by.items():
        t = rs.get(1 if label == "full" else top, {})
        gap = None if t.get("nll_gap") is None else f"{t['nll_gap']:+.4f} ±{t.get('nll_gap_se') or 0:.4f}"
        cells = [rs.get(1, {}).get("ppl_ratio")] * len(ratios) if label == "full" else \
            [rs.get(x, {}).get("ppl_ratio", "error" if "error" in rs.get(x, {}) else None) for x in ratios]
        rows.append([label, *cells, t.get("ppl"), gap, t.get("bytes_ratio")])
    return cols, rows


def caption(payload: dict) -> str:
    st = dict(payload["settings"])
    st["model"] = Path(str(st["model"])).name
    st["text_dir"] = Path(str(st["text_dir"])).name or st["text_dir"]
    keys = ("model", "text_dir", "windows", "window", "decode", "chunk", "scored_tokens", "n_sink", "seed")
    return _caption(payload, keys, settings=st, lead="Teacher-forced perplexity of the decoded tokens after a "
                    "chunked prefill, relative to the full cache (lower is better). ")


def plot_longppl(payload: dict, path) -> Path:
    """Perplexity ratio to the full cache against measured compression, one line per method."""
    plt = pyplot()
    st = payload["settings"]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(20) if i not in (14, 15)]
    labels = [m for m in result_labels(payload) if m != "full"]
    for k, lbl in enumerate(labels):
        pts = sorted((r["bytes_ratio"], r["ppl_ratio"]) for r in payload["results"]
                     if r["label"] == lbl and r.get("ppl_ratio") is not None and r.get("bytes_ratio"))
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=lbl, marker="osD^v<>pPX"[k % 10], markersize=4,
                    color="black" if lbl == "rotating" else colors[k % len(colors)],
                    linestyle="--" if lbl == "rotating" else ("-." if k >= len(colors) // 2 else "-"))
    full = payload["full"].get("ppl") or float("nan")
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1, label=f"full (ppl {full:.3f})")
    ax.axhline(1.1, color="grey", linestyle=":", linewidth=1, label="1.1x full")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV memory compression, measured (full-cache bytes / cache bytes)")
    ax.set_ylabel("perplexity / full cache's")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_title(f"Long-text perplexity, {Path(str(st['model'])).name}, {st['window']}-token windows: lower is better",
                 fontsize=10)
    return save_plot(fig, path, caption(payload))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the longppl workload; omitted options take :data:`DEFAULTS`."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes: two 1024-token windows, 32 scored tokens")
    parser.add_argument("--model", help="mlx-lm model folder or HF id (default: smollm2-135m-instruct under "
                                        "$KVCOMPRESS_MODELS_DIR or ../shared/models)")
    parser.add_argument("--text-dir", "--data", dest="text_dir",
                        help="folder of UTF-8 .txt files (default: longtext under $KVCOMPRESS_DATA_DIR or "
                             "../shared/data)")
    parser.add_argument("--window", type=int, help="tokens per window (default 4096)")
    parser.add_argument("--windows", type=int, help="windows, one per document (default 4)")
    parser.add_argument("--decode", type=int, help="tokens decoded and scored at the end of each window (default 128)")
    parser.add_argument("--chunk", type=int, help="prefill chunk (default 512; 0 = one step)")
    parser.add_argument("--ratios", type=int_list, help="compression ratios; budget = window // ratio (default 4)")
    parser.add_argument("--batch", type=int, help="windows run together (default 4)")
    parser.add_argument("--n-sink", type=int, help="RotatingKVCache keep, attention sinks (default 4)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: every registered method)")
    parser.add_argument("--variant", dest="extra", type=variant, action="append", metavar="METHOD:K=V,...",
                        help="also run METHOD with these parameters, e.g. snapkv:kernel=11,recent=8 (repeatable)")
    parser.add_argument("--seed", type=int, help="seed of the document order and of seeded methods (default 0)")
    parser.add_argument("--no-dequantize", dest="dequantize", action="store_false", default=None,
                        help="keep a quantized model's weights quantized (slow on a CPU)")
    add_output_arguments(parser, "longppl.json/.png")


def settings_from_args(args) -> dict:
    s = _settings_from_args(args, DEFAULTS, QUICK)
    check_settings(s)
    return s


def run(args) -> dict:
    """``kvcompress bench longppl``: run, write ``<out>/longppl.json`` (+ .png), print a table."""
    from .longctx import _resolve_model

    warn_openblas()
    s = settings_from_args(args)
    s["model"] = _resolve_model(s["model"])
    payload = run_longppl(s, progress=True)
    st = payload["settings"]
    title = (f"Long-text perplexity ({Path(str(st['model'])).name}, {st['windows']} x {st['window']} tokens, "
             f"{st['scored_tokens']} scored, lower is better)")
    return report_sweep(payload, args, "longppl", title, results_table, plot_longppl, lambda r: f"C={r['budget']}")
