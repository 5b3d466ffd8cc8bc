"""Records, tables and the frontier plot of the long-context workload (:mod:`kvcompress.bench.longctx`).

:func:`measured_record` turns one cache's replies into a result row: exact-match accuracy over
the questions of the tasks the full cache passes (the gate), its standard error
``std(ddof=1) / sqrt(n)`` over those questions, partial match, per-task and per-turn accuracy,
and the full cache's figures on the same questions beside them. ``relative`` (and, over a
conversation's later turns, ``later_relative``) = correct answers / the full cache's correct answers
on the same questions, with a 90% interval from a seeded bootstrap over episodes (questions of one
context are not independent; both caches are resampled together, so the interval is paired).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ._report import caption as _caption
from ._report import fmt, print_table, pyplot, result_labels, save_plot

__all__ = ["scores", "relative_interval", "measured_record", "results_table", "gate_table", "print_gate", "caption",
           "plot_longctx"]


def scores(episodes, answers) -> tuple[np.ndarray, np.ndarray]:
    from .longctx_tasks import score

    got = [[score(a, q.refs) for a, q in zip(row, ep.questions)] for ep, row in zip(episodes, answers)]
    return (np.array([x[0] for row in got for x in row]), np.array([x[1] for row in got for x in row]))


def _stats(exact: np.ndarray, mask: np.ndarray) -> tuple:
    x = exact[mask]
    if not len(x):
        return None, None
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
    return float(x.mean()), se


#: bootstrap draws and interval of ``relative_ci`` / ``later_relative_ci``
DRAWS, LEVEL = 2000, 0.90


def relative_interval(correct: np.ndarray, full_correct: np.ndarray) -> Optional[list]:
    """``[lo, hi]``: the central ``LEVEL`` interval of ``sum(correct) / sum(full_correct)`` over
    episodes drawn with replacement (``DRAWS`` draws, seed 0; draws where the full cache answers
    nothing are left out), from per-episode counts of correct answers; None without two episodes."""
    c, f = np.asarray(correct, float), np.asarray(full_correct, float)
    if len(c) < 2 or not f.sum():
        return None
    idx = np.random.default_rng(0).integers(0, len(c), (DRAWS, len(c)))
    den = f[idx].sum(axis=1)
    ratio = c[idx].sum(axis=1)[den > 0] / den[den > 0]
    lo, hi = np.percentile(ratio, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
    return [float(lo), float(hi)]


def _relative(exact: np.ndarray, full_exact: np.ndarray, mask: np.ndarray, at: np.ndarray) -> tuple:
    """``(relative, relative_ci)`` over the questions in ``mask`` (flat, episodes at ``at``)."""
    per = [(exact[a:b][mask[a:b]].sum(), full_exact[a:b][mask[a:b]].sum()) for a, b in zip(at[:-1], at[1:])]
    c, f = np.array(per, float).reshape(-1, 2).T
    return (float(c.sum() / f.sum()) if f.sum() else None), relative_interval(c, f)


def measured_record(base: dict, episodes, meas: dict, full: Optional[dict], gate: dict, protocol: str) -> dict:
    """One result row: accuracies (gated mean, per task, per turn), the full cache's, bytes, time."""
    exact, partial = scores(episodes, meas["answers"][protocol])
    tasks = np.array([q.task for ep in episodes for q in ep.questions])
    at = np.cumsum([0] + [len(ep.questions) for ep in episodes])  # each episode's first question
    mask = np.array([bool(gate.get(t)) for t in tasks])
    acc, se = _stats(exact, mask)
    rec = {**base, "protocol": protocol, "accuracy": acc, "accuracy_se": se,
           "partial": float(partial[mask].mean()) if mask.any() else None, "n_questions": int(mask.sum()),
           "by_task": {t: {"accuracy": float(exact[tasks == t].mean()), "partial": float(partial[tasks == t].mean()),
                           "n": int((tasks == t).sum()), "gated_in": bool(gate.get(t))} for t in dict.fromkeys(tasks)},
           "answers": meas["answers"][protocol],
           "exact": [[int(x) for x in exact[at[e]:at[e + 1]]] for e in range(len(episodes))],
           "kv_bytes": meas["kv_bytes"], "kept": meas["kept"],
           "seconds": {k: round(v, 2) for k, v in meas["seconds"].items()}}
    later_mask = None
    if protocol == "turns":  # accuracy of the t-th question asked, over episodes (gated tasks)
        later_mask = mask.copy()
        for e, o in enumerate(meas["orders"]):
            if o:
                later_mask[at[e] + o[0]] = False
        n_turns = max(len(o) for o in meas["orders"])
        by_turn = [[exact[at[e] + o[t]] for e, o in enumerate(meas["orders"]) if t < len(o) and mask[at[e] + o[t]]]
                   for t in range(n_turns)]
        rec["accuracy_by_turn"] = [float(np.mean(x)) if x else None for x in by_turn]
        later = [v for x in by_turn[1:] for v in x]
        rec["later_accuracy"] = float(np.mean(later)) if later else None
    if full is not None:
        rec["full_accuracy"] = full["accuracy"]
        rec["full_later_accuracy"] = full.get("later_accuracy")
        full_exact = np.array([v for row in full["exact"] for v in row], float)
        rec["relative"], rec["relative_ci"] = _relative(exact, full_exact, mask, at)
        if later_mask is not None:
            rec["later_relative"], rec["later_relative_ci"] = _relative(exact, full_exact, later_mask, at)
        rec["bytes_ratio"] = full["kv_bytes"] / meas["kv_bytes"] if meas["kv_bytes"] else None
    return rec


