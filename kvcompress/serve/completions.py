"""``/v1/completions`` and ``/v1/chat/completions``: a checked body becomes one generation per
choice (each prompt x ``n``), admitted, submitted to the generation loop, and answered -- as one
JSON object, or as server-sent events -- while the client is watched: a client that leaves,
streaming or not, cancels its generations at once.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
import uuid
from typing import Any, Optional

import attrs
from mlx_lm.server import (CompletionRequest, GenerationArguments, LogitsProcessorArguments, ModelDescription,
                           SamplingArguments, _image_parts, _inline_image_urls)
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .errors import GenerationFailed, ModelNotFound, RequestError, ServeError
from .output import ChoiceText, chat_logprobs, completion_logprobs, usage
from .schema import ChatBody, CompletionBody

__all__ = ["Plan", "plan", "answer", "ClientGone"]


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@attrs.frozen
class Plan:
    """One generation: choice ``index`` for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    request: Any  # mlx_lm.server.CompletionRequest
    args: Any  # mlx_lm.server.GenerationArguments


def _args(body, cli, top_n: int, max_tokens: Optional[int]) -> GenerationArguments:
    pick = lambda v, default: default if v is None else v  # noqa: E731
    return GenerationArguments(
        model=ModelDescription(model=body.model, draft=body.draft_model, adapter=body.adapters),
        sampling=SamplingArguments(
            temperature=pick(body.temperature, cli.temp), top_p=pick(body.top_p, cli.top_p),
            top_k=pick(body.top_k, cli.top_k), min_p=pick(body.min_p, cli.min_p),
            xtc_probability=body.xtc_probability, xtc_threshold=body.xtc_threshold),
        logits=LogitsProcessorArguments(
            logit_bias=body.logit_bias, repetition_penalty=body.repetition_penalty,
            repetition_context_size=body.repetition_context_size, presence_penalty=body.presence_penalty,
            presence_context_size=body.presence_context_size, frequency_penalty=body.frequency_penalty,
            frequency_context_size=body.frequency_context_size),
        stop_words=[],  # stop sequences are found in the text (output.StopText), not as token ids
        max_tokens=pick(max_tokens, cli.max_tokens),
        num_draft_tokens=pick(body.num_draft_tokens, cli.num_draft_tokens),
        logprobs=body.wants_logprobs, top_logprobs=top_n, seed=body.seed,
        chat_template_kwargs=getattr(body, "chat_template_kwargs", None),
    )


def _seeded(args, index: int):
    """Choice ``index`` of a seeded request samples with ``seed + index``: reproducible, and the
    choices differ (as OpenAI's)."""
    return args if args.seed is None or not index else dataclasses.replace(args, seed=(args.seed + index) % 2**64)


