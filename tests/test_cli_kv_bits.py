"""``--kv-bits`` / ``--kv-group-size`` on the command line: the method's low-bit storage of the kept
slots (``generate``, ``serve``, ``chat``), never mlx-lm's ``kv_bits`` (which would quantize a full
cache); a bad value or a method that cannot take it is one error line, exit status 2."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import mlx_lm
import pytest

import kvcompress
from conftest import tiny_llama
from kvcompress import generate
from kvcompress.cli import build_parser, main
from kvcompress.mlxlm import commands
from kvcompress.storage import KVStorage

ASSET = Path(kvcompress.__file__).resolve().parent / "assets" / "retrieval"
LONG = " ".join(["a b c"] * 30)  # 91 tokens of the retrieval tokenizer: past the budget below


@pytest.fixture(autouse=True)
def no_reexec(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")


@pytest.fixture
def no_model_load(monkeypatch):
    monkeypatch.setattr(mlx_lm, "load", lambda *a, **k: pytest.fail("the model was loaded"))


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(prefix), err
    return err


def _rc(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


def _generate_method(*flags):
    args = build_parser().parse_args(["generate", "--model", "unused", "--method", "snapkv", *flags])
    return generate.check_args(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------
# The options become the method's storage
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, storage", [
    (["--kv-bits", "4", "--kv-group-size", "32"], KVStorage(4, 4, 32)),
    (["--kv-bits", "8,4"], KVStorage(8, 4, 64)),
    (["--kv-bits", "K8V4", "--kv-group-size", "128"], KVStorage(8, 4, 128)),
    (["--kv-bits=2"], KVStorage(2, 2, 64)),
    ([], KVStorage()),
])
def test_generate_options_are_the_methods_storage(no_model_load, flags, storage):
    method = _generate_method("--budget", "64", *flags)
    assert method.storage == storage
    assert method.config.storage == storage.to_dict()


def test_the_options_override_a_configs_storage(no_model_load, tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('method = "snapkv"\n[budget]\nbudget = 64\n[storage]\nkv_bits = 4\nkv_group_size = 32\n')
    args = ["generate", "--model", "unused", "--config", str(cfg)]
    assert generate.check_args(build_parser().parse_args(args)).storage == KVStorage(4, 4, 32)
    method = generate.check_args(build_parser().parse_args([*args, "--kv-bits", "8"]))
    assert method.storage == KVStorage(8, 8, 32)
    assert not generate.check_args(build_parser().parse_args([*args, "--kv-bits", "none"])).storage.quantized


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_serve_and_chat_take_the_options_and_never_pass_them_to_mlx_lm(monkeypatch, command):
    """The options go into the method; mlx-lm's server never sees ``--kv-bits`` (its kv_bits would
    quantize a full cache and turn its batching off)."""
    import kvcompress.serve as serve
    from kvcompress.serve.options import check_storage_args, parse_server_args

    seen = {}
    monkeypatch.setattr(serve, "run_server", lambda method, rest: seen.update(method=method, rest=rest) or 0)
    monkeypatch.setattr(commands, "_run_chat", lambda method, rest: seen.update(method=method, rest=rest) or 0)
    argv = ["--model", "m", "--method", "snapkv", "--budget", "64", "--kv-bits", "8,4", "--kv-group-size", "32",
            "--max-tokens", "5"]
    assert commands.main(command, argv) == 0
    assert seen["method"].storage == KVStorage(8, 4, 32)
    assert seen["rest"] == ["--model", "m", "--max-tokens", "5"]
    if command == "serve":
        cli = parse_server_args(seen["rest"])
        assert cli.kv_bits is None
        check_storage_args(cli)


def test_serve_accepts_kv_bits_and_goes_on_to_load_the_model(monkeypatch, capsys):
    """``serve --kv-bits 4`` passes every option check; the next thing is the model (here missing)."""
    import mlx_lm.server as srv

    monkeypatch.setattr(srv, "ModelProvider", srv.ModelProvider)
    monkeypatch.setattr(srv, "LRUPromptCache", srv.LRUPromptCache)
    rc = commands.main("serve", ["--model", "/no/such/model", "--method", "snapkv", "--budget", "1024", "--kv-bits",
                                 "4", "--host", "127.0.0.1", "--port", str(_free_port())])
    err = _one_line(capsys, "kvcompress serve: error: ")
    assert rc == 2 and "cannot load --model '/no/such/model'" in err, err


def test_mlx_lms_kv_bits_reaching_the_server_options_is_refused():
    from kvcompress import KVCompressError
    from kvcompress.serve.options import check_storage_args, parse_server_args

    check_storage_args(parse_server_args(["--kv-group-size", "64"]))  # mlx-lm's defaults are fine
    for flags, says in [(["--kv-bits", "4"], "--kv-bits reached mlx-lm's server options"),
                        (["--kv-group-size", "32"], "--kv-group-size reached mlx-lm's server options"),
                        (["--quantized-kv-start", "0"], "--quantized-kv-start is mlx-lm's")]:
        with pytest.raises(KVCompressError, match=re.escape(says)):
            check_storage_args(parse_server_args(flags))


# ------------------------------------------------------------------------------------------
# Bad values and methods that cannot take it: one line, before the model loads
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, says", [
    (["--kv-bits", "7"], "--kv-bits 7: kv_bits must be one of 2, 3, 4, 5, 6, 8"),
    (["--kv-bits", "16,4"], "must be one of 2, 3, 4, 5, 6, 8"),
    (["--kv-bits", "four"], "--kv-bits four: kv_bits 'four' is not a number of bits (4), a pair (8,4) or K8V4; "
                            "bits: 2, 3, 4, 5, 6, 8"),
    (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size 48: kv_group_size must be one of 32, 64, 128"),
    (["--kv-group-size", "32"], "--kv-group-size sets the groups of low-bit storage; give --kv-bits too"),
    (["--quantized-kv-start", "0"], "--quantized-kv-start is mlx-lm's; kvcompress stores every kept slot in "
                                    "low bits from the first token"),
    (["--kv-bits", "4", "--param", "kv_bits=8"], "give kv_bits once: --kv-bits or --param kv_bits=..., not both"),
    (["--method", "kivi", "--kv-bits", "4"], "kv_bits: disposition 'kivi_quant' holds its own low-bit store"),
    (["--method", "h2o_kivi", "--kv-bits", "4"], "kv_bits: disposition 'kivi_quant' holds its own low-bit store"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_values_are_one_line_naming_the_choices(no_model_load, capsys, command, flags, says):
    argv = [command, "--model", "/no/such/model", "--method", "snapkv", "--budget", "64", *flags]
    if command == "generate":
        rc = _rc(argv)
    else:
        rc = commands.main("serve", argv[1:])
    err = _one_line(capsys, f"kvcompress {command}: error: ")
    assert rc == 2 and says in err, err


def test_a_saved_cache_refuses_the_storage_options(no_model_load, capsys, tmp_path):
    saved = tmp_path / "c.safetensors"
    saved.write_bytes(b"")
    rc = _rc(["generate", "--model", "unused", "--prompt-cache-file", str(saved), "--kv-bits", "4",
              "--kv-group-size", "32"])
    err = _one_line(capsys, "kvcompress generate: error: ")
    assert rc == 2 and "the method stored in the file; drop --kv-bits, --kv-group-size" in err, err


def test_a_group_size_the_heads_cannot_take_is_refused_when_the_cache_is_built():
    """Not at the first step (for serve: at start-up, not at the first request)."""
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2)  # head_dim 16
    with pytest.raises(kvcompress.ConfigError, match="kv_group_size 64 does not divide the model's key head "
                                                     "dimension 16"):
        kvcompress.make_prompt_cache(model, "snapkv", budget=64, kv_bits=4)
    kvcompress.make_prompt_cache(tiny_llama(n_layers=1, hidden=128, heads=4, kv_heads=2), "snapkv", budget=64,
                                 kv_bits=4, kv_group_size=32)  # head_dim 32


def test_a_served_prompt_cache_file_is_only_for_the_same_storage():
    """``kvcompress serve --prompt-cache-dir``: a file's identity (and so its name) includes the
    storage, so a server never loads caches held in other bits."""
    from kvcompress.serve.identity import cache_identity

    model = tiny_llama(n_layers=1, hidden=128, heads=4, kv_heads=2)
    ids = {bits: cache_identity(model, None, kvcompress.build_method("snapkv", budget=64, kv_bits=bits,
                                                                     kv_group_size=32))
           for bits in (None, 4, 8, "8,4")}
    assert len({i.digest for i in ids.values()}) == len(ids) and len({i.text for i in ids.values()}) == len(ids)
    again = cache_identity(model, None, _generate_method("--budget", "64", "--kv-bits", "4", "--kv-group-size", "32"))
    assert again == ids[4]


# ------------------------------------------------------------------------------------------
# End to end: kvcompress generate --kv-bits on a tiny saved model
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama with head_dim 64 and the retrieval model's tokenizer, in a folder."""
    from mlx_lm.utils import save_config, save_model

    folder = tmp_path_factory.mktemp("kvbits") / "model"
    folder.mkdir()
    model = tiny_llama(n_layers=2, hidden=128, heads=2, kv_heads=1, vocab=72)
    save_model(folder, model)
    save_config({**{k: v for k, v in vars(model.args).items() if not k.startswith("_") and v is not None},
                 "max_position_embeddings": 2048}, folder / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSET / f, folder / f)
    return folder


