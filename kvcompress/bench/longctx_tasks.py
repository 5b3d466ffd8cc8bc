"""Seeded long-context tasks planted in real text (RULER-style, Hsieh et al. 2024), and their scoring.

An **episode** is one document of real filler (:class:`~kvcompress.bench.longctx_text.TextSource`)
in which every chosen task plants its facts at random depths, plus the questions about them.
The questions share the context, as in SCBench (Li et al. 2024): the context is read (and
compressed) once, then each question is asked. Tasks (``TASKS``):

* ``niah_single`` -- one needle ``The special magic number for <word> is <number>. Remember it:
  the special magic number for <word> is <number>.`` (``repeat=False``: the first sentence
  alone, as RULER writes it; SmolLM2-135M finds the repeated form far more reliably); asked once.
* ``niah_multikey`` -- ``n_keys`` such needles under distinct words; ``asks`` of them asked,
  each with the others as distractors.
* ``niah_multivalue`` -- ``n_values`` needles ``One of the special magic numbers for <word> is
  <number>.`` under one key; the question wants all the values.
* ``vt`` (variable tracking) -- a chain ``VAR A = 12345.``, ``VAR B = VAR A.``, ... of ``hops``
  assignments in reading order; the question wants every variable holding the value.
* ``cwe`` (common-word extraction) -- a numbered word list in which ``n_common`` words appear
  ``freq`` times and ``n_rare`` words once; the question wants the common ones.
* ``qa`` -- ``n_facts`` facts about invented people and places (``Mara Quill was born in the
  small town of Dunmere.``); each asked as a question whose answer is a name, word or year.

Every question carries an ``answer_prefix`` (the start of the assistant's reply, as RULER
prompts do) and its references. :func:`score` returns ``(exact, partial)``: exact is 1 when
every reference occurs in the answer as a whole word or number (case-insensitive); partial is
the mean over references of the longest run of the reference found in the answer, as a
fraction of its length (``130`` for ``130414``: 0.5).
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher
from typing import Callable, Optional, Sequence

import attrs
import numpy as np

__all__ = ["Plant", "Question", "Episode", "Draw", "TASKS", "task_plants", "build_episode", "score"]

_WORDS = (
    "apple anchor badge basket beacon blanket bottle bridge bucket cabin candle canyon carpet castle "
    "cellar chimney circus cliff clock cloud compass copper cotton crystal desert diamond dolphin "
    "dragon engine falcon feather fender forest fountain garden glacier goblet granite harbor helmet "
    "hollow island jacket jungle kettle ladder lantern lemon magnet marble meadow mirror monkey "
    "needle orchard oyster paddle parrot pebble pepper pillow pirate planet pocket puzzle quarry "
    "rabbit ribbon river rocket saddle satchel shadow silver spider spoon statue thunder ticket "
    "timber tunnel turtle velvet violin walnut wagon walrus window wizard zebra"
).split()
_FIRST = ("Mara Tobin Elsa Corin Ida Felix Nora Silas Greta Anton Lena Hugo Vera Otto Clara Jonas "
          "Petra Emil Rosa Leon Ada Milo Freya Oskar").split()
_SYL = ("dun mere wick ford lin gar ton bel har row ash by vel mor quin tal ser ven dor lis").split()
_PETS = "Biscuit Pepper Juniper Marlow Tansy Rufus Clover Bramble Sprocket Nutmeg".split()


@attrs.frozen
class Plant:
    """A text planted in the filler at relative depth ``depth`` (0 = start, 1 = end)."""

    task: str
    text: str
    depth: float


@attrs.frozen
class Question:
    """One question: ``refs`` must all occur in the answer; ``plants`` index the episode's
    plants that hold them; ``max_tokens`` caps the reply."""

    task: str
    text: str
    answer_prefix: str
    refs: tuple
    max_tokens: int
    plants: tuple = ()


@attrs.frozen
class Episode:
    """A context (``prefix_ids``: chat head + document, ``n_tokens`` of them) and its questions.

    ``placed``: per plant, ``(task, text, char_start, token_start)`` in the document / prefix;
    ``depths``: per question, the relative token depth of its (first) plant.
    """

    seed: tuple
    length: int
    document: str
    prefix_ids: tuple
    placed: tuple
    questions: tuple
    depths: tuple
    sources: tuple

    @property
    def n_tokens(self) -> int:
        return len(self.prefix_ids)


class Draw:
    """Seeded draws that never repeat a key, name or number within an episode."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.used = rng, set()

    def _fresh(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            v = make()
            if v not in self.used:
                self.used.add(v)
                return v
        raise ValueError("ran out of distinct values for the planted facts (too many facts per episode)")

    def number(self, digits: int) -> str:
        return self._fresh(lambda: str(int(self.rng.integers(10 ** (digits - 1), 10 ** digits))))

    def word(self) -> str:
        return self._fresh(lambda: str(self.rng.choice(_WORDS)))

    def invented(self, parts: int = 2) -> str:
        return self._fresh(lambda: "".join(str(s) for s in self.rng.choice(_SYL, parts)).capitalize())

    def person(self) -> str:
        return self._fresh(lambda: f"{self.rng.choice(_FIRST)} {''.join(self.rng.choice(_SYL, 2)).capitalize()}")

    def year(self) -> str:
        return self._fresh(lambda: str(int(self.rng.integers(1620, 1900))))

    def var(self) -> str:
        return self._fresh(lambda: "".join(chr(65 + int(i)) for i in self.rng.integers(0, 26, 5)))

    def depth(self) -> float:
        return float(self.rng.uniform(0.02, 0.98))


# --------------------------------------------------------------------------------------------
# Tasks: each returns (plants, questions); a question's ``plants`` index its task's plants
# --------------------------------------------------------------------------------------------


def _magic(key: str, value: str, repeat: bool) -> str:
    fact = f"The special magic number for {key} is {value}."
    return fact + (f" Remember it: the special magic number for {key} is {value}." if repeat else "")


def _magic_question(task: str, key: str, value: str, digits: int, plant: int) -> "Question":
    return Question(task, f"What is the special magic number for {key} mentioned in the provided text?",
                    f"The special magic number for {key} mentioned in the provided text is", (value,), digits + 3,
                    (plant,))


def _niah_single(d: Draw, digits: int = 6, repeat: bool = True):
    key, n = d.word(), d.number(digits)
    plant = Plant("niah_single", _magic(key, n, repeat), d.depth())
    return [plant], [_magic_question("niah_single", key, n, digits, 0)]


def _niah_multikey(d: Draw, n_keys: int = 4, asks: int = 2, digits: int = 6, repeat: bool = True):
    keys = [d.word() for _ in range(n_keys)]
    vals = [d.number(digits) for _ in keys]
    plants = [Plant("niah_multikey", _magic(k, v, repeat), d.depth()) for k, v in zip(keys, vals)]
    asked = d.rng.choice(n_keys, size=min(asks, n_keys), replace=False)
    return plants, [_magic_question("niah_multikey", keys[i], vals[i], digits, int(i)) for i in asked]


def _niah_multivalue(d: Draw, n_values: int = 3, digits: int = 6):
    key = d.word()
    vals = [d.number(digits) for _ in range(n_values)]
    plants = [Plant("niah_multivalue", f"One of the special magic numbers for {key} is {v}.", d.depth()) for v in vals]
    q = Question("niah_multivalue", f"What are all the special magic numbers for {key} mentioned in the provided text?",
                 f"The special magic numbers for {key} mentioned in the provided text are", tuple(vals),
                 (digits + 3) * n_values + 6, tuple(range(n_values)))
    return plants, [q]


def _vt(d: Draw, hops: int = 3, digits: int = 5):
    names = [d.var() for _ in range(hops + 1)]
    value = d.number(digits)
    depths = sorted(d.depth() for _ in names)
    texts = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    plants = [Plant("vt", t, x) for t, x in zip(texts, depths)]
    q = Question("vt", f"Find all variables that are assigned the value {value} in the text above.",
                 f"According to the chain of variable assignments in the text above, {len(names)} variables are "
                 f"assigned the value {value}, they are:", tuple(names), 4 * len(names) + 6, tuple(range(len(names))))
    return plants, [q]


def _cwe(d: Draw, n_common: int = 3, freq: int = 5, n_rare: int = 15):
    common = [d.word() for _ in range(n_common)]
    rare = [d.word() for _ in range(n_rare)]
    items = [str(w) for w in d.rng.permutation(common * freq + rare)]
    listing = "Here is a list of words: " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)) + "."
    q = Question("cwe", f"What are the {n_common} most common words in the list of words above?",
                 f"The {n_common} words that appear most often in the list are:", tuple(common),
                 4 * n_common + 6, (0,))
    return [Plant("cwe", listing, d.depth())], [q]


