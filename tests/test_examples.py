"""The examples stay runnable.

* ``examples/configs/``: one config per built-in method (resolving to exactly that method's
  defaults), plus hand-written compositions; every file passes ``kvcompress config validate``,
  and the explicit compositions pass kvcompress's method contract.
* ``examples/*.py``: each script runs on the trained stories260K model and prints what it
  promises (skipped with a reason when the model is absent).
* ``kvcompress generate`` prints the tokens/s, peak-memory and KV-cache lines;
  ``kvcompress doctor`` runs and lists the plugins.
"""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvcompress
from conftest import models_dir
from kvcompress.cli import main
from kvcompress.components import KINDS
from kvcompress.testing import check_method

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIGS = sorted([*(EXAMPLES / "configs").glob("*.toml"), *(EXAMPLES / "configs").glob("*.json")])
BUILTIN_METHODS = sorted(n for n, p in kvcompress.get_registry().methods.items() if p.dist == "kvcompress")
COMPOSED = [p for p in CONFIGS if p.stem not in BUILTIN_METHODS]


def _components(method):
    return {k: method.component(k) for k in KINDS}


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTIN_METHODS)
def test_every_builtin_method_has_a_config_with_its_defaults(name):
    path = EXAMPLES / "configs" / f"{name}.toml"
    assert path.exists(), f"no examples/configs/{name}.toml: run `python scripts/update_docs.py`"
    cfg = kvcompress.load_config(path)
    assert cfg.method == name
    assert _components(kvcompress.build_method(cfg)) == _components(kvcompress.build_method(name))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_with_the_cli(path, capsys):
    assert main(["config", "validate", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: ok"
    assert out[1] == kvcompress.build_method(kvcompress.load_config(path)).describe()


def test_hand_written_compositions_exist_and_name_their_parts():
    assert {p.suffix for p in COMPOSED} == {".toml", ".json"}, "a TOML and a JSON composition"
    explicit = [p for p in COMPOSED if kvcompress.load_config(p).method is None]
    assert len(explicit) >= 2
    for path in explicit:
        cfg = kvcompress.load_config(path)
        m = kvcompress.build_method(cfg)
        assert all(m.config.component(k).name == cfg.component(k).name for k in KINDS)


@pytest.mark.parametrize("path", COMPOSED, ids=lambda p: p.name)
def test_composed_configs_pass_the_method_contract(path):
    report = check_method(kvcompress.load_config(path))
    assert {"budget held", "save/load", "exact without eviction", "float16"} <= set(report.passed)


def test_an_invalid_config_is_explained(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('method = "h2o"\n[params]\nn_sinks = 2\n')
    assert main(["config", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'n_sinks'" in err and "'n_sink'" in err


# ------------------------------------------------------------------------------------------------
# Scripts, on the trained model
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_path() -> Path:
    path = models_dir() / "stories260K"
    if not (path / "config.json").exists():
        pytest.skip(f"stories260K not found at {path}; set KVCOMPRESS_MODELS_DIR to run the example scripts")
    return path


def run_script(name: str, args: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


SCRIPTS = {
    "generate_compressed.py": (["--method", "cam", "--budget", "24", "--max-tokens", "40"],
                               r"layer 0: kept 24 of (\d+) tokens \(([\d.]+)x fewer tokens, ([\d.]+)x fewer bytes "
                               r".* (\d+) evicted, ([\d.]+) merged per KV head, scores from queries"),
    "compose_method.py": (["--budget", "40", "--max-tokens", "30"], r"layer budgets: \[(\d+(?:, \d+){4})\]"),
    "save_load_cache.py": (["--budget", "24", "--max-tokens", "20"], r"continuations identical: (True)"),
}


def test_every_example_script_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_example_script_runs(name, stories_path, monkeypatch, capsys):
    args, pattern = SCRIPTS[name]
    out = run_script(name, [str(stories_path), *args], monkeypatch, capsys)
    m = re.search(pattern, out)
    assert m, out
    if name == "generate_compressed.py":
        seen, evicted = int(m.group(1)), int(m.group(4))
        assert seen > 24 and evicted == seen - 24
        assert float(m.group(2)) == pytest.approx(seen / 24, abs=0.01) and float(m.group(3)) > 1
        assert 0 <= float(m.group(5)) <= evicted
    if name == "compose_method.py":
        budgets = [int(b) for b in m.group(1).split(", ")]
        assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]  # a pyramid
        assert sum(budgets) == 5 * 40
        assert "CompositionError: disposition 'gated_merge' requires ['attention_mass']" in out


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def _kvcompress() -> list[str]:
    """The console script of the environment under test (not whichever ``kvcompress`` is first
    on PATH, which may belong to another install), else ``python -m kvcompress``."""
    exe = shutil.which("kvcompress", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "kvcompress"]


def test_cli_generate_reports_speed_memory_and_cache_bytes(stories_path):
    proc = subprocess.run(
        [*_kvcompress(), "generate", "--model", str(stories_path), "--max-tokens", "20", "--method", "cam",
         "--budget", "32"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert re.search(r"^Prompt: \d+ tokens, [\d.]+ tokens-per-sec$", out, re.M), out
    assert re.search(r"^Generation: 20 tokens, [\d.]+ tokens-per-sec$", out, re.M), out
    assert re.search(r"^Peak memory: [\d.]+ GB$", out, re.M), out
    assert re.search(r"^KV cache: [\d.]+ MB held vs [\d.]+ MB for a full cache \([\d.]+x smaller\)$", out, re.M), out


def test_cli_generate_saves_and_continues_a_compressed_cache(stories_path, tmp_path):
    """--save-prompt-cache writes the compressed cache; --prompt-cache-file continues from it."""
    saved = tmp_path / "cache.safetensors"
    first = subprocess.run(
        [*_kvcompress(), "generate", "--model", str(stories_path), "--max-tokens", "40", "--method", "h2o",
         "--budget", "24", "--save-prompt-cache", str(saved)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert saved.exists()
    import kvcompress

    cache = kvcompress.load_prompt_cache(str(saved))
    offset = cache[0].offset
    assert offset > 24 and cache[0].size() == 24 and cache[0].method.name == "h2o"
    second = subprocess.run(
        [*_kvcompress(), "generate", "--model", str(stories_path), "--max-tokens", "10",
         "--prompt-cache-file", str(saved), "--prompt", " The end.", "--ignore-chat-template", "--verbose"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    offsets = [int(m) for m in re.findall(r"'offset': (\d+)", second.stdout)]
    assert offsets and all(o > offset for o in offsets), second.stdout


def test_cli_doctor_runs_and_lists_plugins():
    proc = subprocess.run([*_kvcompress(), "doctor"], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "KVCOMPRESS_STRICT_PLUGINS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^mlx\s+\S+\s+mlx-lm \S+", proc.stdout, re.M), proc.stdout
    for name in ("basic", "h2o", "cam"):
        assert re.search(rf"^plugin\s+{name}\s+kvcompress \S+ \[active\]", proc.stdout, re.M), proc.stdout
