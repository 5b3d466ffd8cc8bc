"""The persistent prompt cache of ``kvcompress serve --prompt-cache-dir`` without a server: the
folder (names, atomic writes, LRU eviction under the size limit, other processes' files), the
two-tier prompt cache over real compressed caches (exact round trips, misses, damaged and foreign
files), the identity of model and method, and the options."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import kvcompress
from kvcompress.errors import KVCompressError
from kvcompress.serve.cache_dir import CacheDir, parse_size
from kvcompress.serve.identity import Identity, cache_identity
from kvcompress.serve.persistent_cache import PersistentPromptCache

KEY = ("model", None, None)  # mlx-lm's model key: (path, adapter, draft)


# -- sizes and options ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, n", [("2GB", 2 * 10**9), ("500MB", 500 * 10**6), ("1.5GiB", int(1.5 * 2**30)),
                                     ("1000000", 10**6), ("10kb", 10**4), ("3 M", 3 * 10**6), ("64KiB", 65536)])
def test_sizes_in_every_documented_form(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GB", "2XB", "-1GB", "1e9", "2 GB B", "two"])
def test_a_bad_size_names_the_forms(text):
    with pytest.raises(ValueError, match="2GB, 500MB"):
        parse_size(text)


def test_the_options_parse_and_are_checked():
    from kvcompress.serve.options import check_server_args, parse_server_args

    args = parse_server_args(["--prompt-cache-dir", "/tmp/x", "--prompt-cache-dir-bytes", "2GB"])
    assert args.prompt_cache_dir == "/tmp/x" and args.prompt_cache_dir_bytes == 2 * 10**9
    assert parse_server_args([]).prompt_cache_dir is None
    for bad in ("0", "2XB"):
        with pytest.raises(SystemExit):
            parse_server_args(["--prompt-cache-dir", "d", "--prompt-cache-dir-bytes", bad])
    with pytest.raises(KVCompressError, match="give that folder too"):
        check_server_args(parse_server_args(["--prompt-cache-dir-bytes", "1GB"]))


def test_a_folder_that_cannot_hold_files_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(KVCompressError, match="cannot keep cache files there"):
        CacheDir(tmp_path / "file" / "sub", 10**6)


# -- the folder ----------------------------------------------------------------------------------
def _put(folder: CacheDir, n_tokens: int, size: int, seed: int = 0) -> str:
    tokens = np.arange(n_tokens, dtype=np.int64) + seed
    name = folder.name_for("a" * 20, tokens)
    with folder.writing(name, size) as tmp:
        tmp.write_bytes(bytes(size))
    return name


def _ours(path) -> dict:
    return {p.name: p.stat().st_size for p in path.iterdir() if p.name.startswith("kvc-")}


def test_least_recently_used_files_leave_to_keep_the_limit(tmp_path):
    folder = CacheDir(tmp_path, 3500)
    names = [_put(folder, 10 + i, 1000) for i in range(3)]
    folder.touch(names[0])  # used again: now the most recent
    (tmp_path / "notes.txt").write_bytes(bytes(5000))  # not ours: never counted, never removed
    time.sleep(0.01)
    names.append(_put(folder, 20, 1000))
    assert set(_ours(tmp_path)) == {names[0], names[2], names[3]}  # names[1] was the least recent
    assert sum(_ours(tmp_path).values()) <= 3500 and (tmp_path / "notes.txt").exists()
    assert folder.files == 3 and folder.bytes == 3000 and folder.evicted == 1
    big = np.arange(5, dtype=np.int64)
    with pytest.raises(ValueError, match="exceeds the folder's limit"):
        with folder.writing(folder.name_for("a" * 20, big), 100) as tmp:
            tmp.write_bytes(bytes(4000))  # larger than the estimate and the whole limit
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvc-tmp-")]
    assert len(_ours(tmp_path)) == 3


def test_a_lower_limit_evicts_at_start_and_stale_temporary_files_go(tmp_path):
    folder = CacheDir(tmp_path, 10**6)
    for i in range(4):
        _put(folder, 10 + i, 1000)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".kvc-tmp-{dead.pid}-ab12.safetensors"
    stale.write_bytes(bytes(100))
    live = tmp_path / f".kvc-tmp-{os.getpid()}-cd34.safetensors"
    live.write_bytes(bytes(100))
    old = time.time() - 120
    os.utime(stale, (old, old))
    os.utime(live, (old, old))
    folder = CacheDir(tmp_path, 2500)
    assert len(_ours(tmp_path)) == 2 and not stale.exists() and live.exists()  # a live writer's file stays
    assert folder.bytes == 2000


_WRITER = """
import sys, numpy as np
from kvcompress.serve.cache_dir import CacheDir
folder = CacheDir(sys.argv[1], 6000)
seed = int(sys.argv[2])
for i in range(40):
    tokens = np.arange(8 + i % 13, dtype=np.int64) * 1000 + seed
    with folder.writing(folder.name_for("b" * 20, tokens), 1000) as tmp:
        tmp.write_bytes(bytes([len(tokens) % 256]) * 1000)
