"""Restart: kvcompress serve --prompt-cache-dir resumes a conversation after a restart, in a bounded folder.

**Restart phase.** Server *A* (with the folder) holds one chat conversation: a first user
message of ``first_tokens`` tokens (the start of ``--text FILE``, else seeded haystack text),
then short user turns of ``turn_tokens`` tokens (the text that follows), ``answer_tokens``-token
greedy answers. After turn ``turns - 1`` A is stopped (SIGTERM: it writes what it had not
written yet). Turn ``turns`` is then sent, streamed, to server *B*, started on the same folder
(*resumed*), and to server *C*, started without it (*fresh*: the whole prompt is prefilled).
Reported: each turn's time to first token and ``cached_tokens``, A's shutdown time, the folder's
files and bytes, and ``fresh / resumed``.

**Folder phase.** One server with the folder limited to ``dir_bytes`` serves ``conversations``
conversations of ``conversation_turns`` turns (first messages of ``conversation_first_tokens``
tokens), one after another. The bytes of the cache files are sampled every 20 ms (the JSON keeps
500 points, each the largest of its stretch) and after each request; after the run the server is
restarted and the next turn of the last ``resume_check`` conversations is sent, the most recent
first (``cached_tokens``: what the folder still held for them).

Both phases start and stop their servers (127.0.0.1, free ports); every server's exit status is
recorded.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

from . import _serving as srv
from . import _serving_client as client
from ._options import add_output_arguments, at_least, options_given, out_dir
from ._report import caption, finish, machine_info, markdown_table, pyplot, print_table, save_plot, warn_openblas
from ._report import write_json

__all__ = ["RestartSettings", "QUICK", "check_method", "run_restart", "add_arguments", "run", "plot_restart"]

_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}a {% endif %}")
PHASES = ("restart", "folder")


@attrs.frozen
class RestartSettings:
    #: an mlx-lm model folder with a chat template (None: the embedded retrieval model, tiny)
    model: Optional[str] = None
    #: a text file for the user messages (None: seeded haystack text)
    text: Optional[str] = None
    method: str = "snapkv"
    budget: int = attrs.field(default=1024, validator=at_least(1))
    first_tokens: int = attrs.field(default=4000, validator=at_least(8))
    turn_tokens: int = attrs.field(default=48, validator=at_least(1))
    answer_tokens: int = attrs.field(default=32, validator=at_least(1))
    turns: int = attrs.field(default=5, validator=at_least(2))
    conversations: int = attrs.field(default=50, validator=at_least(1))
    conversation_turns: int = attrs.field(default=3, validator=at_least(1))
    conversation_first_tokens: int = attrs.field(default=256, validator=at_least(8))
    dir_bytes: int = attrs.field(default=500 * 10**6, validator=at_least(1))
    resume_check: int = attrs.field(default=5, validator=at_least(1))
    phases: tuple = attrs.field(default=PHASES, converter=tuple)
    prefill_step_size: int = attrs.field(default=512, validator=at_least(1))
    request_timeout_s: int = attrs.field(default=1800, validator=at_least(1))
    startup_timeout_s: int = attrs.field(default=300, validator=at_least(1))
    seed: int = 0

    def __attrs_post_init__(self):
        bad = [p for p in self.phases if p not in PHASES]
        if bad or not self.phases:
            raise ValueError(f"phases must be among {', '.join(PHASES)}, got {', '.join(self.phases) or 'none'}")
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model must be an mlx-lm model folder (with config.json), got {self.model!r}")
        if self.text is not None and not Path(self.text).is_file():
            raise ValueError(f"text must be a text file, got {self.text!r}")

    def to_dict(self) -> dict:
        return attrs.asdict(self)


#: Small sizes for smoke tests and ``--quick`` (seconds, the embedded model).
QUICK = dict(method="h2o", budget=48, first_tokens=160, turn_tokens=8, answer_tokens=6, turns=3, conversations=6,
             conversation_turns=2, conversation_first_tokens=40, dir_bytes=150_000, resume_check=3)


class _Text:
    """User messages: consecutive pieces of a text file, or seeded haystack text."""

    def __init__(self, tok, path: Optional[str], seed: int):
        self.tok, self.seed, self.pos = tok, seed, 0
        self.ids = tok.encode(Path(path).read_text(errors="replace")) if path else None

    def take(self, n: int) -> str:
        if self.ids is None:
            self.seed += 1
            return srv.haystack_text(self.tok, n, self.seed).strip()
        if self.pos + n > len(self.ids):
            self.pos = 0
        piece, self.pos = self.ids[self.pos:self.pos + n], self.pos + n
        return self.tok.decode(piece)


def _model(s: RestartSettings, tmp: Path) -> str:
    if s.model is not None:
        return s.model
    folder = Path(shutil.copytree(srv.ASSET, tmp / "model"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(chat_template=_TEMPLATE, model_max_length=1 << 20)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(folder)


class _Servers:
    """Start servers and keep what each was and how it ended."""

    def __init__(self, s: RestartSettings, model: str, logs: Path):
        self.s, self.model, self.logs, self.record = s, model, logs, []

    def start(self, name: str, *flags: str) -> srv.ServerProcess:
        argv = [sys.executable, "-m", "kvcompress", "serve", "--model", self.model, "--method", self.s.method,
                "--budget", str(self.s.budget), "--prefill-step-size", str(self.s.prefill_step_size),
                "--max-tokens", str(self.s.answer_tokens), "--log-level", "WARNING", *flags]
        p = srv.ServerProcess(name, argv, srv.server_env(), self.logs / f"{name}.log").start()
        try:
            p.wait_healthy(self.s.startup_timeout_s)
        except BaseException:
            p.stop()
            raise
        return p

    def stop(self, p: srv.ServerProcess) -> float:
        t0 = time.perf_counter()
        p.stop(timeout_s=120)
        seconds = time.perf_counter() - t0
        self.record.append({"name": p.name, "cmd": p.cmd, "startup_s": p.started_s, "stop_s": seconds,
                            "returncode": p.returncode})
        return seconds


def _folder_bytes(folder: Path) -> tuple[int, int]:
    """``(files, bytes)`` of the cache files in ``folder``."""
    n = total = 0
    for f in folder.iterdir():
        if f.name.startswith("kvc-"):
            try:
                total += f.stat().st_size
                n += 1
            except FileNotFoundError:
                pass
    return n, total


def _turn(p, messages, s, record: list, label: str) -> str:
    r = client.stream_chat(p.url, messages, s.answer_tokens, s.request_timeout_s)
    record.append({"server": label, **{k: v for k, v in r.items() if k != "text"}})
    return r["text"]


def _restart_phase(s, servers, tok, folder: Path, say) -> dict:
    text = _Text(tok, s.text, s.seed)
    messages = [{"role": "user", "content": text.take(s.first_tokens)}]
    turns: list = []
    a = servers.start("A", "--prompt-cache-dir", str(folder))
    try:
        for t in range(s.turns - 1):
            answer = _turn(a, messages, s, turns, "A")
            say(f"restart: turn {t + 1} on A: TTFT {turns[-1]['ttft_s']:.2f}s, {turns[-1]['cached_tokens']} of "
                f"{turns[-1]['prompt_tokens']} tokens cached")
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": text.take(s.turn_tokens)}]
    finally:
        stop_s = servers.stop(a)
    files, nbytes = _folder_bytes(folder)
    out: dict[str, Any] = {"turns": turns, "shutdown_s": stop_s, "files": files, "bytes": nbytes}
    for name, flags in (("resumed", ("--prompt-cache-dir", str(folder))), ("fresh", ())):
        p = servers.start(name, *flags)
        try:
            _turn(p, messages, s, turns, name)
        finally:
            servers.stop(p)
        out[name] = turns[-1]
        say(f"restart: turn {s.turns} on the {name} server: TTFT {turns[-1]['ttft_s']:.2f}s, "
            f"{turns[-1]['cached_tokens']} of {turns[-1]['prompt_tokens']} tokens cached")
    out["ttft_ratio_fresh_over_resumed"] = out["fresh"]["ttft_s"] / out["resumed"]["ttft_s"]
    return out


def _folder_phase(s, servers, tok, folder: Path, say) -> dict:
    text = _Text(tok, s.text, s.seed + 1000)
    convs = [[{"role": "user", "content": text.take(s.conversation_first_tokens)}] for _ in range(s.conversations)]
    samples: list = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            samples.append((time.perf_counter(), *_folder_bytes(folder)))
            time.sleep(0.02)

    flags = ("--prompt-cache-dir", str(folder), "--prompt-cache-dir-bytes", str(s.dir_bytes))
    p = servers.start("folder", *flags)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    requests: list = []
    try:
        for i, conv in enumerate(convs):
            for _ in range(s.conversation_turns):
                answer = _turn(p, conv, s, requests, "folder")
                requests[-1]["conversation"] = i
                requests[-1]["folder_files"], requests[-1]["folder_bytes"] = _folder_bytes(folder)
                conv += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": text.take(s.turn_tokens)}]
            say(f"folder: conversation {i + 1}/{s.conversations}: {requests[-1]['folder_files']} files, "
                f"{requests[-1]['folder_bytes'] / 1e6:.1f} MB of {s.dir_bytes / 1e6:.1f} MB")
        health = srv_health(p)
    finally:
        servers.stop(p)
        done.set()
        watcher.join()
    files, nbytes = _folder_bytes(folder)
    resumed: list = []
    p = servers.start("folder-restarted", *flags)
    try:
        # the most recent first: each answered turn writes files that may evict older ones
        for i in reversed(range(max(0, s.conversations - s.resume_check), s.conversations)):
            _turn(p, convs[i], s, resumed, "folder-restarted")
            resumed[-1]["conversation"] = i
    finally:
        servers.stop(p)
    peak = max([b for _, _, b in samples] + [r["folder_bytes"] for r in requests])
    return {"requests": requests, "samples": _curve(samples), "n_samples": len(samples),
            "peak_bytes": peak, "limit_bytes": s.dir_bytes, "under_limit": peak <= s.dir_bytes, "files_end": files,
            "bytes_end": nbytes, "server": health, "resumed_after_restart": resumed}


def _curve(samples: list, points: int = 500) -> list:
    """At most ``points`` of the 20 ms samples: each the largest of its stretch (peaks are kept)."""
    step = max(1, -(-len(samples) // points))
    out = []
    for i in range(0, len(samples), step):
        t, n, b = max(samples[i:i + step], key=lambda x: x[2])
        out.append({"t": t - samples[0][0], "files": n, "bytes": b})
    return out


def srv_health(p) -> dict:
    with urllib.request.urlopen(p.url + "/health", timeout=10) as r:
        return json.loads(r.read())["prompt_cache"]["dir"]


def check_method(s: RestartSettings) -> None:
    """ValueError unless the method is registered and its budget builds at the model's layers
    (what the servers would refuse at start-up)."""
    from kvcompress import get_registry
    from kvcompress.cli import check_layer_budgets
    from kvcompress.errors import KVCompressError
    from kvcompress.method import build_method

    from ._caches import method_names

    method_names([s.method], get_registry())
    layers = 2
    if s.model is not None:
        cfg = json.loads((Path(s.model) / "config.json").read_text())
        layers = int(cfg.get("num_hidden_layers") or cfg.get("text_config", {}).get("num_hidden_layers") or 1)
    try:
        check_layer_budgets(build_method(s.method, budget=s.budget), (layers,))
    except KVCompressError as exc:
        raise ValueError(f"method {s.method!r} with budget {s.budget}: {exc}") from None


def run_restart(settings: Optional[RestartSettings] = None, *,
                progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the phases; return the JSON payload. Every server started is stopped."""
    s = settings or RestartSettings()
    check_method(s)
    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    payload: dict[str, Any] = {"benchmark": "restart", "machine": machine_info(), "settings": s.to_dict()}
    with tempfile.TemporaryDirectory(prefix="kvcompress-bench-restart-") as tmp:
        tmp = Path(tmp)
        model = _model(s, tmp)
        payload["model"] = {"path": s.model or "the embedded retrieval model (temporary copy)"}
        tok = srv.load_tokenizer(model)
        servers = _Servers(s, model, tmp / "logs")
        try:
            if "restart" in s.phases:
                payload["restart"] = _restart_phase(s, servers, tok, tmp / "restart-cache", say)
            if "folder" in s.phases:
                payload["folder"] = _folder_phase(s, servers, tok, tmp / "folder-cache", say)
        finally:
            payload["servers"] = servers.record
    payload["seconds_total"] = time.perf_counter() - t0
    return payload


