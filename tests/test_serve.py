"""``kvcompress serve`` as a user runs it: a subprocess on 127.0.0.1, talked to over HTTP.

The server generates with mlx-lm's machinery, every cache compressed (h2o, budget 64, so long requests evict).
Requests are bounded in number and time; the server is stopped at the end of the module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import models_dir

METHOD = ["--method", "h2o", "--budget", "64"]
PROMPTS = [f"Once upon a time there was a {w}" for w in ("cat", "dog", "bird", "girl", "boy", "king", "frog", "tree")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd(*args) -> list:
    return [sys.executable, "-m", "kvcompress", "serve", *args]


@pytest.fixture(scope="module")
def server():
    model = models_dir() / "stories260K"
    if not (model / "config.json").exists():
        pytest.skip(f"trained model not found at {model}; set KVCOMPRESS_MODELS_DIR")
    port = _free_port()
    proc = subprocess.Popen(
        _serve_cmd("--model", str(model), *METHOD, "--host", "127.0.0.1", "--port", str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"kvcompress serve exited early:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("kvcompress serve did not become healthy within 90 s")
    yield url, model
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _post(url: str, body) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _stream(url: str, body: dict) -> str:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def _local_greedy(model_path, prompt: str, n: int) -> str:
    """What ``kvcompress generate`` produces for the same prompt and method (no chat template)."""
    import mlx_lm

    import kvcompress

    model, tok = mlx_lm.load(str(model_path))
    cache = kvcompress.make_prompt_cache(model, "h2o", budget=64)
    return mlx_lm.generate(model, tok, tok.encode(prompt), max_tokens=n, prompt_cache=cache)


def test_concurrent_streams_equal_generate(server):
    """Eight concurrent streaming requests are batched by the server; each greedy answer equals
    the single-sequence generation with the same compressed cache."""
    url, model = server
    out: dict = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, _stream(
            url + "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 80, "temperature": 0})))
        for i in range(len(PROMPTS))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(out) == list(range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        assert out[i] == _local_greedy(model, prompt, 80), f"request {i} differs from generate"


def test_chat_completions(server):
    url, _ = server
    body = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 16, "temperature": 0}
    status, r = _post(url + "/v1/chat/completions", body)
    assert status == 200 and r["choices"][0]["message"]["content"]
    assert _stream(url + "/v1/chat/completions", body) == r["choices"][0]["message"]["content"]


def test_conversation_prefills_only_new_tokens(server):
    """Each turn extends the previous one exactly (a newline cannot merge with the tokens around
    it); the server resumes the compressed cache of the last turn (cached_tokens = everything
    before) even after the cache has evicted (budget 64)."""
    url, _ = server
    prompt = "Once upon a time, in a small village"
    seen = 0
    for turn in range(3):
        status, r = _post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0})
        assert status == 200
        usage = r["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if turn:
            assert cached == seen, f"turn {turn}: reused {cached} of the {seen} tokens already seen"
            assert usage["prompt_tokens"] - cached <= 4  # only the new words are prefilled
        assert usage["completion_tokens"] == 40
        seen = usage["prompt_tokens"] + usage["completion_tokens"]
        prompt = prompt + r["choices"][0]["text"] + "\nThen"
    assert seen > 64 * 2  # the conversation is far longer than the budget


def test_bad_requests_get_http_errors_and_the_server_keeps_serving(server):
    url, _ = server
    for body, code in [
        ("{not json", 400),
        ({"prompt": "Hi", "max_tokens": -1}, 400),
        ({"messages": "x"}, 400),
        ({"prompt": "Hi", "model": "/no/such/model"}, 404),
    ]:
        status, r = _post(url + "/v1/completions", body)
        assert status == code and "error" in r
    status, r = _post(url + "/v1/completions", {"prompt": "Once", "max_tokens": 4})
    assert status == 200 and r["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "snapvk"], "did you mean 'snapkv'"),
        (["--kv-bits", "7"], "--kv-bits 7: kv_bits must be one of 2, 3, 4, 5, 6, 8"),
        (["--kv-bits", "4"], "kv_group_size 64 does not divide the model's key head dimension 8"),
        (["--quantized-kv-start", "0"], "--quantized-kv-start is mlx-lm's"),
        (["--method", "h2o", "--budget", "0"], "--budget"),
        (["--method", "h2o", "--budget", "3"], "budget 3 leaves no room to evict"),
        (["--model", "/no/such/model"], "cannot load --model"),
    ],
)
def test_bad_flags_are_refused_at_start_up(args, message):
    model = models_dir() / "stories260K"
    if "--model" not in args:
        if not (model / "config.json").exists():
            pytest.skip("trained model not found")
        args = ["--model", str(model), *args]
    r = subprocess.run(_serve_cmd(*args, "--port", str(_free_port())), capture_output=True, text=True,
                       timeout=120, env={**os.environ, "KVCOMPRESS_NO_BLAS_REEXEC": "1"})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("kvcompress serve: error:") and message in lines[-1]
    assert "Traceback" not in r.stderr


def test_unsupported_mlx_lm_is_refused(monkeypatch):
    import mlx_lm

    from kvcompress import KVCompressError
    from kvcompress.mlxlm.server import check_mlx_lm

    monkeypatch.setattr(mlx_lm, "__version__", "0.19.3")
    with pytest.raises(KVCompressError, match="mlx-lm 0.19.3 is not supported"):
        check_mlx_lm()
