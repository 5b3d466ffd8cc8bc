"""How the long-context workload runs one cache over its episodes: read, compress, ask.

* :func:`prefill` -- feed a context in chunks (``model(chunk, cache)``, then ``mx.eval`` of the
  cache state, as ``mlx_lm.generate`` prefills: the logits of context positions are never
  computed). A compressing cache evicts while it reads, before any question exists.
* :func:`generate_rows` -- greedy replies of several rows at once through mlx-lm's
  ``BatchGenerator`` (each row its own cache, prompt and token cap; rows stop at an EOS token):
  each row returns its reply and its cache after the reply.
* :func:`ask_each` -- question-blind, one request per question (SCBench's multi-request; a
  server's prompt reuse): the compressed context is copied for every question
  (``copy.deepcopy``), so each question meets the same compressed cache.
* :func:`ask_in_turns` -- multi-turn (SCBench's multi-turn; a chat): the questions follow one
  another in one conversation, each asked after the previous reply, the cache held at its
  budget throughout; rows are episodes.
* :func:`ask_aware` -- question-aware: context and question in one step per question, so the
  first eviction sees the question (SnapKV-style evaluation), then the reply.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Optional, Sequence

import mlx.core as mx

__all__ = ["prefill", "generate_rows", "ask_each", "ask_in_turns", "ask_aware", "ask_aware_first", "eos_ids"]


def eos_ids(tokenizer) -> list[int]:
    """The token ids that end a reply."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return sorted(int(i) for i in ids)


def prefill(model, cache: list, ids: Sequence[int], chunk: int,
            advance: Optional[Callable[[int], None]] = None) -> None:
    """Feed ``ids`` into ``cache`` in chunks of ``chunk`` tokens (``0``: one step)."""
    x = mx.array(list(ids), dtype=mx.uint32)[None]
    step = len(ids) if chunk <= 0 else chunk
    for s in range(0, len(ids), step):
        model(x[:, s : s + step], cache=cache)
        mx.eval([c.state for c in cache])
        if advance is not None:
            advance(min(step, len(ids) - s))


def generate_rows(model, rows: Sequence[tuple], *, stop: Sequence[int], batch: int, step: int = 512) -> list[tuple]:
    """Greedy replies for ``rows`` = ``(cache, prompt_ids, max_tokens)``, ``batch`` rows at a time.

    Returns ``(reply_ids, cache_after)`` per row; the reply includes its stop token when it
    stopped at one, and ``cache_after`` holds the prompt and every reply token (as mlx-lm's
    ``BatchGenerator`` leaves it).
    """
    from mlx_lm.generate import BatchGenerator

    out: list = [None] * len(rows)
    for lo in range(0, len(rows), max(1, batch)):
        part = rows[lo : lo + max(1, batch)]
        gen = BatchGenerator(model, max_tokens=max(r[2] for r in part), stop_tokens=[[t] for t in stop] or None,
                             completion_batch_size=len(part), prefill_batch_size=len(part), prefill_step_size=step)
        try:
            uids = gen.insert([list(r[1]) for r in part], max_tokens=[int(r[2]) for r in part],
                              caches=[r[0] for r in part])
            where = {u: lo + i for i, u in enumerate(uids)}
            toks: dict[int, list] = {u: [] for u in uids}
            left = set(uids)
            while left:
                responses = gen.next_generated()
                if not responses:
                    raise RuntimeError("mlx-lm's BatchGenerator stopped before every reply finished")
                for r in responses:
                    toks[r.uid].append(int(r.token))
                    if r.finish_reason is not None:
                        out[where[r.uid]] = (toks[r.uid], r.prompt_cache)
                        left.discard(r.uid)
        finally:
            gen.close()
    return out


def _reply(tokenizer, ids: Sequence[int], stop: Sequence[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in stop])


def _first_ids(tokenizer, fmt, q) -> list[int]:
    return fmt.encode(tokenizer, fmt.first_question(q.text, q.answer_prefix))


def ask_each(model, tokenizer, fmt, episode, cache: list, *, batch: int, stop: Sequence[int]) -> dict:
    """Every question of ``episode`` on its own copy of the compressed context ``cache``.

    Returns ``{"answers": [str], "cache": a per-question cache after its reply (the first),
    "seconds"}``.
    """
    t0 = time.perf_counter()
    rows = [(copy.deepcopy(cache), _first_ids(tokenizer, fmt, q), q.max_tokens) for q in episode.questions]
    got = generate_rows(model, rows, stop=stop, batch=batch)
    return {"answers": [_reply(tokenizer, ids, stop) for ids, _ in got], "cache": got[0][1],
            "seconds": time.perf_counter() - t0}


