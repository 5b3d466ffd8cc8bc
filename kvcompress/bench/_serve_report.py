"""The report of ``kvcompress bench serve``: the ratio table, the plot and its caption."""

from __future__ import annotations

from typing import Any

from ._report import caption as _caption
from ._report import pyplot, save_plot

__all__ = ["NAMES", "summary_table", "caption", "plot_serve"]

#: The two servers: kvcompress serve, and mlx-lm's own.
NAMES = ("compressed", "plain")


def summary_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per measurement: compressed, plain, compressed / plain."""
    ls, cs, sm = payload["load"]["servers"], payload["conversation"]["servers"], payload["summary"]
    ratio = payload["load"]["ratios"]

    def row(label, key, src, r=None):
        c, p = src["compressed"][key], src["plain"][key]
        return [label, c, p, r if r is not None else (c / p if c is not None and p else None)]

    fits = [f"{cs[n]['fits_tokens']}" + ("" if cs[n]["crossed"] else "+") for n in NAMES]
    return ["measurement", "compressed", "plain", "compressed / plain"], [
        row("aggregate tokens/s (median round)", "tok_s", ls, ratio["tok_s"]),
        row("decode tokens/s (median round)", "decode_tok_s", ls, ratio["decode_tok_s"]),
        row("TTFT p50 s", "ttft_p50_s", ls),
        row("TTFT p99 s", "ttft_p99_s", ls),
        row("peak memory MB (load phase)", "peak_mb", ls),
        ["conversation tokens within the limit", *fits,
         cs["compressed"]["fits_tokens"] / cs["plain"]["fits_tokens"] if cs["plain"]["fits_tokens"] else None],
        row("RSS growth MB / 1k conversation tokens", "rss_growth_mb_per_1k_tokens", cs),
    ] + [["memory limit MB", sm["memory_limit_mb"], sm["memory_limit_mb"], None]]


def caption(payload: dict) -> str:
    s = payload["settings"]
    keys = ("method", "budget", "clients", "prompt_tokens", "new_tokens", "rounds", "prefill_step_size",
            "prompt_cache_size", "turn_tokens", "answer_tokens")
    keys += ("model",) if s["model"] else ("dtype", "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim",
                                           "intermediate")
    return _caption(payload, keys, extra=f"; memory limit {payload['conversation']['memory_limit_mb']} MB")


COLORS = {"compressed": "tab:blue", "plain": "tab:gray"}


def plot_serve(payload: dict, path):
    """Three panels: tokens/s and TTFT p50/p99 bars; peak memory bars; RSS against conversation
    tokens with the memory limit."""
    plt = pyplot()
    ls, cs = payload["load"]["servers"], payload["conversation"]["servers"]
    s = payload["settings"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    ax, ax2 = axes[0], axes[0].twinx()
    w = 0.38
    for i, n in enumerate(NAMES):
        x = [0 + (i - 0.5) * w]
        ax.bar(x, [ls[n]["tok_s"]], w, color=COLORS[n], label=n)
        ax2.bar([1 + (i - 0.5) * w, 2 + (i - 0.5) * w], [ls[n]["ttft_p50_s"], ls[n]["ttft_p99_s"]], w,
                color=COLORS[n], hatch="//", alpha=0.7)
    ax.set_xticks([0, 1, 2], ["tokens/s\n(left axis)", "TTFT p50 s\n(right axis)", "TTFT p99 s\n(right axis)"])
    ax.set_ylabel("aggregate completion tokens/s")
    ax2.set_ylabel("time to first token, s")
    ax.set_ylim(0, 1.3 * max(ls[n]["tok_s"] for n in NAMES))
    ax2.set_ylim(0, 1.3 * max(ls[n]["ttft_p99_s"] for n in NAMES))
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.set_title(f"{s['clients']} concurrent clients x {s['prompt_tokens']}-token prompts, "
                 f"{s['new_tokens']} new tokens", fontsize=10)
    axes[1].bar(list(NAMES), [ls[n]["peak_mb"] for n in NAMES], color=[COLORS[n] for n in NAMES])
    for i, n in enumerate(NAMES):
        axes[1].text(i, ls[n]["peak_mb"], f"{ls[n]['peak_mb']:.0f}", ha="center", va="bottom", fontsize=9)
    weights = payload["model"].get("weights_bytes")
    if weights:
        axes[1].axhline(weights / 2**20, color="black", ls=":", lw=1, label="model weights")
        axes[1].legend(fontsize=8)
    axes[1].set_ylim(0, 1.15 * max(ls[n]["peak_mb"] for n in NAMES))
    axes[1].set_ylabel("MB")
    axes[1].set_title(f"peak resident memory under load ({ls['plain']['peak_source']})", fontsize=10)
    for n in NAMES:
        turns = cs[n]["turns"]
        axes[2].plot([t["tokens"] for t in turns], [t["rss_mb"] for t in turns], marker="o", ms=3,
                     color=COLORS[n], label=f"{n}: {cs[n]['fits_tokens']} tokens within the limit")
    axes[2].axhline(payload["conversation"]["memory_limit_mb"], color="tab:red", ls="--", lw=1, label="memory limit")
    axes[2].set_xlabel("conversation tokens")
    axes[2].set_ylabel("server RSS MB after the turn")
    axes[2].set_title("one conversation, turn by turn", fontsize=10)
    axes[2].legend(fontsize=8)
    for a in axes:
        a.grid(alpha=0.3, axis="y")
    fig.suptitle(f"kvcompress serve ({s['method']}, budget {s['budget']}) against mlx_lm.server: "
                 f"throughput ratio {payload['summary']['throughput_ratio']:.2f}", fontsize=11)
    return save_plot(fig, path, caption(payload))
