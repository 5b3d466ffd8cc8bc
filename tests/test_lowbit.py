"""The few-row low-bit CPU kernel (``kvcompress.ops.quantized_matmul``): MLX's product, faster.

On Linux x86-64 the kernel is built on first use (CMake + a C++ compiler + nanobind); where one
of those is missing the kernel tests skip with the reason and MLX's kernel serves the product
(tested here too). A build that fails with every prerequisite present is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from kvcompress import _lowbit, ops
from kvcompress._lowbit import _build

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.fixture(scope="module")
def kernel():
    st = _lowbit.status(build=True)
    if not st["available"]:
        reason = st["reason"] or ""
        if _build._missing() or "only built on" in reason or "KVCOMPRESS_LOWBIT=0" in reason:
            pytest.skip(f"low-bit kernel not available here: {reason}")
        pytest.fail(f"low-bit kernel failed with every prerequisite present: {reason}")
    return _lowbit._kernel()


def _store(rng, shape, bits, group, dtype):
    w = mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)
    return mx.quantize(w, group_size=group, bits=bits)


def _reference(x, q, s, b, group, bits):
    """float64 ``x @ dequantize(w)``."""
    w = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits).astype(mx.float32), dtype=np.float64)
    return np.array(x.astype(mx.float32), dtype=np.float64) @ w


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sdtype", list(DTYPES))
def test_kernel_equals_mlx_for_float32_queries(kernel, bits, group, sdtype):
    """Float32 ``x``: MLX's result up to float32 rounding, for 1..16 rows (blocks of 4 + rest)."""
    rng = np.random.default_rng(bits * 1000 + group)
    q, s, b = _store(rng, (2, 3, 48, 256), bits, group, DTYPES[sdtype])
    for m in (1, 2, 3, 4, 5, 8, 13, 16):
        x = mx.array(rng.normal(size=(2, 3, m, 48)).astype(np.float32))
        got = ops.quantized_matmul(x, q, s, b, group_size=group, bits=bits)
        want = mx.quantized_matmul(x, q, s, b, transpose=False, group_size=group, bits=bits)
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = float(mx.abs(want).max().item())
        assert float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()) <= 2e-6 * scale


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sdtype", list(DTYPES))
def test_transposed_kernel_equals_mlx_for_float32_queries(kernel, bits, group, sdtype):
    """``transpose=True`` (queries times low-bit keys): MLX's result up to float32 rounding, for
    1..16 rows, rows of any number of groups."""
    rng = np.random.default_rng(bits * 100 + group)
    q, s, b = _store(rng, (2, 3, 37, 256), bits, group, DTYPES[sdtype])
    for m in (1, 3, 4, 5, 9, 16):
        x = mx.array(rng.normal(size=(2, 3, m, 256)).astype(np.float32))
        got = ops.quantized_matmul(x, q, s, b, group_size=group, bits=bits, transpose=True)
        want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group, bits=bits)
        assert got.dtype == want.dtype and got.shape == want.shape == (2, 3, m, 37)
        # float64 product of the codes' exact values (scales and biases widened before dequantizing)
        keys = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
        ref = np.array(x, dtype=np.float64) @ np.array(keys, dtype=np.float64).swapaxes(-1, -2)
        scale = np.abs(ref).max()
        assert np.abs(np.array(got) - ref).max() <= 1e-5 * scale
        if sdtype == "float32":  # (MLX sums half-precision scales' products in half precision)
            assert float(mx.abs(got - want).max().item()) <= 1e-5 * scale


def test_transposed_kernel_reads_any_layout_like_mlx(kernel):
    rng = np.random.default_rng(4)
    q, s, b = _store(rng, (3, 50, 128), 4, 64, mx.float16)
    x = mx.array(rng.normal(size=(3, 128, 4)).astype(np.float32)).swapaxes(-1, -2)  # strided rows
    for qq, ss, bb, xx in ((q, s, b, x), (q[:1], s[:1], b[:1], x), (q[:, 7:30], s[:, 7:30], b[:, 7:30], x[:1])):
        got = ops.quantized_matmul(xx, qq, ss, bb, group_size=64, bits=4, transpose=True)
        want = mx.quantized_matmul(xx, qq, ss, bb, transpose=True, group_size=64, bits=4)
        assert got.shape == want.shape and mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()