def ask_in_turns(model, tokenizer, fmt, episodes: Sequence, caches: Sequence[list], orders: Sequence[Sequence[int]],
                 *, batch: int, stop: Sequence[int], first: Optional[Sequence[tuple]] = None) -> dict:
    """One conversation per episode: its questions in ``orders[e]``, each after the previous
    reply, on ``caches[e]`` (consumed). ``first``: the first turn already answered, per episode
    ``(reply_ids, cache_after)`` (question-aware prefill: :func:`ask_aware_first`).

    Returns ``{"answers": [[str per turn]], "caches": [cache after the last reply], "seconds"}``.
    """
    t0 = time.perf_counter()
    n_turns = max(len(o) for o in orders)
    answers: list[list] = [[] for _ in episodes]
    last: list = [None] * len(episodes)
    cur = list(caches)
    for t in range(n_turns):
        todo = [e for e in range(len(episodes)) if t < len(orders[e])]
        if t == 0 and first is not None:
            got = [first[e] for e in todo]
        else:
            rows = []
            for e in todo:
                q = episodes[e].questions[orders[e][t]]
                if t == 0:
                    ids = _first_ids(tokenizer, fmt, q)
                else:
                    ids = fmt.encode(tokenizer, fmt.later_question(q.text, q.answer_prefix))
                    # a reply that ended on the EOS token already holds the start of the closing text
                    if last[e] and ids and last[e][-1] == ids[0] and last[e][-1] in stop:
                        ids = ids[1:]
                rows.append((cur[e], ids, q.max_tokens))
            got = generate_rows(model, rows, stop=stop, batch=batch)
        for e, (ids, c) in zip(todo, got):
            answers[e].append(_reply(tokenizer, ids, stop))
            last[e], cur[e] = ids, c
    return {"answers": answers, "caches": cur, "seconds": time.perf_counter() - t0}


def _greedy(model, cache: list, logits: mx.array, max_tokens: int, stop: Sequence[int]) -> list[int]:
    """Greedy reply from the next-token ``logits`` ``[1, V]``, fed into ``cache`` as it goes."""
    ids: list[int] = []
    for _ in range(max_tokens):
        tok = int(mx.argmax(logits, axis=-1).item())
        ids.append(tok)
        logits = model(mx.array([[tok]], dtype=mx.uint32), cache=cache)[:, -1, :]
        if tok in stop:
            break
    mx.eval([c.state for c in cache])
    return ids


def ask_aware_first(model, tokenizer, fmt, episode, q, cache: list, *, stop: Sequence[int],
                    advance: Optional[Callable[[int], None]] = None) -> tuple:
    """Question-aware: context + question ``q`` fed in one step (all but the prompt's last
    token, whose logits alone are computed), so the first eviction, made at the next step, sees
    the question; then the greedy reply. Returns ``(reply_ids, cache_after)``."""
    ids = list(episode.prefix_ids) + _first_ids(tokenizer, fmt, q)
    prefill(model, cache, ids[:-1], 0)
    if advance is not None:
        advance(len(episode.prefix_ids))
    logits = model(mx.array([ids[-1:]], dtype=mx.uint32), cache=cache)[:, -1, :]
    return _greedy(model, cache, logits, q.max_tokens, stop), cache


def ask_aware(model, tokenizer, fmt, episode, make_cache: Callable[[], list], *, stop: Sequence[int],
              advance: Optional[Callable[[int], None]] = None) -> dict:
    """Every question of ``episode`` question-aware (:func:`ask_aware_first`), each on a fresh
    cache: one prefill per question."""
    t0 = time.perf_counter()
    got = [ask_aware_first(model, tokenizer, fmt, episode, q, make_cache(), stop=stop, advance=advance)
           for q in episode.questions]
    return {"answers": [_reply(tokenizer, ids, stop) for ids, _ in got], "replies": [ids for ids, _ in got],
            "caches": [c for _, c in got], "cache": got[0][1], "seconds": time.perf_counter() - t0}
