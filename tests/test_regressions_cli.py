"""Regression tests for the command line's bad-input handling: each bad input is one
``kvcompress ...: error: ...`` line on stderr, exit status 2, checked before any work, with
nothing written. Each test's docstring names the bug it catches."""

from __future__ import annotations

import pytest

from kvcompress.cli import main


@pytest.fixture(autouse=True)
def no_reexec(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")


def _rc(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(prefix), err
    return err


def _no_run(monkeypatch, module: str):
    """Make a workload's ``run`` fail the test: the check must come before it."""
    import importlib

    def run(args):
        raise AssertionError("the workload ran before its output folder was checked")

    monkeypatch.setattr(importlib.import_module(module), "run", run)


# ------------------------------------------------------------------------------------------
# Output folders and file stems: checked before any work
# ------------------------------------------------------------------------------------------

BENCH = ["retrieval", "synthetic", "perplexity", "speed", "scaling", "serve", "restart", "distributed"]


@pytest.mark.parametrize("workload", BENCH)
def test_bench_out_that_is_a_file_is_refused_before_the_run(workload, tmp_path, capsys, monkeypatch):
    """Bug: ``bench retrieval/synthetic --out FILE`` ran the whole benchmark, then failed with a
    FileExistsError traceback while writing the results."""
    from kvcompress.cli import BENCH_WORKLOADS

    _no_run(monkeypatch, BENCH_WORKLOADS[workload])
    f = tmp_path / "afile"
    f.write_text("keep")
    assert _rc(["bench", workload, "--out", str(f)]) == 2
    assert "not a folder" in _one_line(capsys, f"kvcompress bench {workload}: error: --out {f}")
    assert _rc(["bench", workload, "--out", str(f / "sub")]) == 2
    assert "is a file, not a folder" in _one_line(capsys, f"kvcompress bench {workload}: error: --out")
    assert f.read_text() == "keep"


def test_bench_out_in_an_unwritable_folder_is_refused(tmp_path, capsys, monkeypatch):
    """Bug: an unwritable ``--out`` was only found after the run."""
    import os

    _no_run(monkeypatch, "kvcompress.bench.retrieval")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert _rc(["bench", "retrieval", "--out", str(tmp_path / "res")]) == 2
    assert "is not writable" in _one_line(capsys, "kvcompress bench retrieval: error: --out")


@pytest.mark.parametrize("workload", ["speed", "serve"])
@pytest.mark.parametrize("stem", ["", "../../x", "a/b", ".."])
def test_bench_out_name_must_be_a_plain_file_stem(workload, stem, tmp_path, capsys, monkeypatch):
    """Bug: ``bench speed --out-name ""`` wrote ``.json``; ``--out-name ../../x`` wrote outside
    ``--out``."""
    _no_run(monkeypatch, f"kvcompress.bench.{workload}")
    assert _rc(["bench", workload, "--out", str(tmp_path), "--out-name", stem]) == 2
    assert "plain file name stem" in _one_line(capsys, f"kvcompress bench {workload}: error: --out-name")
    assert not list(tmp_path.iterdir())


def test_tune_out_that_is_a_file_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Bug: ``tune --out FILE`` searched for minutes, then failed with a traceback."""
    import kvcompress.tune.cli as tune_cli

    monkeypatch.setattr(tune_cli, "_workload", lambda args: pytest.fail("loaded before checking --out"))
    f = tmp_path / "afile"
    f.write_text("keep")
    assert _rc(["tune", "--budget", "8", "--out", str(f)]) == 2
    assert "not a folder" in _one_line(capsys, f"kvcompress tune: error: --out {f}")


def test_tune_empty_methods_says_none_was_named(capsys):
    """Bug: ``tune --methods ""`` said "unknown nothing given"."""
    assert _rc(["tune", "--budget", "8", "--methods", ""]) == 2
    _one_line(capsys, "kvcompress tune: error: argument --methods: no method named")
    from kvcompress.tune.cli import check_args

    args = __import__("argparse").Namespace(quick=False, budget=8, candidates=1, finalists=1, windows=1,
                                            held_out=1, window=64, prefill=1, batch=1, seed=0, top=0,
                                            max_minutes=1.0, data=None, model=None, methods=(), out="x")
    with pytest.raises(ValueError, match="--methods: no method named; give a comma list of registered methods: "):
        check_args(args)


@pytest.mark.parametrize("command", [*(["bench", w] for w in BENCH if w not in ("serve", "restart")),
                                     ["tune", "--budget", "8"]])
def test_methods_take_commas_or_spaces_and_refuse_nothing(command, capsys):
    """Bug: ``bench synthetic/speed --methods h2o,cam`` failed (they took spaces only) while the
    other workloads took commas only; ``bench retrieval --methods ""`` ran every method."""
    from kvcompress.cli import build_parser

    parser = build_parser()
    for given in (["h2o,cam"], ["h2o", "cam"], ["h2o,", "cam"], ["h2o, cam"]):
        assert parser.parse_args([*command, "--methods", *given]).methods == ("h2o", "cam"), given
    for empty in ("", ",", " "):
        assert _rc([*command, "--methods", empty]) == 2
        assert "argument --methods: no method named" in _one_line(capsys, f"kvcompress {command[0]}")


# ------------------------------------------------------------------------------------------
# kvcompress serve: mlx-lm's options checked before the model loads and any thread starts
# ------------------------------------------------------------------------------------------


@pytest.fixture
def serve(monkeypatch, capsys):
    """``kvcompress serve ARGS`` in this process (mlx_lm.server's hooks restored afterwards),
    with a --model that does not exist: a check that comes first names its own problem."""
    import mlx_lm.server as srv

    from kvcompress.mlxlm.commands import main as mlx_main

    monkeypatch.setattr(srv, "ModelProvider", srv.ModelProvider)
    monkeypatch.setattr(srv, "LRUPromptCache", srv.LRUPromptCache)
    monkeypatch.setattr(srv, "run", lambda *a, **k: pytest.fail("mlx-lm's server started"))

    def run(*args):
        rc = mlx_main("serve", ["--model", "/no/such/model", "--method", "h2o", *args])
        return rc, _one_line(capsys, "kvcompress serve: error: ")

    return run


def test_serve_busy_port_is_one_line_before_the_model_loads(serve):
    """Bug: a busy ``--port`` printed an OSError traceback after loading the model, and the
    process never exited (mlx-lm's generation thread was already running)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, err = serve("--host", "127.0.0.1", "--port", str(port))
    assert rc == 2 and f"cannot listen on 127.0.0.1 port {port}: the port is in use" in err, err


@pytest.mark.parametrize("args, says", [
    (["--port", "-1"], "--port must be in [1, 65535], got -1"),
    (["--port", "70000"], "--port must be in [1, 65535], got 70000"),
    (["--temp", "-1"], "--temp must be >= 0, got -1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid': not an address of this machine"),
])
def test_serve_bad_port_and_sampling_options_are_one_line(serve, args, says):
    """Bug: ``serve --port -1`` / ``70000`` printed a traceback and hung; ``--temp -1`` and
    ``--max-tokens 0`` were accepted (generate refuses them)."""
    rc, err = serve(*args)
    assert rc == 2 and says in err, err


def test_serve_checks_the_model_after_the_options(serve):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, err = serve("--host", "127.0.0.1", "--port", str(port))
    assert rc == 2 and "cannot load --model '/no/such/model'" in err, err


# ------------------------------------------------------------------------------------------
# Bad models, texts and sizes name the option that is wrong
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["missing", "empty-folder"])
def test_chat_bad_model_is_one_line_naming_it(kind, tmp_path, capsys, monkeypatch):
    """Bug: ``chat --model /nonexist`` (or a folder without config.json) was a traceback;
    generate and serve said what was wrong in one line."""
    from kvcompress.mlxlm.commands import main as mlx_main

    model = tmp_path / "model"
    if kind == "empty-folder":
        model.mkdir()
    assert mlx_main("chat", ["--model", str(model)]) == 2
    err = _one_line(capsys, "kvcompress chat: error: ")
    if kind == "missing":
        assert f"model {str(model)!r} is neither a local mlx-lm folder nor a reachable Hugging Face id" in err
    else:
        assert f"model folder {str(model)!r} could not be loaded by mlx-lm" in err and "config.json" in err


@pytest.mark.parametrize("argv, says", [
    (["retrieval", "--model", "/no/such/model"], "--model /no/such/model: no retrieval model folder there"),
    (["perplexity", "--model", "/no/such/model"], "--model /no/such/model: no mlx-lm model folder there"),
    (["perplexity", "--text", "/no/such/text.txt"], "--text /no/such/text.txt: no file there"),
    (["perplexity", "--text", "."], "--text .: a folder; name a UTF-8 text file"),
    (["distributed", "--quick", "--hidden", "7"], "hidden must be a multiple of 16"),
    (["serve", "--quick", "--hidden", "7"], "hidden must be a multiple of n_heads (4), got 7"),
])
def test_bench_bad_paths_and_shapes_are_one_line(argv, says, tmp_path, capsys, monkeypatch):
    """Bug: ``bench retrieval --model /nonexist`` was a FileNotFoundError traceback; ``bench
    perplexity --model/--text`` bad paths did not say which option was wrong (or exited 1);
    ``--hidden 7`` (not a multiple of the heads) failed deep in mlx-lm with a traceback."""
    import mlx_lm

    monkeypatch.setattr(mlx_lm, "load", lambda *a, **k: pytest.fail("loaded a model"))
    assert _rc(["bench", *argv, "--out", str(tmp_path)]) == 2
    assert says in _one_line(capsys, f"kvcompress bench {argv[0]}: error: ")
    assert not list(tmp_path.iterdir())


def test_ctrl_c_is_a_quiet_exit_130(monkeypatch, capsys, tmp_path):
    """Bug: Ctrl-C during ``kvcompress bench`` printed a KeyboardInterrupt traceback."""
    import kvcompress.bench.synthetic as synthetic

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "run", interrupted)
    assert main(["bench", "synthetic", "--out", str(tmp_path)]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_a_cache_file_missing_a_tensor_names_it(model, tmp_path):
    """Bug: a cache file with one tensor removed (digest still valid) loaded, then failed at
    generation with "AttributeError: 'dict' object has no attribute 'shape'"."""
    import mlx.core as mx

    import kvcompress
    from kvcompress.persistence import CorruptCacheFile, load_prompt_cache, save_prompt_cache

    cache = kvcompress.make_prompt_cache(model, "h2o", budget=16)
    model(mx.arange(40)[None], cache=cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    arrays, meta = mx.load(path, return_metadata=True)
    for drop, says in [("0.0", "missing tensor '0.0' of layer 0"), ("1.", "missing layer 1 (all its tensors)")]:
        kept = {k: v for k, v in arrays.items() if not (k == drop or (drop.endswith(".") and k.startswith(drop)))}
        bad = str(tmp_path / "bad.safetensors")
        mx.save_safetensors(bad, kept, meta)
        with pytest.raises(CorruptCacheFile, match="the file is damaged or incomplete: " + says.replace("(", r"\(")
                           .replace(")", r"\)")):
            load_prompt_cache(bad)
    assert len(load_prompt_cache(path)) == len(cache)


# ------------------------------------------------------------------------------------------
# Listings and small options
# ------------------------------------------------------------------------------------------


def test_listing_columns_stay_aligned_for_long_names(monkeypatch, capsys):
    """Bug: ``kvcompress methods`` / ``doctor`` ran a name of 17+ characters into the next
    column."""
    import types

    import kvcompress.cli as cli
    from kvcompress import MethodSpec, hookimpl
    from kvcompress.registry import Registry

    long = "a_really_long_method_name"
    mod = types.SimpleNamespace(kvcompress_methods=hookimpl(
        lambda: [MethodSpec(long, "h2o", "lowest", "drop", "uniform", "long")]))
    reg = Registry(plugins=[("a_really_long_plugin_name", mod)])
    monkeypatch.setattr(cli, "_registry", lambda listing=False: reg)
    assert main(["methods"]) == 0
    rows = capsys.readouterr().out.splitlines()
    second = {len(line) - len(line[len(line.split()[0]):].lstrip(" ")) for line in rows}  # column 2 starts
    assert len(second) == 1 and second.pop() == len(long) + 2, rows  # two spaces between columns
    assert main(["plugins"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith(" ")]
    assert len({len(ln) - len(ln[len(ln.split()[0]):].lstrip(" ")) for ln in lines}) == 1, lines


def test_methods_json_and_markdown_are_mutually_exclusive(capsys):
    """Bug: ``methods --json --markdown`` printed the Markdown and ignored --json."""
    assert _rc(["methods", "--json", "--markdown"]) == 2
    assert "not allowed with argument --json" in _one_line(capsys, "kvcompress methods: error: ")


def test_version(capsys):
    """``kvcompress --version`` did not exist."""
    import kvcompress

    assert _rc(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvcompress {kvcompress.__version__}"