def plan(body, cli) -> list[Plan]:
    """The generations a request asks for, in choice order (OpenAI's: prompt-major, then ``n``)."""
    if isinstance(body, ChatBody):
        top_n = body.top_logprobs or 0
        args = _args(body, cli, top_n if body.logprobs else -1, body.effective_max_tokens)
        return [Plan(j, 0, CompletionRequest("chat", "", copy.deepcopy(body.messages), body.template_tools,
                                             body.role_mapping), _seeded(args, j)) for j in range(body.n)]
    args = _args(body, cli, body.top_logprobs, body.max_tokens)
    return [Plan(i * body.n + j, i, CompletionRequest("text", p, [], None, None), _seeded(args, i * body.n + j))
            for i, p in enumerate(body.prompt) for j in range(body.n)]


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _watch(request: Request, jobs, coro):
    """``await coro``, unless the client leaves first: then cancel ``jobs`` and raise ClientGone."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work in done:
        return work.result()
    work.cancel()
    for job in jobs:
        job.cancel()
    raise ClientGone()


async def _choice(job, ctx, body, streaming: bool):
    """Prompt progress tuples and Deltas of one choice; a stop sequence ends its generation."""
    text = ChoiceText(ctx, body.template_tools if isinstance(body, ChatBody) else None, body.stop, streaming,
                      body.wants_logprobs)
    async for item in job.events():
        if isinstance(item, tuple):
            yield item
            continue
        delta = text.add(item)
        yield delta
        if delta.finish_reason is not None:
            if item.finish_reason is None:  # the text reached a stop sequence: stop generating
                job.cancel()
            return


class Answer:
    """What a request's answer shares: ids, model name, the tokenizer, its choices' contexts."""

    def __init__(self, body, plans, ctxs, tokenizer, fingerprint: str):
        self.body, self.plans, self.ctxs, self.tokenizer = body, plans, ctxs, tokenizer
        self.chat = isinstance(body, ChatBody)
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self.fingerprint = fingerprint
        self.top_n = max(0, plans[0].args.top_logprobs)

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.body.model,
                "system_fingerprint": self.fingerprint}

    def echo(self, k: int) -> str:
        if self.chat or not self.body.echo:
            return ""
        p = self.plans[k].request.prompt
        return p if isinstance(p, str) else self.tokenizer.decode(p)

    def logprobs(self, entries, offset: int = 0):
        if not self.body.wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, entries, self.top_n)
        return completion_logprobs(self.tokenizer, entries, self.top_n, offset)

    def usage(self, completion_tokens: int) -> dict:
        firsts = [k for k, p in enumerate(self.plans) if k == 0 or p.prompt_index != self.plans[k - 1].prompt_index]
        return usage(sum(len(self.ctxs[k].prompt) for k in firsts), completion_tokens,
                     sum(self.ctxs[k].prompt_cache_count for k in firsts))


async def _collect(answer: Answer, jobs) -> dict:
    async def one(k):
        text, reasoning, calls, entries, finish, tokens = answer.echo(k), "", [], [], None, 0
        async for d in _choice(jobs[k], answer.ctxs[k], answer.body, streaming=False):
            if isinstance(d, tuple):
                continue
            text, reasoning, tokens = text + d.text, reasoning + d.reasoning, tokens + 1
            calls += d.tool_calls
            if d.logprob is not None:
                entries.append(d.logprob)
            finish = d.finish_reason or finish
        choice = {"index": answer.plans[k].index, "finish_reason": finish or "stop",
                  "logprobs": answer.logprobs(entries)}
        if answer.chat:
            message = {"role": "assistant", "content": text or None}
            if reasoning:
                message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choice["message"] = message
        else:
            choice["text"] = text
        return choice, tokens

    done = await asyncio.gather(*(one(k) for k in range(len(jobs))))
    out = answer.head("chat.completion" if answer.chat else "text_completion")
    out["choices"] = sorted((c for c, _ in done), key=lambda c: c["index"])
    out["usage"] = answer.usage(sum(t for _, t in done))
    return out


def _sse(obj) -> bytes:
    import json

    return f"data: {json.dumps(obj)}\n\n".encode()


async def _stream(answer: Answer, jobs, ticket):
    """Server-sent events of every choice, merged as they come; usage last when asked."""
    obj = "chat.completion.chunk" if answer.chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()
    extra = {"usage": None} if answer.body.include_usage else {}

    def chunk(k, delta: dict, finish=None, logprobs=None) -> bytes:
        c = {"index": answer.plans[k].index, "finish_reason": finish, "logprobs": logprobs}
        c.update({"delta": delta} if answer.chat else delta)
        return _sse({**answer.head(obj), "choices": [c], **extra})

    async def pump(k):
        try:
            async for ev in _choice(jobs[k], answer.ctxs[k], answer.body, streaming=True):
                await queue.put((k, ev))
        except ServeError as exc:
            await queue.put((k, exc))
        except Exception as exc:  # what mlx-lm's loop handed back: end the stream with an error event
            await queue.put((k, GenerationFailed(f"generation failed ({type(exc).__name__}: {exc})")))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.ensure_future(pump(k)) for k in range(len(jobs))]
    try:
        offsets, pending, tokens = [0] * len(jobs), [[] for _ in jobs], 0
        for k in range(len(jobs)):
            first = answer.echo(k)
            offsets[k] = len(first)
            if answer.chat:
                yield chunk(k, {"role": "assistant", "content": ""})
            elif first:
                yield chunk(k, {"text": first})
        remaining = len(jobs)
        while remaining:
            k, ev = await queue.get()
            if ev is None:
                remaining -= 1
            elif isinstance(ev, ServeError):
                yield _sse(ev.body())
                break
            elif isinstance(ev, tuple):
                yield f": keepalive {ev[0]}/{ev[1]}\n\n".encode()
            else:
                tokens += 1
                if ev.logprob is not None:
                    pending[k].append(ev.logprob)
                if ev.empty() and ev.finish_reason is None:
                    continue
                lp, pending[k] = answer.logprobs(pending[k], offsets[k]), []
                if answer.chat:
                    delta = {"content": ev.text} if ev.text else {}
                    if ev.reasoning:
                        delta["reasoning"] = ev.reasoning
                    if ev.tool_calls:
                        delta["tool_calls"] = ev.tool_calls
                else:
                    delta = {"text": ev.text}
                offsets[k] += len(ev.text)
                yield chunk(k, delta, ev.finish_reason, lp)
        else:
            if answer.body.include_usage:
                yield _sse({**answer.head(obj), "choices": [], "usage": answer.usage(tokens)})
        yield b"data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for job in jobs:
            job.cancel()
        ticket.release()


def check_model(body, provider, cli) -> None:
    """With ``--model``, a request may name only the served model (by any of its names): loading
    another would unload it for every other client. Without ``--model``, as in mlx-lm, the model
    a request names is loaded on demand."""
    if cli.model is None:
        return
    served = provider._model_map
    if body.model not in served:
        raise ModelNotFound(f"model {body.model!r} is not served here; this server serves {cli.model!r} "
                            f"(or name it 'default_model'; GET /v1/models lists it)", param="model",
                            code="model_not_found")
    if body.adapters is not None and body.adapters != cli.adapter_path:
        raise RequestError(f"adapters: this server serves {cli.model!r} with adapters {cli.adapter_path!r}; "
                           "another adapter would reload the model for every client", param="adapters")
    if body.draft_model not in ("default_model", cli.draft_model):
        raise RequestError(f"draft_model: this server's draft model is {cli.draft_model!r}; another would "
                           "reload the models for every client", param="draft_model")


async def answer(request: Request, body, state) -> Response:
    """Admit, submit and answer one checked request (``state``: the app's shared objects)."""
    check_model(body, state.provider, state.cli)
    plans = plan(body, state.cli)
    if len(plans) > state.admission.capacity:
        field = "n" if len(plans) == body.n else "prompt"
        raise RequestError(f"{field}: asks for {len(plans)} generations, more than the server holds at once "
                           f"(--max-concurrent-requests {state.admission.capacity})", param=field)
    ticket = state.admission.admit(len(plans))
    jobs: list = []
    try:
        if isinstance(body, ChatBody) and any(_image_parts(body.messages)):
            for p in plans:
                try:  # http(s) image URLs become data URLs (mlx-lm's), off the event loop
                    await asyncio.to_thread(_inline_image_urls, p.request.messages)
                except Exception as exc:
                    raise RequestError(f"messages: an image could not be read ({type(exc).__name__}: {exc})",
                                       param="messages") from None
        jobs = [state.generator.submit(p.request, p.args) for p in plans]
        ctxs = await _watch(request, jobs, asyncio.gather(*(j.context() for j in jobs)))
        ans = Answer(body, plans, ctxs, state.provider.tokenizer, state.fingerprint)
    except BaseException:
        for job in jobs:
            job.cancel()
        ticket.release()
        raise
    if body.stream:
        return StreamingResponse(_stream(ans, jobs, ticket), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(ticket.release))
    try:
        return JSONResponse(await _watch(request, jobs, _collect(ans, jobs)))
    finally:
        for job in jobs:
            job.cancel()
        ticket.release()


def body_class(kind: str):
    return ChatBody if kind == "chat" else CompletionBody
