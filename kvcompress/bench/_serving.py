"""The moving parts of ``kvcompress bench serve``: the served model folder, prompts, server
processes and their memory.

* :func:`write_model` -- a seeded random-weight mlx-lm Llama saved as a model folder with the
  tokenizer of the embedded retrieval model (72 symbols), so nothing is downloaded.
* :func:`haystack_text` -- seeded filler text of the retrieval haystack, cut to a token count.
* :class:`ServerProcess` -- one server subprocess on 127.0.0.1: started, waited for (``/health``,
  with a deadline), its resident memory read (``VmRSS`` / ``VmHWM`` from ``/proc`` on Linux,
  ``ps -o rss=`` elsewhere), stopped (terminate, then kill).
* :class:`MemorySampler` -- a thread sampling the servers' RSS until stopped.

The HTTP clients are in :mod:`._serving_client`.

Every process started here is stopped by :meth:`ServerProcess.stop`
(which callers run in ``finally``) and, on Linux, also receives SIGTERM if this process dies.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "ASSET",
    "SPECIAL_IDS",
    "write_model",
    "load_tokenizer",
    "haystack_text",
    "free_port",
    "server_env",
    "ServerProcess",
    "MemorySampler",
]

#: The embedded retrieval model, whose tokenizer the random-weight served model borrows.
ASSET = Path(__file__).resolve().parents[1] / "assets" / "retrieval"
#: ``<pad>``, ``<s>``, ``</s>`` of that tokenizer: banned from the answers (``logit_bias``) so every
#: request generates exactly ``max_tokens`` tokens whose text round-trips through the tokenizer.
SPECIAL_IDS = (0, 1, 2)


# ------------------------------------------------------------------------------------------------
# Model and prompts
# ------------------------------------------------------------------------------------------------


def write_model(shape, path: Path) -> dict:
    """Write a random-weight Llama of ``shape`` (a :class:`~kvcompress.bench._model.ModelShape`
    whose ``vocab`` is the retrieval tokenizer's) to ``path``; return its facts."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_config, save_model

    from ._model import build_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(shape)
    save_model(path, model)
    config = {
        "model_type": "llama", "hidden_size": shape.hidden, "num_hidden_layers": shape.n_layers,
        "intermediate_size": shape.intermediate, "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads, "head_dim": shape.head_dim, "rms_norm_eps": 1e-5,
        "vocab_size": shape.vocab, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 1 << 20, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "torch_dtype": shape.dtype,
    }
    save_config(config, path / "config.json")
    shutil.copy(ASSET / "tokenizer.json", path / "tokenizer.json")
    tok_config = json.loads((ASSET / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = 1 << 20  # no "sequence longer than" warnings
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    params = tree_flatten(model.parameters())
    return {"path": str(path), "random_weights": True, "n_params": int(sum(v.size for _, v in params)),
            "weights_bytes": int(sum(v.nbytes for _, v in params))}


def load_tokenizer(path):
    """The mlx-lm tokenizer of a model folder (what the servers encode prompts with)."""
    from mlx_lm.tokenizer_utils import load as load_tok

    return load_tok(Path(path))


def haystack_text(tokenizer, n_tokens: int, seed: int) -> str:
    """Seeded haystack sentences (:mod:`kvcompress.bench.retrieval_data`) that the server encodes
    to at most ``n_tokens`` tokens, BOS included, as close as whole words allow; ends with a
    newline so that text appended later (an answer) cannot merge with its last word."""
    import numpy as np

    from .retrieval_data import VOCAB, _haystack

    rng = np.random.default_rng(seed)
    words = [VOCAB[i] for i in _haystack(rng, max(n_tokens, 8), [])[0]]

    def count(k: int) -> int:
        return len(tokenizer.encode(" ".join(words[:k]) + "\n"))

    if count(len(words)) < n_tokens:  # a tokenizer that merges words: draw more
        while count(len(words)) < n_tokens:
            words += [VOCAB[i] for i in _haystack(rng, n_tokens, [])[0]]
    lo, hi = 1, len(words)  # the most words whose text fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(mid) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo]) + "\n"


# ------------------------------------------------------------------------------------------------
# Server processes
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    """The environment both servers run in: this one, with this checkout's kvcompress first on
    ``PYTHONPATH`` and OpenBLAS preloaded in both when it is found (``kvcompress serve`` would
    preload it itself, ``mlx_lm server`` would not: the comparison would time BLAS, not caches)."""
    from kvcompress._blas import find_openblas

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    lib = find_openblas()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env["KVCOMPRESS_NO_BLAS_REEXEC"] = "1"  # same process, same pid: its memory is what we read
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM to the server if the benchmark process dies without stopping it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class ServerProcess:
    """One server subprocess on 127.0.0.1 (``argv`` gets ``--host``/``--port`` appended), its
    output in ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], env: dict, log_path: Path):
        self.name, self.argv, self.env, self.log_path = name, list(argv), env, Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.returncode: Optional[int] = None
        self.started_s = 0.0

    @property
    def cmd(self) -> list:
        return [*self.argv, "--host", "127.0.0.1", "--port", str(self.port)]

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self._t0 = time.perf_counter()
        return self

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``/health`` until 200 or ``timeout_s``; seconds from start. RuntimeError (with
        the end of the server's log) if it exits or does not become healthy in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with status {self.proc.returncode} "
                                   f"before becoming healthy:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.started_s = time.perf_counter() - self._t0
                        return self.started_s
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{self.name} server was not healthy within {timeout_s:.0f} s:\n{self.log_tail()}")

    def _status(self) -> dict:
        out = {}
        try:
            with open(f"/proc/{self.pid}/status") as fh:
                for line in fh:
                    if line.startswith(("VmRSS:", "VmHWM:")):
                        key, value = line.split(":", 1)
                        out[key] = int(value.split()[0]) * 1024
        except (OSError, ValueError, TypeError):
            pass
        return out

    def rss(self) -> Optional[int]:
        """Resident bytes now (None once stopped)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        status = self._status()
        if "VmRSS" in status:
            return status["VmRSS"]
        try:
            out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.pid)], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
            return int(out) * 1024 if out else None
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def peak(self) -> Optional[int]:
        """The kernel's high-water mark of resident bytes since start (Linux ``VmHWM``), or None
        where the platform has none (callers then use the largest sampled RSS)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        return self._status().get("VmHWM")

    def stop(self, timeout_s: float = 20) -> Optional[int]:
        """Terminate (then kill) the server and reap it; its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        self.returncode = self.proc.returncode
        return self.returncode


class MemorySampler(threading.Thread):
    """Samples each server's RSS every ``interval_s`` until :meth:`stop`; ``samples`` holds
    ``(seconds, {name: bytes})``."""

    def __init__(self, servers: Sequence[ServerProcess], interval_s: float):
        super().__init__(daemon=True)
        self.servers, self.interval_s = list(servers), interval_s
        self.samples: list[tuple[float, dict]] = []
        self._halt = threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.perf_counter() - self._t0, {s.name: s.rss() for s in self.servers}))
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def peak(self, name: str) -> Optional[int]:
        vals = [m[name] for _, m in self.samples if m.get(name)]
        return max(vals) if vals else None

    def curve(self, name: str, max_points: int = 400) -> dict:
        """``{"t_s": [...], "rss_mb": [...]}`` of one server, thinned to ``max_points``."""
        pts = [(t, m[name]) for t, m in self.samples if m.get(name)]
        step = max(1, -(-len(pts) // max_points))
        pts = pts[::step]
        return {"t_s": [round(t, 3) for t, _ in pts], "rss_mb": [v / 2**20 for _, v in pts]}
