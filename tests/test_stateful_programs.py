"""Hypothesis state machines of the cache protocol, for every registered method.

Each machine drives real mlx-lm forwards (``model(tokens, cache=caches)``, so attention goes
through kvcompress's wrapper) on a tiny random GQA Llama in float32, float16 or bfloat16, with
random programs of these rules:

* ``prefill`` (a chunk of 2..9 tokens) and ``decode`` (one token);
* ``trim(n)``: when ``can_trim(n)`` the last ``n`` tokens leave; otherwise ``trim`` raises
  :class:`~kvcompress.KVCompressError` and the cache's whole ``state`` is unchanged;
* ``speculate``: a step of 1..4 tokens, ``trim`` of some of them, then the cache continues like a
  copy that only ever saw the kept ones (what speculative decoding relies on);
* ``copy`` (``copy.deepcopy``), ``reload_kvcompress`` (``kvcompress.save_prompt_cache`` /
  ``load_prompt_cache``) and ``reload_mlx_lm`` (mlx-lm's own ``save_prompt_cache`` /
  ``load_prompt_cache``): the copy becomes a *twin* of the main sequence;
* ``batch_start`` / ``batch_extract`` / ``batch_filter`` / ``batch_extend`` / ``batch_end``:
  copies of the main sequence and of a second sequence become rows of a
  :class:`~kvcompress.BatchCompressedKVCache` that decodes and prefills alongside them
  (skipped for a method whose caches cannot yet batch rows that free different numbers of
  slots in one step: kivi / h2o_kivi at the time of writing, see ``batches_uneven``).

After every rule, for every sequence and every batch row: ``offset`` is the number of tokens
seen; each KV head holds ``tokens_kept`` unique positions in ``[0, offset)``; at most
``budget`` tokens after a decode step (``budget - 1 + S`` after a chunk of ``S``); the sinks of
methods whose selector protects them are held; logits and stored keys/values are finite.

The key property: a twin (deep copy, either reload) continues BIT-IDENTICALLY to the sequence it
was copied from -- the same logits and the same kept positions at every later step. Lines that
went through a batch (batch rows, rows extracted from a batch) keep exactly the same positions,
offsets, budgets and eviction counts as the sequence they mirror, and logits equal up to float
rounding: a batch row's slots can sit in a different order than the solo cache's (where a token
is written after a multi-slot eviction depends on the other rows), and a softmax summed in
another order rounds differently (see ``_NEAR``).

Programs are drawn by hypothesis (:func:`run_program`: ``STEPS`` rules among those enabled,
deterministic examples). ``KVCOMPRESS_STATEFUL_EXAMPLES`` sets the programs per method (default
10, about 2 s per method; 40 took about 15 s per method and found nothing more).
"""

from __future__ import annotations

import copy
import os
import tempfile
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_cache

import kvcompress
from _regression_helpers import PARAMS, batches_uneven
from _stateful_helpers import (DTYPES, METHODS, VOCAB, full_state, held_positions,
                               make_line_caches, model_for, read_caches, row_facts, same_state)
from kvcompress import KVCompressError

#: logits tolerance (atol) for lines that went through a batch; twins must be bit-identical
_NEAR = {"float32": 2e-4, "float16": 3e-2, "bfloat16": 2e-1}
EXAMPLES = int(os.environ.get("KVCOMPRESS_STATEFUL_EXAMPLES", "10"))
STEPS = 20


BATCH = "<batch>"
DATA = object()  # a rule argument that receives hypothesis's ``data`` object
TOKEN = st.integers(1, VOCAB - 1)


def rule(pre=None, weight=1, **strategies):
    """Mark a machine method as a rule, enabled when ``pre(machine)`` and drawn ``weight`` times
    as often as a plain rule; arguments are drawn from ``strategies`` (``DATA``: the data object
    itself, for dependent draws)."""

    def deco(fn):
        fn.rule = (pre or (lambda self: True), strategies, weight)
        return fn

    return deco


class Line:
    """One sequence: its per-layer caches and the tokens it has seen."""

    def __init__(self, name: str, caches: list, seen: int, last_s: int = 1, mirrors: str = "", exact: bool = True):
        self.name, self.caches, self.seen, self.last_s = name, caches, seen, last_s
        self.mirrors = mirrors  # the line it must continue like ("" for main / other)
        self.exact = exact  # bit-identical (twins) or equal up to rounding (through a batch)