def _held_mb(out: str) -> float:
    return float(re.search(r"^KV cache: ([0-9.]+) MB held", out, re.M).group(1))


def test_generate_with_kv_bits_on_a_saved_model(saved_model, tmp_path, capsys):
    run = ["generate", "--model", str(saved_model), "--method", "snapkv", "--budget", "40", "--prompt", LONG,
           "--max-tokens", "8", "--ignore-chat-template"]
    assert main(run) == 0
    full = _held_mb(capsys.readouterr().out)
    saved = tmp_path / "c.safetensors"
    assert main([*run, "--kv-bits", "8", "--save-prompt-cache", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "Generation: 8 tokens" in out
    assert _held_mb(out) < full / 2  # 8-bit codes (+ a scale and bias per 64) vs float32
    cache = kvcompress.load_prompt_cache(str(saved))
    assert cache[0].method.storage == KVStorage(8, 8, 64) and cache[0].tokens_kept == 40
    # the file carries its storage: continuing it needs no --kv-bits
    assert main(["generate", "--model", str(saved_model), "--prompt-cache-file", str(saved), "--prompt", "a b",
                 "--max-tokens", "2", "--ignore-chat-template"]) == 0
    assert "Generation: 2 tokens" in capsys.readouterr().out


def test_serve_with_kv_bits_batches_requests_and_reuses_a_conversations_cache(saved_model, tmp_path):
    """A real ``kvcompress serve --kv-bits 4`` on 127.0.0.1: concurrent requests are answered
    (continuous batching of low-bit rows), and the next turn of a conversation resumes its
    compressed low-bit cache (cached_tokens), past the budget."""
    import threading

    from _serve_helpers import post, start

    p = start(tmp_path, saved_model, "--kv-bits", "4", method=("--method", "snapkv", "--budget", "40"))
    try:
        url = p.url
        results = []

        def ask(i):
            results.append(post(url + "/v1/completions", {"prompt": LONG + f" {i}", "max_tokens": 6,
                                                          "temperature": 0}))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(results) == 3 and all(s == 200 and r["usage"]["completion_tokens"] == 6 for s, r, _ in results)
        first = post(url + "/v1/completions", {"prompt": LONG, "max_tokens": 4, "temperature": 0})[1]
        n = first["usage"]["prompt_tokens"]
        again = post(url + "/v1/completions", {"prompt": LONG + first["choices"][0]["text"] + " a b",
                                               "max_tokens": 4, "temperature": 0})[1]
        # (the first turn's last token may merge with the reply's first one when re-tokenized)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 1 > 40
    finally:
        p.stop()
