"""The timing harness the speed workloads share: steps, schedules, paired ratios, peak memory.

* Steps: :func:`greedy_step` and :func:`prefill` (chunked, as ``mlx_lm.generate`` feeds a
  prompt), :func:`start_generation` / :func:`time_block` around mlx-lm's own ``generate_step``.
* Schedules: :func:`round_robin` (blocks of work over several caches, the order rotated every
  block, so bursts of load from other processes hit every cache alike), :func:`interleave`
  (times callables on that schedule) and :func:`time_beside` (each cache's block timed next to
  a block of the reference, so a ratio compares blocks seconds apart however many caches run);
  :class:`Runner` advances one cache through a prompt so that several can move in lockstep.
* Statistics: :func:`paired` ratios of matched measurements and their :func:`median`.
* Memory: :class:`Runner` folds each segment's ``mx.get_peak_memory()`` into the peak its cache
  would reach alone.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

from ._caches import cache_bytes

__all__ = [
    "sync",
    "release",
    "rotate",
    "round_robin",
    "interleave",
    "time_beside",
    "greedy_step",
    "sync_stepper",
    "prefill",
    "chunks",
    "start_generation",
    "time_block",
    "time_generation",
    "paired",
    "median",
    "Runner",
]


def sync() -> None:
    """Wait for all queued work (the default stream and mlx-lm's generation stream)."""
    mx.synchronize()
    mx.synchronize(importlib.import_module("mlx_lm.generate").generation_stream)


def release() -> None:
    """Free what the last measurement left behind (Python garbage and MLX's buffer cache)."""
    gc.collect()
    mx.clear_cache()


def rotate(items: Sequence, r: int) -> list:
    """``items`` starting at index ``r`` (mod its length), wrapping around."""
    items = list(items)
    r %= len(items)
    return items[r:] + items[:r]


def round_robin(names: Sequence[str], n_blocks: int, offset: int = 0) -> Iterator[tuple[int, str]]:
    """``(block, name)`` for ``n_blocks`` blocks over ``names``, the order of block ``b`` rotated
    by ``b + offset``."""
    for b in range(n_blocks):
        for name in rotate(names, b + offset):
            yield b, name


def interleave(steppers: dict, n_blocks: int, k: int) -> dict:
    """Time ``k`` calls of each stepper per block, blocks round-robin over the steppers (order
    rotated every block); return seconds per call for each block, per stepper."""
    out: dict[str, list[float]] = {n: [] for n in steppers}
    for _, name in round_robin(list(steppers), n_blocks):
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            steppers[name]()
        out[name].append((time.perf_counter() - t0) / k)
    return out


def time_beside(runners: dict, ref: str, n_blocks: int, timer: Callable, offset: int = 0) -> tuple[dict, dict]:
    """Time ``timer(runner)`` for ``n_blocks`` rounds over ``runners``, every other runner's block
    next to a block of ``runners[ref]`` (the reference first on alternate rounds and neighbours,
    the order rotated every round). Returns ``(times, beside)``: every block's seconds per runner
    (the reference's included, one per block it ran) and, per other runner, the reference's block
    timed next to each of its blocks -- the pair :func:`paired` compares. Without the reference,
    or with nothing beside it, plain :func:`round_robin`."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    others = [k for k in runners if k != ref]
    beside: dict[str, list[float]] = {k: [] for k in others}
    if ref not in runners or not others:
        for _, name in round_robin(list(runners), n_blocks, offset):
            times[name].append(timer(runners[name]))
        return times, beside
    index = {k: j for j, k in enumerate(others)}
    for b, name in round_robin(others, n_blocks, offset):
        for k in ((ref, name) if (b + index[name]) % 2 == 0 else (name, ref)):
            t = timer(runners[k])
            times[k].append(t)
            if k == ref:
                beside[name].append(t)
    return times, beside


def greedy_step(model, cache: list, y: mx.array) -> mx.array:
    """One decode step of ``model`` on ``cache`` from token(s) ``y`` ``[B, 1]``; the argmax, lazy."""
    logits = model(y, cache=cache)
    return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)


def sync_stepper(model, cache: list, y: mx.array) -> Callable[[], None]:
    """A synchronous greedy decode step (``mx.eval`` each call), continuing from ``y``."""
    state = {"y": y}

    def step():
        state["y"] = greedy_step(model, cache, state["y"])
        mx.eval(state["y"])

    return step


def prefill(model, cache: list, tokens: mx.array, start: int, end: int, step: int) -> int:
    """Feed ``tokens[start:end]`` in chunks whose boundaries fall on multiples of ``step``
    (``model(chunk, cache)``, then ``mx.eval`` of the cache state, as ``mlx_lm.generate`` does);
    return ``end``."""
    for pos, stop in chunks(start, end, step):
        model(tokens[None, pos:stop], cache=cache)
        mx.eval([c.state for c in cache])
    return end


def chunks(start: int, end: int, step: int) -> Iterator[tuple[int, int]]:
    """``(pos, stop)`` of the chunks from ``start`` to ``end`` whose boundaries fall on multiples
    of ``step`` (so a prompt read in segments is cut where it would be read at once)."""
    pos = start
    while pos < end:
        stop = min(end, (pos // step + 1) * step)
        yield pos, stop
        pos = stop


def start_generation(model, prompt: mx.array, cache: list, prefill_step_size: int, max_tokens: int):
    """Start ``generate_step`` and time its first token: ``(generator, {"prefill_s", "prefill_cpu_s"})``."""
    from mlx_lm.generate import generate_step

    gen = generate_step(prompt, model, prompt_cache=cache, max_tokens=max_tokens,
                        prefill_step_size=prefill_step_size)
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    next(gen)
    c1, t1 = time.process_time(), time.perf_counter()
    return gen, {"prefill_s": t1 - t0, "prefill_cpu_s": c1 - c0}


def time_block(gen, k: int) -> tuple[float, float]:
    """Wall and CPU seconds per decode token over ``k`` tokens of a running ``generate_step``.

    ``generate_step`` dispatches step ``n + 1`` before it yields token ``n``. After a full
    synchronisation the first ``next`` only dispatches (its token is ready), and each further
    ``next`` waits for one step, so ``k`` calls time ``k - 1`` pipelined decode steps.
    """
    sync()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(k):
        next(gen)
    c1, t1 = time.process_time(), time.perf_counter()
    return (t1 - t0) / (k - 1), (c1 - c0) / (k - 1)


def time_generation(model, prompt: mx.array, cache: list, prefill_step_size: int, decode_tokens: int) -> dict:
    """One cache alone: time to first token, then ``decode_tokens`` tokens timed as one block."""
    gen, m = start_generation(model, prompt, cache, prefill_step_size, decode_tokens + 2)
    wall, cpu = time_block(gen, decode_tokens + 1)
    gen.close()
    m.update(decode_tok_s=1.0 / wall, decode_cpu_s_per_token=cpu)
    return m


def paired(values: Sequence[float], refs: Sequence[float], invert: bool = False) -> list[float]:
    """Ratios of matched measurements: ``value / ref`` each (``ref / value`` with ``invert``:
    a time ratio turned into a speed ratio, higher is better)."""
    return [r / v if invert else v / r for v, r in zip(values, refs)]


def median(values: Sequence[float]) -> Optional[float]:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


class Runner:
    """One cache advancing through a prompt, with its prefill time and peak memory, so that
    several caches can move through the same prompt in lockstep."""

    def __init__(self, kind: str, model, cache: list, prompt: mx.array, decode_ids: mx.array, weights: int,
                 fill: Optional[Callable[[list, int, int, int], int]] = None):
        self.kind, self.model, self.cache, self.fill = kind, model, cache, fill
        self.prompt, self.decode_ids, self.weights = prompt, decode_ids, weights
        self.pos = 0          # prompt tokens consumed
        self.decoded = 0      # decode steps taken
        self.prefill_s = 0.0
        self.peak = 0         # running peak of this cache alone (bytes)
        self.y = None

    def _track(self, fn: Callable[[], None]) -> float:
        """Run ``fn`` timed; fold its peak memory (others' idle caches removed) into ``peak``:
        the weights plus this cache plus the transient buffers of the segment."""
        gc.collect()
        own_before = cache_bytes(self.cache)
        active_before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        transient = mx.get_peak_memory() - active_before
        self.peak = max(self.peak, self.weights + own_before + transient, self.weights + cache_bytes(self.cache))
        return dt

    def _step(self) -> mx.array:
        y = self.y if self.y is not None else self.decode_ids[self.decoded % self.decode_ids.shape[0]].reshape(1, 1)
        self.decoded += 1
        return greedy_step(self.model, self.cache, y)

    def prefill_to(self, n: int, step: int) -> None:
        """Feed the prompt up to token ``n`` in chunks (or ``fill(cache, start, n, step)`` when
        given: :func:`~kvcompress.bench._fill.synthetic_fill`), then take the first decode step
        (which carries out the eviction the last chunk deferred): the time to the first token,
        as ``mlx_lm.generate`` counts it."""
        def go():
            if self.fill is not None:
                self.pos = self.fill(self.cache, self.pos, n, step)
            else:
                self.pos = prefill(self.model, self.cache, self.prompt, self.pos, n, step)
            self.y = self._step()
            mx.eval(self.y)

        self.prefill_s += self._track(go)

    def decode(self, k: int) -> float:
        """``k`` greedy steps pipelined as ``mlx_lm.generate_step`` runs them (step ``n + 1`` is
        built while step ``n`` computes: ``mx.async_eval``); seconds per step, timed from a
        synchronised start to the last token."""
        def go():
            nxt = self._step()
            mx.async_eval(nxt)
            for i in range(k):
                cur = self.y = nxt
                if i + 1 < k:
                    nxt = self._step()
                    mx.async_eval(nxt)
                mx.eval(cur)

        return self._track(go) / k

    def decode_sync(self, k: int) -> float:
        """``k`` synchronous greedy steps (``mx.eval`` of each token before the next is built):
        the cache's graph-building overhead fully exposed; seconds per step."""
        def go():
            for _ in range(k):
                self.y = self._step()
                mx.eval(self.y)

        return self._track(go) / k
