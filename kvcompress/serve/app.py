"""The HTTP layer of ``kvcompress serve``: a Starlette (ASGI) app, served by uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (also ``/chat/completions``,
as mlx-lm), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``. Every error is
OpenAI's JSON error body with the right status: 400 for a bad body (the message names the
field), 404 for an unknown route or model, 405 for a wrong method, 503 with ``Retry-After``
when every slot is taken or the generation loop is restarting, 500 when generation failed.
CORS follows ``--allowed-origins``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .admission import Admission
from .completions import ClientGone, answer, body_class
from .errors import ModelNotFound, RequestError, ServeError, error_body
from .schema import parse

__all__ = ["AppState", "build_app", "list_models"]

log = logging.getLogger("kvcompress.serve")

_MLX_FILES = ("config.json", "model.safetensors.index.json", "tokenizer_config.json")


@attrs.define
class AppState:
    """What every route shares."""

    generator: Any  # .generator.SupervisedGenerator
    provider: Any  # the ModelProvider
    cli: Any  # the parsed options
    admission: Admission
    fingerprint: str = ""
    started: float = attrs.Factory(time.time)
    disk_cache: Any = None  # the PersistentPromptCache with --prompt-cache-dir


def list_models(cli, created: int) -> list[dict]:
    """The served ``--model`` first, then mlx models in the Hugging Face cache (which a request
    may name); a machine without that cache lists the served model alone."""
    ids = [cli.model] if cli.model else []
    try:
        from huggingface_hub import scan_cache_dir

        for repo in scan_cache_dir().repos:
            if repo.repo_type == "model" and "main" in repo.refs:
                names = {f.file_path.name for f in repo.refs["main"].files}
                if all(f in names for f in _MLX_FILES) and repo.repo_id not in ids:
                    ids.append(repo.repo_id)
    except Exception as exc:  # no cache folder (CacheNotFound), unreadable cache: nothing more to list
        log.debug("no Hugging Face cache models listed: %s", exc)
    return [{"id": i, "object": "model", "created": created, "owned_by": "kvcompress"} for i in ids]


def _error(exc: ServeError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from None


def _completion_route(kind: str):
    async def route(request: Request) -> Response:
        state: AppState = request.app.state.kv
        try:
            body = parse(await _read_json(request), body_class(kind))
            return await answer(request, body, state)
        except ClientGone:
            log.info("client left: its generations were cancelled")
            return Response(status_code=499)
        except ServeError as exc:
            if exc.status >= 500:
                log.warning("%s %s: %s", request.url.path, exc.status, exc.message)
            return _error(exc)
        except Exception as exc:  # unforeseen: answered, logged, the server goes on
            log.exception("unexpected error answering a request")
            return _error(ServeError(f"internal error ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"))

    return route


async def health(request: Request) -> Response:
    """200 while the generation loop runs with a model; 503 (with the reason) otherwise."""
    state: AppState = request.app.state.kv
    gen = state.generator
    ok = gen.generation_available()
    body = {"status": "ok" if ok else "unavailable", "model": state.cli.model,
            "generations_held": state.admission.held, "capacity": state.admission.capacity,
            "refused": state.admission.refused, "restarts": gen.restarts,
            "prompt_cache": {"entries": len(gen.prompt_cache) if hasattr(gen, "prompt_cache") else 0}}
    if state.disk_cache is not None:
        body["prompt_cache"]["dir"] = state.disk_cache.disk_stats()
    if not ok:
        body["reason"] = gen.last_error or "the generation loop is not running"
    return JSONResponse(body, status_code=200 if ok else 503, headers={} if ok else {"Retry-After": "5"})


async def models(request: Request) -> Response:
    state: AppState = request.app.state.kv
    return JSONResponse({"object": "list", "data": list_models(state.cli, int(state.started))})


async def model(request: Request) -> Response:
    state: AppState = request.app.state.kv
    wanted = request.path_params["model_id"]
    for m in list_models(state.cli, int(state.started)):
        if m["id"] == wanted or (Path(wanted).exists() and m["id"] == state.cli.model
                                 and Path(wanted).resolve() == Path(state.cli.model).resolve()):
            return JSONResponse(m)
    return _error(ModelNotFound(f"model {wanted!r} is not served here; GET /v1/models lists them",
                                param="model", code="model_not_found"))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    msg = {404: f"no route {request.url.path}; the routes are /v1/completions, /v1/chat/completions, "
                f"/v1/models, /health",
           405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(msg, kind), status_code=exc.status_code, headers=getattr(exc, "headers", None))


def build_app(state: AppState) -> Starlette:
    """The ASGI app over ``state``."""
    routes = [
        Route("/v1/completions", _completion_route("text"), methods=["POST"]),
        Route("/v1/chat/completions", _completion_route("chat"), methods=["POST"]),
        Route("/chat/completions", _completion_route("chat"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    origins = state.cli.allowed_origins
    origins = [origins] if isinstance(origins, str) else list(origins)
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error},
                    middleware=[Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                                           allow_headers=["*"])])
    app.state.kv = state
    return app
