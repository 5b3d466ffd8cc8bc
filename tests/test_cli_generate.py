"""``kvcompress generate``: bad options are one error line (exit 2) before the model loads, a saved
cache continues without a second BOS or chat-template opening, and the KV-cache line compares the
bytes held with what mlx-lm's own ``KVCache`` would hold."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

import kvcompress
from kvcompress import generate
from kvcompress.cli import main
from kvcompress.generate import cache_report, prompt_tokens

TEMPLATE = (
    "{% for m in messages %}{{ bos_token if loop.first else '' }}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


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
        (["--prompt-cache-file", "nope.safetensors"], "--prompt-cache-file 'nope.safetensors' does not exist"),
        (["--save-prompt-cache", "no/such/dir/c.safetensors"], "folder 'no/such/dir' does not exist"),
        (["--seed", "-1"], "argument --seed: expected an integer in [0, 2**64 - 1], got '-1'"),
        (["--seed", str(2**64)], f"argument --seed: expected an integer in [0, 2**64 - 1], got '{2**64}'"),
        (["--prompt", "ab\udcff"], "--prompt is not UTF-8 text (byte 0xff at position 2)"),
    ],
)
def test_bad_options_are_one_line_before_the_model_loads(no_model_load, capsys, extra, message):
    line = _error(capsys, ["generate", "--model", "unused", *extra])
    assert message in line, line


def test_a_prompt_on_stdin_that_is_not_utf8_is_one_line(no_model_load, capsys, monkeypatch):
    """Bug: ``--prompt -`` with non-UTF-8 bytes on stdin was a UnicodeDecodeError traceback."""
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Once \xff\xfe")))
    line = _error(capsys, ["generate", "--model", "unused", "--prompt", "-"])
    assert "the prompt read from stdin (--prompt -) is not UTF-8 text (byte 0xff at position 5)" in line


def test_folders_given_as_cache_files_are_one_line(no_model_load, capsys, tmp_path):
    """Bug: ``--save-prompt-cache DIR`` silently wrote ``DIR.safetensors`` (or, when that was a
    folder, failed after generating with a traceback); ``--prompt-cache-file DIR`` said "does
    not exist"."""
    line = _error(capsys, ["generate", "--model", "unused", "--save-prompt-cache", str(tmp_path)])
    assert f"--save-prompt-cache {str(tmp_path)!r} is a folder; name a file in it" in line
    (tmp_path / "c.safetensors").mkdir()
    line = _error(capsys, ["generate", "--model", "unused", "--save-prompt-cache", str(tmp_path / "c")])
    assert f"the file it writes, {str(tmp_path / 'c.safetensors')!r}, is a folder" in line
    line = _error(capsys, ["generate", "--model", "unused", "--prompt-cache-file", str(tmp_path)])
    assert f"--prompt-cache-file {str(tmp_path)!r} is a folder" in line
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


@pytest.mark.parametrize("held, full, says", [(100, 356, "3.56x smaller"), (356, 100, "3.56x larger"),
                                              (1000, 1001, "about the same size"), (0, 0, "about the same size")])
def test_the_cache_line_says_larger_when_the_compressed_cache_is_bigger(held, full, says):
    """Bug: a compressed cache bigger than the full one was reported as "0.99x smaller"."""
    assert generate._ratio_words({"held_bytes": held, "full_bytes": full}) == says


@pytest.mark.parametrize(
    "extra", [["--method", "h2o"], ["--budget", "32"], ["--config", "c.toml"], ["--param", "n_sink=2"],
              ["--method", "h2o", "--budget", "32"]],
)
def test_a_saved_cache_refuses_method_options(no_model_load, capsys, tmp_path, extra):
    saved = tmp_path / "c.safetensors"
    saved.write_bytes(b"")
    line = _error(capsys, ["generate", "--model", "unused", "--prompt-cache-file", str(saved), *extra])
    assert "--prompt-cache-file continues the saved cache with the method stored in the file" in line
    assert "drop " + ", ".join(a for a in extra if a.startswith("--")) in line


def test_an_unreadable_saved_cache_is_one_line(no_model_load, capsys, tmp_path):
    saved = tmp_path / "c.safetensors"
    saved.write_bytes(b"not a safetensors file")
    line = _error(capsys, ["generate", "--model", "unused", "--prompt-cache-file", str(saved)])
    assert f"--prompt-cache-file {str(saved)!r}" in line


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
# Continuing a saved cache
# ------------------------------------------------------------------------------------------


