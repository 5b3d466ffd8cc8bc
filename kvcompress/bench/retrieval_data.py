"""Synthetic retrieval tasks and the closed-vocabulary tokenizer of the embedded retrieval model.

Two tasks, both a long *haystack* of filler sentences with facts hidden in it and questions
asked only after the haystack (so a cache compressed while reading the haystack cannot know
which facts will be asked):

* **passkey** -- one needle ``the pass key is d1 d2 d3 d4 d5 .`` at a random depth; the
  question ``. what is the pass key ? the pass key is`` is answered by the five digits.
* **mqar** (multi-query associative recall) -- ``n_pairs`` <= 10 facts ``k d1 d2 .``
  (distinct letter keys; two-digit values whose leading digits differ, so a value is found
  from its key alone and continued from its first digit; letters occur nowhere else)
  scattered in the haystack;
  ``n_queries`` questions ``. ? k`` are asked one after another, each answered by its two
  digits (the leading ``.`` closes the haystack's last, possibly cut, sentence or the
  previous answer).

Every draw comes from a :class:`numpy.random.Generator` seeded by the caller, so a
(task, seed, length) triple always gives the same tokens. The vocabulary has 72 symbols;
text is whitespace-separated symbols, so the tokenizer is a dictionary lookup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Union

import attrs
import numpy as np

__all__ = [
    "VOCAB",
    "WordTokenizer",
    "Sample",
    "passkey_sample",
    "mqar_sample",
    "make_sample",
    "TASKS",
]

_SPECIAL = ["<pad>", "<s>", "</s>"]
_DIGITS = list("0123456789")
_LETTERS = list("abcdefghijklmnopqrstuvwxyz")
_PUNCT = [".", "?"]
_NOUNS = ["grass", "sky", "sun", "tree", "water", "cat", "dog", "bird"]
_ADJS = ["green", "blue", "yellow", "big", "small", "warm"]
_VERBS = ["runs", "sleeps", "sings", "jumps"]
_OTHER = ["the", "my", "is", "here", "we", "go", "there", "and", "back", "again",
          "pass", "key", "what"]
VOCAB: tuple[str, ...] = tuple(_SPECIAL + _DIGITS + _LETTERS + _PUNCT + _NOUNS + _ADJS + _VERBS + _OTHER)
assert len(set(VOCAB)) == len(VOCAB), "duplicate symbol in the retrieval vocabulary"
_ID = {t: i for i, t in enumerate(VOCAB)}
PAD, BOS, EOS = 0, 1, 2


class WordTokenizer:
    """Whitespace tokenizer over a closed vocabulary (what the embedded model was trained with).

    ``encode("the sky is blue .")`` looks each symbol up; ``decode`` joins symbols with a
    space. ``encode`` prepends BOS when ``add_bos`` (default True), like mlx-lm tokenizers.
    """

    def __init__(self, vocab: Sequence[str] = VOCAB, bos: str = "<s>", eos: str = "</s>"):
        self.vocab = list(vocab)
        self._id = {t: i for i, t in enumerate(self.vocab)}
        self.bos_token_id = self._id[bos]
        self.eos_token_id = self._id[eos]

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "WordTokenizer":
        """Read the ``vocab`` of a HF ``WordLevel`` tokenizer.json (as shipped with the model)."""
        data = json.loads(Path(path).read_text())
        vocab = data["model"]["vocab"]
        return cls([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._id[t] for t in text.split()]
        except KeyError as exc:
            raise ValueError(f"symbol {exc.args[0]!r} is not in the retrieval vocabulary") from None
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[int(i)] for i in ids)


def hf_tokenizer_json(vocab: Sequence[str] = VOCAB) -> dict:
    """A HF ``tokenizers`` WordLevel tokenizer.json (whitespace split, BOS prepended)."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(_SPECIAL)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}},
        },
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab)}, "unk_token": "<pad>"},
    }


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


@attrs.frozen
class Sample:
    """One retrieval episode.

    ``context``: BOS + haystack with the facts, exactly ``context_len`` ids.
    ``rounds``: ``(question_ids, answer_ids)`` pairs, asked in order after the context.
    ``depths``: relative depth (0..1) in the context of the fact each round asks about.
    """

    task: str
    context: tuple
    rounds: tuple
    depths: tuple

    def tokens(self) -> list[int]:
        """The whole episode as one sequence (for training)."""
        out = list(self.context)
        for q, a in self.rounds:
            out += list(q) + list(a)
        return out

    def answer_mask(self) -> list[bool]:
        """True at positions (of :meth:`tokens`) that hold answer tokens."""
        out = [False] * len(self.context)
        for q, a in self.rounds:
            out += [False] * len(q) + [True] * len(a)
        return out


def _ids(text: str) -> list[int]:
    return [_ID[t] for t in text.split()]


