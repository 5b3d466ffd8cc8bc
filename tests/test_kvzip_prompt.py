"""KVzip's pass ids without a model: the layout ``prompt + previous 8 + suffix + piece``, when
passes are due, and the reconstruction prompt (kvpress's instruction, a chat template's turn
change)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress_kvzip import KVzipScorer, chat_reconstruction, repeat_prompt
from kvcompress_kvzip.scorer import PREV, REPEAT_TEXT


def _obs_step(scorer, state, tokens, offset, n_valid=None):
    """Feed a regular step's ids to the scorer (no model): returns the new state."""
    b, n = tokens.shape
    pos = mx.broadcast_to(mx.arange(offset, dtype=mx.int32).reshape(1, 1, -1), (b, 1, offset))
    obs = kvcompress.Observation(
        queries=mx.zeros((b, 1, n, 4)), keys=mx.zeros((b, 1, offset, 4)), positions=pos,
        query_positions=mx.arange(offset - n, offset).reshape(1, 1, n), n_new=n, scale=1.0,
        offset=mx.array(offset), offsets=(offset,) * b, layer=kvcompress.LayerInfo(), n_valid=n_valid or (n,) * b,
        state=state, tokens=tokens,
    )
    scores = scorer.observe(mx.zeros((b, 1, offset)), obs)
    assert np.all(np.array(scores)[..., offset - n:] == 1.0)  # provisional score: waits for its pass
    return obs.state


def _consume(scorer, state, offset):
    """Run the scorer's side of one pass (no model): the state after it."""
    ids = scorer.pass_tokens(state)
    b, m = ids.shape
    t = offset + m
    pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32).reshape(1, 1, t), (b, 1, t))
    obs = kvcompress.Observation(
        queries=mx.zeros((b, 1, m, 4)), keys=mx.zeros((b, 1, t, 4)), positions=pos,
        query_positions=mx.arange(offset, t).reshape(1, 1, m), n_new=m, scale=1.0, offset=mx.array(offset),
        offsets=(offset,) * b, layer=kvcompress.LayerInfo(), state=state, tokens=ids, scoring_pass=True,
    )
    scorer.observe(mx.zeros((b, 1, t)), obs)
    return ids, obs.state


@pytest.mark.parametrize("suffix", [(), (7, 8)])
def test_passes_are_prompt_prev8_suffix_piece(suffix):
    """A 300-token prefill: pieces of 128 with the previous piece's last 8 ids after the prompt,
    then the suffix (kvpress: the chat template's end of turn and assistant header)."""
    prompt = (90, 91, 92)
    scorer = KVzipScorer(chunk=128, interval=32, prompt=prompt, suffix=suffix)
    ids = mx.arange(1000, 1300, dtype=mx.int32)[None]
    st = _obs_step(scorer, scorer.init_state(None), ids, 300)
    seen = []
    while scorer.pass_tokens(st) is not None:
        got, st = _consume(scorer, st, 300)
        seen.append(np.array(got)[0].tolist())
    assert len(seen) == 3
    assert seen[0] == [*prompt, *[-1] * PREV, *suffix, *range(1000, 1128)]
    assert seen[1] == [*prompt, *range(1120, 1128), *suffix, *range(1128, 1256)]
    assert seen[2] == [*prompt, *range(1248, 1256), *suffix, *range(1256, 1300)]
    # decode: a pass every `interval` ids, never before
    for i in range(31):
        st = _obs_step(scorer, st, mx.array([[2000 + i]], dtype=mx.int32), 301 + i)
        assert scorer.pass_tokens(st) is None
    st = _obs_step(scorer, st, mx.array([[2031]], dtype=mx.int32), 332)
    got = np.array(scorer.pass_tokens(st))[0].tolist()
    assert got == [*prompt, *range(1292, 1300), *suffix, *range(2000, 2032)]


def test_repeat_prompt_encodes_kvpress_instruction():
    class Tok:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(c) for c in text]

    assert repeat_prompt(Tok()) == tuple(ord(c) for c in REPEAT_TEXT)
    with pytest.raises(ValueError, match="prompt"):
        KVzipScorer(prompt=(1, -2))
    with pytest.raises(ValueError, match="suffix"):
        KVzipScorer(suffix=(-1,))


def test_chat_reconstruction_takes_the_suffix_from_the_chat_template():
    """kvpress's layout: the instruction, then the template's end of the user turn and the
    assistant header; without a template the suffix is a newline."""

    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return f"<s>sys<e><s>user {messages[0]['content']}<e><s>assistant "

    assert chat_reconstruction(Tok()) == {"prompt": repeat_prompt(Tok()), "suffix": (ord("\n"),)}
    Tok.chat_template = "chatml"
    got = chat_reconstruction(Tok())
    assert got["prompt"] == repeat_prompt(Tok())
    assert "".join(map(chr, got["suffix"])) == "<e><s>assistant "
    KVzipScorer(**got)  # valid parameters
    Tok.apply_chat_template = lambda self, m, add_generation_prompt, tokenize: "rewritten"
    with pytest.raises(ValueError, match="verbatim"):
        chat_reconstruction(Tok())


def test_chat_reconstruction_with_smollm2s_chatml_template():
    """With a real chat tokenizer as mlx-lm loads it (SmolLM2's ChatML; skipped when absent): the
    suffix closes the user turn and opens the assistant's, and the pass ids decode to kvpress's text."""
    from conftest import models_dir

    path = models_dir() / "smollm2-135m-instruct"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2's tokenizer is absent ({path}); set KVCOMPRESS_MODELS_DIR")
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(path)
    got = chat_reconstruction(tok)
    assert tok.decode(list(got["suffix"])) == "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(list(got["prompt"])) == REPEAT_TEXT
    scorer = KVzipScorer(chunk=4, **got)
    ids = mx.arange(300, 310, dtype=mx.int32)[None]
    st = _obs_step(scorer, scorer.init_state(None), ids, 10)
    _, st = _consume(scorer, st, 10)
    text = tok.decode([i for i in np.array(scorer.pass_tokens(st))[0].tolist() if i >= 0])
    assert text.startswith(REPEAT_TEXT) and "<|im_end|>\n<|im_start|>assistant\n" in text
