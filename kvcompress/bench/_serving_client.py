"""The HTTP clients of ``kvcompress bench serve`` (standard library only): one streamed
``/v1/completions`` request timed to its first token (:func:`stream_completion`), one plain
request (:func:`complete`), ``N`` concurrent streamed requests timed as a round
(:func:`load_round`), and :func:`percentile`. Every request has a deadline; requests are greedy
and ban the given token ids (``logit_bias``) so each generates exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

__all__ = ["stream_completion", "stream_chat", "complete", "load_round", "percentile"]

_BAN = -1e9



def _body(prompt: str, max_tokens: int, ban: Sequence[int], stream: bool) -> bytes:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "logit_bias": {str(i): _BAN for i in ban}}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return json.dumps(body).encode()


def _usage(u: dict) -> dict:
    return {"prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}


def stream_completion(url: str, prompt: str, max_tokens: int, ban: Sequence[int], timeout_s: float) -> dict:
    """One streamed ``/v1/completions`` request (greedy): ``ttft_s`` (request sent to the first
    ``data:`` chunk, i.e. the first token), ``total_s``, the usage counts and the text.
    TimeoutError past ``timeout_s``; RuntimeError for an HTTP error or a stream without usage."""
    req = urllib.request.Request(url + "/v1/completions", data=_body(prompt, max_tokens, ban, True),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"request to {url} ran past {timeout_s:.0f} s")
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue  # ": keepalive n/m" comments while the prompt is processed
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    usage = _usage(msg["usage"])
                for choice in msg.get("choices") or []:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += choice.get("text") or ""
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:200]!r}") from None
    total = time.perf_counter() - t0
    if usage is None or ttft is None:
        raise RuntimeError(f"{url}: the stream ended without tokens or usage")
    return {"ttft_s": ttft, "total_s": total, **usage, "text": text}


def stream_chat(url: str, messages: list, max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy ``/v1/chat/completions`` request: ``ttft_s`` (request sent to the
    first content chunk), ``total_s``, the usage counts and the answer's text."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"request to {url} ran past {timeout_s:.0f} s")
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    usage = _usage(msg["usage"])
                for choice in msg.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:200]!r}") from None
    if usage is None:
        raise RuntimeError(f"{url}: the stream ended without usage")
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, **usage, "text": text}


def complete(url: str, prompt: str, max_tokens: int, ban: Sequence[int], timeout_s: float) -> dict:
    """One non-streamed ``/v1/completions`` request (greedy): seconds, usage counts, text."""
    req = urllib.request.Request(url + "/v1/completions", data=_body(prompt, max_tokens, ban, False),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            msg = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:200]!r}") from None
    return {"seconds": time.perf_counter() - t0, **_usage(msg["usage"]), "text": msg["choices"][0]["text"]}


def load_round(url: str, prompts: Sequence[str], max_tokens: int, ban: Sequence[int], timeout_s: float) -> dict:
    """``len(prompts)`` clients, one thread each, stream one request each at the same moment.

    Returns the round's ``wall_s`` (first request sent to the last one finished), the
    aggregate ``tok_s`` (completion tokens / ``wall_s``), the aggregate ``decode_tok_s`` (sum
    over requests of ``(tokens - 1) / (total_s - ttft_s)``: the decode rate after each first
    token) and each request's record. The first failed request is raised after all threads
    are joined."""
    out: list[Optional[dict]] = [None] * len(prompts)
    errors: list[BaseException] = []
    go = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        try:
            go.wait(timeout=60)
            out[i] = stream_completion(url, prompts[i], max_tokens, ban, timeout_s)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    go.wait(timeout=60)
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=timeout_s + 30)
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    if any(r is None for r in out) or any(t.is_alive() for t in threads):
        raise TimeoutError(f"a client of {url} did not finish within {timeout_s:.0f} s")
    tokens = sum(r["completion_tokens"] for r in out)
    decode = sum((r["completion_tokens"] - 1) / (r["total_s"] - r["ttft_s"]) for r in out
                 if r["completion_tokens"] > 1 and r["total_s"] > r["ttft_s"])
    return {"wall_s": wall, "completion_tokens": tokens, "tok_s": tokens / wall, "decode_tok_s": decode,
            "requests": [{k: v for k, v in r.items() if k != "text"} for r in out]}


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (linear interpolation, as numpy's default), None for no values."""
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))