@pytest.fixture
def chat_tokenizer(stories_model, monkeypatch):
    """The stories260K tokenizer with a chat template set on it (it has none of its own)."""
    tok = stories_model[1]
    # mlx-lm's TokenizerWrapper forwards these attributes to the tokenizer it wraps: patch that
    # one, so that undoing the patch restores them on every pytest version
    monkeypatch.setattr(tok._tokenizer, "chat_template", TEMPLATE)
    monkeypatch.setattr(tok._tokenizer, "has_chat_template", True)
    return tok


def test_continuation_tokens_without_a_chat_template(stories_model):
    tok = stories_model[1]
    assert not tok.has_chat_template
    fresh = prompt_tokens(tok, " The end.")
    cont = prompt_tokens(tok, " The end.", continuation=True)
    assert fresh[0] == tok.bos_token_id and fresh[1:] == cont
    assert cont == tok.encode(" The end.", add_special_tokens=False) and tok.bos_token_id not in cont


def test_continuation_tokens_with_a_chat_template_are_only_the_new_turn(chat_tokenizer):
    tok = chat_tokenizer
    fresh = prompt_tokens(tok, "The end.", system_prompt="Be brief.")
    assert tok.decode(fresh).startswith("<s> <|system|>\nBe brief.")
    cont = prompt_tokens(tok, "The end.", system_prompt="Be brief.", continuation=True)
    assert cont == tok.encode("<|user|>\nThe end.</s>\n<|assistant|>\n", add_special_tokens=False)
    assert tok.bos_token_id not in cont and "system" not in tok.decode(cont)
    raw = prompt_tokens(tok, "The end.", chat_template=False, continuation=True)
    assert raw == tok.encode("The end.", add_special_tokens=False)


def _capture_prompts(monkeypatch) -> list:
    seen, real = [], mlx_lm.stream_generate

    def stream_generate(model, tokenizer, prompt, **kw):
        seen.append(list(prompt))
        yield from real(model, tokenizer, prompt, **kw)

    monkeypatch.setattr(mlx_lm, "stream_generate", stream_generate)
    return seen


@pytest.mark.parametrize("template", [False, True], ids=["raw", "chat-template"])
def test_generate_continues_a_saved_cache_without_repeating_the_opening(
    stories_model, chat_tokenizer, monkeypatch, capsys, tmp_path, template
):
    model, tok = stories_model
    if not template:
        monkeypatch.setattr(tok._tokenizer, "has_chat_template", False)
        monkeypatch.setattr(tok._tokenizer, "chat_template", None)
    monkeypatch.setattr(mlx_lm, "load", lambda name: (model, tok))
    prompts = _capture_prompts(monkeypatch)
    saved = tmp_path / "c.safetensors"
    assert main(["generate", "--model", "stories", "--method", "h2o", "--budget", "24", "--max-tokens", "20",
                 "--save-prompt-cache", str(saved)]) == 0
    offset = kvcompress.load_prompt_cache(str(saved))[0].offset
    capsys.readouterr()
    assert main(["generate", "--model", "stories", "--prompt-cache-file", str(saved), "--prompt", "The end.",
                 "--max-tokens", "5", "--verbose"]) == 0
    first, second = prompts
    assert first[0] == tok.bos_token_id and tok.bos_token_id not in second
    text = "<|user|>\nThe end.</s>\n<|assistant|>\n" if template else "The end."
    assert second == tok.encode(text, add_special_tokens=False)
    out = capsys.readouterr().out
    n_new = int(re.search(r"^Generation: (\d+) tokens", out, re.M).group(1))
    assert f"'offset': {offset + len(second) + n_new}," in out, out


# ------------------------------------------------------------------------------------------
# The KV cache line: bytes held vs mlx-lm's KVCache
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["h2o", "adakv"])
def test_cache_report_compares_held_bytes_with_mlx_lm_kvcache(tiny_model, method):
    """Also a bug: with head groups (adakv stores several KV heads per row) the full cache's
    bytes counted storage rows as heads (the report said the full cache was smaller)."""
    caches = kvcompress.make_prompt_cache(tiny_model, method, budget=16, **({"recent": 4, "step": 4} if method == "adakv" else {}))
    full = [KVCache() for _ in caches]
    tokens = (mx.arange(1, 271) % 90 + 1)[None]
    steps = [tokens[:, :250], *(tokens[:, t:t + 1] for t in range(250, 270))]  # prefill, then decode past 256
    for step in steps:
        mx.eval(tiny_model(step, cache=caches), tiny_model(step, cache=full))
    report = cache_report(caches)
    assert report["held_bytes"] == sum(c.nbytes for c in caches)
    assert report["full_bytes"] == sum(c.nbytes for c in full)