# (fact, question, answer prefix, which slot is the answer)
_FACTS = (
    ("{p} was born in the small town of {t}.", "Where was {p} born?", "{p} was born in", "t"),
    ("The old lighthouse on {t} Island was built in {y}.", "In what year was the lighthouse on {t} Island built?",
     "The lighthouse on {t} Island was built in", "y"),
    ("{p} lives on {s} Street, next to the old mill.", "On which street does {p} live?", "{p} lives on", "s"),
    ("The {t} Trading Company was founded by {p}.", "Who founded the {t} Trading Company?",
     "The {t} Trading Company was founded by", "p"),
    ("{p} has a dog named {n}.", "What is the name of {p}'s dog?", "The name of {p}'s dog is", "n"),
)


def _qa(d: Draw, n_facts: int = 5):
    frames = d.rng.choice(len(_FACTS), size=min(n_facts, len(_FACTS)), replace=False)
    plants, qs = [], []
    for j, f in enumerate(frames):
        fact, question, prefix, slot = _FACTS[int(f)]
        while True:  # an answer that is part of its own question (a town inside a name) is drawn again
            v = {"p": d.person(), "t": d.invented(), "y": d.year(),
                 "s": d.invented(), "n": str(d.rng.choice(_PETS))}
            if v[slot] not in question.format(**v) + prefix.format(**v):
                break
        plants.append(Plant("qa", fact.format(**v), d.depth()))
        qs.append(Question("qa", question.format(**v), prefix.format(**v), (v[slot],), 10, (j,)))
    return plants, qs


