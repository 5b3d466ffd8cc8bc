"""The supervised generation loop, in process: a loop that raises fails the requests in it
(500), is restarted with the same model and prompt cache, serves the next request; a loop that
keeps failing is given up and the server told to exit (non-zero) for a supervisor."""

from __future__ import annotations

import asyncio

from mlx_lm.server import BatchGenerator
import pytest

from kvcompress.bench import _serving as srv
from kvcompress.method import build_method
from kvcompress.mlxlm.prompt_cache import CompressedPromptCache
from kvcompress.mlxlm.server import model_provider
from kvcompress.serve.completions import plan
from kvcompress.serve.errors import GenerationFailed, RequestError
from kvcompress.serve.generator import SupervisedGenerator
from kvcompress.serve.options import parse_server_args
from kvcompress.serve.schema import CompletionBody, parse


@pytest.fixture(scope="module")
def provider():
    cli = parse_server_args(["--model", str(srv.ASSET)])
    return model_provider(build_method("h2o", budget=32))(cli), cli


async def _generate(gen, cli, body):
    p = plan(parse(body, CompletionBody), cli)[0]
    job = gen.submit(p.request, p.args)
    await asyncio.wait_for(job.context(), 60)
    return [r async for r in job.events() if not isinstance(r, tuple)]


def test_a_failing_loop_is_restarted_then_given_up(provider, monkeypatch):
    model_provider_, cli = provider
    fatal = []
    gen = SupervisedGenerator(model_provider_, CompressedPromptCache(10), max_restarts=1, window_s=60,
                              on_fatal=fatal.append)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "logit_bias": {"0": -1e9, "1": -1e9, "2": -1e9}}
    real_next = BatchGenerator.next
    crash = {"left": 1}

    def next_or_crash(self):
        if crash["left"]:
            crash["left"] -= 1
            raise RuntimeError("injected failure")
        return real_next(self)

    monkeypatch.setattr(BatchGenerator, "next", next_or_crash)
    try:
        with pytest.raises(GenerationFailed, match="injected failure"):
            asyncio.run(_generate(gen, cli, body))
        assert gen.restarts == 1 and gen.generation_available() and not fatal
        assert len(asyncio.run(_generate(gen, cli, body))) == 4  # the restarted loop serves
        with pytest.raises(RequestError, match="outside the vocabulary"):  # a request's fault is its own
            asyncio.run(_generate(gen, cli, {"prompt": [10**6]}))
        assert gen.generation_available() and gen.restarts == 1
        crash["left"] = 1
        with pytest.raises(GenerationFailed):
            asyncio.run(_generate(gen, cli, body))
        gen.join()  # the second failure within the window: the loop gives up
        assert gen.failed and not gen.generation_available()
        assert fatal and "injected failure" in fatal[0]
    finally:
        gen._stop = True
        gen.join()
