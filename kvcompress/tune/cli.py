"""``kvcompress tune --model M --budget C [--data FILE] [--workload longctx]``: options, checks, the run, the files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["DEFAULTS", "WORKLOADS", "add_arguments", "check_args", "run"]

#: What a candidate is measured on: ``perplexity`` (the default with --model), ``retrieval`` (the
#: embedded model, without --model), ``longctx`` (``kvcompress bench longctx``'s tasks on --model).
WORKLOADS = ("perplexity", "retrieval", "longctx")
#: ``--window`` of the longctx workload when not given: its context length
LONGCTX_WINDOW = 2048
#: ``--windows`` / ``--held-out`` of the longctx workload when not given: episodes (a chunked read
#: of 2k tokens and its questions take about a minute on SmolLM2-135M on 2 CPU cores)
LONGCTX_ITEMS = 2

#: Option defaults (``--quick`` shrinks the items for a trial run).
DEFAULTS = {"candidates": 100, "max_minutes": 10.0, "finalists": 4, "windows": 8, "held_out": 8,
            "window": 512, "prefill": 128, "batch": 8, "seed": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcompress.bench._options import DEFAULT_OUT, NameList

    d = DEFAULTS
    p.add_argument("--model", help="mlx-lm model folder or Hugging Face id (default: the embedded retrieval "
                                   "model, scored on passkey and multi-query retrieval)")
    p.add_argument("--budget", type=int, required=True, help="tokens kept per layer (the mean over layers for "
                                                             "per-layer budgets)")
    p.add_argument("--data", help="UTF-8 text to score perplexity on, with --model (default: 45 KB of plain "
                                  "English prose bundled with kvcompress); longctx: a folder of .txt files for the "
                                  "filler (default: the shared longtext folder)")
    p.add_argument("--workload", choices=WORKLOADS,
                   help="what candidates are measured on: perplexity (default with --model), retrieval (default "
                        "without: the embedded model), longctx (bench longctx's needle and fact questions on --model, "
                        f"--window-token contexts, default {LONGCTX_WINDOW})")
    p.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                   help="methods, separated by commas or spaces (default: every registered method)")
    p.add_argument("--candidates", type=int, default=d["candidates"],
                   help=f"at most this many candidates measured (default {d['candidates']})")
    p.add_argument("--max-minutes", type=float, default=d["max_minutes"],
                   help=f"stop starting candidates when the run would pass this (default {d['max_minutes']:g})")
    p.add_argument("--finalists", type=int, default=d["finalists"],
                   help=f"best candidates re-measured on held-out items (default {d['finalists']})")
    p.add_argument("--windows", type=int, default=None,
                   help=f"search items: text windows, retrieval samples per task, or longctx episodes (default "
                        f"{d['windows']}; longctx {LONGCTX_ITEMS})")
    p.add_argument("--held-out", type=int, default=None,
                   help=f"held-out items the finalists are compared on (default {d['held_out']}; longctx "
                        f"{LONGCTX_ITEMS})")
    p.add_argument("--window", type=int, default=None,
                   help=f"tokens per item, BOS included: text window or retrieval context (default {d['window']}; "
                        f"longctx: the context length, default {LONGCTX_WINDOW})")
    p.add_argument("--prefill", type=int, default=d["prefill"],
                   help=f"text: tokens prefilled per window before decoding (default {d['prefill']})")
    p.add_argument("--batch", type=int, default=d["batch"], help=f"text windows decoded together (default {d['batch']})")
    p.add_argument("--seed", type=int, default=d["seed"], help="retrieval: seed of the search samples (held-out: "
                                                               "the next seed)")
    p.add_argument("--allow-over-budget", action="store_true",
                   help="let a candidate holding more than 2x the bytes of BUDGET full-precision tokens win")
    p.add_argument("--quick", action="store_true", help="a trial run: 2+2 items, 12 candidates")
    p.add_argument("--top", type=int, default=0, help="print only the best TOP rows of the ranking (default all)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for tune.toml, tune.json, tune.png (default: ./{DEFAULT_OUT})")
    p.add_argument("--no-plot", action="store_true", help="skip tune.png")
    p.add_argument("--plain", action="store_true", help="plain-text tables (no rich)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_args(args) -> None:
    """Raise ``ValueError`` (one line: the option, the valid range, the value) before anything loads."""
    if getattr(args, "workload", None) is None:
        args.workload = "perplexity" if args.model else "retrieval"
    longctx = args.workload == "longctx"
    if args.window is None:
        args.window = LONGCTX_WINDOW if longctx else DEFAULTS["window"]
    for k in ("windows", "held_out"):
        if getattr(args, k) is None:
            setattr(args, k, LONGCTX_ITEMS if longctx else DEFAULTS[k])
    if args.quick:
        for k, v in {"windows": 2, "held_out": 2, "candidates": 12}.items():
            if getattr(args, k) == DEFAULTS[k]:
                setattr(args, k, v)
    lows = {"budget": 1, "candidates": 1, "finalists": 1, "windows": 1, "held_out": 1, "window": 3, "prefill": 1,
            "batch": 1, "seed": 0, "top": 0}
    for name, low in lows.items():
        v = getattr(args, name)
        if v < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
    if not args.max_minutes > 0:
        raise ValueError(f"--max-minutes must be > 0, got {args.max_minutes:g}")
    if args.workload in ("perplexity", "longctx") and not args.model:
        raise ValueError(f"--workload {args.workload} needs --model (an mlx-lm model folder or Hugging Face id)")
    if args.workload == "retrieval" and args.model:
        raise ValueError("--workload retrieval tunes the embedded retrieval model; leave --model out")
    if args.data and not args.model:
        raise ValueError("--data needs --model (without --model the embedded retrieval model is tuned on "
                         "its own samples)")
    if args.model and not args.prefill < args.window - 1:
        raise ValueError(f"--prefill must be in [1, --window - 2] = [1, {args.window - 2}], got {args.prefill}")
    if not args.budget < args.window - 1:
        raise ValueError(f"--budget must be below the tokens an item holds (--window {args.window} - 1), "
                         f"or nothing is compressed; got {args.budget}")
    if args.workload == "longctx":
        if args.data and not Path(args.data).is_dir():
            raise ValueError(f"--data: no folder at {args.data} (longctx reads a folder of .txt files)")
    elif args.data and not Path(args.data).is_file():
        raise ValueError(f"--data: no file at {args.data}")
    if args.methods is not None:
        from kvcompress import get_registry

        reg = get_registry()
        unknown = [m for m in args.methods if m not in reg.methods]
        if not args.methods:
            raise ValueError(f"--methods: no method named; give a comma list of registered methods: "
                             f"{', '.join(sorted(reg.methods))}")
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; registered: "
                             f"{', '.join(sorted(reg.methods))}")
    from kvcompress.bench._options import check_out_dir

    check_out_dir(args.out)


def _workload(args):
    from .workloads import RetrievalWorkload, TextWorkload, load_text

    if args.model is None:
        from kvcompress.bench.retrieval import ASSET_DIR, load_retrieval_model

        model, _ = load_retrieval_model()
        return RetrievalWorkload(model, context=args.window, samples=args.windows, heldout=args.held_out,
                                 seed=args.seed, source=f"embedded:{ASSET_DIR.name}"), f"embedded:{ASSET_DIR.name}"
    import mlx_lm

    local = Path(args.model).expanduser()
    if (local.exists() or args.model.startswith((".", "/", "~"))) and not (local / "config.json").is_file():
        raise ValueError(f"--model {args.model}: no mlx-lm model folder there (config.json missing)")
    if args.workload == "longctx":
        from kvcompress.bench.longctx import load_chat_model

        from .workloads import LongctxWorkload

        model, tokenizer = load_chat_model(args.model)
        return LongctxWorkload(model, tokenizer, length=args.window, episodes=args.windows, heldout=args.held_out,
                               text_dir=args.data, seed=args.seed, source=args.model), Path(args.model).name
    text, where = load_text(args.data)
    try:
        model, tokenizer = mlx_lm.load(args.model)
    except Exception as exc:  # a missing folder, an unknown id, no network
        raise ValueError(f"--model {args.model}: cannot load it ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]})") from None
    return TextWorkload(model, tokenizer, text, window=args.window, prefill=args.prefill, windows=args.windows,
                        heldout=args.held_out, batch=args.batch, source=where), Path(args.model).name


def run(args) -> int:
    """Run the search, print the ranking, write ``tune.toml``, ``tune.json`` and ``tune.png``."""
    from kvcompress.bench._report import machine_info, warn_openblas, write_json

    from .report import plot_tune, print_ranking, write_toml
    from .search import run_search

    check_args(args)
    warn_openblas()
    workload, model_name = _workload(args)
    result = run_search(workload, args.budget, methods=args.methods, candidates=args.candidates,
                        max_seconds=args.max_minutes * 60, finalists=args.finalists,
                        allow_over=args.allow_over_budget, progress=not args.no_progress)
    settings = {k: getattr(args, k) for k in ("model", "workload", "budget", "data", "methods", "candidates",
                                              "max_minutes", "finalists", "windows", "held_out", "window", "prefill",
                                              "batch", "seed", "allow_over_budget")}
    settings["model_name"] = model_name
    payload = {"benchmark": "tune", "machine": machine_info(), "settings": settings,
               "workload": workload.describe(), **result}
    print_ranking(payload, plain=args.plain, top=args.top)
    w = payload["winner"]
    what = "ppl ratio" if payload["workload"]["workload"] == "perplexity" else "accuracy lost"
    print(f"winner: {w['label']} (held-out gap {w['gap']:+.4f}, {what} {w['ratio']:.3f}) after "
          f"{sum(1 for r in payload['candidates'] if r.get('gap') is not None)} candidates in "
          f"{payload['seconds_total']:.0f} s")
    out = Path(args.out)
    note = (f"kvcompress tune: winner at budget {args.budget} on {model_name} "
            f"(held-out {what} {w['ratio']:.3f}, gap {w['gap']:+.4f})\n"
            f"use: kvcompress generate --model MODEL --config {out / 'tune.toml'}")
    written = [write_toml(out / "tune.toml", payload["config"], note), write_json(out / "tune.json", payload)]
    if not args.no_plot:
        try:
            written.append(plot_tune(payload, out / "tune.png"))
        except ImportError as exc:
            print(f"no plot ({exc}); pip install 'kvcompress[bench]'", file=sys.stderr)
    for p in written:
        print(f"wrote {p}")
    return 0
