"""The command line without a model: method listings, config validation, doctor, bench help.

Bad input is one ``kvcompress...: error: ...`` line (or ``FILE: invalid: ...``) and exit status 2.
"""

from __future__ import annotations

import json

import pytest

import kvcompress
from kvcompress.cli import main
from kvcompress.registry import reset_registry


@pytest.fixture
def disabled(monkeypatch):
    """Run with ``KVCOMPRESS_DISABLE_PLUGINS`` set to the given names (a fresh registry)."""

    def set_(names: str):
        monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGINS", names)
        reset_registry()

    yield set_
    monkeypatch.delenv("KVCOMPRESS_DISABLE_PLUGINS")
    reset_registry()


def _one_error_line(err: str, prefix: str = "kvcompress") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(prefix) and ": error: " in lines[0], err
    return lines[0]


# ------------------------------------------------------------------------------------------
# kvcompress methods
# ------------------------------------------------------------------------------------------


def test_methods_marks_a_method_whose_component_plugin_is_disabled(disabled, capsys):
    disabled("streaming_llm")
    assert main(["methods"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    why = "scorer 'recency' comes from plugin 'streaming_llm', which is disabled"
    assert lines["kivi"].split(None, 1)[1].endswith(f"  [unavailable: {why}]")
    assert "unavailable" not in lines["h2o"] and "streaming_llm" not in lines
    assert main(["methods", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kivi"]["available"] is False and data["kivi"]["why"] == why
    assert data["h2o"]["available"] is True and "why" not in data["h2o"]



def test_methods_columns_are_aligned(capsys):
    """Every row's composition and summary start in the same column as the header's."""
    assert main(["methods"]) == 0
    out = capsys.readouterr().out.splitlines()
    head, rows = out[0], out[1:]
    assert head.split("  ")[0].strip() == "method" and "`" not in "\n".join(out)
    comp, summ = head.index("scorer + selector"), head.index("summary")
    reg = kvcompress.get_registry()
    assert len(rows) == len(reg.methods)
    for line, name in zip(rows, sorted(reg.methods)):
        spec = reg.method(name)
        assert line[:comp].rstrip() == name and line[comp - 2:comp] == "  " and line[comp] != " ", line
        assert line[comp:summ].rstrip() == f"{spec.scorer} + {spec.selector} + {spec.disposition} + {spec.budget}"
        assert line[summ - 2:summ] == "  " and line[summ] != " ", line


def test_aligned_wraps_the_last_column_under_itself():
    from kvcompress.cli import aligned

    lines = aligned([("a", "bb", "one two three four five six seven eight nine ten"), ("ccc", "d", "x")], wrap=40)
    assert lines[0] == "a    bb  one two three four five six"
    assert lines[1] == "         seven eight nine ten" and lines[2] == "ccc  d   x"


# ------------------------------------------------------------------------------------------
# kvcompress --help
# ------------------------------------------------------------------------------------------


def test_help_lists_every_command_with_a_one_line_summary_in_plain_text(capsys):
    from kvcompress.cli import SUMMARIES, build_parser

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvcompress [-h] [--version] COMMAND ...\n")
    assert "`" not in out and "{" not in out  # no reST/markdown quoting, no argparse choice braces
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(SUMMARIES) == set(commands)
    listed = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()}
    for name in commands:
        assert name in listed, f"{name} missing from kvcompress --help"
        assert listed[name].split(None, 1)[1] == SUMMARIES[name] and len(listed[name]) <= 100
    assert "kvcompress COMMAND --help" in out


@pytest.mark.parametrize("command", ["plugins", "components", "methods", "config", "bench", "generate", "tune",
                                     "doctor"])
def test_each_command_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvcompress {command}") and "`" not in out, out


# ------------------------------------------------------------------------------------------
# kvcompress config validate
# ------------------------------------------------------------------------------------------


def test_validate_a_binary_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "cam.toml"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{path}: invalid: config file ") and "not UTF-8 text" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "text, why",
    [
        ('method = "h2o"\n[params]\nbudget = 4\nn_sink = 4\n',
         "budget 'uniform' for a 1-layer model: layer 0 gets 4 tokens but selector 'lowest' always keeps 6"),
        ('method = "pyramidkv"\n[params]\nbudget = 8\n',
         "budget 'pyramid' for a 1-layer model: pyramid budget 8 leaves 0 prefix tokens after the window w=8"),
    ],
    ids=["sinks-fill-the-budget", "pyramid-below-its-window"],
)
def test_validate_rejects_a_config_whose_layer_budgets_cannot_be_built(tmp_path, capsys, text, why):
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{path}: invalid: {why}") and len(err.splitlines()) == 1, err


def test_validate_ok_says_what_was_checked_and_what_is_left(tmp_path, capsys):
    path = tmp_path / "squeeze.toml"
    path.write_text('method = "squeeze"\n[params]\nbudget = 16\n')
    assert main(["config", "validate", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: ok" and out[1].startswith("squeeze: scorer=h2o(")
    assert out[2].startswith("checked: ") and "1, 2, 8, 32 layers" in out[2]
    assert "left to build time: the model's layer count and head dim" in out[2] and "squeeze" in out[2]


def test_validate_suggests_the_method_meant(tmp_path, capsys):
    path = tmp_path / "typo.json"
    path.write_text('{"method": "snapvk"}')
    assert main(["config", "validate", str(path)]) == 2
    assert "unknown method 'snapvk'; did you mean 'snapkv'?" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# kvcompress doctor
# ------------------------------------------------------------------------------------------


def _doctor_blas(monkeypatch, capsys, *, found, preloaded, no_reexec=False) -> list[str]:
    import platform

    from kvcompress import _blas

    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr(_blas, "find_openblas", lambda: found)
    monkeypatch.setattr(_blas, "openblas_preloaded", lambda: preloaded)
    if no_reexec:
        monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")
    else:
        monkeypatch.delenv("KVCOMPRESS_NO_BLAS_REEXEC", raising=False)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(out) if line.startswith("blas"))
    return [out[i], out[i + 1]]


LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def test_doctor_installed_openblas_is_preloaded_by_the_heavy_commands(monkeypatch, capsys):
    blas, hint = _doctor_blas(monkeypatch, capsys, found=LIB, preloaded=False)
    assert blas == f"blas       OpenBLAS found at {LIB}; `kvcompress bench`, `kvcompress generate`, `kvcompress serve`, `kvcompress chat`, `kvcompress tune` preload it automatically"
    assert hint.split() == ["for", "your", "own", "scripts:", "export", f"LD_PRELOAD={LIB}"]
    assert "apt-get" not in blas + hint and "not preloaded" not in blas


def test_doctor_says_when_the_automatic_preload_is_switched_off(monkeypatch, capsys):
    blas, _ = _doctor_blas(monkeypatch, capsys, found=LIB, preloaded=False, no_reexec=True)
    assert blas.endswith("not preloaded: KVCOMPRESS_NO_BLAS_REEXEC is set")


def test_doctor_suggests_installing_only_when_openblas_is_missing(monkeypatch, capsys):
    blas, hint = _doctor_blas(monkeypatch, capsys, found=None, preloaded=False)
    assert "OpenBLAS not found" in blas and "apt-get install libopenblas0-pthread" in hint
    blas, hint = _doctor_blas(monkeypatch, capsys, found=LIB, preloaded=True)
    assert blas == "blas       OpenBLAS preloaded in this process (fast CPU matmul)"
    assert hint.startswith("lowbit ")  # then whether the low-bit CPU kernel is built, or why not


# ------------------------------------------------------------------------------------------
# kvcompress bench --help
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "-h"]])
def test_bench_help_lists_every_workload_with_a_summary(argv, capsys):
    from kvcompress.cli import BENCH_WORKLOADS

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvcompress bench [-h] WORKLOAD")
    listed = out.split("workloads:\n")[1].splitlines()
    for name in BENCH_WORKLOADS:
        line = next(line for line in listed if line.split()[:1] == [name])
        assert len(line.split()) > 4, line  # name + a one-line description
    assert "Retrieval under a bounded KV cache" in out and "``" not in out


# ------------------------------------------------------------------------------------------
# Usage errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["components", "--kind", "scorers"], "kvcompress components: error: argument --kind: invalid choice: 'scorers'"),
        (["config", "validate"], "kvcompress config validate: error: the following arguments are required: file"),
        (["bench", "nosuch"], "kvcompress bench: error: argument WORKLOAD: invalid choice: 'nosuch'"),
    ],
)
def test_usage_errors_are_one_line_with_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(message) and line.endswith("--help)"), line


@pytest.mark.parametrize("buffered", [True, False])
def test_a_closed_pipe_ends_a_listing_quietly(buffered):
    """``kvcompress methods | head -1`` printed a BrokenPipeError traceback (unbuffered stdout)
    or an "Exception ignored" at exit with status 120 (buffered)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVCOMPRESS_NO_BLAS_REEXEC": "1"}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "kvcompress", "methods"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
    proc.stderr.close()
