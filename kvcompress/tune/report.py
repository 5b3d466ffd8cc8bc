"""What ``kvcompress tune`` prints and writes: the ranking, ``tune.toml``, ``tune.json``, ``tune.png``.

``tune.json`` holds ``settings``, ``machine``, the ``workload``, the full cache's reference
(``full``, ``full_heldout``: mean loss, per-item losses, bytes, kept tokens), the time
``estimates``, every ``candidates`` record (``label``, ``method``, ``params``, ``stage``, ``gap``
and ``se``: the mean paired loss difference to the full cache and its standard error,
``ratio``: the perplexity ratio, or the accuracy lost on retrieval, ``nbytes`` per sequence,
``bytes_vs_budget``: over the bytes of ``budget`` full-precision tokens, ``over``, ``seconds``;
or ``skipped`` / ``error``), ``left_out``, the held-out ``finalists``, the ``winner`` and its
``config``. ``tune.toml`` is the winner's method config, loadable by
``make_prompt_cache(model, config=...)``, ``kvcompress generate --config`` and
``kvcompress serve --config``.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any, Mapping

from kvcompress.bench._report import caption as _caption
from kvcompress.bench._report import print_table, pyplot, save_plot

__all__ = ["to_toml", "write_toml", "ranking_rows", "print_ranking", "plot_tune", "tune_figure"]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML has no value for {v!r}")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    raise ValueError(f"cannot write {v!r} ({type(v).__name__}) as a TOML parameter")


def to_toml(config: Mapping[str, Any], comment: str = "") -> str:
    """A method config ``{"method": ..., "params": {...}}`` (scalar parameters) as TOML text;
    ``comment`` lines go on top. ``tomllib.loads(to_toml(c)) == c``."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    lines += [f"{k} = {_toml_value(v)}" for k, v in config.items() if not isinstance(v, Mapping)]
    for k, v in config.items():
        if isinstance(v, Mapping):
            lines += ["", f"[{k}]", *(f"{pk} = {_toml_value(pv)}" for pk, pv in v.items())]
    text = "\n".join(lines) + "\n"
    assert tomllib.loads(text) == dict(config)  # what the readers will see
    return text


def write_toml(path, config: Mapping[str, Any], comment: str = "") -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(to_toml(config, comment))
    return p


def _pm(gap, se) -> str:
    if gap is None:
        return "-"
    return f"{gap:+.4f}" + (f" ± {se:.4f}" if se is not None else "")


