"""Presentation of ``kvcompress bench synthetic`` results: the wide table, the per-scenario
markdown tables, the plot and its caption (from the JSON payload alone)."""

from __future__ import annotations

from typing import Any

from ._report import caption as _caption
from ._report import markdown_table, pyplot, result_labels, save_plot

__all__ = ["caption", "markdown_tables", "plot_synthetic", "results_table"]




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
    keys = ("batch", "n_kv_heads", "n_q_heads", "head_dim", "dtype", "n_decode", "n_probe",
            "n_clusters", "hot_frac", "p_hot", "p_recent", "seeds", "scenarios")
    return _caption(payload, keys, lead="Output perturbation = mean cosine distance between full-cache and "
                    "compressed-cache attention outputs over probe queries (lower is better). ")


def plot_synthetic(payload: dict, path) -> Any:
    """One panel per (scenario, sequence length): perturbation vs budget, one line per variant."""
    plt = pyplot()
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
    return save_plot(fig, path, caption(payload))


def markdown_tables(payload: dict) -> str:
    """Per scenario, a markdown table: one row per method variant, one column per (T, C);
    the lowest perturbation of each column in bold, ``n/a`` where the method could not run."""
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
