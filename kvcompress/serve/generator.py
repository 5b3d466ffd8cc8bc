"""The bridge to mlx-lm's generation machinery, supervised.

:class:`SupervisedGenerator` is mlx-lm's ``ResponseGenerator`` (one thread running
``BatchGenerator`` for continuous batching, single-sequence generation for what cannot batch,
the prompt cache, chat templates, tool-call and reasoning parsing) with four changes:

* **requests arrive as** :class:`Job` **s** -- mlx-lm's per-request queue, read from asyncio:
  the generation thread's ``put`` hands each item to the event loop; a job knows whether its
  client is gone (:meth:`Job.cancel`), and a cancelled job is stopped the moment its context
  exists, or skipped before it reaches the batch.
* **a request cannot kill the loop**: what only a request can get wrong (a prompt of no tokens,
  token ids or ``logit_bias`` ids outside the vocabulary, a chat template that rejects the
  messages) raises :class:`~.errors.RequestError` inside the thread, which mlx-lm hands back to
  that request alone.
* **supervision**: if the loop raises anyway, every request in flight fails with 500, and the loop
  is started again with the same model and prompt cache -- at most ``max_restarts`` times within
  ``window_s`` seconds; past that (or at once under ``mlx.distributed``, where ranks would part)
  the server is told to exit non-zero (``on_fatal``) so that a supervisor restarts the process.
* token-id prompts (``/v1/completions`` with a list of ints) skip the tokenizer.
* **idle work**: ``on_idle(busy)`` runs on the generation thread whenever nothing is generating
  and no request waits (``busy()`` turns true as soon as one arrives), and ``on_exit()`` once when
  the loop ends -- where a persistent prompt cache writes its files.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

from mlx_lm.server import GenerationContext, ResponseGenerator

from .errors import GenerationFailed, RequestError, ServeError, Unavailable

__all__ = ["Job", "SupervisedGenerator", "vocab_size"]

log = logging.getLogger("kvcompress.serve")


def vocab_size(model, tokenizer) -> int:
    """Token ids the model embeds (its config's ``vocab_size``, else the tokenizer's size)."""
    args = getattr(model, "args", None)
    for src in (args, getattr(args, "text_config", None)):
        n = src.get("vocab_size") if isinstance(src, dict) else getattr(src, "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    return len(tokenizer._tokenizer)


def _wait_exited(thread: threading.Thread, timeout_s: float = 10.0) -> None:
    """Return once the OS thread behind ``thread`` (already joined) is gone, or after ``timeout_s``."""
    import os

    task = f"/proc/self/task/{thread.native_id}"
    if thread.native_id is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.25)
        return
    deadline = time.monotonic() + timeout_s
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


class Job:
    """One generation: what the generation thread ``put`` s (the context, prompt progress
    ``(done, total)``, each :class:`~mlx_lm.server.Response`, then ``None`` or an exception),
    delivered to an asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: Callable[["Job"], None]):
        self._loop, self._on_done = loop, on_done
        self._queue: asyncio.Queue = asyncio.Queue()
        self.ctx: Optional[GenerationContext] = None
        self.cancelled = False
        self.done = False

    # -- generation thread side --------------------------------------------------------------
    def put(self, item: Any) -> None:
        if self.done:
            return
        if isinstance(item, GenerationContext):
            self.ctx = item
            if self.cancelled:
                item.stop()
        if item is None or isinstance(item, BaseException):
            self.done = True
            self._on_done(self)
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    # -- event loop side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """The client is gone: stop generating for it (now, or as soon as it starts)."""
        self.cancelled = True
        if self.ctx is not None:
            self.ctx.stop()
        self._on_done(self)  # no longer in flight; a queued one is skipped, a running one removed

    async def context(self) -> GenerationContext:
        """The request's context (prompt tokens, cached count, parsers), once it is admitted to
        generation; raises what the generation thread reported instead."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, GenerationContext):
                return item
            if item is None:
                raise GenerationFailed("the generation ended before it started")

    async def events(self):
        """Prompt progress tuples and generated Responses until the end."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class SupervisedGenerator(ResponseGenerator):
    """mlx-lm's ResponseGenerator with jobs, per-request errors and a supervised loop."""

    def __init__(self, model_provider, prompt_cache, *, max_restarts: int = 3, window_s: float = 60.0,
                 on_fatal: Optional[Callable[[str], None]] = None,
                 on_idle: Optional[Callable[[Callable[[], bool]], None]] = None,
                 on_exit: Optional[Callable[[], None]] = None):
        self.max_restarts, self.window_s, self.on_fatal = max_restarts, window_s, on_fatal
        self.on_idle, self.on_exit = on_idle, on_exit
        self.restarts = 0
        self.last_error: Optional[str] = None
        self._crashes: collections.deque = collections.deque()
        self._jobs: set = set()
        self._jobs_lock = threading.Lock()
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    # -- the loop, supervised ----------------------------------------------------------------
    def _run_generate(self):
        try:
            self._supervise()
        finally:
            if self.on_exit is not None:
                try:
                    self.on_exit()
                except Exception:
                    log.exception("kvcompress serve: the work at the generation loop's end failed")

    def _supervise(self):
        while not self._stop:
            try:
                self._generate()
                return
            except BaseException as exc:  # the loop died: fail what was in it, then restart or give up
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("kvcompress serve: the generation loop failed (%s)", self.last_error)
                now = time.monotonic()
                self._crashes.append(now)
                while self._crashes and now - self._crashes[0] > self.window_s:
                    self._crashes.popleft()
                # the decision is recorded before the requests in flight hear of it: a client that
                # retries at once finds the loop restarted (or the server failed), never in between
                if self._is_distributed or len(self._crashes) > self.max_restarts:
                    self._generation_failed = True
                    log.error("kvcompress serve: %d generation failures within %.0f s; stopping so that a "
                              "supervisor can restart the server", len(self._crashes), self.window_s)
                    self._fail_in_flight(GenerationFailed(
                        f"generation failed ({self.last_error}); the server stops for its supervisor to restart it"))
                    if self.on_fatal is not None:
                        self.on_fatal(self.last_error)
                    return
                self.restarts += 1
                log.warning("kvcompress serve: generation loop restarted (%d so far)", self.restarts)
                self._fail_in_flight(GenerationFailed(
                    f"generation failed ({self.last_error}); the generation loop was restarted, retry the request"))

    def join(self):
        """Wait until the generation thread has ended, its thread-local destructors included:
        MLX's per-thread compile cache releases Python objects when the thread exits, and if
        the interpreter were finalizing by then the process would abort ("terminate called
        without an active exception", status -6 instead of 0). Python's ``join`` returns
        before those destructors run, so on Linux this waits for the thread to leave
        ``/proc/self/task`` (elsewhere: a short pause)."""
        super().join()
        _wait_exited(self._generation_thread)

    def _fail_in_flight(self, error: ServeError) -> None:
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
            job.put(error)

    def _busy(self) -> bool:
        return self._stop or not self.requests.empty()

    def _next_request(self, timeout=None):
        # mlx-lm waits (timeout not None) only when nothing is generating: the time for idle work
        if timeout is not None and self.on_idle is not None and not self._is_distributed and not self._busy():
            try:
                self.on_idle(self._busy)
            except Exception:
                log.exception("kvcompress serve: idle work failed")
        while True:
            request = super()._next_request(timeout)
            if request is None or self._is_distributed or not isinstance(request[0], Job):
                return request
            if not request[0].cancelled:
                return request
            request[0].put(None)  # its client left while it waited: never start it
            timeout = None

    # -- requests ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (waiting or generating)."""
        with self._jobs_lock:
            return len(self._jobs)

    @property
    def failed(self) -> bool:
        return self._generation_failed

    def submit(self, request, args, loop: Optional[asyncio.AbstractEventLoop] = None) -> Job:
        """Queue one generation (mlx-lm's CompletionRequest and GenerationArguments)."""
        if not self.generation_available():
            raise Unavailable("the generation loop has stopped; the server is shutting down", retry_after=5)
        job = Job(loop or asyncio.get_running_loop(), self._forget)
        with self._jobs_lock:
            self._jobs.add(job)
        self.requests.put((job, request, args))
        return job

    def _forget(self, job: Job) -> None:
        with self._jobs_lock:
            self._jobs.discard(job)

    def _tokenize(self, tokenizer, request, args):
        field = "messages" if request.request_type == "chat" else "prompt"
        if request.request_type == "text" and isinstance(request.prompt, list):
            prompt = list(request.prompt)
            out = (prompt, [prompt], ["assistant"], "normal", None)
        else:
            try:
                out = super()._tokenize(tokenizer, request, args)
            except ServeError:
                raise
            except Exception as exc:  # a template or content the tokenizer refuses: this request's fault
                why = " ".join(str(exc).split())[:300]
                raise RequestError(f"{field}: cannot be turned into tokens ({type(exc).__name__}: {why})",
                                   param=field) from None
        prompt = out[0]
        if not prompt:
            raise RequestError(f"{field}: encodes to no tokens; give at least one token", param=field)
        n = vocab_size(self.model_provider.model, tokenizer)
        bad = next((t for t in prompt if not 0 <= t < n), None)
        if bad is not None:
            raise RequestError(f"{field}: token id {bad} is outside the vocabulary [0, {n})", param=field)
        bias = args.logits.logit_bias or {}
        bad = next((t for t in bias if not 0 <= t < n), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, {n})", param="logit_bias")
        return out
