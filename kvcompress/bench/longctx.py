"""Long-context tasks on a real chat model: RULER-style needles and facts in real text, multi-turn.

Episodes (:mod:`kvcompress.bench.longctx_tasks`) plant seeded facts at random depths in real text
(:mod:`kvcompress.bench.longctx_text`; ``--text-dir``, default the shared ``longtext`` folder);
all chosen tasks share one context per episode (``--separate``: one context per task). For each
context length, every registered method, mlx-lm's ``KVCache`` (``full``, once per length) and
``RotatingKVCache`` (``rotating``) at budgets ``C = length // ratio``:

1. **Read.** The chat head and the document are prefilled in chunks of ``chunk`` tokens (512)
   before any question exists: a compressing cache evicts while it reads (question-blind, as a
   chat or a server's prompt reuse runs it). ``--question-aware``: context and question in one
   step per question instead, so the first eviction sees the question.
2. **Ask** (:mod:`kvcompress.bench._longctx_run`), greedy replies capped per task, through
   mlx-lm's ``BatchGenerator``:
   ``blind`` -- each question on its own copy of the compressed context (one request per
   question, the prefix reused); ``turns`` -- the questions one after another in one conversation
   (SCBench's multi-turn), each after the previous reply, the cache held at its budget.
3. **Score** exact match (every reference in the reply) and partial match
   (:func:`~kvcompress.bench.longctx_tasks.score`); ``accuracy`` is the exact-match mean over the
   questions of the tasks on which the full cache scores at least ``min_full`` (the others are
   reported, not averaged), with its standard error; ``bytes_ratio`` = full-cache live bytes /
   live bytes after the first reply (measured, next to the nominal ratio).

A method that fails at a setting is recorded with its error; the sweep goes on.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ._caches import live_kv_bytes, make_cache, stored_tokens
from ._options import DEFAULT_OUT, NameList, add_output_arguments, check_at_least, check_minimums, int_list, name_list
from ._options import settings_from_args as _settings_from_args
from ._longctx_report import measured_record, scores
from ._report import machine_info, progress_bar, report_sweep, warn_openblas
from ._variants import cache_entries, variant

__all__ = ["DEFAULTS", "QUICK", "PROTOCOLS", "load_chat_model", "default_model_path", "check_settings",
           "make_episodes", "measure", "run_longctx", "add_arguments", "settings_from_args", "run"]

PROTOCOLS = ("blind", "turns")

#: The default run (about 30 minutes here: SmolLM2-135M, 2 cores); the sweep of docs/bench_longctx.md
#: sets lengths 2048,4096,8192 and ratios 2,4,8,16.
DEFAULTS: dict[str, Any] = {
    "model": None,  # None = $KVCOMPRESS_MODELS_DIR/smollm2-135m-instruct (or ../shared/models/...)
    "text_dir": None,  # None = $KVCOMPRESS_DATA_DIR/longtext (or ../shared/data/longtext)
    "tasks": ("niah_single", "qa"),
    "separate": False,
    "lengths": (2048,),
    "ratios": (4,),
    "episodes": 2,
    "protocols": PROTOCOLS,
    "question_aware": False,
    "chunk": 512,
    "batch": 8,
    "n_sink": 4,
    "methods": None,  # None = every registered method
    "extra": (),
    "seed": 0,
    "min_full": 0.8,
    "chat_template": True,
    "dequantize": True,  # dequantize a quantized model after loading (CPU speed; same values)
    "out": DEFAULT_OUT,
}
#: ``--quick``: seconds on a tiny model (stories260K), a minute or two on SmolLM2-135M.
QUICK: dict[str, Any] = {"lengths": (512,), "episodes": 1, "ratios": (4,)}


def default_model_path() -> Path:
    import os

    base = os.environ.get("KVCOMPRESS_MODELS_DIR")
    return (Path(base) if base else Path(__file__).resolve().parents[3] / "shared" / "models") / "smollm2-135m-instruct"


def _resolve_model(model: Optional[str]) -> str:
    if model:
        local = Path(model).expanduser()
        if (local.exists() or str(model).startswith((".", "/", "~"))) and not (local / "config.json").is_file():
            raise ValueError(f"--model {model}: no mlx-lm model folder there (config.json missing)")
        return str(model)
    p = default_model_path()
    if not (p / "config.json").is_file():
        raise ValueError(f"no --model given and the default {p} is absent; pass --model PATH_OR_HF_ID (an mlx-lm "
                         "chat model) or set KVCOMPRESS_MODELS_DIR to a folder holding smollm2-135m-instruct")
    return str(p)


def load_chat_model(path: str, dequantize: bool = True):
    """``mlx_lm.load(path)``; a quantized model is dequantized (``mlx_lm.utils.dequantize_model``,
    float32: the same weights, ~12x faster prefill on a CPU) unless ``dequantize`` is False."""
    import mlx.core as mx
    import mlx_lm

    try:
        model, tokenizer = mlx_lm.load(path)
    except Exception as exc:  # a missing folder, an unknown id, no network
        raise ValueError(f"--model {path}: cannot load it ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]})") from None
    from mlx.utils import tree_flatten

    if dequantize and any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters())):
        from mlx_lm.utils import dequantize_model

        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return model, tokenizer


def check_settings(s: dict) -> None:
    """Raise ``ValueError`` for impossible settings (before anything is loaded or run)."""
    from .longctx_tasks import TASKS

    check_at_least("lengths", s["lengths"], 64)
    check_at_least("ratios", s["ratios"], 1, " (budget = length // ratio)")
    check_minimums(s, {"episodes": 1, "chunk": 0, "batch": 1, "n_sink": 0, "seed": 0})
    if not s["tasks"] or set(s["tasks"]) - set(TASKS):
        raise ValueError(f"tasks must be among {', '.join(TASKS)}, got {','.join(s['tasks']) or 'nothing'}")
    if not s["protocols"] or set(s["protocols"]) - set(PROTOCOLS):
        raise ValueError(f"protocols must be among {', '.join(PROTOCOLS)}, got {','.join(s['protocols']) or 'nothing'}")
    if not 0.0 <= float(s["min_full"]) <= 1.0:
        raise ValueError(f"min_full must be in [0, 1], got {s['min_full']}")


def make_episodes(tokenizer, fmt, source, s: dict, length: int) -> list:
    """The seeded episodes of one length: ``episodes`` contexts holding every task (or, with
    ``separate``, ``episodes`` contexts per task)."""
    from .longctx_tasks import build_episode

    groups = [(t,) for t in s["tasks"]] if s["separate"] else [tuple(s["tasks"])]
    return [build_episode(tokenizer, fmt, source, length, g, (s["seed"], length, gi, e))
            for gi, g in enumerate(groups) for e in range(s["episodes"])]


def _orders(episodes, seed: int) -> list:
    """The order each episode's questions are asked in a conversation (seeded per episode)."""
    return [[int(i) for i in np.random.default_rng([seed, *ep.seed, 7]).permutation(len(ep.questions))]
            for ep in episodes]