"""


def test_two_processes_writing_one_folder_never_corrupt_it(tmp_path):
    """Two writers, 40 files each, a limit of 6 files: every file left is whole (its bytes are the
    ones written for its name), none is half-written, the limit holds."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(seed)]) for seed in (1, 2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    files = _ours(tmp_path)
    assert 1 <= len(files) <= 6 and sum(files.values()) <= 6000
    for name in files:
        n = int(name.split("-")[2])
        assert (tmp_path / name).read_bytes() == bytes([n % 256]) * 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kvc-tmp-")]


# -- the two-tier prompt cache -------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from conftest import tiny_llama

    return tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=3)


def _filled(model, tokens, method="h2o", budget=16):
    cache = kvcompress.make_prompt_cache(model, method, budget=budget)
    for i in range(0, len(tokens), 8):
        model(mx.array([tokens[i:i + 8]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _tier(path, identity: Identity, max_size=4, limit=10**8) -> PersistentPromptCache:
    return PersistentPromptCache(max_size, CacheDir(path, limit), lambda key: identity if key == KEY else None)


def _ident(method="h2o", budget=16, model=None) -> Identity:
    return cache_identity(model, None, kvcompress.build_method(method, budget=budget))


def _arrays(cache):
    return [np.array(x) for _, x in tree_flatten([c.state for c in cache])]


def test_a_restarted_cache_resumes_exactly_what_was_kept(llm, tmp_path):
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 97, 41)]
    ident = _ident(model=llm)
    first = _tier(tmp_path, ident)
    kept = _filled(llm, tokens)
    first.insert_cache(KEY, tokens, kept)
    assert first.pending == 1 and not _ours(tmp_path)  # written when idle, not at insert
    assert first.write_pending() == 1 and len(_ours(tmp_path)) == 1
    again = _tier(tmp_path, ident)  # a new process
    cache, rest = again.fetch_nearest_cache(KEY, tokens + [5, 6, 7])  # the conversation goes on
    assert rest == [5, 6, 7] and again.hits == 1 and again.hit_tokens == 41
    for a, b in zip(_arrays(cache), _arrays(kept)):
        np.testing.assert_array_equal(a, b)
    # the same prompt again: a loaded cache cannot drop its last token, so the exact file is not
    # used; the entry of the prompt before its last token (which the server saves) is
    assert again.fetch_nearest_cache(KEY, tokens) == (None, tokens)
    first.insert_cache(KEY, tokens[:-1], _filled(llm, tokens[:-1]))
    first.close()
    cache, rest = again.fetch_nearest_cache(KEY, tokens)
    assert rest == tokens[-1:] and cache[0].offset == 40
    assert again.fetch_nearest_cache(KEY, tokens[:30] + [1, 2]) == (None, tokens[:30] + [1, 2])  # not a prefix
    other = ("other-model", None, None)
    assert again.fetch_nearest_cache(other, tokens + [5]) == (None, tokens + [5])  # identity unknown: no reads


@pytest.mark.parametrize("other", [dict(budget=24), dict(method="snapkv"), dict(model="other weights")])
def test_a_file_is_never_used_for_another_model_method_or_budget(llm, tmp_path, other, caplog):
    from conftest import tiny_llama

    tokens = list(range(1, 41))
    ident = _ident(model=llm)
    first = _tier(tmp_path, ident)
    first.insert_cache(KEY, tokens, _filled(llm, tokens))
    first.close()
    if other.get("model"):
        other = dict(model=tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=4))
    else:
        other = dict(model=llm, **other)
    ident2 = _ident(**other)
    assert ident2.digest != ident.digest
    second = _tier(tmp_path, ident2)
    assert second.fetch_nearest_cache(KEY, tokens + [1]) == (None, tokens + [1])
    # the other server's file under this server's name: read, refused by its metadata, kept
    (name,) = _ours(tmp_path)
    mine = second.folder.name_for(ident2.digest, np.asarray(tokens, dtype=np.int64))
    os.link(tmp_path / name, tmp_path / mine)
    with caplog.at_level(logging.WARNING, "kvcompress.serve"):
        for _ in range(2):
            assert second.fetch_nearest_cache(KEY, tokens + [1]) == (None, tokens + [1])
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "another model, method, budget" in lines[0] and (tmp_path / mine).exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_damaged_file_is_skipped_with_one_line_and_removed(llm, tmp_path, damage, caplog):
    tokens = list(range(3, 43))
    ident = _ident(model=llm)
    first = _tier(tmp_path, ident)
    first.insert_cache(KEY, tokens[:20], _filled(llm, tokens[:20]))
    first.insert_cache(KEY, tokens, _filled(llm, tokens))
    first.close()
    path = tmp_path / first.folder.name_for(ident.digest, np.asarray(tokens, dtype=np.int64))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0xFF  # in the tensor data: only the digest sees it
    data = {"flip": data, "truncate": data[: len(data) // 2], "garbage": os.urandom(5000), "empty": b""}[damage]
    path.write_bytes(bytes(data))
    second = _tier(tmp_path, ident)
    with caplog.at_level(logging.WARNING, "kvcompress.serve"):
        cache, rest = second.fetch_nearest_cache(KEY, tokens + [9])
        assert cache is not None and rest == tokens[20:] + [9]  # the next best file
        second.fetch_nearest_cache(KEY, tokens + [9])
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and path.name in lines[0] and not path.exists()


def test_entries_leaving_memory_are_written_then_and_reused_ones_stay_recent(llm, tmp_path):
    ident = _ident(model=llm)
    tier = _tier(tmp_path, ident, max_size=0)  # memory keeps nothing: every entry goes straight to disk
    a, b = list(range(10, 30)), list(range(40, 60))
    tier.insert_cache(KEY, a, _filled(llm, a))
    assert tier.pending == 0 and tier.written == 1 and len(tier) == 0
    tier.insert_cache(KEY, a, _filled(llm, a))  # the same tokens again: the file is reused, not rewritten
    assert tier.written == 1
    tier = _tier(tmp_path, ident, max_size=4)
    tier.insert_cache(KEY, b, _filled(llm, b))
    tier.write_pending(busy=lambda: True)  # a request waits: nothing is written
    assert tier.pending == 1
    tier.write_pending()
    name_b = tier.folder.name_for(ident.digest, np.asarray(b, dtype=np.int64))
    old = time.time() - 1000
    os.utime(tmp_path / name_b, (old, old))
    tier.fetch_nearest_cache(KEY, b + [1])  # reused from memory
    assert (tmp_path / name_b).stat().st_mtime > old + 500  # recently used on disk too


def test_identity_follows_weights_not_paths(llm, tmp_path):
    from conftest import tiny_llama

    same = tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=3)
    assert _ident(model=same) == _ident(model=llm)
    tweaked = tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=3)
    w = tweaked.model.layers[1].mlp.down_proj.weight
    tweaked.model.layers[1].mlp.down_proj.weight = w * 1.001  # a fine-tune of the same shape
    assert _ident(model=tweaked).digest != _ident(model=llm).digest
    assert _ident(model=llm, budget=17).digest != _ident(model=llm).digest
