"""Real ``kvcompress serve`` processes on 127.0.0.1 for the server tests.

The served model is the embedded retrieval model (a trained 2-layer Llama, 72-word vocabulary)
copied to a temporary folder with a small chat template, so nothing is downloaded and the
shared models are not needed; the server runs with ``HF_HOME`` pointing at a folder that does
not exist (a machine without a Hugging Face cache).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvcompress.bench import _serving as srv

#: what every served request bans (pad, BOS, EOS) when it must generate exactly max_tokens
BAN = {str(i): -1e9 for i in srv.SPECIAL_IDS}
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a {% endif %}")


def write_model(folder: Path) -> Path:
    """The retrieval model with a chat template, in ``folder``."""
    shutil.copytree(srv.ASSET, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(chat_template=TEMPLATE, model_max_length=1 << 20)
    cfg_path.write_text(json.dumps(cfg))
    return folder


def start(tmp: Path, model: Path, *flags: str, method=("--method", "h2o", "--budget", "32"),
          timeout_s: float = 120) -> srv.ServerProcess:
    """A started, healthy ``kvcompress serve`` (stop it with ``.stop()``)."""
    env = srv.server_env()
    env["HF_HOME"] = str(tmp / "no-hf-home")
    env["HF_HUB_CACHE"] = str(tmp / "no-hf-home" / "hub")
    argv = [sys.executable, "-m", "kvcompress", "serve", "--model", str(model), *method, "--log-level", "WARNING",
            *flags]
    p = srv.ServerProcess("kvcompress", argv, env, tmp / f"serve-{srv.free_port()}.log").start()
    try:
        p.wait_healthy(timeout_s)
    except BaseException:
        p.stop()
        raise
    return p


def post(url: str, body, timeout: float = 60) -> tuple[int, dict, Any]:
    """``(status, JSON body, headers)`` of a POST."""
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), e.headers


def get(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks the process has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def busy_ticks(pid: int, seconds: float) -> int:
    a = cpu_ticks(pid)
    time.sleep(seconds)
    return cpu_ticks(pid) - a