def ranking_rows(payload: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per measured candidate, best search gap first; over-budget ones marked."""
    perplexity = payload["workload"]["workload"] == "perplexity"
    cols = ["#", "candidate", "stage", "gap ± se", "ppl ratio" if perplexity else "accuracy lost",
            "bytes / budget", "s"]
    done = sorted((r for r in payload["candidates"] if r.get("gap") is not None), key=lambda r: r["gap"])
    rows = []
    for i, r in enumerate(done, 1):
        rows.append([i, r["label"] + (" (over)" if r["over"] else ""), r["stage"], _pm(r["gap"], r["se"]),
                     r["ratio"], r["bytes_vs_budget"], r["seconds"]])
    return cols, rows


def finalist_rows(payload: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    perplexity = payload["workload"]["workload"] == "perplexity"
    cols = ["finalist", "search gap", "held-out gap ± se", "ppl ratio" if perplexity else "accuracy lost"]
    rows = [[f["label"] + (" (over)" if f["over"] else "") + (" <- winner" if f == payload["winner"] else ""),
             f["search_gap"], _pm(f["gap"], f["se"]), f["ratio"]] for f in payload["finalists"]]
    return cols, rows


def print_ranking(payload: Mapping[str, Any], plain: bool = False, top: int = 0) -> None:
    """The ranking (``top`` rows, 0 = all), skipped / failed / left-out candidates, finalists."""
    st = payload["settings"]
    loss = "NLL" if payload["workload"]["workload"] == "perplexity" else "error rate"
    cols, rows = ranking_rows(payload)
    shown = rows[:top] if top else rows
    print_table(f"kvcompress tune: {st['model_name']} at budget {st['budget']} (gap = {loss} - full cache's, "
                "lower is better; search items)", cols, shown, plain=plain)
    if len(shown) < len(rows):
        print(f"  ... {len(rows) - len(shown)} more in tune.json")
    for r in payload["candidates"]:
        if "skipped" in r or "error" in r:
            print(f"  {r['label']}: {r.get('skipped') or r.get('error')}")
    if payload["left_out"]:
        why = sorted({x["why"] for x in payload["left_out"]})
        print(f"  left out ({'; '.join(why)}): {len(payload['left_out'])} candidates")
        by: dict[str, list[str]] = {}
        for x in payload["left_out"]:
            method, _, params = x["label"].partition(":")
            by.setdefault(method, []).append(f"[{params}]" if x["stage"] == "combined" else params or "defaults")
        for method, what in by.items():
            print(f"    {method}: {', '.join(what)}")
    cols, rows = finalist_rows(payload)
    print_table("held-out items (the winner is picked here)", cols, rows, plain=plain)


def caption(payload: Mapping[str, Any]) -> str:
    st = {**payload["workload"], "model": payload["settings"]["model_name"], "budget": payload["settings"]["budget"],
          "tried": sum(1 for r in payload["candidates"] if r.get("gap") is not None)}
    st.pop("text", None)
    return _caption(payload, list(st), lead="kvcompress tune. ", settings=st)


def plot_tune(payload: Mapping[str, Any], path, top: int = 30) -> Path:
    """Save :func:`tune_figure` with its caption."""
    return save_plot(tune_figure(payload, top), path, caption(payload))


def tune_figure(payload: Mapping[str, Any], top: int = 30):
    """The ``top`` candidates by search gap (error bars: one standard error), the finalists'
    held-out gaps beside them, the winner in green, over-budget candidates in grey; the legend
    sits above the axes, where it hides no point."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    done = sorted((r for r in payload["candidates"] if r.get("gap") is not None), key=lambda r: r["gap"])[:top]
    held = {f["label"]: f for f in payload["finalists"]}
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.22 * max(len(done), 4)))
    ys = list(range(len(done)))[::-1]
    colors = {"search": "tab:blue", "winner": "tab:green", "over": "0.6", "held": "tab:orange"}
    for y, r in zip(ys, done):
        kind = "over" if r["over"] else ("winner" if r["label"] == payload["winner"]["label"] else "search")
        ax.errorbar(r["gap"], y, xerr=r["se"] or 0.0, fmt="o", color=colors[kind], markersize=4, capsize=2)
        if r["label"] in held:
            f = held[r["label"]]
            ax.errorbar(f["gap"], y - 0.25, xerr=f["se"] or 0.0, fmt="D", color=colors["held"], markersize=4,
                        capsize=2)
    ax.set_yticks(ys)
    ax.set_yticklabels([r["label"] + (" (over)" if r["over"] else "") for r in done], fontsize=7)
    ax.axvline(0.0, color="black", linestyle=":", linewidth=1)
    loss = "NLL" if payload["workload"]["workload"] == "perplexity" else "error rate"
    ax.set_xlabel(f"gap to the full cache ({loss}, lower is better; bars: 1 s.e.)")
    ax.grid(alpha=0.3, axis="x")
    legend = [("search", "o", colors["search"]), ("winner", "o", colors["winner"]),
              ("held-out (finalists)", "D", colors["held"])]
    if any(r["over"] for r in done):
        legend.append(("over budget", "o", colors["over"]))
    ax.legend([Line2D([], [], marker=m, color=c, linestyle="none", markersize=5) for _, m, c in legend],
              [t for t, _, _ in legend], fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(legend),
              frameon=False, borderaxespad=0.3, handletextpad=0.3, columnspacing=1.2)
    w = payload["winner"]
    fig.suptitle(f"kvcompress tune, {payload['settings']['model_name']}, budget {payload['settings']['budget']}: "
                 f"winner {w['label']}", fontsize=9)
    return fig