@pytest.mark.parametrize("sdtype", ["float16", "bfloat16"])
def test_kernel_half_precision_queries_accumulate_in_float32(kernel, sdtype):
    """Half-precision ``x``: closer to the float64 product than MLX (which sums in half)."""
    rng = np.random.default_rng(7)
    dt = DTYPES[sdtype]
    q, s, b = _store(rng, (1, 2, 64, 1024), 2, 32, dt)
    x = mx.array(rng.normal(size=(1, 2, 4, 64)).astype(np.float32)).astype(dt)
    got = ops.quantized_matmul(x, q, s, b, group_size=32, bits=2)
    assert got.dtype == dt
    ref = _reference(x, q, s, b, 32, 2)
    err = np.abs(np.array(got.astype(mx.float32)) - ref).max() / np.abs(ref).max()
    half_ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8}[sdtype]
    assert err <= 2 * half_ulp


@pytest.mark.parametrize("case", ["broadcast_x", "broadcast_w", "two_d", "transposed_x", "sliced_w"])
def test_kernel_reads_any_layout_like_mlx(kernel, case):
    rng = np.random.default_rng(3)
    q, s, b = _store(rng, (3, 64, 512), 2, 32, mx.float32)
    x = mx.array(rng.normal(size=(3, 4, 64)).astype(np.float32))
    if case == "broadcast_x":
        x = x[:1]
    elif case == "broadcast_w":
        q, s, b = q[:1], s[:1], b[:1]
    elif case == "two_d":
        x, q, s, b = x[0], q[0], s[0], b[0]
    elif case == "transposed_x":
        x = mx.array(rng.normal(size=(3, 64, 4)).astype(np.float32)).swapaxes(-1, -2)
    else:
        q, s, b = q[..., 8:24], s[..., 4:12], b[..., 4:12]  # columns 128..383
    got = ops.quantized_matmul(x, q, s, b, group_size=32, bits=2)
    want = mx.quantized_matmul(x, q, s, b, transpose=False, group_size=32, bits=2)
    assert got.shape == want.shape
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()


def test_kernel_is_lazy_and_composes_under_compile(kernel):
    rng = np.random.default_rng(5)
    q, s, b = _store(rng, (2, 64, 256), 4, 64, mx.float32)
    x = mx.array(rng.normal(size=(2, 4, 64)).astype(np.float32))
    f = mx.compile(lambda x: mx.softmax(ops.quantized_matmul(x * 0.5, q, s, b, group_size=64, bits=4), axis=-1))
    want = mx.softmax(mx.quantized_matmul(x * 0.5, q, s, b, transpose=False, group_size=64, bits=4), axis=-1)
    assert mx.allclose(f(x), want, rtol=1e-5, atol=1e-6).item()


