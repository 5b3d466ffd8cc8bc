"""``kvcompress tune --model M --budget N`` without ``--data``: the text bundled with kvcompress.

A fresh install has no data folder: the command scores the bundled prose, which must fill the
default windows with real tokenizers, and too little text names the options to change.
"""

from __future__ import annotations

import json

import pytest

from conftest import tiny_llama
from kvcompress.cli import main
from kvcompress.tune import TextWorkload


@pytest.fixture
def no_reexec(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")


class _ByteTokenizer:
    """UTF-8 bytes as tokens (BOS = 256): enough tokenizer for ``prepare_windows``."""

    bos_token_id = 256

    def encode(self, text):
        return [self.bos_token_id, *text.encode("utf-8")]


def test_a_model_without_data_is_tuned_on_the_bundled_text(no_reexec, monkeypatch, tmp_path, capsys):
    """``--model M --budget N`` alone runs: no ``--data``, no ``../shared``, nothing downloaded."""
    import mlx_lm

    from kvcompress.tune.workloads import DEFAULT_TEXT

    monkeypatch.setenv("KVCOMPRESS_DATA_DIR", str(tmp_path / "no-data-here"))
    loaded = []
    monkeypatch.setattr(mlx_lm, "load", lambda name: loaded.append(name) or (tiny_llama(vocab=257), _ByteTokenizer()))
    out = tmp_path / "res"
    rc = main(["tune", "--model", "some/model", "--budget", "16", "--window", "48", "--prefill", "8",
               "--windows", "2", "--held-out", "2", "--candidates", "2", "--finalists", "1", "--methods",
               "h2o,streaming_llm", "--out", str(out), "--no-progress", "--plain", "--no-plot"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert loaded == ["some/model"]
    res = json.loads((out / "tune.json").read_text())
    assert res["workload"]["text"] == f"bundled:{DEFAULT_TEXT.name}" and res["settings"]["data"] is None
    assert len([r for r in res["candidates"] if r.get("gap") is not None]) == 2


@pytest.mark.parametrize("name", ["stories260K", "smollm2-135m-instruct"])
def test_the_bundled_text_fills_the_default_windows(name):
    """The bundled text gives ``--windows 8 --held-out 8`` windows of 512 tokens with a small
    SentencePiece vocabulary (stories260K) and a 49k BPE one (SmolLM2)."""
    from conftest import models_dir

    from kvcompress.bench.perplexity import prepare_windows
    from kvcompress.tune.cli import DEFAULTS
    from kvcompress.tune.workloads import load_text

    path = models_dir() / name
    if not (path / "tokenizer_config.json").exists():
        pytest.skip(f"tokenizer not found at {path}; set KVCOMPRESS_MODELS_DIR")
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text, where = load_text(None)
    assert where == "bundled:stories_and_notes.txt"
    need = DEFAULTS["windows"] + DEFAULTS["held_out"]
    assert len(prepare_windows(load_tokenizer(path), text, DEFAULTS["window"], need)) == need


def test_too_little_text_says_which_options_to_change(tmp_path):
    with pytest.raises(ValueError, match=r"gives 1 windows of 48 tokens; --windows 2 \+ --held-out 2 = 4 needed "
                       r"\(pass --data FILE with more text, or lower --windows, --held-out or --window\)"):
        TextWorkload(tiny_llama(vocab=257), _ByteTokenizer(), "x" * 60, window=48, prefill=8, windows=2, heldout=2)