#: progress units (prefill tokens) one reply token counts for: a decode step costs several times a
#: prefilled token per row
REPLY_WEIGHT = 4


def ask_units(ep) -> int:
    """Progress units of asking every question of ``ep`` once (prompt + weighted reply tokens)."""
    return sum(len(q.text) // 4 + 8 + REPLY_WEIGHT * q.max_tokens for q in ep.questions)


def measure(model, tokenizer, fmt, episodes, build, s, stop, advance=None) -> dict:
    """Every protocol of settings ``s`` over ``episodes`` with caches from ``build()``: the
    replies per protocol, episode and question; mean live bytes and kept tokens per layer after
    a reply; seconds; the order of each conversation's questions."""
    from ._longctx_run import ask_aware, ask_aware_first, ask_each, ask_in_turns, prefill

    out: dict[str, Any] = {"answers": {}, "seconds": {}}
    orders = _orders(episodes, s["seed"])
    t0 = time.perf_counter()
    caches, blind, firsts, sizes = [], [], [], []
    for ep, order in zip(episodes, orders):
        if s["question_aware"]:
            if "blind" in s["protocols"]:
                got = ask_aware(model, tokenizer, fmt, ep, build, stop=stop, advance=advance)
                if advance is not None:
                    advance(ask_units(ep))
                # the conversation starts with the question asked first, already answered on its own cache
                firsts.append((got["replies"][order[0]], got["caches"][order[0]]))
            else:
                got = None
                firsts.append(ask_aware_first(model, tokenizer, fmt, ep, ep.questions[order[0]], build(), stop=stop,
                                              advance=advance))
            caches.append(None)
        else:
            cache = build()
            prefill(model, cache, ep.prefix_ids, s["chunk"], advance)
            got = None
            if "blind" in s["protocols"]:
                got = ask_each(model, tokenizer, fmt, ep, cache, batch=s["batch"], stop=stop)
                if advance is not None:
                    advance(ask_units(ep))
            caches.append(cache)
        if got is not None:
            blind.append(got["answers"])
            sizes.append((live_kv_bytes(got["cache"]), float(np.mean([stored_tokens(c) for c in got["cache"]]))))
    out["seconds"]["read_and_blind"] = time.perf_counter() - t0
    if blind:
        out["answers"]["blind"] = blind
    if "turns" in s["protocols"]:
        t1 = time.perf_counter()
        turns = ask_in_turns(model, tokenizer, fmt, episodes, caches, orders, batch=s["batch"], stop=stop,
                             first=firsts or None)
        out["seconds"]["turns"] = time.perf_counter() - t1
        if advance is not None:
            advance(sum(ask_units(ep) for ep in episodes))
        out["answers"]["turns"] = [[turns["answers"][e][orders[e].index(q)] for q in range(len(ep.questions))]
                                   for e, ep in enumerate(episodes)]
        if not sizes:
            sizes = [(live_kv_bytes(c), float(np.mean([stored_tokens(x) for x in c]))) for c in turns["caches"]]
    out["kv_bytes"] = float(np.mean([b for b, _ in sizes]))
    out["kept"] = float(np.mean([k for _, k in sizes]))
    out["orders"] = orders
    return out


def run_longctx(settings: Optional[dict] = None, *, model=None, tokenizer=None, registry=None,
                progress: bool = True) -> dict:
    """The sweep; returns ``{"benchmark", "machine", "settings", "episodes", "results", ...}``.

    One record per (length, cache, ratio, protocol): ``accuracy`` (exact match over the gated
    tasks' questions) with ``accuracy_se``, ``partial``, ``by_task``, ``full_accuracy`` (the full
    cache on the same questions), ``relative`` (accuracy / full's), ``answers`` and ``exact`` per
    episode and question, ``accuracy_by_turn`` / ``later_accuracy`` (``turns``), ``kv_bytes``,
    ``bytes_ratio``, ``kept``, ``seconds``; or ``error``. ``gate`` holds, per length, the full
    cache's accuracy per task and whether the task is averaged (>= ``min_full``).
    """
    from kvcompress import get_registry

    from ._longctx_run import eos_ids
    from .longctx_text import ChatFormat, TextSource, default_text_dir

    s = {**DEFAULTS, **(settings or {})}
    check_settings(s)
    reg = registry or get_registry()
    todo = cache_entries(s["methods"], reg, s["extra"])
    if model is None:
        s["model"] = _resolve_model(s["model"])
        model, tokenizer = load_chat_model(s["model"], s["dequantize"])
    machine = machine_info()  # the commit and load the run starts with (a long run outlives edits)
    source = TextSource.from_dir(s["text_dir"])
    if s["text_dir"] is None and source.where.startswith("embedded"):
        warnings.warn(f"longctx: no text folder (the default {default_text_dir()} is absent): the filler is "
                      "kvcompress's own docstrings; pass --text-dir DIR for real documents", RuntimeWarning,
                      stacklevel=2)
    fmt = ChatFormat.for_tokenizer(tokenizer, s["chat_template"])
    stop = eos_ids(tokenizer)
    episodes = {L: make_episodes(tokenizer, fmt, source, s, L) for L in s["lengths"]}
    per_run = {L: sum(ep.n_tokens * (len(ep.questions) if s["question_aware"] and "blind" in s["protocols"] else 1)
                      + ask_units(ep) * len(s["protocols"]) for ep in eps) for L, eps in episodes.items()}
    total = sum(per_run[L] * (1 + len(todo) * len(s["ratios"])) for L in s["lengths"])
    bar = progress_bar(total=total, desc="longctx", unit="tok", leave=False) if progress else None
    advance = bar.update if bar is not None and hasattr(bar, "update") else None
    results: list[dict] = []
    gates: dict = {}
    t_start = time.perf_counter()
    for L in s["lengths"]:
        eps = episodes[L]
        full_meas = measure(model, tokenizer, fmt, eps, lambda: make_cache(model, "full", 0), s, stop, advance)
        exact, _ = scores(eps, full_meas["answers"][s["protocols"][0]])
        tasks = np.array([q.task for ep in eps for q in ep.questions])
        gate = {t: float(exact[tasks == t].mean()) >= s["min_full"] for t in dict.fromkeys(tasks)}
        gates[L] = {t: {"full_accuracy": float(exact[tasks == t].mean()), "gated_in": ok} for t, ok in gate.items()}
        fulls = {}
        for p in s["protocols"]:
            base = {"length": L, "kind": "baseline", "method": "full", "label": "full", "params": {}, "ratio": 1,
                    "budget": None}
            fulls[p] = measured_record(base, eps, full_meas, None, gate, p)
            fulls[p].update(full_accuracy=fulls[p]["accuracy"], bytes_ratio=1.0, relative=1.0)
            results.append(fulls[p])
        for kind, name, params, label in todo:
            for ratio in s["ratios"]:
                budget = max(1, L // ratio)
                base = {"length": L, "kind": kind, "method": name, "label": label, "params": params, "ratio": ratio,
                        "budget": budget}
                if bar is not None and hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{L} {label} {ratio}x"[:40])
                try:
                    meas = measure(model, tokenizer, fmt, eps, lambda: make_cache(
                        model, name, budget, keep=s["n_sink"], seed=s["seed"], params=params, registry=reg,
                        tokenizer=tokenizer),
                        s, stop, advance)
                except Exception as exc:  # one method failing at one setting must not end the sweep
                    warnings.warn(f"longctx: {label} (length {L}, C={budget}): {exc}", RuntimeWarning, stacklevel=2)
                    err = f"{type(exc).__name__}: {exc}"
                    results += [{**base, "protocol": p, "error": err} for p in s["protocols"]]
                    continue
                results += [measured_record(base, eps, meas, fulls[p], gate, p) for p in s["protocols"]]
    if bar is not None and hasattr(bar, "close"):
        bar.close()
    return {
        "benchmark": "longctx",
        "machine": {**machine, "load_average_end": machine_info()["load_average"]},
        "settings": {**s, "text_dir": source.where, "extra": [[n, dict(p)] for n, p in (s["extra"] or ())],
                     "methods": sorted({r["method"] for r in results if r["kind"] == "method"}),
                     "chat_template": fmt.templated},
        "gate": {str(L): g for L, g in gates.items()},
        "episodes": {str(L): [{"seed": list(ep.seed), "tokens": ep.n_tokens, "sources": list(ep.sources),
                               "questions": [{"task": q.task, "text": q.text, "refs": list(q.refs), "depth": d}
                                             for q, d in zip(ep.questions, ep.depths)]} for ep in eps]
                     for L, eps in episodes.items()},
        "results": results,
        "seconds_total": round(time.perf_counter() - t_start, 1),
    }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the longctx workload; omitted options take :data:`DEFAULTS`."""
    from .longctx_tasks import TASKS

    parser.add_argument("--quick", action="store_true", help="tiny sizes: one 512-token episode at 4x")
    parser.add_argument("--model", help="mlx-lm chat model folder or HF id (default: smollm2-135m-instruct under "
                                        "$KVCOMPRESS_MODELS_DIR or ../shared/models)")
    parser.add_argument("--text-dir", "--data", dest="text_dir",
                        help="folder of UTF-8 .txt files for the filler (default: longtext under $KVCOMPRESS_DATA_DIR "
                             "or ../shared/data; without one, kvcompress's own docstrings)")
    parser.add_argument("--tasks", type=name_list, help=f"comma list among {','.join(TASKS)} (default niah_single,qa)")
    parser.add_argument("--separate", action="store_true", default=None,
                        help="one context per task (RULER) instead of every task in one context (SCBench)")
    parser.add_argument("--lengths", type=int_list, help="context lengths in tokens (default 2048)")
    parser.add_argument("--ratios", type=int_list, help="compression ratios; budget = length // ratio (default 4)")
    parser.add_argument("--episodes", type=int, help="contexts per length (per task with --separate; default 2)")
    parser.add_argument("--protocols", type=name_list, help="blind (a copy of the context per question), turns "
                                                            "(one conversation); default both")
    parser.add_argument("--question-aware", action="store_true", default=None,
                        help="prefill context + question in one step per question (the cache sees the question)")
    parser.add_argument("--chunk", type=int, help="prefill chunk, tokens (default 512; 0 = one step)")
    parser.add_argument("--batch", type=int, help="replies generated together (default 8)")
    parser.add_argument("--n-sink", type=int, help="RotatingKVCache keep, attention sinks (default 4)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: every registered method)")
    parser.add_argument("--variant", dest="extra", type=variant, action="append", metavar="METHOD:K=V,...",
                        help="also run METHOD with these parameters, e.g. snapkv:kernel=11,recent=8 (repeatable)")
    parser.add_argument("--seed", type=int, help="seed of the episodes and of seeded methods (default 0)")
    parser.add_argument("--min-full", type=float,
                        help="average only tasks the full cache scores >= this on (default 0.8)")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false", default=None,
                        help="plain Question:/Answer: turns instead of the model's chat template")
    parser.add_argument("--no-dequantize", dest="dequantize", action="store_false", default=None,
                        help="keep a quantized model's weights quantized (slow on a CPU)")
    add_output_arguments(parser, "longctx.json/.png")


def settings_from_args(args) -> dict:
    """The settings the options give, checked (:func:`check_settings`)."""
    s = _settings_from_args(args, DEFAULTS, QUICK)
    check_settings(s)
    return s


def run(args) -> dict:
    """``kvcompress bench longctx``: run, write ``<out>/longctx.json`` (+ .png), print the tables."""
    from ._longctx_report import plot_longctx, print_gate, results_table

    warn_openblas()
    s = settings_from_args(args)
    s["model"] = _resolve_model(s["model"])
    payload = run_longctx(s, progress=True)
    print_gate(payload, plain=getattr(args, "plain", False))
    st = payload["settings"]
    title = (f"Long-context accuracy ({Path(str(st['model'])).name}, "
             f"{'question-aware' if st['question_aware'] else 'question-blind'}, higher is better)")
    return report_sweep(payload, args, "longctx", title, results_table, plot_longctx,
                        lambda r: f"length {r['length']}, {r['protocol']}, C={r['budget']}")