#: name -> generator ``(draw, **options) -> (plants, questions)``
TASKS: dict[str, Callable] = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "vt": _vt,
    "cwe": _cwe,
    "qa": _qa,
}


def task_plants(tasks: Sequence[str], rng: np.random.Generator, options: Optional[dict] = None):
    """The plants and questions of ``tasks`` drawn for one episode (question ``plants`` index
    the returned plant list)."""
    d = Draw(rng)
    plants: list[Plant] = []
    questions: list[Question] = []
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; choose from {', '.join(TASKS)}")
        ps, qs = TASKS[t](d, **(options or {}).get(t, {}))
        questions += [attrs.evolve(q, plants=tuple(len(plants) + i for i in q.plants)) for q in qs]
        plants += ps
    return plants, questions


# --------------------------------------------------------------------------------------------
# Episodes
# --------------------------------------------------------------------------------------------


def _boundaries(text: str, n: int) -> list[tuple[int, str]]:
    """Where a plant may go: after a blank line (as its own paragraph) or after a sentence."""
    out = [(m.end(), "\n\n") for m in re.finditer(r"\n\n", text)]
    out += [(m.end(), " ") for m in re.finditer(r"(?<=[.!?])[ \n](?=[A-Z])", text)]
    if len(out) < 4 * n:  # text with few sentences (code, lists): any space will do
        out += [(m.end(), " ") for m in re.finditer(r"[ \n]", text)]
    return sorted(set(out))


#: tasks whose plants must be read in the order they were drawn (a chain of assignments)
_IN_READING_ORDER = frozenset({"vt"})


def _insert(fill: str, plants: Sequence[Plant]) -> tuple[str, list[int]]:
    """``fill`` with each plant at the free boundary nearest its depth; each plant's start."""
    bounds = _boundaries(fill, len(plants))
    if len(bounds) < len(plants):
        raise ValueError(f"the filler has {len(bounds)} places for {len(plants)} planted facts")
    pos = np.array([b for b, _ in bounds], dtype=np.float64)
    free = np.ones(len(bounds), dtype=bool)
    slot = []
    for p in plants:
        cost = np.abs(pos - p.depth * len(fill)) + np.where(free, 0.0, np.inf)
        k = int(np.argmin(cost))
        free[k] = False
        slot.append(k)
    for task in _IN_READING_ORDER:  # the nearest free places may cross: keep the chain in order
        chain = [i for i, p in enumerate(plants) if p.task == task]
        for i, k in zip(chain, sorted(slot[i] for i in chain)):
            slot[i] = k
    order = sorted(range(len(plants)), key=lambda i: (slot[i], i))
    out, prev, starts = [], 0, [0] * len(plants)
    size = 0
    for i in order:
        b, kind = bounds[slot[i]]
        out.append(fill[prev:b])
        size += b - prev
        starts[i] = size
        piece = plants[i].text + kind
        out.append(piece)
        size += len(piece)
        prev = b
    out.append(fill[prev:])
    return "".join(out), starts


