"""Regression tests for saved and loaded prompt caches: ChunkKV's index reuse survives a reload, a
cache loaded in a fresh process continues like the uninterrupted run, damaged files are detected,
and mlx-lm's own loader reads kvcompress files. Each test's docstring names the bug it catches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

import kvcompress
from conftest import REPO, tiny_llama
from _regression_helpers import caches_for, greedy, held, prompt_tokens


# ------------------------------------------------------------------------------------------
# ChunkKV layer-wise index reuse survives save/load
# ------------------------------------------------------------------------------------------


def test_chunkkv_index_reuse_survives_save_and_load(model, tmp_path):
    """Bug: ChunkKV's layer-wise index reuse shared layer 0's eviction indices through a dict
    held by the caches of one ``make_prompt_cache`` call; a loaded cache list lost it, so after
    a reload layer 1 chose its own chunks and the run diverged from the unsaved one."""
    kw = dict(budget=16, recent=4, chunk=4, n_sink=0)
    caches = kvcompress.make_prompt_cache(model, "chunkkv", reuse_layers=2, **kw)
    own = kvcompress.make_prompt_cache(model, "chunkkv", reuse_layers=1, **kw)
    prompt = mx.array([prompt_tokens(40)])
    model(prompt, cache=caches)
    model(prompt, cache=own)
    greedy(model, caches, 5, 6)
    greedy(model, own, 5, 6)
    assert (held(caches[0]) == held(caches[1])).all()
    # without reuse the layers choose differently here (so the comparison below means something)
    assert not np.array_equal(held(own[0]), held(own[1]))

    path = str(tmp_path / "chunk.safetensors")
    kvcompress.save_prompt_cache(path, caches)
    loaded = kvcompress.load_prompt_cache(path)
    # a chunk, then decode steps: the step after the chunk frees several chunks at once
    steps = [prompt_tokens(20, salt=9)] + [[11 + i] for i in range(10)]
    for step, tokens in enumerate(steps):
        a = model(mx.array([tokens]), cache=caches)
        b = model(mx.array([tokens]), cache=loaded)
        assert mx.array_equal(a, b).item(), f"step {step}: the loaded cache diverged"
        for x, y in zip(caches, loaded):
            np.testing.assert_array_equal(held(x), held(y))
        np.testing.assert_array_equal(held(loaded[0]), held(loaded[1]), err_msg="layer 1 no longer reuses layer 0")
    assert loaded[0].evictions == caches[0].evictions > 0


# ------------------------------------------------------------------------------------------
# A cache loaded in a fresh process continues like the uninterrupted run
# ------------------------------------------------------------------------------------------

_GREEDY_SRC = '''
def greedy_digest(model, caches, token, n):
    """n greedy steps: the tokens and a digest of every step's logits (bit-exact)."""
    import hashlib
    import mlx.core as mx
    import numpy as np
    out, h = [], hashlib.sha256()
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32)
        token = int(mx.argmax(logits).item())
        out.append(token)
        h.update(np.array(logits).tobytes())
    return out, h.hexdigest()
'''

_CHILD = '''
import json, sys
sys.path.insert(0, {tests!r})
from conftest import tiny_llama
import kvcompress


{greedy}
model = tiny_llama(**{model_kw!r})
out = {{}}
for method, path, token in {jobs!r}:
    installed = kvcompress.is_installed(model)
    caches = kvcompress.load_prompt_cache(path)
    toks, digest = greedy_digest(model, caches, token, {steps})
    out[method] = dict(tokens=toks, digest=digest, sources=[c.score_source for c in caches], installed_before=installed,
                       offsets=[c.offset for c in caches])
