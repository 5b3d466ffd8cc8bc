"""The bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked field by field.

:func:`parse` turns a JSON object into a :class:`CompletionBody` or :class:`ChatBody` with a strict
``cattrs`` converter (no ``"5"`` for an integer, no ``true`` for a number, no unknown field) and
range checks, or raises :class:`~.errors.RequestError` naming the field (``max_tokens``,
``messages[2].content[0].text``, ``stop[1]``). Every field OpenAI documents for the endpoint is
known: those kvcompress serve cannot honour (``suffix``, ``best_of > n``, ``echo`` with
``logprobs``, ``response_format`` other than text, ``tool_choice: "required"``, audio, ...) are
refused by name rather than ignored; a few that change nothing here (``user``, ``metadata``,
``store``, ``service_tier``, ...) are accepted. mlx-lm's own extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``xtc_*``, ``chat_template_kwargs``, ...) are kept.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError

from ..config import did_you_mean
from .errors import RequestError
from .messages import FieldError, LogitBias, Messages, Prompts, Stop, ToolChoice, Tools, register_hooks

__all__ = ["StreamOptions", "CompletionBody", "ChatBody", "parse", "MAX_COMPLETION_LOGPROBS", "MAX_TOP_LOGPROBS"]

#: OpenAI's limits: ``logprobs`` of /v1/completions, ``top_logprobs`` of chat
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _strict(kind: str, ok):
    def hook(v, _):
        if not ok(v):
            raise FieldError(f"must be {kind}, got {_kind(v)}" + ("" if v is None else f" {json.dumps(v)[:40]}"))
        return v
    return hook


_conv = cattrs.Converter(forbid_extra_keys=True)
_conv.register_structure_hook(bool, _strict("a boolean", lambda v: isinstance(v, bool)))
_conv.register_structure_hook(int, _strict("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)))
_conv.register_structure_hook(str, _strict("a string", lambda v: isinstance(v, str)))
_conv.register_structure_hook(
    float, lambda v, t: float(_strict("a finite number", lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
                                      and math.isfinite(x))(v, t)))
_conv.register_structure_hook(dict, _strict("an object", lambda v: isinstance(v, dict)))
_conv.register_structure_hook(Any, lambda v, _: v)
register_hooks(_conv)


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range(name: str, v, lo=None, hi=None, lo_open=False) -> None:
    if v is None:
        return
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        if hi is None:
            want = f"{'>' if lo_open else '>='} {_num(lo)}"
        elif lo is None:
            want = f"<= {_num(hi)}"
        else:
            want = f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
        raise RequestError(f"{name}: must be {want}, got {_num(v)}", param=name)


def _unsupported(name: str, why: str):
    return RequestError(f"{name}: {why}", param=name, code="unsupported_parameter")


@attrs.frozen(kw_only=True)
class StreamOptions:
    include_usage: bool = False
    include_obfuscation: bool = False  # accepted; chunks are never padded


@attrs.frozen(kw_only=True)
class _Common:
    """Fields both endpoints share (OpenAI's and mlx-lm's)."""

    model: str = "default_model"
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    n: int = 1
    stop: Stop = ()
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    logit_bias: LogitBias = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    user: Optional[str] = None
    # mlx-lm's server extensions
    draft_model: str = "default_model"
    num_draft_tokens: Optional[int] = None
    adapters: Optional[str] = None

    def __attrs_post_init__(self):
        _range("max_tokens", self.max_tokens, 1)
        _range("n", self.n, 1)
        _range("temperature", self.temperature, 0)
        _range("top_p", self.top_p, 0, 1, lo_open=True)
        _range("top_k", self.top_k, 0)
        _range("min_p", self.min_p, 0, 1)
        _range("presence_penalty", self.presence_penalty, -2, 2)
        _range("frequency_penalty", self.frequency_penalty, -2, 2)
        _range("repetition_penalty", self.repetition_penalty, 0)
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            _range(name, getattr(self, name), 0)
        _range("xtc_probability", self.xtc_probability, 0, 1)
        _range("xtc_threshold", self.xtc_threshold, 0, 0.5)
        _range("num_draft_tokens", self.num_draft_tokens, 0)
        _range("seed", self.seed, 0, 2**64 - 1)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


@attrs.frozen(kw_only=True)
class CompletionBody(_Common):
    """``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a
    list of such lists (one choice per prompt and per ``n``)."""

    prompt: Prompts
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        _range("logprobs", self.logprobs, 0, MAX_COMPLETION_LOGPROBS)
        if self.suffix:
            raise _unsupported("suffix", "insertion (text after the completion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", f"must equal n ({self.n}): ranking several generations is not supported")
        if self.echo and self.logprobs is not None:
            raise _unsupported("echo", "echo with logprobs would need the prompt tokens' log-probabilities, "
                               "which are not computed; drop one of them")

    @property
    def top_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


@attrs.frozen(kw_only=True)
class ResponseFormat:
    type: str = "text"
    json_schema: Optional[dict] = None


@attrs.frozen(kw_only=True)
class ChatBody(_Common):
    """``/v1/chat/completions``."""

    messages: Messages
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    modalities: Optional[list[str]] = None
    chat_template_kwargs: Optional[dict] = None
    role_mapping: Optional[dict] = None
    # accepted, change nothing here
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    # documented by OpenAI, not supported: refused when given
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        _range("max_completion_tokens", self.max_completion_tokens, 1)
        _range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: needs logprobs to be true", param="top_logprobs")
        if self.response_format is not None and self.response_format.type != "text":
            raise _unsupported("response_format", f"type {self.response_format.type!r} is not supported "
                               "(constrained decoding); only 'text'")
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise _unsupported("modalities", f"only ['text'] is supported, got {list(self.modalities)}")
        for name in ("audio", "prediction", "web_search_options", "functions", "function_call"):
            if getattr(self, name) is not None:
                raise _unsupported(name, "not supported by kvcompress serve"
                                   + ("; use tools" if name.startswith("function") else ""))
        if self.tool_choice not in (None, "auto", "none"):
            raise _unsupported("tool_choice", f"only 'auto' and 'none' are supported, got {self.tool_choice!r} "
                               "(forcing a tool call needs constrained decoding)")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def template_tools(self) -> Optional[list]:
        """The tools the chat template sees (none for ``tool_choice: "none"``)."""
        return None if self.tool_choice == "none" else (list(self.tools) if self.tools else None)

    @property
    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _param_of(path: str) -> str:
    return path[2:] if path.startswith("$.") else ("" if path == "$" else path)


def _first_error(exc: BaseException, path: str = "$"):
    """The first leaf of a cattrs error tree with its JSON path."""
    if isinstance(exc, cattrs.ClassValidationError):
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", None) or []
            name = next((getattr(n, "name", None) for n in notes if hasattr(n, "name")), None)
            return _first_error(sub, f"{path}.{name}" if name is not None else path)
    if isinstance(exc, cattrs.IterableValidationError):
        for sub in exc.exceptions:
            notes = getattr(sub, "__notes__", None) or []
            idx = next((getattr(n, "index", None) for n in notes if hasattr(n, "index")), None)
            return _first_error(sub, f"{path}[{idx}]" if idx is not None else path)
    return exc, path


def parse(body: Any, cls) -> Any:
    """``body`` (decoded JSON) as ``cls``, or RequestError naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_kind(body)}")
    try:
        return _conv.structure(body, cls)
    except (cattrs.BaseValidationError, RequestError, KeyError, TypeError, ValueError) as exc:
        leaf, path = _first_error(exc)
        param = _param_of(path)
        if isinstance(leaf, ForbiddenExtraKeysError):
            fields = sorted(leaf.extra_fields)
            known = [a.name for a in attrs.fields(leaf.cl)]
            where = f"{param}." if param else ""
            hint = did_you_mean(fields[0], known)
            raise RequestError(f"unrecognized field '{where}{fields[0]}'{hint}", param=f"{where}{fields[0]}",
                               code="unknown_parameter") from None
        if isinstance(leaf, KeyError):
            raise RequestError(f"{param}: required", param=param) from None
        if isinstance(leaf, RequestError):  # a check that names its own field (ranges, combinations)
            raise leaf from None
        if isinstance(leaf, FieldError):
            param += leaf.subpath
            raise RequestError(f"{param}: {leaf.message}", param=param) from None
        raise RequestError(f"{param or 'body'}: {leaf}", param=param or None) from None
