"""The benchmark plots a person reads: every series told apart, no legend over a point.

``retrieval.png`` draws ~20 methods on each panel: each needs its own colour, marker and line
style in strong colours, series with identical results are drawn once under a joint label, and
the legend stays outside the axes. ``tune.png``'s legend hides no candidate.
"""

from __future__ import annotations

import colorsys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgb  # noqa: E402

from kvcompress.bench._styles import dodge, identical_series, series_styles  # noqa: E402

MACHINE = {"cpu": "test", "cpu_count": 2, "platform": "test", "mlx": "0", "mlx_device": "cpu", "date_utc": "2026"}


def _retrieval_payload(n_methods=20, twins=("streaming_llm", "streaming_llm_shift")):
    """20 methods on 2 panels at 2/4/8x; ``twins`` score exactly alike; several others tie at
    single points (as real runs do)."""
    rng = np.random.default_rng(0)
    names = [*twins, *[f"method_{i:02d}" for i in range(n_methods - 2)], "rotating"]
    results = []
    for task in ("passkey", "mqar"):
        results.append({"task": task, "prefill_chunk": 64, "label": "full", "kind": "full", "ratio": 1,
                        "bytes_ratio": 1.0, "accuracy": 1.0})
        for k, name in enumerate(names):
            base = 0.9 - 0.04 * (k // 2)  # pairs of methods share their 2x accuracy
            for ratio in (2, 4, 8):
                acc = round(max(base - 0.1 * np.log2(ratio), 0.0), 3)
                if name not in twins and ratio > 2:
                    acc = round(acc - 0.01 * rng.integers(0, 3), 3)
                results.append({"task": task, "prefill_chunk": 64, "label": name, "kind": "method", "ratio": ratio,
                                "bytes_ratio": ratio * (0.97 if name not in twins else 0.96), "accuracy": acc})
    settings = {"tasks": ["passkey", "mqar"], "prefill_chunks": [64], "ratios": [2, 4, 8], "model": "m",
                "context": 512, "samples": 8, "n_pairs": 8, "n_queries": 4, "n_sink": 4, "seed": 0}
    return {"benchmark": "retrieval", "machine": MACHINE, "settings": settings, "results": results}


def _series(ax):
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def _style(line):
    return (line.get_color(), line.get_marker(), str(line.get_linestyle()), str(line.get_markerfacecolor()))


def test_retrieval_series_are_told_apart_and_twins_drawn_once():
    import matplotlib.pyplot as plt

    from kvcompress.bench.retrieval import retrieval_figure

    payload = _retrieval_payload()
    fig = retrieval_figure(payload)
    try:
        fig.canvas.draw()
        for ax in fig.axes:
            lines = _series(ax)
            labels = [ln.get_label() for ln in lines]
            assert "streaming_llm = streaming_llm_shift" in labels and "streaming_llm" not in labels
            assert len(lines) == 20  # 18 methods + the twins once + rotating
            assert len({_style(ln) for ln in lines}) == len(lines), "two series share colour, marker and line"
            for ln in lines:  # strong colours: no pastel tab20 half (its lightness is ~0.75-0.85)
                if ln.get_label() != "rotating":
                    assert colorsys.rgb_to_hls(*to_rgb(ln.get_color()))[1] < 0.7, ln.get_label()
            xy = [tuple(np.round(np.concatenate([ln.get_xdata(), ln.get_ydata()]), 9)) for ln in lines]
            assert len(set(xy)) == len(xy), "a series is drawn exactly on top of another"
        (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        box = legend.get_window_extent()
        assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes), "the legend covers a panel"
        shown = [t.get_text() for t in legend.get_texts()]
        assert shown[0] == "full (KVCache)" and len(shown) == 21
        mean = {}
        for r in payload["results"]:
            mean.setdefault(r["label"], []).append(r["accuracy"])
        ranked = [n.split(" = ")[0] for n in shown[1:]]
        assert [np.mean(mean[n]) for n in ranked] == sorted((np.mean(mean[n]) for n in ranked), reverse=True)
    finally:
        plt.close(fig)


def test_series_styles_are_distinct_for_many_series():
    styles = series_styles([f"m{i}" for i in range(60)])
    keys = {(s["color"], s["marker"], s["linestyle"], s["markerfacecolor"]) for s in styles.values()}
    assert len(keys) == 60
    assert series_styles(["rotating", "a"])["rotating"]["color"] == "0.35"


def test_dodge_is_symmetric_and_small():
    f = dodge(5)
    assert f[2] == pytest.approx(1.0) and f[0] == pytest.approx(1 / f[-1]) and 0.96 < f[0] < 1.0
    assert dodge(1) == [1.0] and dodge(0) == []


def test_identical_series_groups_only_series_equal_in_every_panel():
    pts = {"a": {1: [(2.0, 0.5)], 2: [(2.0, 0.1)]}, "b": {1: [(2.001, 0.5)], 2: [(2.0, 0.1)]},
           "c": {1: [(2.0, 0.5)], 2: [(2.0, 0.2)]}}
    assert identical_series(pts) == [["a", "b"], ["c"]]


def _tune_payload(n=12):
    cands = [{"label": f"m{i}", "method": f"m{i}", "params": {}, "stage": "defaults", "gap": 0.01 * i, "se": 0.004,
              "over": i == 3, "ratio": 1.0, "bytes_vs_budget": 1.0, "seconds": 1.0} for i in range(n)]
    finals = [{"label": f"m{i}", "method": f"m{i}", "params": {}, "search_gap": 0.01 * i, "gap": 0.01 * i + 0.002,
               "se": 0.003, "ratio": 1.0, "over": False} for i in (0, 1, 2)]
    return {"candidates": cands, "finalists": finals, "winner": finals[0], "workload": {"workload": "perplexity"},
            "settings": {"model_name": "m", "budget": 64}, "machine": MACHINE}


def test_tune_legend_hides_no_point_and_stays_in_the_figure():
    import matplotlib.pyplot as plt

    from kvcompress.tune.report import tune_figure

    fig = tune_figure(_tune_payload())
    try:
        fig.canvas.draw()
        (ax,) = fig.axes
        box = ax.get_legend().get_window_extent()
        fig_box = fig.bbox
        assert box.x0 >= fig_box.x0 and box.x1 <= fig_box.x1 and box.y1 <= fig_box.y1, "the legend is cut off"
        points = [ax.transData.transform(xy) for coll in ax.collections for seg in coll.get_segments() for xy in seg]
        points += [ax.transData.transform(xy) for ln in ax.get_lines() for xy in ln.get_xydata()
                   if ln.get_marker() not in (None, "None", "")]
        assert points and not [p for p in points if box.contains(*p)], "the legend hides a point"
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["search", "winner", "held-out (finalists)", "over budget"]
    finally:
        plt.close(fig)
