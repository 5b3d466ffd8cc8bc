"""``kvcompress serve --prompt-cache-dir`` with real server processes on 127.0.0.1 (the embedded
retrieval model, h2o budget 32): conversations resumed after a restart, damaged and foreign
files, servers of another model / method / budget on the same folder, two servers writing one
folder under a size limit. Every request loop is bounded in count and time; every server is
stopped with SIGTERM and must exit with status 0."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import _serve_helpers as H
from kvcompress.bench import _serving as srv

ANSWER = 8  # tokens per answer


def _text(p, prompt: str):
    status, r, _ = H.post(p.url + "/v1/completions", {"prompt": prompt, "max_tokens": ANSWER, "temperature": 0,
                                                      "logit_bias": H.BAN})
    assert status == 200, r
    return r["choices"][0]["text"], r["usage"]


def _chat(p, messages):
    status, r, _ = H.post(p.url + "/v1/chat/completions", {"messages": messages, "max_tokens": ANSWER,
                                                           "temperature": 0, "logit_bias": H.BAN})
    assert status == 200, r
    return r["choices"][0]["message"]["content"], r["usage"]


def _cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def _idle(p, timeout_s: float = 60) -> dict:
    """The server's /health once nothing is generating and its cache files are written."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = H.get(p.url + "/health")[1]
        if not body["generations_held"] and not body["prompt_cache"]["dir"]["pending"]:
            return body
        time.sleep(0.05)
    raise AssertionError("the server did not write its cache files in time")


def _files(folder: Path) -> dict:
    return {f.name: f.stat().st_size for f in folder.iterdir() if f.name.startswith("kvc-")}


def _skipped(p) -> list:
    return [ln for ln in p.log_path.read_text(errors="replace").splitlines() if "prompt-cache-dir: skipped" in ln]