def test_kernel_baseline_build_without_avx2(kernel):
    """The SSE2 build (CPUs without AVX2) gives the same products (a fresh process: the CPU
    check is made once)."""
    code = textwrap.dedent("""
        import mlx.core as mx, numpy as np
        from kvcompress import _lowbit, ops
        assert _lowbit.status(build=True)["avx2"] is False
        rng = np.random.default_rng(1)
        for bits, group in ((2, 32), (4, 64), (8, 128)):
            q, s, b = mx.quantize(mx.array(rng.normal(size=(2, 64, 512)).astype(np.float32)), group_size=group, bits=bits)
            x = mx.array(rng.normal(size=(2, 5, 64)).astype(np.float32))
            got = ops.quantized_matmul(x, q, s, b, group_size=group, bits=bits)
            want = mx.quantized_matmul(x, q, s, b, transpose=False, group_size=group, bits=bits)
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item(), (bits, group)
            x = mx.array(rng.normal(size=(2, 5, 512)).astype(np.float32))
            got = ops.quantized_matmul(x, q, s, b, group_size=group, bits=bits, transpose=True)
            want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=group, bits=bits)
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item(), (bits, group, "transposed")
        print("ok")
    """)
    env = {**os.environ, "KVCOMPRESS_LOWBIT_NO_AVX2": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_disabled_kernel_falls_back_to_mlx(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_LOWBIT", "0")
    monkeypatch.setattr(_lowbit, "_resolved", {})
    rng = np.random.default_rng(2)
    q, s, b = _store(rng, (1, 64, 256), 2, 32, mx.float32)
    x = mx.array(rng.normal(size=(1, 4, 64)).astype(np.float32))
    got = ops.quantized_matmul(x, q, s, b, group_size=32, bits=2)
    want = mx.quantized_matmul(x, q, s, b, transpose=False, group_size=32, bits=2)
    assert mx.array_equal(got, want).item()
    st = _lowbit.status()
    assert st["available"] is False and "KVCOMPRESS_LOWBIT=0" in st["reason"]


def test_missing_prerequisite_is_reported_and_falls_back(monkeypatch, tmp_path):
    """No CMake: no build is attempted, the reason is kept, and MLX's kernel serves the product."""
    monkeypatch.setenv("KVCOMPRESS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVCOMPRESS_LOWBIT", raising=False)
    monkeypatch.setattr(_lowbit, "_resolved", {})
    monkeypatch.setattr(_lowbit, "_not_applicable", lambda: None)
    monkeypatch.setattr(_build, "_cmake", lambda: None)
    rng = np.random.default_rng(4)
    q, s, b = _store(rng, (1, 64, 128), 4, 32, mx.float32)
    x = mx.array(rng.normal(size=(1, 2, 64)).astype(np.float32))
    got = ops.quantized_matmul(x, q, s, b, group_size=32, bits=4)
    assert mx.array_equal(got, mx.quantized_matmul(x, q, s, b, transpose=False, group_size=32, bits=4)).item()
    st = _lowbit.status()
    assert st["available"] is False and "CMake is not installed" in st["reason"]
    assert not any(tmp_path.rglob("*.so"))


def test_failed_build_is_recorded_once(monkeypatch, tmp_path):
    """A build that fails leaves its reason next to the cache entry; the next process reads it
    instead of building again."""
    monkeypatch.setenv("KVCOMPRESS_CACHE_DIR", str(tmp_path))
    calls = []

    def failing_build(entry, so):
        calls.append(entry)
        raise _build.BuildError("building the low-bit kernel failed (exit 1); log: x")

    monkeypatch.setattr(_build, "_build", failing_build)
    monkeypatch.setattr(_build, "_missing", lambda: None)
    for _ in range(2):
        with pytest.raises(_build.BuildError, match="exit 1"):
            _build.load()
    assert len(calls) == 1
    assert (_build.entry_dir() / "FAILED").read_text().startswith("building the low-bit kernel failed")


def test_kivi_decode_with_the_kernel_matches_mlx_kernel(kernel, monkeypatch):
    """A KIVI cache decodes the same logits (float32 rounding apart) and tokens whichever kernel
    reads its 2-bit store."""
    import kvcompress
    from conftest import tiny_llama

    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=1, vocab=97, seed=3)
    prompt = mx.array([[(7 * i) % 97 for i in range(160)]])

    def run():
        cache = kvcompress.make_prompt_cache(model, "kivi", budget=32)
        logits, tok = [], model(prompt, cache=cache)[:, -1:]
        for _ in range(6):
            logits.append(tok[0, -1])
            tok = model(mx.argmax(tok, axis=-1), cache=cache)
        assert cache[0].diagnostics["quantized_tokens"] > 0
        return mx.stack(logits)

    fast = run()
    monkeypatch.setattr(_lowbit, "_resolved", {"module": None, "reason": "test"})
    plain = run()
    assert mx.array_equal(mx.argmax(fast, axis=-1), mx.argmax(plain, axis=-1)).item()
    assert mx.allclose(fast, plain, rtol=1e-4, atol=1e-4).item()


class _FakeKernel:
    """MLX's product behind the compiled module's interface (the probe accepts it)."""

    @staticmethod
    def qmm(x, w, scales, biases, *, group_size, bits, stream=None):
        return mx.quantized_matmul(x, w, scales, biases, transpose=False, group_size=group_size, bits=bits)

    @staticmethod
    def softmax(x, *, normalize=True, stream=None):
        return mx.softmax(x, axis=-1) if normalize else mx.exp(x - x.max(axis=-1, keepdims=True))

    @staticmethod
    def owner_softmax(x, v, *, shift=0, stream=None):
        heads = mx.where(v >= 0, v >> shift, -1)[..., None, None, :]
        own = heads == mx.arange(x.shape[-3]).reshape(-1, 1, 1)
        return mx.softmax(mx.where(own, x, -mx.inf), axis=-1)

    @staticmethod
    def has_avx2():
        return False


@pytest.fixture
def first_build(monkeypatch):
    """A process that has not resolved the kernel yet; ``events`` records the (fake) build."""
    events = []

    def load():
        print("kvcompress: building the low-bit CPU kernel once (fake)", file=sys.stderr, flush=True)
        events.append("build")
        return _FakeKernel()

    monkeypatch.setattr(_lowbit, "_resolved", {})
    monkeypatch.setattr(_lowbit, "_not_applicable", lambda: None)
    monkeypatch.setattr(_build, "load", load)
    if mx.default_device() != mx.cpu:
        pytest.skip("the low-bit kernel serves the CPU only")
    return events


@pytest.mark.parametrize("how", ["make", "load"])
def test_a_kivi_cache_builds_the_kernel_when_made_or_loaded_not_in_its_first_decode(first_build, how, tmp_path,
                                                                                   monkeypatch):
    import kvcompress
    from conftest import tiny_llama

    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=1, vocab=97, seed=3)
    if how == "load":
        cache = kvcompress.make_prompt_cache(model, "kivi", budget=32)
        mx.eval(model(mx.array([[(7 * i) % 97 for i in range(80)]]), cache=cache))
        kvcompress.save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
        monkeypatch.setattr(_lowbit, "_resolved", {})
        first_build.clear()
        cache = kvcompress.load_prompt_cache(str(tmp_path / "c.safetensors"))
    else:
        cache = kvcompress.make_prompt_cache(model, "kivi", budget=32)
    assert first_build == ["build"]  # before any token: the decode below runs the built kernel
    tok = model(mx.array([[1, 2, 3] * 30]), cache=cache)[:, -1:]
    mx.eval(model(mx.argmax(tok, axis=-1), cache=cache))
    assert cache[0].diagnostics["quantized_tokens"] > 0 and first_build == ["build"]