def summary_table(payload: dict):
    rows = []
    if "restart" in payload:
        r = payload["restart"]
        for name in ("fresh", "resumed"):
            rows.append([f"turn {payload['settings']['turns']}, {name}: TTFT s", r[name]["ttft_s"],
                         f"{r[name]['cached_tokens']} of {r[name]['prompt_tokens']} cached"])
        rows.append(["fresh / resumed TTFT", r["ttft_ratio_fresh_over_resumed"], ""])
        rows.append(["folder after the stop: MB", r["bytes"] / 1e6, f"{r['files']} files; stop {r['shutdown_s']:.1f}s"])
    if "folder" in payload:
        f = payload["folder"]
        rows.append(["folder: peak MB (limit)", f["peak_bytes"] / 1e6, f"limit {f['limit_bytes'] / 1e6:.1f} MB, "
                     f"{'under' if f['under_limit'] else 'OVER'}; {f['server']['written']} written, "
                     f"{f['server']['evicted']} evicted"])
        got = [q["cached_tokens"] for q in f["resumed_after_restart"]]
        rows.append(["after a restart: cached tokens of the last conversations", sum(got), " ".join(map(str, got))])
    return ["measurement", "value", "detail"], rows


def plot_restart(payload: dict, path):
    plt = pyplot()
    panels = [k for k in PHASES if k in payload]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.8), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "restart":
            r = payload["restart"]
            labels = ["turn 1\nA (prefill)"] + [f"turn {i + 2}\nA (memory)" for i in range(len(r["turns"]) - 3)]
            labels += ["resumed\n(restart)", "fresh\n(no folder)"]
            ax.bar(labels, [t["ttft_s"] for t in r["turns"]],
                   color=["tab:gray"] * (len(labels) - 2) + ["tab:blue", "tab:red"])
            ax.set_ylabel("time to first token, s")
            ax.set_title(f"turn {payload['settings']['turns']} after a restart: fresh / resumed = "
                         f"{r['ttft_ratio_fresh_over_resumed']:.1f}x", fontsize=10)
        else:
            f = payload["folder"]
            ax.plot([x["t"] for x in f["samples"]], [x["bytes"] / 1e6 for x in f["samples"]], lw=1, label="cache files")
            ax.axhline(f["limit_bytes"] / 1e6, color="tab:red", ls="--", lw=1, label="--prompt-cache-dir-bytes")
            ax.set_xlabel("seconds")
            ax.set_ylabel("MB in the folder")
            ax.set_title(f"{payload['settings']['conversations']} conversations: peak "
                         f"{f['peak_bytes'] / 1e6:.1f} MB", fontsize=10)
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    keys = ("method", "budget", "first_tokens", "turn_tokens", "answer_tokens", "turns", "conversations",
            "conversation_turns", "dir_bytes", "model")
    return save_plot(fig, path, caption(payload, keys))