def _token_at(tokenizer, ids: Sequence[int], n_chars: int) -> int:
    """The index of the token holding character ``n_chars`` of ``decode(ids)``: the most tokens
    whose text fits in the first ``n_chars`` characters (a binary search over decoded prefixes;
    a space or newline before a plant may merge into its first token)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(list(ids[:mid]))) <= n_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


def build_episode(tokenizer, fmt, source, length: int, tasks: Sequence[str], seed: Sequence[int],
                  options: Optional[dict] = None) -> Episode:
    """One seeded episode whose prefix (chat head + document) is ``length`` tokens (within a few:
    the filler is cut at a token and re-fitted until the tokenized document has the size)."""
    from .longctx_text import encode_long, special_strings

    rng = np.random.default_rng(list(seed))
    plants, questions = task_plants(tasks, rng, options)
    head = fmt.head_ids(tokenizer)
    plant_tokens = sum(len(tokenizer.encode(" " + p.text, add_special_tokens=False)) + 1 for p in plants)
    want = length - len(head)
    n_fill = want - plant_tokens
    if n_fill < max(16, plant_tokens // 4):
        raise ValueError(f"a context of {length} tokens is too short for the planted facts of "
                         f"{', '.join(tasks)} (about {plant_tokens + len(head)} tokens); raise the length")
    chars = 5 * want + 400  # about 4 characters a token in English; more is drawn when short
    for _ in range(5):
        text, sources = source.filler(rng, chars, special_strings(tokenizer))
        fill_ids = encode_long(tokenizer, text, add_special_tokens=False)
        if len(fill_ids) >= n_fill + 64:
            break
        chars *= 2
    else:
        raise ValueError(f"the text source ({source.where}) gives {len(fill_ids)} tokens of filler; "
                         f"{n_fill + 64} are needed for one {length}-token context")
    best = None
    for _ in range(6):
        doc, starts = _insert(tokenizer.decode(fill_ids[:n_fill]), plants)
        doc_ids = encode_long(tokenizer, doc, add_special_tokens=False)
        if best is None or abs(len(doc_ids) - want) < abs(len(best[1]) - want):
            best = (doc, doc_ids, starts)
        if len(doc_ids) == want:
            break
        n_fill += want - len(doc_ids)
    doc, doc_ids, starts = best
    tok_starts = [len(head) + _token_at(tokenizer, doc_ids, s) for s in starts]
    n = len(head) + len(doc_ids)
    placed = tuple((p.task, p.text, s, t) for p, s, t in zip(plants, starts, tok_starts))
    depths = tuple(round(tok_starts[q.plants[0]] / n, 4) if q.plants else None for q in questions)
    return Episode(tuple(seed), length, doc, tuple(head + doc_ids), placed, tuple(questions), depths,
                   tuple(dict.fromkeys(sources)))


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


def _found(ref: str, answer: str) -> bool:
    """``ref`` occurs in ``answer`` as a whole word / number (case-insensitive)."""
    return re.search(r"(?<![0-9A-Za-z])" + re.escape(ref) + r"(?![0-9A-Za-z])", answer, re.IGNORECASE) is not None


def _part(ref: str, answer: str) -> float:
    if _found(ref, answer):
        return 1.0
    m = SequenceMatcher(None, ref.lower(), answer.lower(), autojunk=False).find_longest_match()
    return m.size / len(ref) if ref else 0.0


def score(answer: str, refs: Sequence[str]) -> tuple[float, float]:
    """``(exact, partial)`` of ``answer`` against ``refs`` (see the module docstring)."""
    if not refs:
        raise ValueError("a question needs at least one reference answer")
    exact = float(all(_found(r, answer) for r in refs))
    return exact, float(np.mean([_part(r, answer) for r in refs]))
