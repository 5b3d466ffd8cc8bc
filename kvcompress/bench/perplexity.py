"""Streaming perplexity of a real model with a bounded KV cache (teacher-forced).

Text preparation follows the recipe of the TinyStories validation file's README (the format
the stories260K model was trained on): paragraphs (blank-line separated) are stripped and
joined by a single ``"\\n"``, the whole string is encoded in **one** call (so the tokenizer's
leading ``"▁"`` appears once), the tokens after BOS are cut into windows of ``window - 1``
tokens and BOS is put in front of each window. Only full windows are used.

For each window ``x_0 .. x_{W-1}`` and each cache (every registered method, mlx-lm's
``RotatingKVCache`` and the full ``KVCache``; mlx-lm's ``QuantizedKVCache`` when ``quantized2`` /
``quantized4`` / ``quantized8`` are named in ``methods``, once, as it has no budget) at each
budget ``C``:

1. prefill ``x_0 .. x_{P-1}`` in one step (``P = prefill``);
2. decode teacher-forced: feed ``x_t`` for ``t = P .. W-2``, one token per step, with the cache
   held at ``C`` tokens; the step's logits give ``-log p(x_{t+1} | cache)``.

Only the ``W - 1 - P`` decoded predictions are scored (the prefill's own last prediction sees
the full prompt for every cache, so it would only dilute differences).
``nll = mean over scored tokens``, ``ppl = exp(nll)`` and ``gap = ppl - ppl_full`` on the same
tokens. Windows are batched (``B = batch``) so each decode step is one model call.
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

from ._caches import QUANTIZED, entries, live_kv_bytes, make_cache, stored_tokens
from ._options import DEFAULT_OUT, NameList, add_output_arguments, check_minimums, int_list
from ._options import settings_from_args as _settings_from_args
from ._report import caption as _caption
from ._report import machine_info, progress_bar, pyplot, report_sweep, save_plot, warn_openblas
from ._styles import series_styles

__all__ = [
    "DEFAULTS",
    "default_model_path",
    "default_text_path",
    "check_settings",
    "prepare_windows",
    "window_nll",
    "run_perplexity",
    "add_arguments",
    "run",
    "results_table",
    "plot_perplexity",
    "settings_from_args",
]

_REPO = Path(__file__).resolve().parents[2]

#: The committed run (docs/results/perplexity.json).
DEFAULTS: dict[str, Any] = {
    "model": None,  # None = $KVCOMPRESS_MODELS_DIR/stories260K or ../shared/models/stories260K
    "text": None,  # None = $KVCOMPRESS_DATA_DIR/tinystories_valid/tinystories_val.txt or ../shared/...
    "windows": 32,
    "window": 512,
    "prefill": 128,
    "budgets": (64, 256),
    "batch": 32,
    "n_sink": 4,
    "methods": None,
    #: extra (method, params) variants, labelled "method:k=v". Default: SnapKV re-scoring at every
    #: decode step from the window of the last ``recent`` queries (its ``interval`` option), the
    #: best equal-memory result at 8x here (docs/bench_models.md)
    "extra": (("snapkv", {"interval": 1}),),
    "seed": 0,
    "step_tokens": 1,
    "out": DEFAULT_OUT,  # the folder --out names; recorded with the results
}


def _env_dir(var: str, default: Path) -> Path:
    import os

    return Path(os.environ[var]) if os.environ.get(var) else default


def default_model_path() -> Path:
    return _env_dir("KVCOMPRESS_MODELS_DIR", _REPO.parent / "shared" / "models") / "stories260K"


def default_text_path() -> Path:
    return (_env_dir("KVCOMPRESS_DATA_DIR", _REPO.parent / "shared" / "data")
            / "tinystories_valid" / "tinystories_val.txt")


def _resolve_model(model: Optional[str]) -> str:
    if model:
        return str(model)
    p = default_model_path()
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"no model given and the default {p} is absent; pass --model PATH_OR_HF_ID or set "
            "KVCOMPRESS_MODELS_DIR to a folder holding stories260K"
        )
    return str(p)


def _resolve_text(text: Optional[str]) -> Path:
    p = Path(text) if text else default_text_path()
    if not p.exists():
        hint = "" if text else " (the default); pass --text FILE or set KVCOMPRESS_DATA_DIR"
        raise FileNotFoundError(f"evaluation text not found at {p}{hint}")
    return p


def check_paths(s: dict) -> None:
    """Raise ``ValueError`` naming ``--model`` or ``--text`` when it cannot be what it names: a
    local path without an mlx-lm model, a text file that is absent or a folder (before loading)."""
    model, text = s.get("model"), s.get("text")
    if model:
        local = Path(model).expanduser()
        if (local.exists() or str(model).startswith((".", "/", "~"))) and not (local / "config.json").is_file():
            raise ValueError(f"--model {model}: no mlx-lm model folder there (config.json missing)")
    if text:
        p = Path(text).expanduser()
        if p.is_dir():
            raise ValueError(f"--text {text}: a folder; name a UTF-8 text file")
        if not p.is_file():
            raise ValueError(f"--text {text}: no file there")
    try:
        _resolve_model(model)
        _resolve_text(text)
    except FileNotFoundError as exc:  # the defaults are absent
        raise ValueError(str(exc)) from None


def check_settings(s: dict) -> None:
    """Raise ``ValueError`` for impossible settings (before anything is loaded or run)."""
    check_minimums(s, {"windows": 1, "window": 3, "prefill": 1, "budgets": 1, "batch": 1, "n_sink": 0,
                                "seed": 0, "step_tokens": 1})
    if not s["prefill"] < s["window"] - 1:
        raise ValueError(f"prefill must be in [1, window - 2] = [1, {s['window'] - 2}] so that some "
                         f"tokens are decoded, got {s['prefill']}")


def prepare_windows(tokenizer, text: str, window: int = 512, n: Optional[int] = None) -> np.ndarray:
    """``[n, window]`` int32 windows, each ``[BOS] + window - 1`` tokens of the one-call encoding."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    ids = list(tokenizer.encode("\n".join(paragraphs)))
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ValueError("the tokenizer has no BOS token; this recipe needs one")
    if ids and ids[0] == bos:
        ids = ids[1:]
    step = window - 1
    count = len(ids) // step
    if n is not None:
        count = min(count, n)
    if count == 0:
        raise ValueError(f"text too short for one window of {window} tokens")
    body = np.array(ids[: count * step], dtype=np.int32).reshape(count, step)
    return np.concatenate([np.full((count, 1), bos, dtype=np.int32), body], axis=1)


