"""``kvcompress generate``: bad options are one error line (exit 2) before the model loads, and the
KV-cache line compares the bytes held with what mlx-lm's own ``KVCache`` would hold."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

import kvcompress
from kvcompress import generate
from kvcompress.cli import main
from kvcompress.generate import cache_report, full_cache_bytes


def _error(capsys, argv) -> str:
    """Run the CLI expecting exit status 2 and one ``kvcompress generate: error: ...`` line."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("kvcompress generate: error: "), err
    return lines[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model is loaded: these errors must come first."""
    monkeypatch.setattr(mlx_lm, "load", lambda *a, **k: pytest.fail("the model was loaded"))


# ------------------------------------------------------------------------------------------
# Options checked before the model loads
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-tokens", "0"], "argument --max-tokens/-m: expected a positive integer, got 0"),
        (["-m", "-5"], "argument --max-tokens/-m: expected a positive integer, got -5"),
        (["--max-tokens", "many"], "expected a positive integer, got 'many'"),
        (["--budget", "0"], "argument --budget: expected a positive integer, got 0"),
        (["--prefill-step-size", "0"], "argument --prefill-step-size: expected a positive integer"),
        (["--temp", "-1"], "argument --temp: expected a number >= 0, got '-1'"),
        (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got '0'"),
        (["--param", "n_sink"], "argument --param: expected NAME=VALUE, got 'n_sink'"),
        (["--method", "snapvk"], "unknown method 'snapvk'; did you mean 'snapkv'? registered methods: "),
        (["--method", "h2o", "--param", "n_sinks=2"], "unknown parameter 'n_sinks' for method 'h2o'"),
        (["--method", "h2o", "--config", "x.toml"], "give either --method or --config, not both"),
        (["--save-prompt-cache", "no/such/dir/c.safetensors"], "folder 'no/such/dir' does not exist"),
    ],
)
def test_bad_options_are_one_line_before_the_model_loads(no_model_load, capsys, extra, message):
    line = _error(capsys, ["generate", "--model", "unused", *extra])
    assert message in line, line


def test_a_method_whose_plugin_is_disabled_says_how_to_re_enable(no_model_load, capsys, monkeypatch):
    from kvcompress.registry import reset_registry

    monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGINS", "streaming_llm")
    reset_registry()
    try:
        line = _error(capsys, ["generate", "--model", "unused", "--method", "kivi"])
    finally:
        monkeypatch.delenv("KVCOMPRESS_DISABLE_PLUGINS")
        reset_registry()
    assert "scorer 'recency' comes from plugin 'streaming_llm', which is disabled" in line
    assert "remove 'streaming_llm' from KVCOMPRESS_DISABLE_PLUGINS" in line


@pytest.mark.parametrize("kind", ["missing", "empty-folder"])
def test_a_bad_model_is_one_line_naming_it(capsys, tmp_path, kind):
    model = tmp_path / "model"
    if kind == "empty-folder":
        model.mkdir()
    line = _error(capsys, ["generate", "--model", str(model), "--max-tokens", "1"])
    if kind == "missing":
        assert f"model {str(model)!r} is neither a local mlx-lm folder nor a reachable Hugging Face id" in line
    else:
        assert f"model folder {str(model)!r} could not be loaded by mlx-lm" in line and "config.json" in line


def test_main_reports_os_and_value_errors_of_generate_but_not_bugs(monkeypatch, capsys):
    def fail(exc):
        def run(args):
            raise exc
        return run

    monkeypatch.setattr(generate, "run", fail(OSError(28, "No space left on device")))
    assert "OSError: [Errno 28] No space left on device" in _error(capsys, ["generate", "--model", "m"])
    monkeypatch.setattr(generate, "run", fail(ValueError("bad\nvalue")))
    assert _error(capsys, ["generate", "--model", "m"]).endswith("ValueError: bad value")
    monkeypatch.setattr(generate, "run", fail(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        main(["generate", "--model", "m"])


# ------------------------------------------------------------------------------------------
# The KV cache line: bytes held vs mlx-lm's KVCache
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, dk, dv", [(mx.float32, 16, 16), (mx.float16, 8, 12)])
@pytest.mark.parametrize("prefill", [1, 200, 256, 300, 600])
def test_full_cache_bytes_is_what_mlx_lm_kvcache_holds(dtype, dk, dv, prefill):
    c = KVCache()
    B, H = 2, 3
    c.update_and_fetch(mx.zeros((B, H, prefill, dk), dtype), mx.zeros((B, H, prefill, dv), dtype))
    for _ in range(300):  # decode one token at a time across a step boundary
        assert full_cache_bytes(c.offset, c.keys, c.values) == c.nbytes, c.offset
        c.update_and_fetch(mx.zeros((B, H, 1, dk), dtype), mx.zeros((B, H, 1, dv), dtype))


def test_cache_report_compares_held_bytes_with_mlx_lm_kvcache(tiny_model):
    caches = kvcompress.make_prompt_cache(tiny_model, "h2o", budget=16)
    full = [KVCache() for _ in caches]
    tokens = mx.arange(1, 41)[None]
    steps = [tokens[:, :30], *(tokens[:, t:t + 1] for t in range(30, 40))]  # prefill, then decode
    for step in steps:
        mx.eval(tiny_model(step, cache=caches), tiny_model(step, cache=full))
    report = cache_report(caches)
    assert report["held_bytes"] == sum(c.nbytes for c in caches)
    assert report["full_bytes"] == sum(c.nbytes for c in full)
