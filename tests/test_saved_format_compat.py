"""Cache files saved by the version before the engine package (state version 2, commit
0239f97: ``tests/data/cache-state-v2-*.safetensors``, a 1-layer Llama with 2 KV heads of 8 after
70 prompt and 10 decode tokens at budget 40) load, save back bit for bit (the state's text only
gains the parameters components got since, at their defaults), and continue."""

from __future__ import annotations

import json

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kvcompress

DATA = Path(__file__).resolve().parent / "data"


def _assert_only_gained(old, new, where):
    """``new`` holds every entry of ``old`` unchanged; what it adds is in a component's config."""
    if isinstance(old, dict):
        assert isinstance(new, dict) and set(old) <= set(new), where
        added = set(new) - set(old)
        assert not added or "name" in new, f"{where}: {added} added outside a component's config"
        for k in old:
            _assert_only_gained(old[k], new[k], f"{where}.{k}")
    else:
        assert old == new, where


@pytest.mark.parametrize("method", ["h2o", "adakv", "kvzip"])
def test_a_previous_versions_file_loads_saves_back_and_continues(method, tmp_path):
    path = DATA / f"cache-state-v2-{method}.safetensors"
    (c,), meta = kvcompress.load_prompt_cache(str(path), return_metadata=True)
    assert c.method.name == method and meta.get("made_by", "").startswith("kvcompress 0.1.0")
    assert c.offset == 80 and c.budget == 40 and c.tokens_kept <= 40
    assert c.heads_per_row == (2 if method == "adakv" else 1)

    again = tmp_path / "again.safetensors"
    kvcompress.save_prompt_cache(str(again), [c], metadata=meta)
    old, new = mx.load(str(path), return_metadata=True), mx.load(str(again), return_metadata=True)
    assert sorted(old[0]) == sorted(new[0])
    # mlx-lm's record of the entries it stored as strings: "2.<i>.0" = the entry, "2.<i>.1" = "string"
    text_keys = {old[1][k[:-1] + "0"] for k, v in old[1].items() if k.startswith("2.") and v == "string"}
    for name in old[0]:
        a, b = np.array(old[0][name]), np.array(new[0][name])
        if name in text_keys and not np.array_equal(a, b):
            was, now = json.loads("".join(map(chr, a))), json.loads("".join(map(chr, b)))
            _assert_only_gained(was, now, name)
            # the entries gained are the components' own defaults (the behaviour the file had), not
            # a method default added since: adakv's method default step=16 came after these files
            reg = kvcompress.get_registry()
            want = {k: ({**reg.component(k, t["name"]).params(), **t} if isinstance(t, dict) and "name" in t else t)
                    for k, t in was["config"].items()}
            assert json.loads(json.dumps(kvcompress.build_method(want).config.to_dict())) == now["config"]
            if method == "adakv":
                assert now["config"]["selector"]["step"] == 1 != kvcompress.build_method("adakv").selector.step
        else:
            assert np.array_equal(a, b), name
    assert {k: v for k, v in old[1].items() if "digest" not in k} == {k: v for k, v in new[1].items() if "digest" not in k}

    if method == "kvzip":  # its scorer needs the model hook's token ids: a model-free step is refused
        return
    k = mx.random.normal((1, 2, 1, 8), key=mx.random.key(1))
    c.update_and_fetch(k, -k)
    assert c.offset == 81 and c.tokens_kept <= 40
    assert 80 in np.array(c.slot_positions).reshape(-1).tolist()


def test_a_file_from_before_a_parameter_existed_loads_and_damage_is_still_found(tmp_path, tiny_model):
    """A component that gains a parameter (with a default) must not turn older files into
    "damaged" ones: the digest is checked over the layers as the file stores them. A changed
    byte in such a file is still refused."""
    from kvcompress.persistence import CorruptCacheFile, _stored_digest
    from kvcompress._autoload import DIGEST_KEY

    cache = kvcompress.make_prompt_cache(tiny_model, "kvzip", budget=16)
    tiny_model(mx.arange(40, dtype=mx.int32)[None] % 64, cache=cache)
    path = tmp_path / "new.safetensors"
    kvcompress.save_prompt_cache(str(path), cache, metadata={"note": "x"})
    arrays, meta = mx.load(str(path), return_metadata=True)
    text_keys = [meta[k[:-1] + "0"] for k, v in meta.items() if k.startswith("2.") and v == "string"]
    for key in text_keys:  # as an older kvzip wrote it: no `suffix` parameter
        state = json.loads("".join(map(chr, arrays[key].tolist())))
        del state["config"]["scorer"]["suffix"]
        arrays[key] = mx.array([ord(ch) for ch in json.dumps(state)], dtype=mx.int32)
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), arrays, meta)
    user = {k[2:]: v for k, v in meta.items() if k.startswith("0.")}
    meta["0." + DIGEST_KEY] = _stored_digest(str(old), user)
    mx.save_safetensors(str(old), arrays, meta)

    loaded = kvcompress.load_prompt_cache(str(old))
    assert loaded[0].method.scorer.suffix == () and len(loaded) == len(cache)
    for a, b in zip(loaded, cache):
        assert np.array_equal(np.array(a.state[-4]), np.array(b.state[-4]))  # the same keys

    key = text_keys[0]
    text = "".join(map(chr, arrays[key].tolist()))
    arrays[key] = mx.array([ord(ch) for ch in text.replace('"chunk": 128', '"chunk": 64')], dtype=mx.int32)
    mx.save_safetensors(str(old), arrays, meta)
    with pytest.raises(CorruptCacheFile, match="damaged"):
        kvcompress.load_prompt_cache(str(old))