_OPTIONS = ("model", "text", "method", "budget", "first_tokens", "turn_tokens", "answer_tokens", "turns",
            "conversations", "conversation_turns", "conversation_first_tokens", "dir_bytes", "resume_check",
            "phases", "prefill_step_size", "seed")


def add_arguments(parser) -> None:
    from ..serve.cache_dir import parse_size
    from ._options import name_list

    d = RestartSettings.__attrs_attrs__
    parser.add_argument("--quick", action="store_true", help="the embedded model, tiny sizes (seconds)")
    parser.add_argument("--model", help="an mlx-lm model folder with a chat template (default: the embedded model)")
    parser.add_argument("--text", help="a text file for the user messages (default: seeded haystack text)")
    parser.add_argument("--method", help=f"kvcompress method (default {d.method.default})")
    for name, what in (("budget", "tokens kept per layer"), ("first-tokens", "tokens of the first message"),
                       ("turn-tokens", "tokens of each later message"), ("answer-tokens", "tokens per answer"),
                       ("turns", "turns of the restart conversation (the last after the restart)"),
                       ("conversations", "conversations of the folder phase"),
                       ("conversation-turns", "turns per folder-phase conversation"),
                       ("conversation-first-tokens", "first message of a folder-phase conversation"),
                       ("resume-check", "conversations resumed after the folder phase's restart"),
                       ("prefill-step-size", "prefill chunk"), ("seed", "text seed")):
        default = getattr(d, name.replace("-", "_")).default
        parser.add_argument(f"--{name}", type=int, help=f"{what} (default {default})")
    parser.add_argument("--dir-bytes", type=parse_size, help="--prompt-cache-dir-bytes of the folder phase "
                        f"(default {d.dir_bytes.default // 10**6}MB)")
    parser.add_argument("--phases", type=name_list, help="restart, folder or both (default: both)")
    add_output_arguments(parser, "restart.json / restart.png")
    parser.add_argument("--out-name", default="restart", help="file stem of the outputs (default: restart)")


def run(args) -> dict:
    settings = RestartSettings(**options_given(args, _OPTIONS, QUICK))
    warn_openblas()
    payload = run_restart(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
    json_path = write_json(out_dir(args) / f"{getattr(args, 'out_name', None) or 'restart'}.json", payload)
    cols, rows = summary_table(payload)
    print_table(f"kvcompress serve --prompt-cache-dir ({settings.method}, budget {settings.budget})", cols, rows,
                plain=getattr(args, "plain", False))
    if getattr(args, "markdown", False):
        print(markdown_table(cols, rows))
    finish(payload, json_path, plot_restart, args)
    return payload
