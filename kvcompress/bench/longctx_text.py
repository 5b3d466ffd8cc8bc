"""Filler text and chat turns for the long-context workload (:mod:`kvcompress.bench.longctx`).

* :class:`TextSource` -- real text from a folder of UTF-8 ``.txt`` files (searched
  recursively, sorted by path; the shared ``longtext`` folder or any other), or, when no folder
  exists, the docstrings of kvcompress's own modules (:func:`embedded_text`: real English shipped
  with the package, enough for a ``--quick`` run on a tiny model). :meth:`TextSource.filler`
  draws a seeded stretch of paragraphs of a given size, starting at a random paragraph of a
  random document and running on through other documents when one ends.
* :class:`ChatFormat` -- where the context, the questions and the answers go in the model's chat
  template: the context is the start of the first user message; a question closes that message
  (or opens a later one) and the assistant's reply starts with the task's answer prefix. The
  pieces come from rendering the template around marker strings, so any chat template that
  renders earlier turns unchanged works; a tokenizer without a template gets plain
  ``Question: ... Answer: ...`` turns.

Strings that the tokenizer would read as special tokens (``<filename>`` in man pages, ``<|im_end|>``)
are defused in the filler: the brackets are dropped.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Sequence

import attrs
import numpy as np

__all__ = ["TextSource", "ChatFormat", "default_text_dir", "embedded_text", "special_strings", "defuse", "encode_long"]

_REPO = Path(__file__).resolve().parents[2]


def default_text_dir() -> Path:
    """``$KVCOMPRESS_DATA_DIR/longtext``, or ``../shared/data/longtext`` next to the checkout."""
    base = os.environ.get("KVCOMPRESS_DATA_DIR")
    return (Path(base) if base else _REPO.parent / "shared" / "data") / "longtext"


def embedded_text() -> list[tuple[str, str]]:
    """``(name, text)`` of the docstrings of kvcompress's modules: real English that ships with
    the package (about 40k tokens), the filler when no text folder is available."""
    import importlib
    import pkgutil

    import kvcompress

    docs = []
    for info in sorted(pkgutil.walk_packages(kvcompress.__path__, "kvcompress."), key=lambda m: m.name):
        if info.name.startswith(("kvcompress._lowbit", "kvcompress.__main__")):
            continue
        try:
            mod = importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: that module's text is not needed
            continue
        if mod.__doc__ and len(mod.__doc__) > 200:
            docs.append((f"embedded:{info.name}", mod.__doc__.replace("``", "")))
    return docs


def special_strings(tokenizer) -> list[str]:
    """The added-token strings of ``tokenizer`` that plain text could spell (``<|im_end|>``)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    found: set[str] = set()
    get = getattr(inner, "get_added_vocab", None)
    if callable(get):
        try:
            found |= set(get())
        except Exception:
            pass
    found |= set(getattr(inner, "all_special_tokens", None) or ())
    return sorted((s for s in found if len(s) >= 3 and s.startswith("<")), key=len, reverse=True)


def encode_long(tokenizer, text: str, **kw) -> list[int]:
    """``tokenizer.encode(text, **kw)`` without Hugging Face's warning that the text is longer
    than the model's context (the filler and documents are cut to size afterwards)."""
    inner = getattr(tokenizer, "_tokenizer", None)
    limit = getattr(inner, "model_max_length", None)
    if isinstance(limit, int):
        inner.model_max_length = max(limit, 1 << 40)
    try:
        return list(tokenizer.encode(text, **kw))
    finally:
        if isinstance(limit, int):
            inner.model_max_length = limit


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