def machine_for(method: str):
    """The state machine class for ``method`` (its rules are run by :func:`run_program`)."""

    batch_ok = batches_uneven(method)
    sel = kvcompress.build_method(method, **PARAMS.get(method, {})).selector
    n_sink = int(getattr(sel, "n_sink", 0) or 0)
    token = TOKEN

    class CacheMachine:
        def __init__(self):
            self.tmp = tempfile.TemporaryDirectory()
            self.files = 0
            self.lines: dict[str, Line] = {}
            self.batch = None  # per-layer BatchCompressedKVCache
            self.rows: list[str] = []  # the solo line each batch row mirrors
            self.batch_last_s = 1

        def teardown(self):
            self.tmp.cleanup()

        # -- set-up ---------------------------------------------------------------------

        def start(self, dtype, prompt):
            self.dtype = dtype
            self.model = model_for(dtype)
            self.lines["main"] = Line("main", make_line_caches(self.model, method), 0)
            self.step({"main": prompt})

        # -- driving --------------------------------------------------------------------

        def step(self, tokens: dict) -> None:
            """Feed ``tokens[line]`` to every line (lines that mirror another get its tokens)
            and to the batch rows; then check everything (one device sync for all of it)."""
            outs = {}
            for name, line in self.lines.items():
                if (line.mirrors or name) not in tokens:
                    continue
                toks = tokens[line.mirrors or name]
                outs[name] = self.model(mx.array([toks]), cache=line.caches)[0]
                line.seen += len(toks)
                line.last_s = len(toks)
            if self.batch is not None:
                outs[BATCH] = self.model(mx.array([tokens[r] for r in self.rows]), cache=self.batch)
                self.batch_last_s = len(tokens["main"])
            mx.eval(list(outs.values()))
            logits = {k: np.array(v.astype(mx.float32)) for k, v in outs.items()}
            for name, x in logits.items():
                assert np.isfinite(x).all(), f"{name}: non-finite logits"
            for r, name in enumerate(self.rows):
                self.compare_logits(f"batch row {r}", logits[BATCH][r], logits[name], exact=False)
            for name, line in self.lines.items():
                if line.mirrors and name in logits:
                    self.compare_logits(name, logits[name], logits[line.mirrors], exact=line.exact)
            self.check()

        def tokens_for(self, data_tokens: list, extra: list) -> dict:
            out = {"main": data_tokens}
            if "other" in self.lines:
                out["other"] = extra[: len(data_tokens)]
            return out

        def compare_logits(self, what, a: np.ndarray, b: np.ndarray, exact: bool) -> None:
            """float32 copies of the logits (exact for float16/bfloat16 values)."""
            if exact:
                assert np.array_equal(a, b), f"{what}: logits differ from the line it copies (max |diff| {np.abs(a - b).max()})"
            else:
                diff = float(np.abs(a - b).max())
                assert diff <= _NEAR[self.dtype], f"{what}: logits differ by {diff}"

        @rule(weight=3, t=token, u=token)
        def decode(self, t, u):
            self.step(self.tokens_for([t], [u]))

        @rule(weight=2, chunk=st.lists(token, min_size=2, max_size=9), extra=st.lists(token, min_size=9, max_size=9))
        def prefill(self, chunk, extra):
            self.step(self.tokens_for(chunk, extra))

        # -- trimming -------------------------------------------------------------------

        def trim_line(self, line: Line, n: int) -> bool:
            """Trim ``n`` from every layer if each can; otherwise the trim must raise and change
            nothing. Returns whether it trimmed."""
            can = [c.can_trim(n) for c in line.caches]
            if all(can):
                for c in line.caches:
                    assert c.trim(n) == n
                line.seen -= n
                line.last_s = max(line.last_s - n, 0)
                return True
            before = full_state(line.caches)
            bad = next(c for c, ok in zip(line.caches, can) if not ok)
            with pytest.raises(KVCompressError):
                bad.trim(n)
            assert same_state(before, full_state(line.caches)), f"{line.name}: a refused trim changed the cache"
            return False

        @rule(pre=lambda self: self.batch is None, n=st.integers(1, 12))
        def trim(self, n):
            main = self.lines["main"]
            if n > main.seen:
                return
            if not self.trim_line(main, n):
                return
            for name, line in list(self.lines.items()):
                if line.mirrors == "main" and not self.trim_line(line, n):
                    del self.lines[name]  # it cannot follow (e.g. reloaded: no undo kept)
            self.check()

        @rule(pre=lambda self: self.batch is None and self.lines["main"].seen > 0, chunk=st.lists(token, min_size=1, max_size=4), data=DATA, nxt=token)
        def speculate(self, chunk, data, nxt):
            """Draft ``chunk``, reject the last ``n``: the cache continues like one that only saw
            the accepted tokens (positions exact, logits up to rounding)."""
            main = self.lines["main"]
            pre = copy.deepcopy(main.caches)
            self.model(mx.array([chunk]), cache=main.caches)
            n = data.draw(st.integers(1, len(chunk)), label="rejected")
            assert all(c.can_trim(n) for c in main.caches), "a step of <= 16 tokens must be trimmable"
            for c in main.caches:
                assert c.trim(n) == n
            keep = chunk[: len(chunk) - n]
            if keep:
                self.model(mx.array([keep]), cache=pre)
            assert [c.offset for c in main.caches] == [c.offset for c in pre]
            a = self.model(mx.array([[nxt]]), cache=main.caches)
            b = self.model(mx.array([[nxt]]), cache=pre)
            self.compare_logits("after a trim", np.array(a[0].astype(mx.float32)), np.array(b[0].astype(mx.float32)), exact=False)
            for c, d in zip(main.caches, pre):
                assert row_facts(c) == row_facts(d)
                np.testing.assert_array_equal(held_positions(c), held_positions(d))
            main.seen += len(keep) + 1
            main.last_s = 1
            # the twins did not take part: they leave
            for name in [k for k, v in self.lines.items() if v.mirrors == "main"]:
                del self.lines[name]
            self.check()

        # -- copies ---------------------------------------------------------------------

        def add_twin(self, kind: str, caches: list, exact: bool = True, mirrors: str = "main") -> None:
            twins = [k for k, v in self.lines.items() if v.mirrors]
            if len(twins) >= 2:
                del self.lines[twins[0]]
            src = self.lines[mirrors]
            name = f"{kind}{self.files}"
            self.files += 1
            self.lines[name] = Line(name, caches, src.seen, src.last_s, mirrors=mirrors, exact=exact)
            if exact:  # nothing may differ, not even before the next step
                for c, d in zip(caches, src.caches):
                    assert type(c) is type(d)
                    assert row_facts(c) == row_facts(d)
                    np.testing.assert_array_equal(held_positions(c), held_positions(d))
                    assert c.score_source == d.score_source
            self.check()

        @rule()
        def copy(self):
            self.add_twin("copy", copy.deepcopy(self.lines["main"].caches))

        @rule()
        def reload_kvcompress(self):
            path = str(Path(self.tmp.name) / f"kv{self.files}.safetensors")
            kvcompress.save_prompt_cache(path, self.lines["main"].caches)
            self.add_twin("kvload", kvcompress.load_prompt_cache(path))

        @rule()
        def reload_mlx_lm(self):
            path = str(Path(self.tmp.name) / f"mlx{self.files}.safetensors")
            mlx_cache.save_prompt_cache(path, self.lines["main"].caches)
            self.add_twin("mlxload", mlx_cache.load_prompt_cache(path))

        # -- batches ----------------------------------------------------------------------

        @rule(pre=lambda self: batch_ok and self.batch is None, weight=3,
              prefix=st.lists(token, min_size=0, max_size=20), main_first=st.booleans())
        def batch_start(self, prefix, main_first):
            """Rows: copies of the main sequence and of a second one, which first takes ``prefix``
            on its own (so that the rows' lengths, and the slots they free, differ)."""
            if "other" not in self.lines:
                self.lines["other"] = Line("other", make_line_caches(self.model, method), 0)
                prefix = prefix or [1]
            if prefix:
                self.step({"other": prefix})
            self.rows = ["main", "other"] if main_first else ["other", "main"]
            parts = [copy.deepcopy(self.lines[r].caches) for r in self.rows]
            self.batch = [type(layer[0]).merge(list(layer)) for layer in zip(*parts)]
            self.batch_last_s = max(self.lines[r].last_s for r in self.rows)
            self.check()

        @rule(pre=lambda self: self.batch is not None, data=DATA)
        def batch_extract(self, data):
            r = data.draw(st.integers(0, len(self.rows) - 1), label="row")
            caches = [c.extract(r) for c in self.batch]
            assert all(type(c) is kvcompress.CompressedKVCache for c in caches)
            self.add_twin("extract", caches, exact=False, mirrors=self.rows[r])

        @rule(pre=lambda self: self.batch is not None and len(self.rows) > 1, data=DATA)
        def batch_filter(self, data):
            keep = sorted(data.draw(st.sets(st.integers(0, len(self.rows) - 1), min_size=1, max_size=len(self.rows) - 1), label="keep"))
            for c in self.batch:
                c.filter(keep)
            self.rows = [self.rows[i] for i in keep]
            self.check()

        @rule(pre=lambda self: self.batch is not None and len(self.rows) < 4, which=st.sampled_from(["main", "other"]))
        def batch_extend(self, which):
            more = [type(c).merge([c]) for c in copy.deepcopy(self.lines[which].caches)]
            for c, m in zip(self.batch, more):
                c.extend(m)
            self.rows.append(which)
            self.batch_last_s = max(self.batch_last_s, self.lines[which].last_s)
            self.check()

        @rule(pre=lambda self: self.batch is not None)
        def batch_end(self):
            self.batch, self.rows = None, []

        # -- invariants -------------------------------------------------------------------

        def check_row(self, what, snap, c, row, seen, last_s, ref=None):
            offset, kept, budget, evicted = row_facts(c, row)
            assert offset == seen, f"{what}: offset {offset} != tokens seen {seen}"
            pos = snap[id(c)][row]
            counts = (pos >= 0).sum(axis=1)
            if "head_wise_budgets" not in c.method.selector.provides:
                assert len(set(counts.tolist())) <= 1, f"{what}: KV heads hold different counts {counts.tolist()}"
            n = counts.mean() if counts.size else 0
            assert n == kept, f"{what}: tokens_kept {kept} != positions held {n} (mean over heads)"
            assert kept <= budget - 1 + max(last_s, 1), f"{what}: {kept} held over budget {budget} (step of {last_s})"
            for p in pos:
                p = p[p >= 0]
                assert (np.diff(p) > 0).all(), f"{what}: repeated positions"
                assert not p.size or p.max() < offset, f"{what}: positions outside [0, {offset})"
            sinks = min(n_sink, offset)
            if sinks:
                assert (pos[:, :sinks] == np.arange(sinks)).all(), f"{what}: a sink left the cache"
            if ref is not None:  # a line that must hold exactly what ``ref`` holds
                assert (offset, kept, budget, evicted) == row_facts(ref), f"{what}: {(offset, kept, budget, evicted)} != {row_facts(ref)}"
                np.testing.assert_array_equal(pos, snap[id(ref)][0], err_msg=f"{what}: kept positions differ")

        def check(self):
            caches = [c for line in self.lines.values() for c in line.caches] + list(self.batch or [])
            snap = read_caches(caches, DTYPES[self.dtype])
            for name, line in self.lines.items():
                ref = self.lines[line.mirrors].caches if line.mirrors else None
                for i, c in enumerate(line.caches):
                    self.check_row(f"{name} layer {i}", snap, c, 0, line.seen, line.last_s, None if ref is None else ref[i])
            if self.batch is not None:
                for i, c in enumerate(self.batch):
                    assert len(c.offset.tolist()) == len(self.rows)
                    for r, name in enumerate(self.rows):
                        line = self.lines[name]
                        self.check_row(f"batch row {r} ({name}) layer {i}", snap, c, r, line.seen,
                                       max(line.last_s, self.batch_last_s), line.caches[i])

    CacheMachine.__name__ = f"CacheMachine_{method}"
    CacheMachine.RULES = [(k, v) for k, v in vars(CacheMachine).items() if hasattr(v, "rule")]
    return CacheMachine


def run_program(method: str, data) -> None:
    """A random program: set-up, then ``STEPS`` rules drawn among the enabled ones (the first
    rule, ``decode``, is what a shrunk program falls back to)."""
    machine = machine_for(method)()
    for _ in range(zlib.crc32(method.encode()) % 5):  # each method its own (deterministic) programs
        data.draw(st.integers(0, 255), label="salt")
    try:
        machine.start(data.draw(st.sampled_from(sorted(DTYPES)), label="dtype"),
                      data.draw(st.lists(TOKEN, min_size=1, max_size=20), label="prompt"))
        for _ in range(STEPS):
            enabled = [(name, fn) for name, fn in machine.RULES if fn.rule[0](machine)]
            name = data.draw(st.sampled_from([n for n, fn in enabled for _ in range(fn.rule[2])]), label="rule")
            fn = dict(enabled)[name]
            kwargs = {k: data if v is DATA else data.draw(v, label=f"{name}.{k}") for k, v in fn.rule[1].items()}
            fn(machine, **kwargs)
    finally:
        machine.teardown()


_SETTINGS = dict(
    deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_cache_programs(method, data):
    run_program(method, data)
