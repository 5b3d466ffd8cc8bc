"""The fields of a request body that are not one plain type: prompts, stop sequences, logit
bias, chat messages, tools, tool choice. Each is a ``NewType`` with a ``cattrs`` structure hook
that checks the value and raises :class:`FieldError` with the path inside the field
(``[2].content[0].text``) and what is wrong."""

from __future__ import annotations

import json
import math
from typing import Any, NewType, Optional

__all__ = ["FieldError", "Prompts", "Stop", "LogitBias", "Messages", "Tools", "ToolChoice", "register_hooks",
           "MAX_STOP", "ROLES"]

#: stop sequences per request at most (OpenAI takes 4)
MAX_STOP = 16
#: chat roles a message may have (``developer`` is given to the chat template as ``system``)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_PARTS = ("text", "image_url", "input_image", "image")

#: ``str`` or list of prompts -> list of ``str`` / list of token ids
Prompts = NewType("Prompts", list)
#: ``None``, ``str`` or list of ``str`` -> tuple of ``str``
Stop = NewType("Stop", tuple)
#: ``{"token id": bias}`` -> ``{int: float}`` (or None)
LogitBias = NewType("LogitBias", dict)
#: chat messages -> list of message dicts for the chat template
Messages = NewType("Messages", list)
#: tool definitions -> list of dicts (or None)
Tools = NewType("Tools", list)
#: ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", ...}``
ToolChoice = NewType("ToolChoice", object)


class FieldError(ValueError):
    """A field's value is wrong at ``subpath`` inside it (``""``: the value itself)."""

    def __init__(self, message: str, subpath: str = ""):
        super().__init__(message)
        self.message, self.subpath = message, subpath


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_ids(v, where: str) -> list:
    if not v:
        raise FieldError("must not be empty", where)
    for i, t in enumerate(v):
        if not _is_int(t) or t < 0:
            raise FieldError(f"token ids must be integers >= 0, got {_kind(t)} {t!r}", f"{where}[{i}]")
    return list(v)


def structure_prompts(v, _=None) -> list:
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise FieldError(f"must be a string, a list of strings, a list of token ids or a list of such lists; "
                         f"got {_kind(v)}")
    if not v:
        raise FieldError("must not be empty")
    if all(_is_int(t) for t in v):
        return [_token_ids(v, "")]
    out = []
    for i, p in enumerate(v):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list):
            out.append(_token_ids(p, f"[{i}]"))
        else:
            raise FieldError(f"each prompt must be a string or a list of token ids, got {_kind(p)}", f"[{i}]")
    return out


def structure_stop(v, _=None) -> tuple:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise FieldError(f"must be a string or a list of strings, got {_kind(v)} {v!r}")
    if len(items) > MAX_STOP:
        raise FieldError(f"at most {MAX_STOP} stop sequences, got {len(items)}")
    for i, s in enumerate(items):
        where = "" if isinstance(v, str) else f"[{i}]"
        if not isinstance(s, str):
            raise FieldError(f"must be a string, got {_kind(s)} {s!r}", where)
        if not s:
            raise FieldError("must not be empty", where)
    return tuple(items)


def structure_logit_bias(v, _=None) -> Optional[dict]:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError(f"must be an object mapping token ids to biases, got {_kind(v)}")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            tok = -1
        if tok < 0:
            raise FieldError(f"keys must be token ids (integers >= 0), got {k!r}", f"[{k!r}]")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b):
            raise FieldError(f"must be a finite number, got {_kind(b)} {b!r}", f"[{k!r}]")
        out[tok] = float(b)
    return out


def _check_content(content, role: str, where: str) -> None:
    if content is None:
        if role in ("user", "system", "developer", "tool"):
            raise FieldError(f"a {role} message needs content", f"{where}.content")
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise FieldError(f"must be a string, a list of content parts or null, got {_kind(content)}",
                         f"{where}.content")
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise FieldError(f"a content part must be an object, got {_kind(part)}", at)
        kind = part.get("type")
        if kind not in _PARTS:
            raise FieldError(f"content part type {kind!r} is not supported; valid: {', '.join(_PARTS)}", f"{at}.type")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise FieldError(f"must be a string, got {_kind(part.get('text'))}", f"{at}.text")


def _check_tool_calls(calls, where: str) -> list:
    if not isinstance(calls, list):
        raise FieldError(f"must be a list, got {_kind(calls)}", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError("must be {\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}", at)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise FieldError(f"must be JSON text ({exc.msg} at character {exc.pos})", f"{at}.function.arguments")
        if not isinstance(args, dict):
            raise FieldError(f"must encode a JSON object, got {_kind(args)}", f"{at}.function.arguments")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def structure_messages(v, _=None) -> list:
    if not isinstance(v, list):
        raise FieldError(f"must be a list of messages, got {_kind(v)}")
    if not v:
        raise FieldError("must not be empty")
    out = []
    for i, m in enumerate(v):
        where = f"[{i}]"
        if not isinstance(m, dict):
            raise FieldError(f"a message must be an object, got {_kind(m)}", where)
        role = m.get("role")
        if role not in ROLES:
            raise FieldError(f"must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
        _check_content(m.get("content"), role, where)
        msg = dict(m, role="system" if role == "developer" else role)
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise FieldError("only assistant messages have tool calls", f"{where}.tool_calls")
            msg["tool_calls"] = _check_tool_calls(m["tool_calls"], where)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise FieldError(f"must be a string, got {_kind(m[key])}", f"{where}.{key}")
        out.append(msg)
    return out


def structure_tools(v, _=None) -> Optional[list]:
    if v is None:
        return None
    if not isinstance(v, list):
        raise FieldError(f"must be a list of tools, got {_kind(v)}")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise FieldError("must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}", f"[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError("must be a non-empty string", f"[{i}].function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise FieldError(f"must be a JSON schema object, got {_kind(fn['parameters'])}", f"[{i}].function.parameters")
    return v or None


def structure_tool_choice(v, _=None):
    if v is None or v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") in ("function", "allowed_tools", "custom"):
        return v
    raise FieldError(f"must be 'auto', 'none', 'required' or a tool object, got {v!r}")


def register_hooks(conv) -> None:
    """Install the hooks into the cattrs converter ``conv``."""
    for kind, hook in ((Prompts, structure_prompts), (Stop, structure_stop), (LogitBias, structure_logit_bias),
                       (Messages, structure_messages), (Tools, structure_tools), (ToolChoice, structure_tool_choice)):
        conv.register_structure_hook(kind, hook)
