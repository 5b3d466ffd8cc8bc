"""What ``kvcompress tune`` measures a candidate on, reusing the benchmarks' code.

A workload has two disjoint splits, ``search`` (every candidate) and ``heldout`` (the finalists
and the full cache, measured again), plus ``warmup`` (its first item, untimed work), and the ``model`` and its ``tokenizer`` (None
where methods get no tokenizer) the candidates' caches are built for. Measuring
builds a fresh cache per batch with ``make_cache()`` and returns a :class:`Measurement`: one
**loss** per item (lower is better) and the live bytes the cache holds per sequence at the end.
The score of a candidate is the mean paired difference of its losses to the full cache's on
the same items, with the standard error of those differences (:func:`paired_gap`).

* :class:`TextWorkload` (``--model``): teacher-forced streaming perplexity as
  ``kvcompress bench perplexity`` measures it (:func:`~kvcompress.bench.perplexity.prepare_windows`,
  :func:`~kvcompress.bench.perplexity.window_nll`): prefill ``prefill`` tokens, decode the rest
  of the window one token per step with the cache held at its budget; loss = mean NLL of the
  decoded predictions of a window. ``exp(gap)`` is the perplexity ratio to the full cache.
* :class:`RetrievalWorkload` (no ``--model``): the embedded retrieval model on
  ``kvcompress bench retrieval``'s seeded passkey and multi-query samples
  (:func:`~kvcompress.bench.retrieval.make_samples`, :func:`~kvcompress.bench.retrieval.evaluate`),
  prompt prefilled in chunks of 64 so evictions are blind to the question; loss = fraction of a
  sample's questions answered wrong. Held-out samples use the next seed.
* :class:`LongctxWorkload` (``--workload longctx``): ``kvcompress bench longctx``'s episodes on a
  chat model (:func:`~kvcompress.bench.longctx.make_episodes`), the context read in chunks before
  any question, then asked one request per question and as a conversation
  (:func:`~kvcompress.bench.longctx.measure`); loss = fraction of an episode's questions answered
  wrong over both protocols. Held-out episodes use the next seed.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import attrs
import numpy as np

__all__ = ["DEFAULT_TEXT", "Measurement", "paired_gap", "TextWorkload", "RetrievalWorkload", "LongctxWorkload",
           "load_text"]

SPLITS = ("warmup", "search", "heldout")


@attrs.frozen
class Measurement:
    """``losses`` ``[items]`` (lower is better), ``nbytes`` live cache bytes per sequence at the
    end, ``kept`` mean tokens a layer holds then, ``seconds`` wall time."""

    losses: np.ndarray
    nbytes: float
    kept: float
    seconds: float


def paired_gap(losses: np.ndarray, reference: np.ndarray) -> tuple[float, Optional[float]]:
    """Mean of ``losses - reference`` and its standard error (``std(ddof=1) / sqrt(n)``; None
    for one item)."""
    d = np.asarray(losses, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    return float(d.mean()), se


def _kept(cache) -> float:
    from kvcompress.bench._caches import stored_tokens

    return float(np.mean([stored_tokens(c) for c in cache]))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


class TextWorkload:
    """Streaming perplexity of ``model`` on ``text`` (see the module docstring)."""

    kind = "perplexity"
    loss_name = "nll"

    def __init__(self, model, tokenizer, text: str, *, window: int = 512, prefill: int = 128,
                 windows: int = 8, heldout: int = 8, batch: int = 8, source: str = ""):
        from kvcompress.bench.perplexity import prepare_windows

        if not 0 < prefill < window - 1:
            raise ValueError(f"prefill must be in [1, window - 2] = [1, {window - 2}], got {prefill}")
        self.model, self.tokenizer, self.prefill, self.batch, self.window = model, tokenizer, prefill, batch, window
        need = windows + heldout
        try:
            w = prepare_windows(tokenizer, text, window, need)
        except ValueError as exc:
            raise ValueError(f"{source or 'the text'}: {exc}") from None
        if len(w) < need:
            raise ValueError(f"{source or 'the text'} gives {len(w)} windows of {window} tokens; "
                             f"--windows {windows} + --held-out {heldout} = {need} needed "
                             "(pass --data FILE with more text, or lower --windows, --held-out or --window)")
        self.items = {"search": w[:windows], "heldout": w[windows:need], "warmup": w[:1]}
        self.source = source

    def describe(self) -> dict:
        return {"workload": self.kind, "text": self.source, "window": self.window, "prefill": self.prefill,
                "windows": len(self.items["search"]), "heldout": len(self.items["heldout"]),
                "scored_tokens_per_window": self.window - 1 - self.prefill}

    def ratio(self, gap: float) -> float:
        """What a gap means to a user: the perplexity ratio to the full cache."""
        return math.exp(gap)

    def measure(self, make_cache: Callable[[], list], split: str) -> Measurement:
        from kvcompress.bench._caches import live_kv_bytes
        from kvcompress.bench.perplexity import window_nll

        _check_split(split)
        w = self.items[split]
        t0 = time.perf_counter()
        losses, nbytes = [], 0.0
        for i in range(0, len(w), self.batch):
            part = w[i : i + self.batch]
            cache = make_cache()
            losses.append(window_nll(self.model, part, cache, self.prefill).mean(axis=1))
            nbytes = live_kv_bytes(cache) / len(part)
        return Measurement(np.concatenate(losses), nbytes, _kept(cache), time.perf_counter() - t0)


class RetrievalWorkload:
    """Passkey and multi-query retrieval on the embedded model (see the module docstring)."""

    kind = "retrieval"
    loss_name = "error rate"

    def __init__(self, model, *, context: int = 512, samples: int = 8, heldout: int = 8,
                 tasks: Sequence[str] = ("passkey", "mqar"), prefill_chunk: int = 64, seed: int = 0,
                 source: str = ""):
        from kvcompress.bench.retrieval import make_samples

        self.model, self.context, self.prefill_chunk, self.tasks = model, context, prefill_chunk, tuple(tasks)
        self.tokenizer = None  # the embedded model's word tokenizer names no token ids for methods
        self.items = {
            "search": {t: make_samples(t, samples, context, seed) for t in self.tasks},
            "heldout": {t: make_samples(t, heldout, context, seed + 1) for t in self.tasks},
        }
        self.items["warmup"] = {t: s[:1] for t, s in self.items["search"].items()}
        self.source, self.seed = source, seed

    def describe(self) -> dict:
        return {"workload": self.kind, "model": self.source, "context": self.context, "tasks": list(self.tasks),
                "samples": len(self.items["search"][self.tasks[0]]),
                "heldout": len(self.items["heldout"][self.tasks[0]]),
                "prefill_chunk": self.prefill_chunk, "seed": self.seed}

    def ratio(self, gap: float) -> float:
        """What a gap means to a user: the accuracy lost (a fraction of questions)."""
        return gap

    def measure(self, make_cache: Callable[[], list], split: str) -> Measurement:
        from kvcompress.bench._caches import live_kv_bytes
        from kvcompress.bench.retrieval import evaluate

        _check_split(split)
        t0 = time.perf_counter()
        losses, nbytes, kept = [], [], []
        for task, samples in self.items[split].items():
            cache = make_cache()
            out = evaluate(self.model, samples, cache, self.prefill_chunk)
            losses.append(1.0 - out["answered"].mean(axis=1))
            nbytes.append(live_kv_bytes(cache) / len(samples))
            kept.append(_kept(cache))
        return Measurement(np.concatenate(losses), float(np.mean(nbytes)), float(np.mean(kept)),
                           time.perf_counter() - t0)


class LongctxWorkload:
    """Long-context tasks on a chat model (see the module docstring)."""

    kind = "longctx"
    loss_name = "error rate"

    def __init__(self, model, tokenizer, *, length: int = 2048, episodes: int = 2, heldout: int = 2,
                 text_dir: Optional[str] = None, seed: int = 0, source: str = "", **settings):
        from kvcompress.bench._longctx_run import eos_ids
        from kvcompress.bench.longctx import DEFAULTS, check_settings, make_episodes
        from kvcompress.bench.longctx_text import ChatFormat, TextSource

        self.model, self.tokenizer, self.length = model, tokenizer, length
        self.settings = {**DEFAULTS, **settings, "lengths": (length,), "seed": seed, "episodes": episodes}
        check_settings(self.settings)
        self.text = TextSource.from_dir(text_dir)
        self.fmt = ChatFormat.for_tokenizer(tokenizer, self.settings["chat_template"])
        self.stop = eos_ids(tokenizer)
        held = {**self.settings, "seed": seed + 1, "episodes": heldout}
        self.items = {"search": make_episodes(tokenizer, self.fmt, self.text, self.settings, length),
                      "heldout": make_episodes(tokenizer, self.fmt, self.text, held, length)}
        self.items["warmup"] = self.items["search"][:1]
        self.source, self.seed = source, seed

    def describe(self) -> dict:
        st = self.settings
        return {"workload": self.kind, "model": self.source, "text": self.text.where, "length": self.length,
                "tasks": list(st["tasks"]), "protocols": list(st["protocols"]), "chunk": st["chunk"],
                "question_aware": st["question_aware"], "episodes": len(self.items["search"]),
                "heldout": len(self.items["heldout"]), "seed": self.seed}

    def ratio(self, gap: float) -> float:
        """What a gap means to a user: the accuracy lost (a fraction of questions)."""
        return gap

    def measure(self, make_cache: Callable[[], list], split: str) -> Measurement:
        from kvcompress.bench._longctx_report import scores
        from kvcompress.bench.longctx import measure

        _check_split(split)
        eps = self.items[split]
        t0 = time.perf_counter()
        m = measure(self.model, self.tokenizer, self.fmt, eps, make_cache, self.settings, self.stop, None)
        wrong = np.zeros(len(eps))
        for answers in m["answers"].values():
            exact, _ = scores(eps, answers)
            at = np.cumsum([0] + [len(e.questions) for e in eps])
            wrong += np.array([1.0 - exact[at[i]:at[i + 1]].mean() for i in range(len(eps))])
        return Measurement(wrong / len(m["answers"]), m["kv_bytes"], m["kept"], time.perf_counter() - t0)


#: The text ``--model`` runs are scored on without ``--data``: 45 KB of plain English prose
#: shipped with kvcompress (``kvcompress/assets/text``; 19 windows of 512 tokens with SmolLM2).
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "assets" / "text" / "stories_and_notes.txt"


def load_text(path: Optional[str]) -> tuple[str, str]:
    """``(text, where)`` of ``--data``, or of the bundled :data:`DEFAULT_TEXT` without it."""
    p = Path(path) if path else DEFAULT_TEXT
    if not p.is_file():
        hint = "" if path else " (the text bundled with kvcompress: reinstall it, or pass --data FILE)"
        raise FileNotFoundError(f"--data: no text file at {p}{hint}")
    try:
        return p.read_text(encoding="utf-8"), (str(p) if path else f"bundled:{p.name}")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data: {p} is not UTF-8 text (byte {exc.start})") from None
