"""From generated tokens to OpenAI's answer: stop sequences, text, reasoning, tool calls,
log-probabilities, usage.

* :class:`StopText` finds the first stop sequence in the generated *text* (so ``"."`` stops at
  the first period however the tokenizer spells it), holding back a tail that may begin one; the
  answer ends before it, as OpenAI's does.
* :class:`ChoiceText` runs one choice: the stop sequences, then mlx-lm's ``TextStateMachine``
  (reasoning and tool-call markers) and ``ToolCallFormatter``, giving a :class:`Delta` per token.
* ``*_logprobs`` write OpenAI's two log-probability formats (chat's ``content`` entries with
  ``bytes``; completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``).
  A sampled token's text is the text it added to the answer (so the tokens join to the text);
  an alternative's is the token decoded alone.
"""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
from mlx_lm.generate import TextStateMachine
from mlx_lm.server import ToolCallFormatter

__all__ = ["StopText", "Delta", "ChoiceText", "chat_logprobs", "completion_logprobs", "usage"]


class StopText:
    """The first occurrence of any of ``stops`` in text fed piece by piece."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text safe to emit, whether a stop sequence was reached)``; after a hit the safe
        text is everything before the stop sequence."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[: min(hits)], True
        keep = 0  # the longest tail of buf that begins a stop sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail (the text ended without completing a stop sequence)."""
        out, self._held = self._held, ""
        return out


@attrs.define
class Delta:
    """What one generated token adds to a choice."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list = attrs.Factory(list)
    #: ``(token id, logprob, top tokens, its text)`` of the token, when log-probabilities are asked for
    logprob: Optional[tuple] = None
    finish_reason: Optional[str] = None

    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.tool_calls)


class ChoiceText:
    """One choice of one request: generated Responses in, Deltas out (mirrors mlx-lm's
    ``APIHandler.handle_completion``, with text-level stop sequences)."""

    def __init__(self, ctx, tools, stops: Sequence[str], streaming: bool, logprobs: bool):
        self._sm = ctx.text_sm.make_state(ctx.initial_state)
        self._state = ctx.initial_state
        self._tools = ToolCallFormatter(ctx.tool_parser, tools, streaming)
        self._stop = StopText(stops)
        self._logprobs = logprobs
        self._tool_text = ""
        self._made_tool_call = False
        self.tokens = 0
        self.finish_reason: Optional[str] = None

    def add(self, gen) -> Delta:
        """One generated token (mlx-lm's ``Response``); sets :attr:`finish_reason` at the end."""
        self.tokens += 1
        delta = Delta(logprob=(gen.token, gen.logprob, gen.top_tokens, gen.text) if self._logprobs else None)
        safe, hit = self._stop.feed(gen.text)
        finish = "stop" if hit else gen.finish_reason
        if finish is not None and not hit:
            safe += self._stop.flush()
        self._sm, segments = TextStateMachine.split(self._sm, safe)
        if finish == "length" or hit:
            self._sm, rest, state = TextStateMachine.flush(self._sm)
            segments.append((state, rest))
        elif finish == "stop":  # end of sequence: a half-read marker is dropped, as mlx-lm does
            self._sm, _ = TextStateMachine.discard(self._sm)
        calls = []
        for state, text in segments:
            if state == "reasoning":
                delta.reasoning += text
            elif state == "tool":
                self._tool_text += text
            elif state == "normal":
                if self._state == "tool":
                    calls.append(self._tool_text)
                    self._tool_text, self._made_tool_call = "", True
                delta.text += text
            self._state = state
        if finish is not None:
            if self._state == "tool" and self._tool_text:
                calls.append(self._tool_text)
                self._tool_text, self._made_tool_call = "", True
            self.finish_reason = "tool_calls" if finish == "stop" and self._made_tool_call else finish
            delta.finish_reason = self.finish_reason
        delta.tool_calls = self._tools(calls)
        return delta

    @property
    def in_tool_call(self) -> bool:
        """Inside a tool call: streamed chunks wait until it is complete."""
        return self._state == "tool"


def _token_text(tokenizer, token: int) -> str:
    """The text of one token, its leading space kept (SentencePiece's decode drops it)."""
    text = tokenizer.decode([int(token)])
    piece = tokenizer.convert_ids_to_tokens(int(token))
    if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
        text = " " + text
    return text


def chat_logprobs(tokenizer, entries, top_n: int) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(tok, lp, text=None):
        text = _token_text(tokenizer, tok) if text is None else text
        return {"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for tok, lp, top, text in entries:
        item = one(tok, lp, text)
        item["top_logprobs"] = [one(t["id"], t["logprob"]) for t in (top or ())][:top_n] if top_n > 0 else []
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, entries, top_n: int, offset: int = 0) -> dict:
    """Completions' ``logprobs``: parallel ``tokens``, ``token_logprobs``, ``top_logprobs``
    (``{token text: logprob}`` per position) and ``text_offset`` (from ``offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp, top, text in entries:
        out["tokens"].append(text)
        out["token_logprobs"].append(float(lp))
        out["top_logprobs"].append({_token_text(tokenizer, t["id"]): float(t["logprob"]) for t in (top or ())[:top_n]}
                                   if top_n > 0 else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(0, cached_tokens)}}