class Conversations:
    """A text conversation and a chat conversation, turn by turn."""

    def __init__(self, tok, seed: int = 0):
        self.tok, self.seed = tok, seed
        self.prompt = srv.haystack_text(tok, 60, seed)
        self.messages = [{"role": "user", "content": srv.haystack_text(tok, 60, seed + 100)}]
        self.turn = 0

    def ask(self, p):
        return _text(p, self.prompt), _chat(p, self.messages)

    def advance(self, answers) -> None:
        (text, _), (content, _) = answers
        self.turn += 1
        more = srv.haystack_text(self.tok, 6, self.seed + self.turn)
        self.prompt = self.prompt + text + " " + more
        self.messages = self.messages + [{"role": "assistant", "content": content}, {"role": "user", "content": more}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("persist-model")
    return H.write_model(tmp / "model")


@pytest.fixture(scope="module")
def after_turn_4(tmp_path_factory, model):
    """A folder as a server left it after 4 turns of two conversations (SIGTERM), the fifth turn's
    prompts, and what that server answered for them from memory."""
    tmp = tmp_path_factory.mktemp("persist")
    folder = tmp / "cache"
    conv = Conversations(srv.load_tokenizer(model))
    p = H.start(tmp, model, "--prompt-cache-dir", str(folder))
    try:
        for _ in range(4):
            conv.advance(conv.ask(p))
        _idle(p)
        kept = set(_files(folder))
        reference = conv.ask(p)  # turn 5, resumed from memory
        assert all(_cached(u) for _, u in reference)
    finally:
        assert p.stop() == 0
    for name in set(_files(folder)) - kept:  # the folder as it was before turn 5
        (folder / name).unlink()
    return folder, conv, reference


def _copy(folder: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(folder, tmp / "cache"))


def test_a_restarted_server_resumes_both_conversations_from_disk(after_turn_4, model, tmp_path):
    """Turn 5 after a restart reuses what the uninterrupted server reused (the text conversation:
    everything before the new words) and answers the same tokens."""
    folder, conv, reference = after_turn_4
    p = H.start(tmp_path, model, "--prompt-cache-dir", str(_copy(folder, tmp_path)))
    try:
        resumed = conv.ask(p)
        (_, text_usage), _ = resumed
        assert [_cached(u) for _, u in resumed] == [_cached(u) for _, u in reference]
        assert [a for a, _ in resumed] == [a for a, _ in reference]
        assert text_usage["prompt_tokens"] - _cached(text_usage) <= 8  # only the new words were prefilled
        health = _idle(p)["prompt_cache"]["dir"]
        assert health["hits"] == 2 and health["skipped"] == 0
    finally:
        assert p.stop() == 0
    assert not _skipped(p)


def test_damaged_and_foreign_files_are_skipped_with_one_line_each(after_turn_4, model, tmp_path):
    folder, conv, reference = after_turn_4
    cache = _copy(folder, tmp_path)
    files = sorted(_files(cache), key=lambda n: int(n.split("-")[2]))
    text_tokens = reference[0][1]["prompt_tokens"]
    # the file each conversation would resume from, damaged: a flipped byte, and cut in half
    best = [n for n in files if int(n.split("-")[2]) == _cached(reference[0][1])]
    best_chat = [n for n in files if int(n.split("-")[2]) == _cached(reference[1][1])]
    assert len(best) == 1 and len(best_chat) == 1
    data = bytearray((cache / best[0]).read_bytes())
    data[-50] ^= 0x55
    (cache / best[0]).write_bytes(bytes(data))
    data = (cache / best_chat[0]).read_bytes()
    (cache / best_chat[0]).write_bytes(data[: len(data) // 2])
    (cache / "notes.txt").write_text("not a cache file")
    (cache / "other.safetensors").write_bytes(b"\x00" * 64)
    p = H.start(tmp_path, model, "--prompt-cache-dir", str(cache))
    try:
        (text, text_usage), (content, chat_usage) = conv.ask(p)  # served from the next best files
        assert text and content
        assert 0 < _cached(text_usage) < _cached(reference[0][1]) <= text_tokens
        assert _idle(p)["prompt_cache"]["dir"]["skipped"] == 2
    finally:
        assert p.stop() == 0
    lines = _skipped(p)
    assert len(lines) == 2 and any(best[0] in ln for ln in lines) and any(best_chat[0] in ln for ln in lines)
    assert all("removed" in ln for ln in lines)
    assert not (cache / best[0]).exists() and (cache / "notes.txt").exists() and (cache / "other.safetensors").exists()


def _other_model(model: Path, tmp: Path) -> Path:
    """The retrieval model with one weight matrix scaled by 1.01: same shapes, other weights."""
    import mlx.core as mx

    other = Path(shutil.copytree(model, tmp / "other-model"))
    weights = mx.load(str(other / "model.safetensors"))
    name = sorted(k for k in weights if k.endswith("down_proj.weight"))[0]
    weights[name] = weights[name] * 1.01
    mx.save_safetensors(str(other / "model.safetensors"), weights)
    return other


@pytest.mark.parametrize("other", ["budget", "method", "model"])
def test_files_of_another_model_method_or_budget_are_never_used(after_turn_4, model, tmp_path, other):
    folder, conv, _ = after_turn_4
    cache = _copy(folder, tmp_path)
    before = set(_files(cache))
    method = {"budget": ("--method", "h2o", "--budget", "48"), "method": ("--method", "tova", "--budget", "32"),
              "model": ("--method", "h2o", "--budget", "32")}[other]
    served = _other_model(model, tmp_path) if other == "model" else model
    p = H.start(tmp_path, served, "--prompt-cache-dir", str(cache), method=method)
    try:
        assert [_cached(u) for _, u in conv.ask(p)] == [0, 0]
        _idle(p)
    finally:
        assert p.stop() == 0
    after = set(_files(cache))
    assert before < after  # the others' files stay; this server wrote its own
    assert len({n.split("-")[1] for n in after}) == 2 and not _skipped(p)


def test_two_servers_on_one_folder_keep_it_whole_and_under_its_limit(model, tmp_path):
    import kvcompress

    folder, limit = tmp_path / "cache", 200_000  # about 6 files
    tok = srv.load_tokenizer(model)
    servers = [H.start(tmp_path, model, "--prompt-cache-dir", str(folder), "--prompt-cache-dir-bytes", str(limit))
               for _ in range(2)]
    convs = [Conversations(tok, seed) for seed in range(0, 60, 10)]
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], sum(_files(folder).values()))
            except FileNotFoundError:  # a file removed between listing and stat
                pass
            time.sleep(0.01)

    def talk(i):
        for _ in range(3):
            convs[i].advance(convs[i].ask(servers[i % 2]))

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(convs))]
    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads)
    finally:
        done.set()
        watcher.join()
        assert [s.stop() for s in servers] == [0, 0]
    files = _files(folder)
    assert 0 < sum(files.values()) <= limit and peak[0] <= limit
    assert not [f for f in folder.iterdir() if f.name.startswith(".kvc-tmp-")]
    held = []
    for name in files:  # every file whole, holding what its name says
        _, meta = kvcompress.load_prompt_cache(str(folder / name), return_metadata=True)
        held.append(json.loads(meta["kvcompress_serve_tokens"]))
        assert len(held[-1]) == int(name.split("-")[2])
    # a third server resumes each conversation from the longest file its next prompt extends
    # (a larger limit: its own files must not evict the ones asked for)
    expect = []
    for c in convs:
        prompts = (tok.encode(c.prompt), tok.apply_chat_template(c.messages, add_generation_prompt=True))
        expect.append([max((len(t) for t in held if len(t) < len(q) and q[:len(t)] == t), default=0) for q in prompts])
    assert any(any(e) for e in expect)
    third = H.start(tmp_path, model, "--prompt-cache-dir", str(folder))
    try:
        assert [[_cached(u) for _, u in c.ask(third)] for c in convs] == expect
    finally:
        assert third.stop() == 0
    assert not _skipped(third) and not any(_skipped(s) for s in servers)


@pytest.mark.parametrize("flags, message", [
    (["--prompt-cache-dir", "{file}/sub"], "cannot keep cache files there"),
    (["--prompt-cache-dir", "{tmp}", "--prompt-cache-dir-bytes", "2XB"], "expected a size such as 2GB"),
    (["--prompt-cache-dir-bytes", "1GB"], "give that folder too"),
])
def test_an_unusable_folder_or_limit_is_a_one_line_error(model, tmp_path, flags, message):
    (tmp_path / "file").write_text("x")
    flags = [f.format(file=tmp_path / "file", tmp=tmp_path) for f in flags]
    r = subprocess.run([sys.executable, "-m", "kvcompress", "serve", "--model", str(model), "--method", "h2o",
                        "--budget", "32", "--port", str(srv.free_port()), *flags], capture_output=True, text=True,
                       timeout=120, env=srv.server_env())
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert message in [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