def window_nll(model, windows: np.ndarray, cache, prefill: int, step: int = 1) -> np.ndarray:
    """``[B, W - 1 - prefill]`` float32 NLL of each decoded prediction (teacher-forced), the
    cache fed ``step`` tokens per forward (``step > 1``: as speculative decoding's verification
    steps feed it when every draft token is accepted)."""
    B, W = windows.shape
    if not 0 < prefill < W - 1:
        raise ValueError(f"prefill must be in [1, {W - 2}], got {prefill}")
    x = mx.array(windows)
    mx.eval(model(x[:, :prefill], cache=cache))
    out = []
    for t in range(prefill, W - 1, step):
        k = min(step, W - 1 - t)
        logits = model(x[:, t : t + k], cache=cache).astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        tgt = mx.take_along_axis(logits, x[:, t + 1 : t + 1 + k, None], axis=-1)[..., 0]
        nll = lse - tgt
        mx.async_eval(nll)
        out.append(nll)
    return np.array(mx.concatenate(out, axis=1))


def run_perplexity(settings: Optional[dict] = None, *, model=None, tokenizer=None, registry=None,
                   progress: bool = True) -> dict:
    """The sweep; returns ``{"benchmark", "machine", "settings", "full", "results", ...}``.

    ``full``: the full-cache ``nll``/``ppl``; each record of ``results`` (one per method and
    budget) has ``nll``, ``ppl``, ``gap`` (ppl minus full ppl), ``nll_gap``, ``nll_gap_se`` (its
    standard error from the per-window paired differences), ``kept`` (mean
    tokens stored per layer at the end of a window), ``kv_bytes_per_window`` and
    ``bytes_ratio`` (full-cache bytes over this cache's live bytes at the end of a window:
    quantizing methods keep every token, so their ratio is below ``window / budget``),
    ``seconds``; or ``error``.
    """
    from kvcompress import get_registry

    s = {**DEFAULTS, **(settings or {})}
    check_settings(s)
    reg = registry or get_registry()
    if model is None:
        import mlx_lm

        model_path = _resolve_model(s["model"])
        try:
            model, tokenizer = mlx_lm.load(model_path)
        except Exception as exc:  # a missing folder, an unknown id, no network
            raise ValueError(f"--model {model_path}: cannot load it ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]})") from None
        s["model"] = model_path
    text_path = _resolve_text(s["text"])
    s["text"] = str(text_path)
    windows = prepare_windows(tokenizer, text_path.read_text(), s["window"], s["windows"])
    s["windows"] = int(windows.shape[0])
    batches = [windows[i : i + s["batch"]] for i in range(0, len(windows), s["batch"])]
    t_start = time.perf_counter()

    def measure(kind, name, params, budget):
        nlls, cache = [], None
        for wb in batches:
            cache = make_cache(model, name, budget or 0, keep=s["n_sink"], seed=s["seed"], params=params,
                               registry=reg, tokenizer=tokenizer)
            nlls.append(window_nll(model, wb, cache, s["prefill"], s["step_tokens"]))
        kept = float(np.mean([stored_tokens(c) for c in cache]))
        return np.concatenate(nlls, axis=0), kept, live_kv_bytes(cache) / len(batches[-1])

    todo = [e for e in entries(s["methods"], reg, s["extra"]) if e[1] != "full"]
    # caches without a budget (full; mlx-lm's QuantizedKVCache, on request) run once
    once = [(*e, None) for e in todo if e[1] in QUANTIZED]
    grid = [("baseline", "full", {}, "full", None), *once] + [
        (*e, b) for b in s["budgets"] for e in todo if e[1] not in QUANTIZED]
    full_nll = None
    results: list[dict] = []
    for kind, name, params, label, budget in (
            progress_bar(grid, desc="perplexity", unit="run", leave=False) if progress else grid):
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"kind": kind, "method": name, "label": label, "params": params,
                               "budget": budget, "ratio": None if budget is None else s["window"] / budget}
        try:
            nll, kept, nbytes = measure(kind, name, params, budget)
        except Exception as exc:  # reported, not fatal
            rec["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"perplexity: {label} (C={budget}): {exc}", RuntimeWarning, stacklevel=2)
            results.append(rec)
            continue
        m = float(nll.mean())
        if name == "full":
            full_nll, full_bytes = nll, nbytes
        base = float(full_nll.mean())
        paired = nll.mean(axis=1) - full_nll.mean(axis=1)
        se = float(paired.std(ddof=1) / math.sqrt(len(paired))) if len(paired) > 1 else None
        rec.update(nll=m, ppl=math.exp(m), nll_gap=m - base, nll_gap_se=se, gap=math.exp(m) - math.exp(base),
                   nll_by_window=[float(x) for x in nll.mean(axis=1)], kept=kept,
                   kv_bytes_per_window=nbytes, bytes_ratio=full_bytes / nbytes if nbytes else None,
                   seconds=round(time.perf_counter() - t0, 2))
        results.append(rec)
    full = results[0]
    return {
        "benchmark": "perplexity",
        "machine": machine_info(),
        "settings": {**s, "methods": sorted({r["method"] for r in results if r["kind"] == "method"}),
                     "extra": [[n, dict(p)] for n, p in (s["extra"] or ())],
                     "scored_tokens": int(windows.shape[0] * (s["window"] - 1 - s["prefill"]))},
        "full": {k: full.get(k) for k in ("nll", "ppl", "error") if k in full},
        "results": results,
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }


# --------------------------------------------------------------------------------------------
# Presentation
# --------------------------------------------------------------------------------------------


def results_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per cache; ``ppl (gap)`` columns per budget."""
    budgets = list(payload["settings"]["budgets"])
    w = payload["settings"]["window"]
    cols = ["method", *[f"C={b} ({w / b:g}x) ppl" for b in budgets], *[f"gap C={b}" for b in budgets],
            f"bytes ratio C={min(budgets)}"]
    by: dict[str, dict] = {}
    for r in payload["results"]:
        by.setdefault(r["label"], {})[r["budget"]] = r
    rows = []
    for m, rs in by.items():
        if m == "full":
            f = rs[None]
            rows.append([m, *[f.get("ppl")] * len(budgets), *[0.0] * len(budgets), 1.0])
            continue
        if list(rs) == [None]:  # no budget (mlx-lm's QuantizedKVCache): the same at every budget
            f = rs[None]
            rows.append([m, *[f.get("ppl", "error")] * len(budgets), *[f.get("gap")] * len(budgets),
                         f.get("bytes_ratio")])
            continue
        rows.append([m, *[rs.get(b, {}).get("ppl", "error") for b in budgets],
                     *[rs.get(b, {}).get("gap") for b in budgets],
                     rs.get(min(budgets), {}).get("bytes_ratio")])
    return cols, rows


def caption(payload: dict) -> str:
    st = dict(payload["settings"])
    st["model"] = Path(str(st["model"])).name
    st["text"] = Path(str(st["text"])).name
    keys = ("model", "text", "windows", "window", "prefill", "scored_tokens", "n_sink", "seed")
    return _caption(payload, keys, lead="Teacher-forced streaming perplexity of decoded tokens (lower is better). ",
                    settings=st)


def plot_perplexity(payload: dict, path) -> Path:
    """Perplexity gap to the full cache vs budget, one line per method."""
    plt = pyplot()
    st = payload["settings"]
    budgets = list(st["budgets"])
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    labels = [m for m in dict.fromkeys(r["label"] for r in payload["results"]) if m != "full"]
    styles = series_styles(labels)  # colour x marker x line style: 20 methods told apart
    gaps = [0.0]
    for lbl in labels:
        pts = sorted((r["budget"], r["gap"]) for r in payload["results"]
                     if r["label"] == lbl and r.get("gap") is not None and r["budget"] is not None)
        flat = [r["gap"] for r in payload["results"] if r["label"] == lbl and r["budget"] is None
                and r.get("gap") is not None]
        if flat:  # no budget: one horizontal line
            gaps.append(flat[0])
            ax.axhline(flat[0], label=lbl, color=styles[lbl]["color"], linestyle="--", linewidth=1)
        if pts:
            xs, ys = zip(*pts)
            gaps += ys
            ax.plot(xs, ys, label=lbl, markersize=4, **styles[lbl])
    ax.axhline(0.0, color="black", linestyle=":", linewidth=1, label=f"full (ppl {payload['full'].get('ppl', float('nan')):.3f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets)
    ax.set_xticklabels([f"{b}\n({st['window'] / b:g}x)" for b in budgets])
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_ylim(min(-0.01, 2 * min(gaps)), 2 * max(gaps) + 0.01)
    ax.set_xlabel(f"budget C (tokens per layer; window {st['window']})")
    ax.set_ylabel("perplexity gap to full cache")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_title(f"Streaming perplexity, {Path(str(st['model'])).name}: lower is better", fontsize=10)
    return save_plot(fig, path, caption(payload))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


#: Tiny sizes for ``--quick`` (seconds).
QUICK: dict[str, Any] = {"windows": 4, "batch": 4, "budgets": (64,)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the perplexity workload; omitted options take :data:`DEFAULTS`."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--model",
                        help="mlx-lm model folder or HF id (default: $KVCOMPRESS_MODELS_DIR/stories260K "
                             "or ../shared/models/stories260K next to the checkout)")
    parser.add_argument("--text",
                        help="UTF-8 text file (default: tinystories_valid/tinystories_val.txt under "
                             "$KVCOMPRESS_DATA_DIR or ../shared/data)")
    parser.add_argument("--windows", type=int, help="number of windows: the cost knob (default 32)")
    parser.add_argument("--window", type=int, help="tokens per window, BOS included (default 512)")
    parser.add_argument("--prefill", type=int, help="tokens prefilled per window (default 128)")
    parser.add_argument("--budgets", type=int_list, help="comma list of budgets (default 64,256)")
    parser.add_argument("--batch", type=int, help="windows decoded together (default 32)")
    parser.add_argument("--n-sink", type=int, help="RotatingKVCache keep, attention sinks (default 4)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: every registered method); quantized2, "
                             "quantized4, quantized8 add mlx-lm's QuantizedKVCache")
    parser.add_argument("--seed", type=int, help="seed of seeded methods (default 0)")
    parser.add_argument("--step-tokens", type=int,
                        help="decode tokens per forward, as speculative decoding verifies drafts (default 1)")
    add_output_arguments(parser, "perplexity.json/.png")


def settings_from_args(args) -> dict:
    """The settings the options give, checked (:func:`check_settings`)."""
    s = _settings_from_args(args, DEFAULTS, QUICK)
    check_settings(s)
    return s


def run(args) -> dict:
    """``kvcompress bench perplexity``: run, write ``<out>/perplexity.json`` (+ .png), print a table."""
    warn_openblas()
    settings = settings_from_args(args)
    check_paths(settings)
    payload = run_perplexity(settings, progress=True)
    st = payload["settings"]
    title = f"Streaming perplexity ({Path(st['model']).name}, {st['scored_tokens']} scored tokens, lower is better)"
    return report_sweep(payload, args, "perplexity", title, results_table, plot_perplexity,
                        lambda r: f"C={r['budget']}")
