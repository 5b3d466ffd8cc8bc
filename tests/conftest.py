"""Shared fixtures: tiny random mlx-lm models built in memory, and the optional trained model."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama

REPO = Path(__file__).resolve().parents[1]
_DEFAULT_MODELS = REPO.parent / "shared" / "models"
_DEFAULT_DATA = REPO.parent / "shared" / "data"


def pytest_addoption(parser, pluginmanager):
    """Without pytest-xdist (the ``dev`` extra installs it) the ``-n auto --dist loadgroup`` of
    pyproject's ``addopts`` would stop pytest before any test: accept them, run in one process."""
    if not pluginmanager.has_plugin("xdist"):
        group = parser.getgroup("xdist", "pytest-xdist is not installed: its options are ignored")
        # ``_addoption``: how pytest-xdist itself declares ``-n`` (``addoption`` refuses lowercase short options)
        group._addoption("-n", "--numprocesses", dest="ignored_numprocesses", default=None,
                         help="pytest-xdist is not installed: ignored, the tests run in one process")
        group.addoption("--dist", dest="ignored_dist", default="no", help="pytest-xdist is not installed: ignored")


def fresh_pytest_env(**extra) -> dict:
    """This process's environment for a pytest run in a subprocess, without the ``PYTEST_XDIST_*``
    variables that would make it look like a worker of this run (plus ``extra``)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}, **extra}


def models_dir() -> Path:
    """``$KVCOMPRESS_MODELS_DIR`` or ``../shared/models`` next to the checkout."""
    return Path(os.environ.get("KVCOMPRESS_MODELS_DIR", _DEFAULT_MODELS))


def data_dir() -> Path:
    """``$KVCOMPRESS_DATA_DIR`` or ``../shared/data`` next to the checkout."""
    return Path(os.environ.get("KVCOMPRESS_DATA_DIR", _DEFAULT_DATA))


def tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, seed=0, dtype=mx.float32):
    """A random-weight mlx-lm Llama; enough to exercise the cache protocol, not to talk."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="module")
def model():
    """The regression tests' tiny Llama (``test_regressions_*.py``), one per test module."""
    return tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=0)


@pytest.fixture(scope="session")
def stories_model():
    """The trained stories260K model and tokenizer; skips when the folder is absent."""
    path = models_dir() / "stories260K"
    if not (path / "config.json").exists():
        pytest.skip(
            f"trained model not found at {path}; set KVCOMPRESS_MODELS_DIR to a folder holding "
            "stories260K to run this test"
        )
    import mlx_lm

    return mlx_lm.load(str(path))


@pytest.fixture(scope="session")
def stories_text():
    path = data_dir() / "tinystories_valid" / "tinystories_val.txt"
    if not path.exists():
        pytest.skip(f"evaluation text not found at {path}; set KVCOMPRESS_DATA_DIR")
    return path.read_text()


#: methods of the third-party plugin example, registered once it is pip-installed
EXAMPLE_PLUGIN_METHODS = {"knorm": "examples/kvcompress-knorm"}


def require_method(name: str) -> None:
    """Skip, saying how to install it, unless method ``name`` is registered (the example
    plugin's ``knorm`` is not, in a fresh clone: ``.ci/run`` installs it)."""
    import kvcompress

    reg = kvcompress.get_registry()
    if name not in reg.methods or reg.unavailable(name):
        where = EXAMPLE_PLUGIN_METHODS.get(name)
        why = reg.unavailable(name) if name in reg.methods else "it is not registered"
        pytest.skip(f"method {name!r} cannot run here ({why}): " + (
            f"pip install -e {where} to test the example plugin" if where else "install its plugin"))


def make_caches(model, method: str, want: int, **params) -> list:
    """``make_prompt_cache`` with the smallest budget >= ``want`` the method accepts (methods
    protect different numbers of tokens: sinks, recent windows, chunk slack)."""
    import kvcompress
    from kvcompress import ConfigError

    b = max(want, kvcompress.build_method(method, **params).selector.reserved(want) + 1)
    for _ in range(256):
        try:
            return kvcompress.make_prompt_cache(model, method, budget=b, **params)
        except ConfigError:
            b += 1
    raise AssertionError(f"no budget in [{want}, {b}] accepted by {method}")


def slot_tags(c) -> mx.array:
    """Each stored slot's token position with its head in the row above bit 24 (head groups),
    -1 empty: two caches with equal tags hold the same tokens in the same heads and slots."""
    pos, own = c.slot_positions, c.slot_owners
    return pos if own is None else mx.where(pos >= 0, pos + own * (1 << 24), -1)


def held_tokens(c):
    """Tokens held per KV head in the fullest row (a head group's slots / heads per row: its
    row may also keep a few empty slots an eviction freed, so ``size()`` can be wider)."""
    kept = c.tokens_kept
    return max(kept) if isinstance(kept, list) else kept


def assert_step_accounting(c, n_before, evicted_before: int, S: int) -> None:
    """One ``update_and_fetch`` of ``S`` tokens (``n_before``: :func:`held_tokens` before it):
    if ``n_before + S`` exceeds the budget, at least ``n_before - (budget - 1)`` old tokens
    left (exactly that many with the ``lowest`` selector; a selector may free whole chunks), none
    otherwise; the S new tokens are all stored."""
    need = max(n_before - (c.budget - 1), 0) if n_before + S > c.budget else 0
    gone = c.evictions - evicted_before
    assert held_tokens(c) == pytest.approx(n_before + S - gone)
    assert gone >= need and (need > 0 or gone == 0)
    if c.method.config.selector.name == "lowest":
        assert gone == need