def test_generate_builds_the_kernel_before_the_story_and_its_timer(first_build, stories_model, monkeypatch, capsys):
    """``kvcompress generate --method kivi`` on a fresh machine: the build notice comes on its
    own line before any token is printed, and the build is not counted as generation time."""
    import mlx_lm

    from kvcompress import generate
    from kvcompress.cli import main

    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")
    monkeypatch.setattr(generate, "load_model", lambda name, pipeline=False: stories_model)
    real = mlx_lm.stream_generate

    def stream_generate(*a, **kw):
        first_build.append("generate")
        yield from real(*a, **kw)

    monkeypatch.setattr(mlx_lm, "stream_generate", stream_generate)
    rc = main(["generate", "--model", "stories260K", "--method", "kivi", "--budget", "16", "--max-tokens", "40",
               "--prompt", "Once upon a time, there was a little girl named Lily. She liked to play"])
    out = capsys.readouterr()
    assert rc == 0 and first_build == ["build", "generate"]
    assert out.err.splitlines()[0].startswith("kvcompress: building the low-bit CPU kernel")
    assert "building" not in out.out and "Generation: 40 tokens" in out.out


def test_the_build_notice_takes_its_own_line_under_a_progress_bar(capsys):
    """A benchmark's first KIVI cache builds the kernel while its tqdm bar is drawn: the notice
    used to be glued to the end of the bar's line."""
    tqdm = pytest.importorskip("tqdm").tqdm
    bar = tqdm(total=10, file=sys.stderr, desc="retrieval")
    bar.update(3)
    _build._say("kvcompress: building the low-bit CPU kernel once (test)")
    bar.close()
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert "kvcompress: building the low-bit CPU kernel once (test)" in lines
