"""``kvcompress serve``: an OpenAI-compatible server whose every KV cache is compressed.

Generation is mlx-lm's (its ``ResponseGenerator``: continuous batching, the prompt cache, chat
templates, tool calls); the HTTP layer is a standard ASGI stack (Starlette on uvicorn) that mlx-lm's
``BaseHTTPRequestHandler`` could not be made into. The parts, one module each:

* :mod:`.options` -- mlx-lm's server flags and ours, checked before the model loads;
* :mod:`.schema` / :mod:`.messages` -- request bodies checked field by field (400 naming the field);
* :mod:`.admission` -- a bounded number of generations held; beyond, 503 with ``Retry-After``;
* :mod:`.generator` -- the bridge to mlx-lm's generation loop: jobs read from asyncio,
  cancellation, per-request errors, and a supervisor that restarts a failed loop or exits non-zero;
* :mod:`.output` -- text-level stop sequences, reasoning and tool calls, log-probabilities;
* :mod:`.completions` -- the two completion routes (streaming or not, disconnects cancel);
* :mod:`.app` -- routes, errors, ``/health``, ``/v1/models``; :mod:`.runner` -- start-up and exit code.
"""

from .runner import run_server

__all__ = ["run_server"]