@attrs.define
class TextSource:
    """Documents to draw filler from: ``docs`` is a list of ``(name, text)``."""

    docs: list = attrs.field(repr=False)
    where: str = ""

    @classmethod
    def from_dir(cls, path, *, allow_embedded: bool = True) -> "TextSource":
        """Every ``*.txt`` under ``path`` (recursively); with ``path`` None, the default folder
        (:func:`default_text_dir`) or, when that is absent and ``allow_embedded``, the embedded
        text. A named folder without text is a ``ValueError``."""
        if path is None:
            d = default_text_dir()
            if d.is_dir() and any(d.rglob("*.txt")):
                return cls.from_dir(d)
            if not allow_embedded:
                raise ValueError(f"no text folder given and the default {d} is absent; pass --text-dir DIR "
                                 "(a folder of UTF-8 .txt files) or set KVCOMPRESS_DATA_DIR")
            return cls(embedded_text(), "embedded: kvcompress module docstrings")
        p = Path(path).expanduser()
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        else:
            raise ValueError(f"--text-dir {path}: no such folder")
        if not files:
            raise ValueError(f"--text-dir {path}: no .txt files there")
        docs = []
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"--text-dir: {f} is not UTF-8 text (byte {exc.start})") from None
            if text.strip():
                docs.append((str(f.relative_to(p)) if p.is_dir() else f.name, text))
        if not docs:
            raise ValueError(f"--text-dir {path}: every .txt file there is empty")
        return cls(docs, str(p))

    def total_chars(self) -> int:
        return sum(len(t) for _, t in self.docs)

    def filler(self, rng: np.random.Generator, n_chars: int, specials: Sequence[str] = ()) -> tuple[str, list]:
        """About ``n_chars`` characters (whole paragraphs, joined by blank lines) and the names of
        the documents they came from. Starts at a random paragraph of a random document, then
        runs on through the others in a seeded order (the source repeats only if it is shorter
        than ``n_chars``)."""
        order = [int(i) for i in rng.permutation(len(self.docs))]
        out: list[str] = []
        used: list[str] = []
        size = 0
        for k in range(len(order) * (2 + n_chars // max(self.total_chars(), 1))):
            name, text = self.docs[order[k % len(order)]]
            paras = _paragraphs(defuse(text, specials))
            if not paras:
                continue
            start = int(rng.integers(0, max(1, len(paras) // 2))) if k == 0 else 0
            used.append(name)
            for para in paras[start:]:
                out.append(para)
                size += len(para) + 2
                if size >= n_chars:
                    return "\n\n".join(out), used
        return "\n\n".join(out), used


def defuse(text: str, specials: Sequence[str]) -> str:
    """``text`` with each of ``specials`` (``<filename>``) spelled without its brackets."""
    for s in specials:
        if s in text:
            text = text.replace(s, s.strip("<>|"))
    return text


_MARK = ("\x01CONTEXT\x01", "\x01ANSWER\x01", "\x01QUESTION\x01")


@attrs.frozen
class ChatFormat:
    """The text around the context, questions and answers.

    First prompt: ``head + context + sep + question + open_answer + answer_prefix``; a later
    question (multi-turn): ``close_answer + question + open_answer + answer_prefix`` after the
    previous reply. ``bos``: the tokenizer's BOS id when the head does not already start with it.
    """

    head: str
    sep: str
    open_answer: str
    close_answer: str
    templated: bool
    bos: Optional[int] = None

    @classmethod
    def for_tokenizer(cls, tokenizer, chat_template: bool = True) -> "ChatFormat":
        """The model's chat template split into turns (``chat_template=False``, or no template:
        plain ``Question:`` / ``Answer:`` turns after BOS)."""
        has = bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))
        if not (chat_template and has):
            return cls(head="", sep="\n\nQuestion: ", open_answer="\nAnswer: ", close_answer="\n\nQuestion: ",
                       templated=False, bos=getattr(tokenizer, "bos_token_id", None))
        ctx, ans, q = _MARK

        def render(msgs):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        one = render([{"role": "user", "content": ctx + "\n\n" + q}])
        two = render([{"role": "user", "content": ctx + "\n\n" + q}, {"role": "assistant", "content": ans},
                      {"role": "user", "content": q}])
        head, rest = one.split(ctx, 1) if ctx in one else (None, "")
        if head is None or not two.startswith(one) or q not in rest:
            raise ValueError("the model's chat template cannot be split into turns (a template that rewrites "
                             "earlier turns); pass --no-chat-template to use plain Question:/Answer: turns")
        open_answer = rest.split(q, 1)[1]
        later = two[len(one):]
        close_answer, tail = later.split(ans, 1)[1].split(q, 1)
        if close_answer == "" or tail != open_answer:
            raise ValueError("the model's chat template renders later turns differently from the first; pass "
                             "--no-chat-template to use plain Question:/Answer: turns")
        return cls(head=head, sep="\n\n", open_answer=open_answer, close_answer=close_answer, templated=True)

    def encode(self, tokenizer, text: str) -> list[int]:
        """``text`` as token ids, special-token strings of the template parsed, no BOS added."""
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    def head_ids(self, tokenizer) -> list[int]:
        ids = self.encode(tokenizer, self.head)
        if self.bos is not None and (not ids or ids[0] != self.bos):
            ids = [self.bos, *ids]
        return ids

    def first_question(self, question: str, answer_prefix: str) -> str:
        return self.sep + question + self.open_answer + answer_prefix

    def later_question(self, question: str, answer_prefix: str) -> str:
        return self.close_answer + question + self.open_answer + answer_prefix