print("RESULT" + json.dumps(out))
'''


def test_cache_loaded_in_a_fresh_process_continues_like_the_uninterrupted_run(tmp_path):
    """Bug: the query-observing attention wrapper was installed only by ``make_prompt_cache`` /
    ``kvcompress.install``, so a cache loaded in a fresh process scored with the key-as-query
    proxy and evicted other tokens than the uninterrupted run. It is now installed on the first
    update of any kvcompress cache: 40 greedy steps after loading equal the uninterrupted run's
    (tokens and bit-exact logits), with real-query scores."""
    model_kw = dict(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=7)
    model = tiny_llama(**model_kw)
    steps = 40
    scope: dict = {}
    exec(_GREEDY_SRC, scope)
    jobs, expected = [], {}
    for method in ("h2o", "cam", "snapkv"):
        # no recent window for h2o / cam: every eviction is decided by the scores
        caches = caches_for(model, method, 16, **({} if method == "snapkv" else {"recent_ratio": 0.0}))
        model(mx.array([prompt_tokens(30, salt=3)]), cache=caches)
        toks, _ = greedy(model, caches, 5, 4)
        path = str(tmp_path / f"{method}.safetensors")
        kvcompress.save_prompt_cache(path, caches)
        expected[method] = scope["greedy_digest"](model, caches, toks[-1], steps)
        assert caches[0].evictions > 0
        jobs.append((method, path, toks[-1]))
    code = _CHILD.format(tests=str(REPO / "tests"), greedy=_GREEDY_SRC, model_kw=model_kw, jobs=jobs, steps=steps)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kvcompress.__file__).parents[1]),
                                         str(Path(kvcompress.__file__).parents[1] / "plugins"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    for method in expected:
        assert (got[method]["tokens"], got[method]["digest"]) == expected[method], method
        assert got[method]["sources"] == ["queries"] * 2, (method, got[method])
        assert got[method]["offsets"] == [30 + 4 + steps] * 2


# ------------------------------------------------------------------------------------------
# Saved files: damage is detected; mlx-lm's own loader reads them
# ------------------------------------------------------------------------------------------


def _saved(model, tmp_path):
    caches = caches_for(model, "cam", 12)
    model(mx.array([prompt_tokens(30)]), cache=caches)
    greedy(model, caches, 3, 3)
    path = tmp_path / "cache.safetensors"
    kvcompress.save_prompt_cache(str(path), caches)
    return caches, path


def _header(data: bytes) -> tuple[int, str]:
    n = int.from_bytes(data[:8], "little")
    return n, data[8 : 8 + n].decode()


def test_damaged_cache_files_raise_corrupt_cache_file(model, tmp_path):
    """Bug: a prompt-cache file damaged in its header or its tensor data loaded silently (or
    failed with an unrelated exception), so a cache that was not the saved one could continue a
    generation. Every such file now raises :class:`kvcompress.CorruptCacheFile` naming it."""
    _, path = _saved(model, tmp_path)
    data = path.read_bytes()
    n, header = _header(data)
    flips = {}
    m = re.search(r'"data_offsets":\[\d+,(\d)', header)  # a tensor's end offset
    flips["data_offsets"] = 8 + m.start(1)
    m = re.search(r"CompressedKVCache", header)  # a layer's class name
    flips["class name"] = 8 + m.start() + 3
    m = re.search(r'kvcompress_digest":"v2:([0-9a-f])', header)  # the digest itself
    flips["digest"] = 8 + m.start(1)
    flips["first tensor byte"] = 8 + n
    flips["middle tensor byte"] = 8 + n + (len(data) - 8 - n) // 2
    flips["last byte"] = len(data) - 1
    for what, at in flips.items():
        bad = bytearray(data)
        if at >= 8 + n:
            bad[at] ^= 0x01
        else:  # a digit stays a digit, a letter a letter: the header is still valid JSON
            old = chr(bad[at])
            bad[at] = ord(str((int(old) + 1) % 10) if old.isdigit() else ("a" if old == "f" else chr(ord(old) + 1)))
        target = tmp_path / f"bad-{what.replace(' ', '_')}.safetensors"
        target.write_bytes(bytes(bad))
        with pytest.raises(kvcompress.CorruptCacheFile, match=re.escape(str(target))):
            kvcompress.load_prompt_cache(str(target))


def test_mlx_lm_loader_reads_kvcompress_files(model, tmp_path):
    """Bug: mlx-lm's own ``load_prompt_cache`` could not read a file with compressed layers (it
    only knows its own classes), so ``mlx_lm.generate --prompt-cache-file`` and other tools
    failed on them. The classes are registered with mlx-lm; its loader's caches continue
    bit-identically."""
    caches, path = _saved(model, tmp_path)
    loaded = mlx_cache.load_prompt_cache(str(path))
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    a_toks, a_logits = greedy(model, caches, 9, 12)
    b_toks, b_logits = greedy(model, loaded, 9, 12)
    assert a_toks == b_toks
    for x, y in zip(a_logits, b_logits):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------------------------------
# The digest is mandatory, covers the metadata, and mlx-lm's own functions check / write it
# ------------------------------------------------------------------------------------------

META = {"model": "tiny-model", "chat_template": "{{ messages }}", "notes": "saved by a test"}


def _flipped(path: Path, tmp_path: Path, old: bytes, new: bytes) -> Path:
    data = path.read_bytes()
    assert data.count(old) >= 1, old
    out = tmp_path / f"flip-{len(list(tmp_path.iterdir()))}.safetensors"
    out.write_bytes(data.replace(old, new, 1))
    return out


def _loaders():
    return [("kvcompress", kvcompress.load_prompt_cache), ("mlx-lm", mlx_cache.load_prompt_cache)]


@pytest.mark.parametrize("what,old,new", [
    ("the digest's key name", b"kvcompress_digest", b"kvcompress_digesu"),
    ("the model name", b"tiny-model", b"tiny-modem"),
    ("the chat template", b"{{ messages }}", b"{{ messagfs }}"),
    ("a note", b"saved by a test", b"saved by a tesu"),
    ("the digest format", b'"v2:', b'"v3:'),
])
def test_a_file_whose_digest_or_metadata_is_damaged_is_refused_by_both_loaders(model, tmp_path, what, old, new):
    """Bug: the digest was optional (a file whose digest key lost one bit loaded unchecked) and did
    not cover the user metadata (``model``, chat template, notes), and mlx-lm's own loader never
    checked it. A kvcompress file now needs a valid digest over every layer and the metadata,
    through either loader."""
    caches = caches_for(model, "cam", 12)
    model(mx.array([prompt_tokens(30)]), cache=caches)
    path = tmp_path / "good.safetensors"
    kvcompress.save_prompt_cache(str(path), caches, META)
    for name, load in _loaders():
        got, meta = load(str(path), return_metadata=True)
        assert meta == META and len(got) == 2, name
    bad = _flipped(path, tmp_path, old, new)
    for name, load in _loaders():
        with pytest.raises(kvcompress.CorruptCacheFile, match=re.escape(str(bad))):
            load(str(bad))


def test_every_single_bit_flip_in_the_file_header_is_refused(model, tmp_path):
    """Bug: 4 of 760 single-bit flips of a cache file loaded (a flipped digest key dropped the
    check, a flipped metadata byte was not covered). Each byte of the header (JSON: tensor table,
    classes, scalars, metadata, digest) flipped in one bit (the bit cycling over the bytes) is now
    refused by both loaders: CorruptCacheFile from kvcompress's; mlx-lm's raises that too, or its
    own error for a header it cannot parse as a prompt-cache file at all."""
    caches = caches_for(model, "h2o", 12)
    model(mx.array([prompt_tokens(20)]), cache=caches)
    path = tmp_path / "good.safetensors"
    kvcompress.save_prompt_cache(str(path), caches, {"model": "m"})
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    loaded_anyway = []
    for i in range(8, 8 + n):
        bad = bytearray(data)
        bad[i] ^= 1 << (i % 8)
        target = tmp_path / "bad.safetensors"
        target.write_bytes(bytes(bad))
        for name, load in _loaders():
            try:
                load(str(target))
            except kvcompress.CorruptCacheFile:
                continue
            except Exception:  # mlx-lm's own loader on an unparsable header
                if name == "mlx-lm":
                    continue
            loaded_anyway.append((i, chr(data[i]), name))
    assert not loaded_anyway


def test_files_mlx_lm_writes_old_digests_and_plain_files_still_load(model, tmp_path):
    """Compatibility: mlx-lm's own ``save_prompt_cache`` given kvcompress caches now writes the
    digest (so its files load under the mandatory check), files written before the digest covered
    the metadata (a bare hex digest over the layers) load with their layers checked, and plain
    mlx-lm files (no kvcompress layer, no digest) load as before."""
    from kvcompress import persistence

    caches = caches_for(model, "h2o", 12)
    model(mx.array([prompt_tokens(20)]), cache=caches)
    via_mlx = tmp_path / "via-mlx.safetensors"
    mlx_cache.save_prompt_cache(str(via_mlx), caches, {"model": "m"})
    got, meta = kvcompress.load_prompt_cache(str(via_mlx), return_metadata=True)
    assert meta == {"model": "m"} and [c.offset for c in got] == [c.offset for c in caches]

    old = tmp_path / "old.safetensors"
    persistence.original(mlx_cache.save_prompt_cache)(
        str(old), caches, {"model": "m", persistence.DIGEST_KEY: persistence._digest_layers(caches)})
    assert [c.offset for c in kvcompress.load_prompt_cache(str(old))] == [c.offset for c in caches]
    data = bytearray(old.read_bytes())
    data[-1] ^= 1  # the last tensor byte
    damaged = tmp_path / "old-damaged.safetensors"
    damaged.write_bytes(bytes(data))
    with pytest.raises(kvcompress.CorruptCacheFile, match="does not match its digest"):
        kvcompress.load_prompt_cache(str(damaged))

    plain = tmp_path / "plain.safetensors"
    ref = mlx_cache.make_prompt_cache(model)
    model(mx.array([prompt_tokens(20)]), cache=ref)
    mlx_cache.save_prompt_cache(str(plain), ref, {"model": "m"})
    for name, load in _loaders():
        got, meta = load(str(plain), return_metadata=True)
        assert meta == {"model": "m"} and [type(c).__name__ for c in got] == ["KVCache", "KVCache"], name
