"""Compressed caches under mlx.distributed: 2 ranks on loopback (ring backend, ``mlx.launch``).

For every registered method, greedy tokens under tensor parallelism (llama: KV heads split) and
pipeline parallelism (qwen2: layers split) equal the single-process run, and each rank's kept
positions equal the matching head (or layer) slice of the single-process cache. An MLA model
(DeepSeek-V3 family: the latent cache replicated on every rank, query heads split) is exact too,
because the cache agrees its scores across ranks. Tiny random-weight models are written to a temp
folder with the embedded retrieval model's tokenizer.

A run that cannot start the ranks skips with the reason, unless ``KVCOMPRESS_REQUIRE_DISTRIBUTED=1``
(set by ``.ci/run``) turns that into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kvcompress

HERE = Path(__file__).resolve().parent
ASSETS = Path(kvcompress.__file__).resolve().parent / "assets" / "retrieval"
BUDGET, N_TOKENS = 40, 24
#: mlx.launch's ring backend listens on fixed ports: every test that launches ranks runs on one
#: pytest-xdist worker (``--dist loadgroup``), one launch at a time
pytestmark = pytest.mark.xdist_group("mlx_launch")
#: methods the MLA model refuses at build time (with a clear error): per-layer budgets under its
#: shared array mask, or a disposition that needs real cached values
MLA_REFUSED = {"kivi", "h2o_kivi", "squeeze", "pyramidkv", "h2o_pyramid", "snapkv_merge"}

sys.path.insert(0, str(HERE))
import dist_worker  # noqa: E402


def _write(model, args, folder: Path) -> Path:
    from mlx.utils import tree_map
    from mlx_lm.utils import save_config, save_model

    # larger weights so greedy decoding of a random model is not one repeated token
    model.update(tree_map(lambda p: p * 8 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    folder.mkdir(parents=True)
    save_model(folder, model)
    cfg = {k: v for k, v in vars(args).items() if not k.startswith("_") and v is not None}
    cfg.setdefault("max_position_embeddings", 2048)
    save_config(cfg, folder / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, folder / f)
    (folder / "prompt.json").write_text(json.dumps(np.random.default_rng(1).integers(3, 70, 40).tolist()))
    return folder


def _models(root: Path) -> dict:
    from mlx_lm.models import deepseek_v3, llama, qwen2

    mx.random.seed(0)
    common = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=72, rope_theta=10000.0,
                  tie_word_embeddings=True)
    out = {}
    a = llama.ModelArgs(model_type="llama", **common)
    out["tp"] = _write(llama.Model(a), a, root / "llama")
    a = qwen2.ModelArgs(model_type="qwen2", **common)
    out["pp"] = _write(qwen2.Model(a), a, root / "qwen2")
    a = deepseek_v3.ModelArgs(vocab_size=72, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                              n_routed_experts=None, first_k_dense_replace=4)
    out["mla"] = _write(deepseek_v3.Model(a), a, root / "mla")
    return out


def _skip_or_fail(reason: str):
    if os.environ.get("KVCOMPRESS_REQUIRE_DISTRIBUTED") == "1":
        pytest.fail(f"distributed run required but: {reason}")
    pytest.skip(reason)


def _launch(model_dir: Path, mode: str, out: Path, methods: list) -> list:
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        _skip_or_fail("mlx.launch is not on PATH")
    out.mkdir()
    cmd = [launcher, "-n", "2", "--backend", "ring", "--python", sys.executable, str(HERE / "dist_worker.py"),
           str(model_dir), "tp" if mode == "mla" else mode, str(out), str(BUDGET), str(N_TOKENS), *methods]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mlx.launch {mode} did not finish in 420 s")
    files = [out / f"rank{i}.json" for i in (0, 1)]
    if not all(f.exists() for f in files):
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        if "Address already in use" in tail or "Connection refused" in tail:
            _skip_or_fail(f"the ring backend could not start on loopback:\n{tail}")
        pytest.fail(f"mlx.launch {mode} exited {r.returncode} without results:\n{tail}")
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    methods = _methods()
    root = tmp_path_factory.mktemp("dist")
    models = _models(root)
    out = {}
    for mode in ("tp", "pp", "mla"):
        ranks = _launch(models[mode], mode, root / f"out-{mode}", methods)
        from mlx_lm.utils import load

        model, _ = load(str(models[mode]))
        prompt = mx.array(json.loads((models[mode] / "prompt.json").read_text()))
        refs = {}
        for m in methods:
            try:
                refs[m] = dist_worker.run(model, prompt, m, BUDGET, N_TOKENS)
            except kvcompress.ConfigError as exc:
                refs[m] = {"error": str(exc)}
        out[mode] = (ranks, refs)
    return out


#: head-wise budgets over every KV head of a layer cannot be exact when ranks hold some heads:
#: refused under tensor parallelism; a head group within a rank's heads runs exactly
TP_REFUSED = {m for m in kvcompress.get_registry().methods
              if "head_wise_budgets" in kvcompress.build_method(m).selector.provides}
VARIANTS = sorted(f"{m}:heads=2" for m in TP_REFUSED)  # 4 KV heads, 2 per rank


def _methods():
    return sorted(kvcompress.get_registry().methods) + VARIANTS


def _assert_ranks_match(ranks, ref, method) -> set:
    """Every rank generated the single-process run's tokens and kept its positions for the heads
    it holds; returns the layers the ranks hold between them."""
    layers_seen = set()
    for r in ranks:
        got = r["methods"][method]
        assert "error" not in got, got.get("error")
        assert got["tokens"] == ref["tokens"], f"rank {r['rank']}: tokens differ from the single-process run"
        for layer, entry in got["layers"].items():
            h, off = len(entry["positions"]), entry["head_offset"]
            want = ref["layers"][layer]["positions"][off : off + h]
            assert entry["positions"] == want, f"rank {r['rank']} layer {layer}: kept positions differ"
            layers_seen.add(layer)
    return layers_seen


@pytest.mark.parametrize("mode", ["tp", "pp", "mla"])
@pytest.mark.parametrize("method", _methods())
def test_ranks_equal_the_single_process_run(runs, mode, method):
    if mode == "mla" and method == "knorm":
        pytest.skip("MLA caches RMS-normalised latents, so every key norm is nearly equal and key-norm "
                    "scores are decided by float rounding (TP sums heads in another order)")
    ranks, refs = runs[mode]
    ref = refs[method]
    if mode == "mla" and method in MLA_REFUSED:
        for r in ranks:  # refused loudly on every rank, never run divergent
            assert "ConfigError" in r["methods"][method].get("error", "") or "no budget" in r["methods"][method].get("error", "")
        assert "error" in ref
        return
    if mode == "mla" and method in VARIANTS:  # one latent KV head: a group of 2 heads is refused
        assert all("must divide" in r["methods"][method].get("error", "") for r in ranks)
        assert "must divide" in ref.get("error", "")
        return
    if mode == "tp" and method in TP_REFUSED:
        for r in ranks:  # refused loudly on every rank, never run divergent
            assert "tensor parallelism" in r["methods"][method].get("error", "")
        assert "error" not in ref  # a single process runs it
        return
    assert "error" not in ref, ref.get("error")
    layers_seen = _assert_ranks_match(ranks, ref, method)
    assert layers_seen == set(ref["layers"])  # between them the ranks hold every compressed layer
    if mode == "pp":
        assert not set(ranks[0]["methods"][method]["layers"]) & set(ranks[1]["methods"][method]["layers"])


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    """Every rank's result of the agreement cases: llama (tensor parallel) with ranks building
    different methods or budgets, qwen2 (pipeline) with a refusal only rank 0 sees, and a llama
    whose 3 KV heads do not split over 2 ranks; each launch ends with a case every rank agrees on."""
    root = tmp_path_factory.mktemp("agree")
    from mlx_lm.models import llama, qwen2

    mx.random.seed(0)
    common = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=72, rope_theta=10000.0,
                  tie_word_embeddings=True)
    a = llama.ModelArgs(model_type="llama", **common)
    tp = _write(llama.Model(a), a, root / "llama")
    a = qwen2.ModelArgs(model_type="qwen2", **common)
    pp = _write(qwen2.Model(a), a, root / "qwen2")
    a = llama.ModelArgs(model_type="llama", **{**common, "hidden_size": 48, "num_attention_heads": 6,
                                               "num_key_value_heads": 3})
    odd = _write(llama.Model(a), a, root / "llama3")
    return {
        "tp": _launch(tp, "tp-agree", root / "out-tp", ["methods", "budgets", "agreed"]),
        "pp": _launch(pp, "pp-agree", root / "out-pp", ["reuse", "agreed"]),
        "odd": _launch(odd, "tp-agree", root / "out-odd", ["agreed"]),
    }


@pytest.mark.parametrize("run,case,expect", [
    ("tp", "methods", r"the 2 ranks built different caches \(rank 0: h2o: .*rank 1: tova: "),
    ("tp", "budgets", r"the 2 ranks built different caches \(rank 0: .*budget 40 over 4 layers; rank 1: .*budget 41"),
    ("pp", "reuse", r"rank 0 of 2 refused the cache: chunk reuse_layers=3: layer 2 reuses layer 0's choice"),
    ("odd", "agreed", r"the model's 3 KV heads do not divide by the 2 ranks"),
])
def test_ranks_that_disagree_raise_the_same_config_error_on_every_rank(agreement, run, case, expect):
    """Bug: ranks built with different methods or budgets hung in the per-step collective (or
    kept different tokens silently), a build refusal only one rank saw (chunkkv reuse_layers across
    pipeline ranks) killed the other rank with a ring error, and KV heads that do not divide by
    the ranks failed with mlx's shape error at the first step. The ranks now agree the build in
    one collective and raise the same ConfigError on every rank; afterwards they still agree on
    the next build and generate the same tokens."""
    ranks = agreement[run]
    errors = [r["methods"][case].get("error", "") for r in ranks]
    assert errors[0] == errors[1] and errors[0].startswith("ConfigError: "), errors
    assert re.search(expect, errors[0]), errors[0]
    if run != "odd":
        agreed = [r["methods"]["agreed"] for r in ranks]
        assert "error" not in agreed[0] and agreed[0] == agreed[1]


#: low-bit storage under tensor parallelism (a llama with head_dim 32: one group of 32 per vector)
LOW_BIT = ["h2o:kv_bits=4,kv_group_size=32", "snapkv:kv_bits=8,kv_group_size=32", "cam:kv_bits=4,kv_group_size=32",
           "kvzip:kv_bits=4,kv_group_size=32"]


@pytest.fixture(scope="module")
def low_bit_runs(tmp_path_factory):
    from mlx_lm.models import llama
    from mlx_lm.utils import load

    root = tmp_path_factory.mktemp("dist-lowbit")
    mx.random.seed(0)
    a = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-5,
                        vocab_size=72, rope_theta=10000.0, tie_word_embeddings=True)
    folder = _write(llama.Model(a), a, root / "llama32")
    ranks = _launch(folder, "tp", root / "out", LOW_BIT)
    model, _ = load(str(folder))
    prompt = mx.array(json.loads((folder / "prompt.json").read_text()))
    return ranks, {m: dist_worker.run(model, prompt, m, BUDGET, N_TOKENS) for m in LOW_BIT}


@pytest.mark.parametrize("method", LOW_BIT)
def test_low_bit_ranks_equal_the_single_process_run(low_bit_runs, method):
    """Each rank quantizes its own heads' vectors, exactly as one process quantizes them: the
    same tokens and the same kept positions per head."""
    ranks, refs = low_bit_runs
    assert _assert_ranks_match(ranks, refs[method], method) == set(refs[method]["layers"])