def _acc(r: dict) -> Any:
    if "error" in r:
        return "error"
    if r.get("accuracy") is None:
        return None
    se = r.get("accuracy_se")
    return f"{r['accuracy']:.3f}" + (f" ±{se:.2f}" if se is not None else "")


def results_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per (length, protocol, cache): accuracy ± s.e. per ratio, the full cache's, the
    measured bytes ratio and the seconds at the largest ratio."""
    ratios = list(payload["settings"]["ratios"])
    top = max(ratios)
    cols = ["length", "protocol", "method", *[f"{x}x" for x in ratios], "full", f"bytes ratio {top}x",
            f"later turns {top}x", f"of full {top}x (90% CI; turns: later)", f"seconds {top}x"]
    cells: dict[tuple, dict] = {}
    for r in payload["results"]:
        cells.setdefault((r["length"], r["protocol"], r["label"]), {})[r["ratio"]] = r
    rows = []
    for (length, protocol, label), by in cells.items():
        if label == "full":
            f = by[1]
            rows.append([length, protocol, label, *[_acc(f)] * len(ratios), fmt(f.get("accuracy")), 1.0,
                         f.get("later_accuracy"), None, _seconds(f)])
            continue
        t = by.get(top, {})
        full = next((x.get("full_accuracy") for x in by.values() if x.get("full_accuracy") is not None), None)
        rows.append([length, protocol, label, *[_acc(by[x]) if x in by else None for x in ratios], full,
                     t.get("bytes_ratio"), t.get("later_accuracy"), _of_full(t, protocol), _seconds(t)])
    return cols, rows


def _of_full(r: dict, protocol: str):
    """``relative [lo, hi]`` (``later_relative`` for a conversation), or None."""
    key = "later_relative" if protocol == "turns" else "relative"
    v, ci = r.get(key), r.get(key + "_ci")
    if v is None:
        return None
    return f"{v:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _seconds(r: dict):
    s = r.get("seconds")
    return round(sum(s.values()), 1) if s else None


def gate_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """The full cache's accuracy per task and length, and whether the task is averaged."""
    lengths = list(payload["gate"])
    tasks = list(dict.fromkeys(t for g in payload["gate"].values() for t in g))
    cols = ["task", *[f"full @ {L}" for L in lengths]]
    rows = []
    for t in tasks:
        cells = []
        for L in lengths:
            g = payload["gate"][L].get(t)
            cells.append(None if g is None else f"{g['full_accuracy']:.3f}" + ("" if g["gated_in"] else " (out)"))
        rows.append([t, *cells])
    return cols, rows


def print_gate(payload: dict, plain: bool = False) -> str:
    cols, rows = gate_table(payload)
    return print_table(f"Full cache per task (tasks under min_full={payload['settings']['min_full']:g} are "
                       "reported, not averaged)", cols, rows, plain=plain)


def caption(payload: dict) -> str:
    st = dict(payload["settings"])
    st["model"] = Path(str(st["model"])).name
    st["text_dir"] = Path(str(st["text_dir"])).name or st["text_dir"]
    keys = ("model", "text_dir", "tasks", "episodes", "chunk", "question_aware", "min_full", "n_sink", "seed")
    return _caption(payload, keys, settings=st,
                    lead="Exact-match accuracy of greedy replies over the tasks the full cache passes (higher is "
                         "better), against measured KV compression. ")


def plot_longctx(payload: dict, path) -> Path:
    """Accuracy against measured compression, one line per method: a panel per length and protocol."""
    plt = pyplot()
    st = payload["settings"]
    lengths = sorted({r["length"] for r in payload["results"]})
    protocols = list(dict.fromkeys(r["protocol"] for r in payload["results"]))
    labels = [m for m in result_labels(payload) if m != "full"]
    ratios = list(st["ratios"])
    fig, axes = plt.subplots(len(lengths), len(protocols), figsize=(5.2 * len(protocols) + 2.4, 3.8 * len(lengths)),
                             squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(20) if i not in (14, 15)]
    markers = "osD^v<>pPX*h"
    for i, L in enumerate(lengths):
        for j, p in enumerate(protocols):
            ax = axes[i][j]
            rs = [r for r in payload["results"] if r["length"] == L and r["protocol"] == p]
            full = next((r.get("accuracy") for r in rs if r["label"] == "full"), None)
            if full is not None:
                ax.axhline(full, color="black", linestyle=":", linewidth=1, label="full (KVCache)")
            else:
                ax.text(0.5, 0.5, f"no task passes the gate\n(full cache < {st['min_full']:g} on every task)",
                        transform=ax.transAxes, ha="center", va="center", fontsize=8)
            for k, lbl in enumerate(labels):
                pts = sorted((r["bytes_ratio"], r["accuracy"]) for r in rs if r["label"] == lbl
                             and r.get("accuracy") is not None and r.get("bytes_ratio"))
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=lbl, color="black" if lbl == "rotating" else colors[k % len(colors)],
                            linestyle="--" if lbl == "rotating" else ("-." if k >= len(colors) // 2 else "-"),
                            marker=markers[k % len(markers)], markersize=4, alpha=0.85)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ratios)
            ax.set_xticklabels([f"{x}x" for x in ratios])
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            ax.set_title(f"{L} tokens, {p}" + (" (question-aware)" if st.get("question_aware") else ""), fontsize=8)
            if i == len(lengths) - 1:
                ax.set_xlabel("KV memory compression, measured (full-cache bytes / cache bytes)")
            if j == 0:
                ax.set_ylabel("exact-match accuracy")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"Long-context tasks with a bounded KV cache ({Path(str(st['model'])).name}), higher is better",
                 fontsize=10)
    return save_plot(fig, path, caption(payload))
