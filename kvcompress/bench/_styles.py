"""Series styles for plots with many methods: each one told apart by colour, marker and line.

Twenty methods on one axis defeat a colour cycle alone (and a pastel half of ``tab20`` is
unreadable on white). :func:`series_styles` gives every series its own (colour, marker, line
style, filled or hollow marker) from strong colours only; :func:`dodge` spreads series
sideways on a log axis so equal values stay visible; :func:`identical_series` finds series that
would be drawn exactly on top of each other, to be drawn once under a joint label.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

__all__ = ["BASELINE", "COLORS", "MARKERS", "LINESTYLES", "series_styles", "dodge", "identical_series"]

#: matplotlib's ``tab10`` less its grey (kept for baselines), and a navy: dark enough on white
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
          "#1a1a6e")
#: nine markers: with ten colours, colour and marker repeat together only after 90 series
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h")
LINESTYLES = ("-", "--", "-.")
#: the reference lines: the full cache and mlx-lm's RotatingKVCache
BASELINE = {"full": {"color": "black", "linestyle": ":", "linewidth": 1.0},
            "rotating": {"color": "0.35", "linestyle": (0, (5, 2)), "marker": "o", "linewidth": 1.6}}


def series_styles(labels: Sequence[str]) -> dict[str, dict]:
    """``label -> matplotlib line kwargs``: no two labels share colour, marker, line style and
    fill; the baselines keep :data:`BASELINE`'s black and grey."""
    out, k = {}, 0
    for label in labels:
        if label in BASELINE:
            out[label] = dict(BASELINE[label])
            continue
        color = COLORS[k % len(COLORS)]
        out[label] = {"color": color, "marker": MARKERS[k % len(MARKERS)],
                      "linestyle": LINESTYLES[(k // len(COLORS)) % len(LINESTYLES)],
                      "markerfacecolor": "white" if (k // len(COLORS)) % 2 else color, "markeredgecolor": color,
                      "linewidth": 1.4}
        k += 1
    return out


def dodge(n: int, spread: float = 0.08) -> list[float]:
    """``n`` horizontal factors evenly in ``2 ** [-spread / 2, spread / 2]`` (a log-2 axis): the
    k-th series is drawn at ``x * dodge(n)[k]``, so series with equal values sit side by side."""
    if n <= 1:
        return [1.0] * n
    return [2.0 ** (spread * (k / (n - 1) - 0.5)) for k in range(n)]


def identical_series(points: Mapping[str, Mapping[Hashable, Sequence[tuple]]], rel: float = 0.01) -> list[list[str]]:
    """Groups of labels whose points are the same in every panel: ``points[label][panel]`` is a
    sorted list of ``(x, y)``; equal means the same y and x within ``rel``. Each group is in the
    order of ``points``; a label alone is a group of one."""

    def same(a, b) -> bool:
        if a.keys() != b.keys():
            return False
        for panel in a:
            pa, pb = a[panel], b[panel]
            if len(pa) != len(pb):
                return False
            for (xa, ya), (xb, yb) in zip(pa, pb):
                if ya != yb or abs(xa - xb) > rel * max(abs(xa), abs(xb), 1e-12):
                    return False
        return True

    groups: list[list[str]] = []
    for label, pts in points.items():
        for g in groups:
            if same(points[g[0]], pts):
                g.append(label)
                break
        else:
            groups.append([label])
    return groups