def _sentence(rng: np.random.Generator) -> list[int]:
    k = rng.integers(5)
    if k == 0:
        return _ids(f"the {rng.choice(_NOUNS)} is {rng.choice(_ADJS)} .")
    if k == 1:
        return _ids(f"my {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} .")
    if k == 2:
        return _ids(f"the {rng.choice(_NOUNS)} {rng.choice(_VERBS)} .")
    if k == 3:
        return _ids("here we go .")
    return _ids("there and back again .")


def _haystack(rng: np.random.Generator, n_tokens: int, needles: list[list[int]]):
    """``n_tokens`` ids of filler with ``needles`` inserted at random sentence boundaries.

    Returns the ids and each needle's start index. Needle order is random; boundaries are
    drawn without replacement so two needles never touch.
    """
    n_fill = n_tokens - sum(len(n) for n in needles)
    if n_fill < 4 * len(needles) + 4:
        raise ValueError(f"context of {n_tokens} tokens is too short for {len(needles)} facts")
    fill: list[int] = []
    bounds: list[int] = [0]
    while len(fill) < n_fill:
        fill += _sentence(rng)
        bounds.append(len(fill))
    fill = fill[:n_fill]
    bounds = [b for b in bounds if b < n_fill]
    at = np.sort(rng.choice(len(bounds), size=len(needles), replace=False))
    order = rng.permutation(len(needles))
    out: list[int] = []
    starts = [0] * len(needles)
    prev = 0
    for slot, which in zip(at, order):
        b = bounds[slot]
        out += fill[prev:b]
        starts[which] = len(out)
        out += needles[which]
        prev = b
    out += fill[prev:]
    return out, starts


def passkey_sample(rng: np.random.Generator, context_len: int, n_digits: int = 5) -> Sample:
    """BOS + haystack holding ``the pass key is <digits> .``; one question."""
    digits = [str(d) for d in rng.integers(0, 10, size=n_digits)]
    needle = _ids("the pass key is " + " ".join(digits) + " .")
    hay, starts = _haystack(rng, context_len - 1, [needle])
    q = _ids(". what is the pass key ? the pass key is")
    return Sample(
        "passkey", (BOS, *hay), ((tuple(q), tuple(_ids(" ".join(digits)))),),
        (round(starts[0] / (context_len - 1), 4),),
    )


def mqar_sample(rng: np.random.Generator, context_len: int, n_pairs: int = 8,
                n_queries: int = 4) -> Sample:
    """BOS + haystack holding ``n_pairs`` facts ``k d d .``; ``n_queries`` questions ``. ? k``."""
    if n_pairs > 10:
        raise ValueError(f"mqar supports at most 10 facts (distinct leading digits), got {n_pairs}")
    keys = rng.choice(_LETTERS, size=n_pairs, replace=False)
    lead = rng.choice(10, size=n_pairs, replace=False)
    vals = [[str(d), str(e)] for d, e in zip(lead, rng.integers(0, 10, size=n_pairs))]
    needles = [_ids(f"{k} {' '.join(v)} .") for k, v in zip(keys, vals)]
    hay, starts = _haystack(rng, context_len - 1, needles)
    asked = rng.choice(n_pairs, size=min(n_queries, n_pairs), replace=False)
    rounds = []
    for i in asked:
        # "." closes the (possibly cut) last filler sentence, then each previous answer
        rounds.append((tuple(_ids(f". ? {keys[i]}")), tuple(_ids(" ".join(vals[i])))))
    depths = tuple(round(starts[i] / (context_len - 1), 4) for i in asked)
    return Sample("mqar", (BOS, *hay), tuple(rounds), depths)


def copy_sample(rng: np.random.Generator, context_len: int, span: int = 24) -> Sample:
    """Training aid: ``span`` random letters/digits then ``.``, repeated to ``context_len``.

    Every repeat is an answer (fully predictable by copying from the previous repeat), which
    gives the dense signal that makes induction-style copy heads form quickly.
    """
    syms = _LETTERS + _DIGITS
    seg = [_ID[syms[i]] for i in rng.integers(0, len(syms), size=span)] + [_ID["."]]
    reps = max(2, (context_len - 1) // len(seg))
    return Sample("copy", (BOS, *seg), tuple(((), tuple(seg)) for _ in range(reps - 1)), ())


TASKS = {"passkey": passkey_sample, "mqar": mqar_sample}
TRAIN_TASKS = {**TASKS, "copy": copy_sample}


def make_sample(task: str, rng: np.random.Generator, context_len: int, **kw) -> Sample:
    if task not in TRAIN_TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; choose from {sorted(TASKS)}")
    return TRAIN_TASKS[task](rng, context_len, **kw)


def batch_tokens(samples: Sequence[Sample], weight_answers: float = 1.0,
                 weight_text: Optional[float] = 0.1):
    """Stack equal-length samples into ``(inputs, targets, weights)`` int32/float32 arrays."""
    toks = np.array([s.tokens() for s in samples], dtype=np.int32)
    ans = np.array([s.answer_mask() for s in samples], dtype=bool)
    w = np.where(ans, weight_answers, weight_text or 0.0).astype(np.float32)
    return toks[:, :-1], toks[:, 1:], w[:, 1:]
