"""``kvcompress chat``: mlx-lm's terminal chat with a compressed cache kept across turns."""

from __future__ import annotations

import builtins
import json
import shutil

import pytest

from conftest import models_dir


@pytest.fixture
def chat_model(tmp_path):
    """stories260K with a minimal chat template (the model itself has none)."""
    src = models_dir() / "stories260K"
    if not (src / "config.json").exists():
        pytest.skip(f"trained model not found at {src}; set KVCOMPRESS_MODELS_DIR")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_turns_reuse_the_compressed_cache(chat_model, monkeypatch, capsys):
    """Each turn feeds only its own tokens; the cache keeps every earlier turn (bounded by the
    budget, so later turns evict) and is compressed in every layer."""
    import mlx_lm.chat

    from kvcompress import CompressedKVCache
    from kvcompress.cli import main

    lines = iter(["Once upon a time", "The dog ran", "Then the cat", "q"])
    monkeypatch.setattr(builtins, "input", lambda *a: next(lines))
    seen = []
    real = mlx_lm.chat.stream_generate

    def spy(model, tokenizer, prompt, prompt_cache=None, **kw):
        seen.append((len(prompt), prompt_cache[0].offset, all(isinstance(c, CompressedKVCache) for c in prompt_cache)))
        yield from real(model, tokenizer, prompt, prompt_cache=prompt_cache, **kw)

    monkeypatch.setattr(mlx_lm.chat, "stream_generate", spy)
    code = main(["chat", "--model", str(chat_model), "--method", "cam", "--budget", "48", "--max-tokens", "24"])
    assert code == 0
    assert len(seen) == 3 and all(compressed for *_, compressed in seen)
    offset = 0
    for n_prompt, before, _ in seen:
        assert before == offset  # the cache holds every earlier turn: nothing is re-prefilled
        offset = before + n_prompt + 24
    assert offset > 48  # the conversation outgrew the budget


def test_chat_needs_a_chat_template(capsys):
    from kvcompress.cli import main

    src = models_dir() / "stories260K"
    if not (src / "config.json").exists():
        pytest.skip("trained model not found")
    assert main(["chat", "--model", str(src)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvcompress chat: error:") and "chat template" in err[-1]
