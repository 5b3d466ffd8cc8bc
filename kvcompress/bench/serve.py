"""Serving: kvcompress serve against plain mlx_lm.server, N concurrent clients and one long conversation.

**Servers.** Both are started by the benchmark as subprocesses on free ports of 127.0.0.1, with
the same model and the same mlx-lm flags (``--decode-concurrency``, ``--prompt-concurrency``,
``--prefill-step-size``, ``--prompt-cache-size``; OpenBLAS preloaded in both when found):
``python -m kvcompress serve --method M --budget B ...`` (*compressed*) and ``python -m mlx_lm
server ...`` (*plain*). The model is, by default, a seeded random-weight Llama (8 layers, hidden
512, 8 query / 4 KV heads of 64, MLP 1408: the KV bytes per token of the scaling workload's
model at a quarter of its weights) saved to a temporary folder with the tokenizer of the
embedded retrieval model, so nothing is downloaded; ``--model PATH`` serves a real mlx-lm model.
Prompts are seeded haystack text of :mod:`~kvcompress.bench.retrieval_data`, cut to a token
count; answers are greedy with the special tokens banned (``logit_bias``), so every request
generates exactly its ``max_tokens``.

**Load phase** (fresh servers). One untimed warm-up round per server, then ``rounds`` rounds,
interleaved server by server (order rotated every round, so noise from other processes hits
both). In a round ``clients`` threads each stream one ``/v1/completions`` request with their own
``prompt_tokens``-token prompt (the same prompts for both servers, new ones every round) and
``new_tokens`` new tokens. Per request: time to first token (request sent to the first streamed
token); per round: aggregate tokens/s = completion tokens / wall time of the round, and the
aggregate decode rate (sum over requests of tokens after the first / time after the first).
Peak memory: the server's ``VmHWM`` (Linux; the largest sampled RSS elsewhere) at the end of the
phase, with an RSS curve sampled meanwhile. Ratios compressed / plain are paired per round.

**Conversation phase** (fresh servers). One client converses with each server, turns
alternating between them: every turn sends the whole conversation so far plus
``turn_tokens`` new tokens of text (ending on a newline, so the server's prompt cache resumes
the previous turn: ``cached_tokens`` is recorded) and gets ``answer_tokens`` back. After every
turn the server's RSS and peak are read. A server stops when its peak passes the memory limit
(``--memory-limit-mb``; default: the larger first-turn peak plus 512 MB); the phase ends when
both stopped, after ``max_turns`` turns or after ``conversation_seconds``. Reported: the longest
conversation (tokens) each server held within the limit and the RSS-vs-tokens curves. RSS is the
whole process: the weights, MLX's buffer cache and mlx-lm's LRU prompt cache (up to
``prompt_cache_size`` entries; plain mlx-lm drops an entry a longer one extends, kvcompress keeps
it since a compressed cache cannot be trimmed back to it).
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

from . import _serving as srv
from . import _serving_client as client
from ._harness import median, paired, rotate
from ._model import DTYPES, ModelShape
from ._options import add_output_arguments, at_least, options_given, out_dir
from ._report import finish, machine_info, markdown_table, print_table, warn_openblas, write_json
from ._serve_report import NAMES, caption, plot_serve, summary_table

__all__ = ["ServeSettings", "QUICK", "NAMES", "run_serve", "check_method", "summary_table", "caption", "plot_serve",
           "add_arguments", "settings_from_args", "run"]

#: The automatic memory limit: this much above the larger first-turn peak of the two servers.
AUTO_HEADROOM_MB = 512


@attrs.frozen
class ServeSettings:
    """Servers, load, conversation and model shape (defaults: the committed run, ~10 min on 2
    cores)."""

    #: an mlx-lm model folder (None: the random-weight Llama below, written to a temp folder)
    model: Optional[str] = None
    method: str = "snapkv"
    budget: int = attrs.field(default=256, validator=at_least(1))
    clients: int = attrs.field(default=8, validator=at_least(1))
    prompt_tokens: int = attrs.field(default=2048, validator=at_least(8))
    new_tokens: int = attrs.field(default=64, validator=at_least(2))
    rounds: int = attrs.field(default=3, validator=at_least(1))
    #: mlx-lm's batch sizes, the same for both servers (None: ``clients``)
    decode_concurrency: Optional[int] = attrs.field(default=None, validator=at_least(1))
    prompt_concurrency: Optional[int] = attrs.field(default=None, validator=at_least(1))
    prefill_step_size: int = attrs.field(default=512, validator=at_least(1))
    prompt_cache_size: int = attrs.field(default=10, validator=at_least(1))
    turn_tokens: int = attrs.field(default=512, validator=at_least(8))
    answer_tokens: int = attrs.field(default=16, validator=at_least(1))
    max_turns: int = attrs.field(default=40, validator=at_least(2))
    #: None: AUTO_HEADROOM_MB above the larger first-turn peak
    memory_limit_mb: Optional[int] = attrs.field(default=None, validator=at_least(1))
    #: no new round (turn) starts after this many seconds of the load (conversation) phase
    load_seconds: int = attrs.field(default=600, validator=at_least(1))
    conversation_seconds: int = attrs.field(default=360, validator=at_least(1))
    request_timeout_s: int = attrs.field(default=600, validator=at_least(1))
    startup_timeout_s: int = attrs.field(default=180, validator=at_least(1))
    sample_interval_s: float = 0.25
    warmup: bool = True
    seed: int = attrs.field(default=0, validator=at_least(0))
    dtype: str = "float32"
    n_layers: int = attrs.field(default=8, validator=at_least(1))
    hidden: int = attrs.field(default=512, validator=at_least(1))
    n_heads: int = attrs.field(default=8, validator=at_least(1))
    n_kv_heads: int = attrs.field(default=4, validator=at_least(1))
    head_dim: int = attrs.field(default=64, validator=at_least(1))
    intermediate: int = attrs.field(default=1408, validator=at_least(1))

    def __attrs_post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.prompt_tokens <= self.budget:
            raise ValueError(f"prompt_tokens must exceed the budget ({self.budget}) so that the compressed "
                             f"cache evicts, got {self.prompt_tokens}")
        if not self.sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model must be an mlx-lm model folder (with config.json), got {self.model!r}")
        self.shape()  # head counts

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    def shape(self) -> ModelShape:
        from .retrieval_data import VOCAB

        return ModelShape(dtype=self.dtype, n_layers=self.n_layers, hidden=self.hidden, n_heads=self.n_heads,
                          n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, intermediate=self.intermediate,
                          vocab=len(VOCAB), seed=self.seed, prefill_step_size=self.prefill_step_size)

    def layers(self) -> int:
        if self.model is None:
            return self.n_layers
        import json

        cfg = json.loads((Path(self.model) / "config.json").read_text())
        return int(cfg.get("num_hidden_layers") or cfg.get("text_config", {}).get("num_hidden_layers") or 1)

    def server_flags(self) -> list[str]:
        return ["--decode-concurrency", str(self.decode_concurrency or self.clients),
                "--prompt-concurrency", str(self.prompt_concurrency or self.clients),
                "--prefill-step-size", str(self.prefill_step_size), "--prompt-cache-size", str(self.prompt_cache_size),
                "--max-tokens", str(max(self.new_tokens, self.answer_tokens)), "--log-level", "WARNING"]


#: Small sizes for smoke tests and ``--quick`` (well under a minute).
QUICK = dict(
    budget=64, clients=2, prompt_tokens=128, new_tokens=4, rounds=1, prefill_step_size=32, turn_tokens=48,
    answer_tokens=4, max_turns=3, load_seconds=60, conversation_seconds=60, n_layers=2, hidden=64, n_heads=4,
    n_kv_heads=2, head_dim=16, intermediate=128,
)


def check_method(s: ServeSettings, registry=None) -> None:
    """ValueError unless the method is registered and its budget leaves room to evict at every
    layer of the served model (what ``kvcompress serve`` would refuse at start-up)."""
    from kvcompress import get_registry
    from kvcompress.cli import check_layer_budgets
    from kvcompress.errors import KVCompressError
    from kvcompress.method import build_method

    from ._caches import method_names

    method_names([s.method], registry or get_registry())
    try:
        check_layer_budgets(build_method(s.method, budget=s.budget), (s.layers(),))
    except KVCompressError as exc:
        raise ValueError(f"method {s.method!r} with budget {s.budget}: {exc}") from None


@contextlib.contextmanager
def _servers(s: ServeSettings, model: str, logs: Path, phase: str, record: dict):
    """Both servers, started, healthy, and stopped on the way out (also on errors); their
    commands, pids, start-up seconds and exit status go to ``record[phase]``."""
    env = srv.server_env()
    flags = ["--model", model, *s.server_flags()]
    argv = {"compressed": [sys.executable, "-m", "kvcompress", "serve", "--method", s.method,
                           "--budget", str(s.budget), *flags],
            "plain": [sys.executable, "-m", "mlx_lm", "server", *flags]}
    procs = {n: srv.ServerProcess(n, argv[n], env, logs / f"{phase}-{n}.log") for n in NAMES}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_healthy(s.startup_timeout_s)
        yield procs
    finally:
        for p in procs.values():
            p.stop()
        record[phase] = {n: {"cmd": p.cmd, "pid": p.pid, "startup_s": p.started_s, "returncode": p.returncode}
                         for n, p in procs.items()}


def _load_phase(s, procs, tok, ban, say, t0) -> dict:
    n = s.clients
    sampler = srv.MemorySampler(list(procs.values()), s.sample_interval_s)
    sampler.start()
    try:
        if s.warmup:
            warm = [srv.haystack_text(tok, min(s.prompt_tokens, 128), s.seed * 7919 + 99_000 + i) for i in range(n)]
            for name in NAMES:
                client.load_round(procs[name].url, warm, 2, ban, s.request_timeout_s)
            say(f"warm-up done ({time.perf_counter() - t0:.0f}s)")
        rounds, start = [], time.monotonic()
        for r in range(s.rounds):
            if r and time.monotonic() - start > s.load_seconds:
                say(f"load: time limit ({s.load_seconds}s) after {r} rounds")
                break
            prompts = [srv.haystack_text(tok, s.prompt_tokens, s.seed * 7919 + 1000 * r + i) for i in range(n)]
            row: dict[str, Any] = {"round": r, "order": rotate(NAMES, r)}
            for name in row["order"]:
                m = client.load_round(procs[name].url, prompts, s.new_tokens, ban, s.request_timeout_s)
                ttft = [q["ttft_s"] for q in m["requests"]]
                m.update(ttft_p50_s=client.percentile(ttft, 50), ttft_p99_s=client.percentile(ttft, 99))
                row[name] = m
                say(f"round {r + 1}/{s.rounds} {name:>10}: {m['tok_s']:.1f} tok/s, TTFT p50 {m['ttft_p50_s']:.2f}s "
                    f"({time.perf_counter() - t0:.0f}s)")
            rounds.append(row)
    finally:
        sampler.stop()
    out: dict[str, Any] = {"rounds": rounds, "servers": {}}
    for name, p in procs.items():
        hwm = p.peak()
        ttft = [q["ttft_s"] for row in rounds for q in row[name]["requests"]]
        out["servers"][name] = {
            "tok_s": median([row[name]["tok_s"] for row in rounds]),
            "decode_tok_s": median([row[name]["decode_tok_s"] for row in rounds]),
            "ttft_p50_s": client.percentile(ttft, 50), "ttft_p99_s": client.percentile(ttft, 99),
            "peak_mb": (hwm or sampler.peak(name) or 0) / 2**20, "peak_source": "VmHWM" if hwm else "sampled RSS",
            "rss_end_mb": (p.rss() or 0) / 2**20, "rss_curve": sampler.curve(name),
        }
    pair = {k: paired([row["compressed"][k] for row in rounds], [row["plain"][k] for row in rounds])
            for k in ("tok_s", "decode_tok_s", "ttft_p50_s", "ttft_p99_s")}
    out["ratios"] = {**{f"{k}_rounds": v for k, v in pair.items()}, **{k: median(v) for k, v in pair.items()}}
    return out


def _conversation_phase(s, procs, tok, ban, say, t0) -> dict:
    text = {n: srv.haystack_text(tok, s.turn_tokens, s.seed * 7919 + 500_000) for n in NAMES}
    state = {n: {"turns": [], "fits_tokens": 0, "crossed": False, "stop_reason": None} for n in NAMES}
    limit = s.memory_limit_mb
    start = time.monotonic()
    for turn in range(s.max_turns):
        active = [n for n in rotate(NAMES, turn) if state[n]["stop_reason"] is None]
        if not active:
            break
        if turn and time.monotonic() - start > s.conversation_seconds:
            for n in active:
                state[n]["stop_reason"] = "time limit"
            say(f"conversation: time limit ({s.conversation_seconds}s) after {turn} turns")
            break
        for n in active:
            r = client.complete(procs[n].url, text[n], s.answer_tokens, ban, s.request_timeout_s)
            rss = (procs[n].rss() or 0) / 2**20
            hwm = procs[n].peak()  # None off Linux: the largest RSS read after a turn so far
            peak = hwm / 2**20 if hwm else max([rss, *(t["rss_mb"] for t in state[n]["turns"])])
            rec = {"turn": turn, "tokens": r["prompt_tokens"] + r["completion_tokens"],
                   **{k: r[k] for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "seconds")},
                   "rss_mb": rss, "peak_mb": peak}
            state[n]["turns"].append(rec)
            text[n] += r["text"] + "\n" + srv.haystack_text(tok, s.turn_tokens, s.seed * 7919 + 500_001 + turn)
        if limit is None:  # automatic: above the larger first-turn peak
            limit = math.ceil(max(state[n]["turns"][0]["peak_mb"] for n in NAMES)) + AUTO_HEADROOM_MB
        for n in active:
            rec = state[n]["turns"][-1]
            if rec["peak_mb"] > limit:
                state[n].update(crossed=True, stop_reason="memory limit")
            else:
                state[n]["fits_tokens"] = rec["tokens"]
        say(f"turn {turn + 1}/{s.max_turns}: " + ", ".join(
            f"{n} {state[n]['turns'][-1]['tokens']} tok {state[n]['turns'][-1]['rss_mb']:.0f} MB" for n in active)
            + f" (limit {limit} MB, {time.perf_counter() - t0:.0f}s)")
    for n in NAMES:
        state[n]["stop_reason"] = state[n]["stop_reason"] or "max turns"
        state[n]["rss_growth_mb_per_1k_tokens"] = _slope(state[n]["turns"])
    return {"memory_limit_mb": limit, "memory_limit_auto": s.memory_limit_mb is None, "servers": state}


def _slope(turns: list) -> Optional[float]:
    """Least-squares RSS growth (MB per 1000 conversation tokens) over the turns after the first."""
    pts = [(t["tokens"] / 1e3, t["rss_mb"]) for t in turns[1:]]
    if len(pts) < 2:
        return None
    mx_, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    var = sum((x - mx_) ** 2 for x, _ in pts)
    return sum((x - mx_) * (y - my) for x, y in pts) / var if var else None


def run_serve(settings: Optional[ServeSettings] = None, *, progress: Optional[Callable[[str], None]] = None,
              registry=None) -> dict:
    """Run both phases; return the JSON payload (``load``, ``conversation``, ``servers``,
    ``summary``). Every server started is stopped before this returns or raises."""
    s = settings or ServeSettings()
    check_method(s, registry)
    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    payload: dict[str, Any] = {"benchmark": "serve", "machine": machine_info(), "settings": s.to_dict(),
                               "servers": {}}
    with tempfile.TemporaryDirectory(prefix="kvcompress-bench-serve-") as tmp:
        tmp = Path(tmp)
        if s.model is None:
            payload["model"] = srv.write_model(s.shape(), tmp / "model")
            payload["model"]["path"] = "random-weight Llama (temporary folder)"
            model = str(tmp / "model")
        else:
            payload["model"], model = {"path": s.model, "random_weights": False}, s.model
        tok = srv.load_tokenizer(model)
        ban = srv.SPECIAL_IDS if s.model is None else sorted(tok.eos_token_ids)
        payload["banned_token_ids"] = list(ban)
        say(f"model ready ({time.perf_counter() - t0:.0f}s); starting servers")
        with _servers(s, model, tmp / "logs", "load", payload["servers"]) as procs:
            payload["load"] = _load_phase(s, procs, tok, ban, say, t0)
        with _servers(s, model, tmp / "logs", "conversation", payload["servers"]) as procs:
            payload["conversation"] = _conversation_phase(s, procs, tok, ban, say, t0)
    payload["summary"] = _summarise(payload)
    payload["machine_after"] = {"load_average": machine_info()["load_average"]}
    payload["seconds_total"] = time.perf_counter() - t0
    return payload


def _summarise(payload: dict) -> dict:
    load, conv = payload["load"], payload["conversation"]
    ls, cs = load["servers"], conv["servers"]
    growth = {n: cs[n]["rss_growth_mb_per_1k_tokens"] for n in NAMES}
    out = {
        "throughput_ratio": load["ratios"]["tok_s"], "decode_ratio": load["ratios"]["decode_tok_s"],
        "ttft_p50_ratio": load["ratios"]["ttft_p50_s"], "ttft_p99_ratio": load["ratios"]["ttft_p99_s"],
        "peak_memory_ratio": ls["compressed"]["peak_mb"] / ls["plain"]["peak_mb"],
        "memory_limit_mb": conv["memory_limit_mb"],
        "fits_tokens": {n: cs[n]["fits_tokens"] for n in NAMES},
        "crossed_limit": {n: cs[n]["crossed"] for n in NAMES},
        "rss_growth_mb_per_1k_tokens": growth,
        "cached_tokens_later_turns": {n: [t["cached_tokens"] for t in cs[n]["turns"][1:]] for n in NAMES},
    }
    out["throughput_target_met"] = out["throughput_ratio"] >= 0.9
    if growth["compressed"] is not None and growth["plain"]:
        # "flat": grows by at most a tenth of what the plain server grows per conversation token
        out["memory_flat"] = growth["compressed"] <= 0.1 * abs(growth["plain"])
    return out


# ------------------------------------------------------------------------------------------------
# Command line (``kvcompress bench serve``)
# ------------------------------------------------------------------------------------------------

_OPTIONS = ("model", "method", "budget", "clients", "prompt_tokens", "new_tokens", "rounds", "decode_concurrency",
            "prompt_concurrency", "prefill_step_size", "prompt_cache_size", "turn_tokens", "answer_tokens",
            "max_turns", "memory_limit_mb", "load_seconds", "conversation_seconds", "n_layers", "hidden", "n_heads",
            "n_kv_heads", "intermediate", "dtype", "seed")


def add_arguments(parser) -> None:
    """Options of the serve workload (defaults: :class:`ServeSettings`)."""
    d = ServeSettings.__attrs_attrs__
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 clients, 3 turns (seconds)")
    parser.add_argument("--model", help="an mlx-lm model folder (default: a random-weight Llama, no download)")
    parser.add_argument("--method", help=f"kvcompress method of the compressed server (default {d.method.default})")
    parser.add_argument("--budget", type=int, help=f"tokens kept per layer (default {d.budget.default})")
    parser.add_argument("--clients", type=int, help=f"concurrent clients (default {d.clients.default})")
    parser.add_argument("--prompt-tokens", type=int, help=f"tokens per client prompt (default {d.prompt_tokens.default})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens generated per request (default {d.new_tokens.default})")
    parser.add_argument("--rounds", type=int, help=f"timed rounds per server (default {d.rounds.default})")
    parser.add_argument("--decode-concurrency", type=int, help="mlx-lm batch size of both servers (default: clients)")
    parser.add_argument("--prompt-concurrency", type=int, help="mlx-lm prefill batch of both servers (default: clients)")
    parser.add_argument("--prefill-step-size", type=int, help=f"prefill chunk (default {d.prefill_step_size.default})")
    parser.add_argument("--prompt-cache-size", type=int,
                        help=f"mlx-lm LRU prompt-cache entries (default {d.prompt_cache_size.default})")
    parser.add_argument("--turn-tokens", type=int, help=f"new text per conversation turn (default {d.turn_tokens.default})")
    parser.add_argument("--answer-tokens", type=int, help=f"answer per turn (default {d.answer_tokens.default})")
    parser.add_argument("--max-turns", type=int, help=f"conversation turns at most (default {d.max_turns.default})")
    parser.add_argument("--memory-limit-mb", type=int, help="server memory limit of the conversation "
                        f"(default: the larger first-turn peak + {AUTO_HEADROOM_MB} MB)")
    parser.add_argument("--load-seconds", type=int, help=f"no new round after this (default {d.load_seconds.default})")
    parser.add_argument("--conversation-seconds", type=int,
                        help=f"no new turn after this (default {d.conversation_seconds.default})")
    parser.add_argument("--n-layers", type=int, help=f"layers of the random model (default {d.n_layers.default})")
    parser.add_argument("--hidden", type=int, help=f"hidden size of the random model (default {d.hidden.default})")
    parser.add_argument("--n-heads", type=int, help=f"query heads of the random model (default {d.n_heads.default})")
    parser.add_argument("--n-kv-heads", type=int, help=f"KV heads of the random model (default {d.n_kv_heads.default})")
    parser.add_argument("--intermediate", type=int, help=f"MLP size of the random model (default {d.intermediate.default})")
    parser.add_argument("--dtype", choices=DTYPES, help="weights of the random model (default float32)")
    parser.add_argument("--seed", type=int, help="model and prompt seed (default 0)")
    add_output_arguments(parser, "serve.json / serve.png")
    parser.add_argument("--out-name", default="serve", help="file stem of the outputs (default: serve)")


def settings_from_args(args) -> ServeSettings:
    return ServeSettings(**options_given(args, _OPTIONS, QUICK))


def run(args) -> dict:
    """Run from parsed arguments; write ``<out>/<name>.json`` (+ .png); print the table."""
    settings = settings_from_args(args)
    check_method(settings)
    warn_openblas()
    payload = run_serve(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
    json_path = write_json(out_dir(args) / f"{getattr(args, 'out_name', None) or 'serve'}.json", payload)
    s = payload["settings"]
    cols, rows = summary_table(payload)
    print_table(f"Serving: kvcompress serve ({s['method']}, budget {s['budget']}) vs mlx_lm.server, "
                f"{s['clients']} clients x {s['prompt_tokens']} tokens", cols, rows, plain=getattr(args, "plain", False))
    if getattr(args, "markdown", False):
        print(markdown_table(cols, rows))
    finish(payload, json_path, plot_serve, args)
    return payload
