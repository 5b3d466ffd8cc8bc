"""Decode and prefill speed of compressed caches against mlx-lm's ``RotatingKVCache``.

**Workload.** The random-weight Llama of :mod:`kvcompress.bench._model` (default 8 layers,
hidden 1024, 16 query / 4 KV heads, head_dim 64, MLP 2816, vocab 32000) generates from a seeded
random prompt of ``context`` tokens through ``mlx_lm.generate.generate_step`` -- the chunked
prefill (``prefill_step_size``) and pipelined decode loop ``mlx_lm.generate`` uses. For each
cache kind:

* ``prefill_s``: time to the first token (the chunked prefill plus the step of the last prompt
  token);
* ``decode_tok_s``: ``decode_tokens / t`` for the next ``decode_tokens`` tokens.

Kinds: every method in ``methods`` (built with ``kvcompress.make_prompt_cache(model, name,
budget=budget)``), ``rotating`` (``RotatingKVCache(budget, keep=keep)``, the reference the
targets are stated against) and ``full`` (``KVCache``). The query-observing attention wrapper is
installed once for all kinds, so every kind pays the same ``isinstance`` check.

**Protocol.** One untimed warm-up generation per kind, then ``rounds`` rounds. In a round every
kind prefills (order rotated by one per round, round-robin), then the decode of all kinds is
timed in blocks of ``decode_block`` tokens, interleaved kind by kind with the order rotated per
block (:mod:`kvcompress.bench._harness`), so bursts of load from other processes hit every kind
alike. Ratios are paired -- prefill per round, decode per (round, block) -- and the reported
ratio is their median (decode: tokens/s ratio, higher is better, target >= 0.9; prefill: time
ratio, lower is better, target <= 1.3). A method whose disposition keeps the tokens it frees
and attends them (its ``attend`` hook, e.g. KIVI's quantized store) holds every token, so its
targets are those of a full cache's replacement: decode >= 0.8x ``rotating`` and prefill <= 2x
``full`` (``prefill_ratio_full``, paired per round, whenever ``full`` runs). The same ratios in
CPU seconds of this process are reported alongside as a cross-check.

**Profile** (:func:`~kvcompress.bench._profile.profile_decode`): where the decode time of the
compressed caches goes. **dtype probe** (:func:`dtype_probe`): the weight dtypes compared on a
short prefill and a few decode steps.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import attrs
import mlx.core as mx

from ._caches import make_cache, method_names, stored_tokens
from ._harness import (
    interleave,
    median,
    paired,
    release,
    rotate,
    round_robin,
    start_generation,
    sync,
    sync_stepper,
    time_block,
    time_generation,
)
from ._model import DTYPES, ModelShape, build_model, random_tokens
from ._options import NameList, add_output_arguments, check_minimums, options_given, out_dir
from ._profile import profile_decode
from ._profile_report import profile_markdown, profile_table
from ._report import caption as _caption
from ._report import finish, machine_info, markdown_table, print_table, pyplot, save_plot, warn_openblas, write_json

__all__ = [
    "SpeedSettings",
    "QUICK",
    "run_speed",
    "profile_decode",
    "dtype_probe",
    "summary_table",
    "caption",
    "markdown_report",
    "plot_speed",
    "add_arguments",
    "run",
    "settings_from_args",
]


@attrs.frozen
class SpeedSettings(ModelShape):
    """Workload and protocol on top of the model shape (defaults: the committed run, ~10 min on
    2 cores)."""

    context: int = 4096
    budget: int = 512
    decode_tokens: int = 64
    #: decode is timed in blocks of this many tokens, interleaved across cache kinds
    decode_block: int = 8
    rounds: int = 3
    methods: tuple = attrs.field(default=("h2o", "cam"), converter=tuple)
    baselines: tuple = attrs.field(default=("rotating", "full"), converter=tuple)
    profile: bool = True
    #: decode steps timed per profile variant; profile prefill is 2 * budget tokens
    profile_steps: int = 24
    #: compare float32/bfloat16/float16 on a short prefill + a few decode steps first
    dtype_probe: bool = True

    def __attrs_post_init__(self):
        bad = set(self.baselines) - {"rotating", "full"}
        if bad:
            raise ValueError(f"unknown baselines {sorted(bad)}; choose from rotating, full")
        if "rotating" not in self.baselines:
            raise ValueError("the rotating baseline is required: ratios are stated against it")
        check_minimums(self.to_dict(), {"budget": 1, "decode_block": 2, "rounds": 1, "profile_steps": 1})
        if self.context <= self.budget:
            raise ValueError(f"context must exceed the budget, or nothing is ever evicted; got context "
                             f"{self.context}, budget {self.budget}")
        if self.decode_tokens < self.decode_block:
            raise ValueError(f"decode_tokens must be >= decode_block ({self.decode_block}), got {self.decode_tokens}")

    def kinds(self) -> list[str]:
        return [*self.methods, *self.baselines]


#: Small sizes for smoke tests and ``--quick``.
QUICK = dict(
    context=384, budget=128, decode_tokens=8, decode_block=4, rounds=2, prefill_step_size=128, n_layers=2,
    hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, intermediate=512, vocab=1000,
    profile_steps=6, dtype_probe=False,
)


def run_speed(
    settings: Optional[SpeedSettings] = None, *, progress: Optional[Callable[[str], None]] = None
) -> dict:
    """Run the interleaved rounds (and the profile); return the JSON payload.

    Per round: every kind prefills ``context`` tokens through ``generate_step`` (kinds in
    round-robin order), then the decode of all kinds is timed in blocks of ``decode_block``
    tokens, interleaved kind by kind (order rotated every block). ``summary[kind]``: medians of
    ``prefill_s`` and ``decode_tok_s`` and, for kinds other than ``rotating``, the medians of
    the paired ratios with ``target_met``.
    """
    from kvcompress import get_registry, install

    s = settings or SpeedSettings()
    if s.methods:
        method_names(s.methods, get_registry())  # unknown names: a ValueError before anything runs
    say = progress or (lambda m: None)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    payload: dict[str, Any] = {"benchmark": "speed", "machine": machine_info(), "settings": s.to_dict()}
    if s.dtype_probe:
        say("dtype probe ...")
        payload["dtype_probe"] = dtype_probe(s)
        say("dtype probe: " + ", ".join(
            f"{k}: prefill {v['prefill_s']:.2f}s, decode step {1e3 * v['decode_step_s']:.0f} ms"
            for k, v in payload["dtype_probe"].items()))

    model = build_model(s)
    install(model)
    prompt = random_tokens(s, s.context)
    kinds = s.kinds()
    if s.warmup:
        warm_prompt = random_tokens(s, 2 * s.budget + 9)
        for kind in kinds:
            time_generation(model, warm_prompt, make_cache(model, kind, s.budget, keep=s.keep),
                            s.prefill_step_size, 4)
            release()
        say(f"warm-up done ({time.perf_counter() - t_start:.0f}s)")

    n_blocks = s.decode_tokens // s.decode_block
    rounds = []
    for r in range(s.rounds):
        order = rotate(kinds, r)
        row: dict[str, Any] = {"order": order, "by_kind": {}}
        gens, caches = {}, {}
        for kind in order:
            caches[kind] = make_cache(model, kind, s.budget, keep=s.keep)
            gens[kind], m = start_generation(model, prompt, caches[kind], s.prefill_step_size,
                                             1 + n_blocks * s.decode_block + 1)
            m["decode_s_per_token"], m["decode_cpu_s_per_token"] = [], []
            row["by_kind"][kind] = m
            say(f"round {r + 1}/{s.rounds} {kind:>9}: prefill {m['prefill_s']:.2f}s "
                f"({time.perf_counter() - t_start:.0f}s)")
        for _, kind in round_robin(order, n_blocks):
            wall, cpu = time_block(gens[kind], s.decode_block)
            row["by_kind"][kind]["decode_s_per_token"].append(wall)
            row["by_kind"][kind]["decode_cpu_s_per_token"].append(cpu)
        for kind in order:
            m = row["by_kind"][kind]
            m["decode_tok_s"] = 1.0 / median(m["decode_s_per_token"])
            m["stored_tokens"] = stored_tokens(caches[kind][0])
            gens[kind].close()
        say(f"round {r + 1}/{s.rounds} decode tok/s: " + ", ".join(
            f"{k} {row['by_kind'][k]['decode_tok_s']:.2f}" for k in order)
            + f" ({time.perf_counter() - t_start:.0f}s)")
        del gens, caches
        release()
        rounds.append(row)
    payload["rounds"] = rounds
    payload["summary"] = _summarise(rounds, s)
    payload["machine_after_rounds"] = {"load_average": machine_info()["load_average"]}
    if s.profile:
        say("profile ...")
        payload["profile"] = profile_decode(s, model=model)
    payload["seconds_total"] = time.perf_counter() - t_start
    payload["cpu_seconds_total"] = time.process_time() - cpu_start
    return payload


def _summarise(rounds: list, s: SpeedSettings) -> dict:
    out = {}
    for kind in s.kinds():
        def per_round(key, k=kind):
            return [r["by_kind"][k][key] for r in rounds]

        def per_block(key, k=kind):  # decode ratios as speed ratios: rotating time / kind time
            return [x for r in rounds for x in paired(r["by_kind"][k][key], r["by_kind"]["rotating"][key], True)]

        rec = {
            "prefill_s_median": median(per_round("prefill_s")),
            "decode_tok_s_median": median([1.0 / t for ts in per_round("decode_s_per_token") for t in ts]),
            "prefill_s": per_round("prefill_s"),
            "decode_tok_s": per_round("decode_tok_s"),
        }
        if kind != "rotating":
            p_ratio = paired(per_round("prefill_s"), per_round("prefill_s", "rotating"))
            p_cpu = paired(per_round("prefill_cpu_s"), per_round("prefill_cpu_s", "rotating"))
            d_ratio, d_cpu = per_block("decode_s_per_token"), per_block("decode_cpu_s_per_token")
            rec.update(
                decode_ratio=median(d_ratio),
                prefill_ratio=median(p_ratio),
                decode_ratio_by_block=d_ratio,
                prefill_ratio_by_round=p_ratio,
                decode_ratio_cpu=median(d_cpu),
                prefill_ratio_cpu=median(p_cpu),
            )
            if kind in s.methods and "full" in s.kinds():
                rec["prefill_ratio_full"] = median(paired(per_round("prefill_s"), per_round("prefill_s", "full")))
            if kind in s.methods:
                rec.update(_targets(kind, rec))
        out[kind] = rec
    return out


def _keeps_every_token(name: str) -> bool:
    """Whether the method's disposition keeps the tokens it frees and attends them."""
    from kvcompress import build_method

    return "attend" in build_method(name).hooks()["disposition"]


