"""mlx-lm reads kvcompress cache files without the user importing kvcompress.

The package installs ``kvcompress-autoload.pth``: at start-up it only arranges for two
placeholder classes to appear in ``mlx_lm.models.cache`` when that module is imported, so
``mlx_lm.models.cache.load_prompt_cache`` and ``mlx_lm.generate --prompt-cache-file`` rebuild
kvcompress caches (the placeholder imports kvcompress on first use).
"""

from __future__ import annotations

import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import models_dir

HERE = Path(__file__).resolve().parent


def _installed() -> bool:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any((Path(d) / "kvcompress-autoload.pth").exists() for d in dirs)


pytestmark = pytest.mark.skipif(not _installed(), reason="kvcompress-autoload.pth is not installed "
                                "(install the package with pip install -e . or pip install .)")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=str(HERE))


def test_start_up_imports_nothing_heavy():
    r = _run("import sys; print('kvcompress' in sys.modules, 'mlx' in sys.modules, 'mlx_lm' in sys.modules)")
    assert r.stdout.split() == ["False", "False", "False"], r.stderr


def test_mlx_lm_loader_reads_a_kvcompress_file_in_a_fresh_process(tmp_path):
    path = tmp_path / "c.safetensors"
    r = _run(f"""
        from conftest import tiny_llama
        import kvcompress, mlx.core as mx
        m = tiny_llama()
        c = kvcompress.make_prompt_cache(m, "cam", budget=16)
        m(mx.arange(1, 30).reshape(1, -1), cache=c)
        kvcompress.save_prompt_cache({str(path)!r}, c)
        print(c[0].offset, c[0].tokens_kept)
    """)
    assert r.returncode == 0, r.stderr
    r2 = _run(f"""
        import sys
        from mlx_lm.models.cache import load_prompt_cache
        c = load_prompt_cache({str(path)!r})
        print(type(c[0]).__module__, type(c[0]).__name__, c[0].offset, c[0].tokens_kept)
    """)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.split() == ["kvcompress.cache", "CompressedKVCache", *r.stdout.split()]


def test_mlx_lm_generate_cli_continues_a_kvcompress_file(tmp_path):
    model = models_dir() / "stories260K"
    if not (model / "config.json").exists():
        pytest.skip(f"trained model not found at {model}")
    path = tmp_path / "s.safetensors"
    r = subprocess.run([sys.executable, "-m", "kvcompress", "generate", "--model", str(model), "--method", "h2o",
                        "--budget", "32", "--prompt", "Once upon a time", "--max-tokens", "40",
                        "--save-prompt-cache", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt-cache-file",
                        str(path), "--prompt", " The next day", "--max-tokens", "10"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Generation: 10 tokens" in r.stdout


def test_mlx_lm_loader_checks_the_digest_in_a_fresh_process(tmp_path):
    """Bug: mlx-lm's own loader (``--prompt-cache-file``, ``load_prompt_cache``) read a kvcompress
    file without checking its digest, so a damaged file loaded silently. The start-up hook wraps
    it: in a process that never imports kvcompress itself, a file whose metadata lost one bit is
    refused, and the intact file loads with its metadata."""
    path = tmp_path / "c.safetensors"
    r = _run(f"""
        from conftest import tiny_llama
        import kvcompress, mlx.core as mx
        m = tiny_llama()
        c = kvcompress.make_prompt_cache(m, "h2o", budget=16)
        m(mx.arange(1, 30).reshape(1, -1), cache=c)
        kvcompress.save_prompt_cache({str(path)!r}, c, {{"model": "the-model"}})
    """)
    assert r.returncode == 0, r.stderr
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(path.read_bytes().replace(b"the-model", b"the-modem"))
    r = _run(f"""
        from mlx_lm.models.cache import load_prompt_cache
        c, meta = load_prompt_cache({str(path)!r}, return_metadata=True)
        print(type(c[0]).__name__, meta)
        try:
            load_prompt_cache({str(bad)!r})
        except Exception as exc:
            print(type(exc).__name__, "digest" in str(exc))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["CompressedKVCache {'model': 'the-model'}", "CorruptCacheFile True"]