def _targets(kind: str, rec: dict) -> dict:
    """``decode_target_met`` / ``prefill_target_met`` and the rule they were judged by."""
    if _keeps_every_token(kind):
        prefill = rec.get("prefill_ratio_full")
        return {"target_rule": "keeps every token: decode >= 0.8x rotating, prefill <= 2x full",
                "decode_target_met": rec["decode_ratio"] >= 0.8,
                "prefill_target_met": None if prefill is None else prefill <= 2.0}
    return {"target_rule": "decode >= 0.9x rotating, prefill <= 1.3x rotating",
            "decode_target_met": rec["decode_ratio"] >= 0.9, "prefill_target_met": rec["prefill_ratio"] <= 1.3}


def dtype_probe(s: SpeedSettings, prefill_tokens: int = 32, decode_steps: int = 8) -> dict:
    """Per weight dtype: seconds of a ``prefill_tokens`` forward pass, and the median decode
    step (full ``KVCache``, synchronous), the dtypes' decode steps interleaved in blocks of 2."""
    from mlx_lm.models.cache import KVCache

    out, steppers, keep = {}, {}, []
    for dt in DTYPES:
        model = build_model(s, dt)
        x = random_tokens(s, prefill_tokens)[None]
        mx.eval(model(x[:, :8], cache=[KVCache() for _ in model.layers]))  # warm-up
        cache = [KVCache() for _ in model.layers]
        sync()
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        out[dt] = {"prefill_s": time.perf_counter() - t0, "prefill_tokens": prefill_tokens}
        steppers[dt] = sync_stepper(model, cache, x[:, -1:])
        steppers[dt]()  # untimed first step
        keep.append(model)
    for dt, ts in interleave(steppers, max(1, decode_steps // 2), 2).items():
        out[dt]["decode_step_s"] = median(ts)
    del keep, steppers
    release()
    return out


# ------------------------------------------------------------------------------------------------
# Presentation
# ------------------------------------------------------------------------------------------------


def summary_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    """One row per cache kind: medians, ratios to rotating (wall and CPU), targets."""
    cols = ["cache", "prefill s (median)", "prefill / rotating", "(cpu s)", "decode tok/s (median)",
            "decode / rotating", "(cpu s)", "targets met (wall)"]
    rows = []
    for kind, rec in payload["summary"].items():
        met = "-"
        if "decode_target_met" in rec:
            vs_full = rec.get("target_rule", "").startswith("keeps")
            prefill = {True: "yes", False: "NO", None: "?"}[rec["prefill_target_met"]]
            met = ("decode yes" if rec["decode_target_met"] else "decode NO") + ", " + (
                f"prefill (vs full) {prefill}" if vs_full else f"prefill {prefill}")
        one = 1.0 if kind == "rotating" else None
        rows.append([
            kind, rec["prefill_s_median"], rec.get("prefill_ratio", one), rec.get("prefill_ratio_cpu", one),
            rec["decode_tok_s_median"], rec.get("decode_ratio", one), rec.get("decode_ratio_cpu", one), met,
        ])
    return cols, rows



def caption(payload: dict) -> str:
    keys = ("context", "budget", "keep", "decode_tokens", "decode_block", "rounds", "prefill_step_size", "dtype",
            "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")
    return _caption(payload, keys)


def plot_speed(payload: dict, path) -> Any:
    """Bars: decode tokens/s and prefill seconds per cache kind (median, with per-round points)."""
    plt = pyplot()
    summ = payload["summary"]
    kinds = list(summ)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, title in (
        (axes[0], "decode_tok_s", "decode tokens/s (higher is better)"),
        (axes[1], "prefill_s", "prefill seconds (lower is better)"),
    ):
        med = [summ[k][key + "_median"] for k in kinds]
        ax.bar(kinds, med, color=["tab:orange" if k in payload["settings"]["methods"] else "tab:gray" for k in kinds])
        for i, k in enumerate(kinds):
            ax.plot([i] * len(summ[k][key]), summ[k][key], "k.", markersize=4)
            ratio = summ[k].get("decode_ratio" if key == "decode_tok_s" else "prefill_ratio")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (i, med[i]), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Speed vs RotatingKVCache (labels: ratio to rotating, median of paired measurements; "
                 "dots: per round)", fontsize=10)
    return save_plot(fig, path, caption(payload))


def markdown_report(payload: dict) -> str:
    """Markdown tables of a speed payload: ratios, dtype probe, and the decode profile."""
    parts = [markdown_table(*summary_table(payload))]
    if "dtype_probe" in payload:
        rows = [[dt, r["prefill_s"], r["prefill_tokens"], 1e3 * r["decode_step_s"]]
                for dt, r in payload["dtype_probe"].items()]
        parts.append("Weight dtype probe (full KVCache, synchronous):\n\n" + markdown_table(
            ["weights", "prefill s", "prefill tokens", "decode step ms"], rows))
    if "profile" in payload:
        parts += profile_markdown(payload)
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------
# Command line (``kvcompress bench speed`` and ``benchmarks/speed.py``)
# ------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """Options of the speed workload (defaults: :class:`SpeedSettings`)."""
    parser.add_argument("--quick", action="store_true", help="tiny model and context (seconds)")
    parser.add_argument("--context", type=int, help="prompt tokens (default 4096)")
    parser.add_argument("--budget", type=int, help="tokens kept per layer (default 512)")
    parser.add_argument("--decode-tokens", type=int, help="decode tokens per cache and round (default 64)")
    parser.add_argument("--rounds", type=int, help="rounds (default 3)")
    parser.add_argument("--prefill-step-size", type=int, help="generate_step prefill chunk (default 512)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights (default float32)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: h2o cam)")
    parser.add_argument("--no-full", action="store_true", help="skip the full KVCache reference")
    parser.add_argument("--no-profile", action="store_true", help="skip the decode/prefill profile")
    parser.add_argument("--no-dtype-probe", action="store_true", help="skip the weight dtype probe")
    add_output_arguments(parser, "the JSON/PNG")
    parser.add_argument("--out-name", default="speed", help="file stem of the outputs (default: speed)")


def settings_from_args(args) -> SpeedSettings:
    kw = options_given(args, ("context", "budget", "decode_tokens", "rounds", "prefill_step_size", "dtype",
                              "methods"), QUICK)
    if getattr(args, "no_full", False):
        kw["baselines"] = ("rotating",)
    if getattr(args, "no_profile", False):
        kw["profile"] = False
    if getattr(args, "no_dtype_probe", False):
        kw["dtype_probe"] = False
    return SpeedSettings(**kw)


def run(args) -> dict:
    """Run the benchmark from parsed arguments; write ``<out>/<name>.json`` (+ .png); print tables."""
    settings = settings_from_args(args)
    warn_openblas()
    payload = run_speed(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
    json_path = write_json(out_dir(args) / f"{getattr(args, 'out_name', 'speed')}.json", payload)
    plain = getattr(args, "plain", False)
    print_table("Speed vs RotatingKVCache (medians; ratios paired per round / decode block)",
                *summary_table(payload), plain=plain)
    if "profile" in payload:
        print_table(f"Decode profile (context {payload['profile']['context']})", *profile_table(payload),
                    plain=plain)
    if getattr(args, "markdown", False):
        print(markdown_report(payload))
    finish(payload, json_path, plot_speed, args)
    return payload
