"""Validated method configuration: frozen attrs classes structured with cattrs.

A method is named (``method = "cam"``) or composed from one component of each kind::

    method = "cam"                  # or leave out and name all four components
    [params]                        # routed to every component with a parameter of that name
    budget = 64
    [disposition]                   # override a component (name = ...), or, without
    name = "gated_merge"            # a name, only the parameters of the method's own
    merge = "mean"

Errors name the field, the bad value and the valid choices.
"""

from __future__ import annotations

import json
import numbers
import tomllib
from pathlib import Path
from typing import Any, Optional, Union

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from .components import KINDS
from .errors import ConfigError

__all__ = ["ComponentConfig", "MethodConfig", "load_config", "structure_component"]


def _component(value: Any) -> Optional["ComponentConfig"]:
    if value is None or isinstance(value, ComponentConfig):
        return value
    if isinstance(value, str):
        return ComponentConfig(name=value)
    if isinstance(value, dict):
        value = dict(value)
        name = value.pop("name", "")  # "": the named method's own component, these parameters changed
        params = value.pop("params", {})
        return ComponentConfig(name=name, params={**value, **params})
    raise ConfigError(f"a component is a name or a table with 'name', got {value!r}")


@attrs.frozen
class ComponentConfig:
    """A component by registered name, with parameter overrides (``name=""``: the named
    method's own component, only its parameters changed)."""

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    params: dict = attrs.field(factory=dict, converter=dict)


@attrs.frozen
class MethodConfig:
    """A named method and/or explicit components, plus flat parameters."""

    method: Optional[str] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )
    scorer: Optional[ComponentConfig] = attrs.field(default=None, converter=_component)
    selector: Optional[ComponentConfig] = attrs.field(default=None, converter=_component)
    disposition: Optional[ComponentConfig] = attrs.field(default=None, converter=_component)
    budget: Optional[ComponentConfig] = attrs.field(default=None, converter=_component)
    params: dict = attrs.field(factory=dict, converter=dict)
    #: how the kept slots are held: ``{"kv_bits": 4 | [8, 4], "kv_group_size": 64}`` (empty: the
    #: model's dtype); see :mod:`kvcompress.storage`
    storage: dict = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self):
        for kind in KINDS:
            c = self.component(kind)
            if c is not None and not c.name and self.method is None:
                raise ConfigError(
                    f"the [{kind}] table needs a 'name' key when no method is named, got keys "
                    f"{sorted(c.params)}; with method = \"...\", a table without 'name' changes the "
                    f"parameters of that method's own {kind}"
                )

    def component(self, kind: str) -> Optional[ComponentConfig]:
        return getattr(self, kind)

    @classmethod
    def from_dict(cls, data: dict) -> "MethodConfig":
        """Build from a plain dict (as parsed from JSON or TOML); unknown keys are errors."""
        if not isinstance(data, dict):
            raise ConfigError(f"a method config is a table/object, got {type(data).__name__}")
        allowed = {"method", *KINDS, "params", "storage"}
        extra = sorted(set(data) - allowed)
        if extra:
            raise ConfigError(
                f"unknown config key(s) {extra}; valid keys: {sorted(allowed)} "
                "(put component parameters under [params] or a component table)"
            )
        try:
            return cls(**data)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid method config: {validator_message(exc)}") from None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        if self.method:
            out["method"] = self.method
        for kind in KINDS:
            c = self.component(kind)
            if c is not None:
                out[kind] = {**({"name": c.name} if c.name else {}), **c.params}
        if self.params:
            out["params"] = dict(self.params)
        if self.storage:
            out["storage"] = dict(self.storage)
        return out


def load_config(source: Union[str, Path, dict]) -> MethodConfig:
    """Read a :class:`MethodConfig` from a dict, a ``.toml`` file or a ``.json`` file."""
    if isinstance(source, dict):
        return MethodConfig.from_dict(source)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {str(path)!r}: use a .toml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}); is it a binary file?"
        ) from exc
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from exc
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid {path.suffix[1:]}: {exc}") from exc
    return MethodConfig.from_dict(data)


# ------------------------------------------------------------------------------------------
# Structuring component parameters
# ------------------------------------------------------------------------------------------

_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict(kind: type, accept: tuple, cast):
    """A structure hook that refuses lossy coercions (``2.5`` -> ``2``, ``"false"`` -> ``True``)."""

    def hook(value, _type):
        if isinstance(value, bool) and kind is not bool or not isinstance(value, accept):
            raise TypeError(f"expected {kind.__name__}, got {value!r} ({type(value).__name__})")
        return cast(value)

    return hook


_converter.register_structure_hook(bool, _strict(bool, (bool,), bool))
_converter.register_structure_hook(int, _strict(int, (numbers.Integral,), int))
_converter.register_structure_hook(float, _strict(float, (numbers.Real,), float))
_converter.register_structure_hook(str, _strict(str, (str,), str))


def did_you_mean(value: Any, choices) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``value``, or ``""``."""
    import difflib

    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def validator_message(exc: BaseException) -> str:
    """One plain sentence for an ``attrs`` validator error (whose ``str`` is a tuple holding the
    Attribute): ``bits must be one of 2, 4, 8, got 3``; other errors as they are."""
    args = getattr(exc, "args", ())
    if len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], attrs.Attribute):
        name, value = args[1].name, args[-1]
        if len(args) == 4 and isinstance(args[2], (tuple, list, set, frozenset, dict)):  # attrs' in_
            choices = list(args[2])
            shown = ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)
            near = did_you_mean(value, choices) if isinstance(value, str) else ""
            return f"{name} must be one of {shown}, got {value!r}{near}"
        if len(args) == 4 and isinstance(args[2], (type, tuple)):  # attrs' instance_of
            kinds = args[2] if isinstance(args[2], tuple) else (args[2],)
            want = " or ".join(k.__name__ for k in kinds)
            return f"{name} must be a {want}, got {value!r} ({type(value).__name__})"
        return args[0].replace(f"'{name}'", name)
    return str(exc)


def _literal_message(exc: BaseException) -> Optional[str]:
    """cattrs' ``X not in literal typing.Literal[...]`` as the valid choices and a did-you-mean."""
    import typing

    text = str(exc)
    if " not in literal " not in text:
        return None
    literal = getattr(exc, "type", None) or getattr(exc, "literal", None)
    choices = list(typing.get_args(literal)) if literal is not None else []
    if not choices:
        import re

        found = re.search(r"Literal\[(.*)\]", text)
        choices = [c.strip().strip("'\"") for c in found.group(1).split(",")] if found else []
    value = text.split(" not in literal ")[0]
    return f"{value!r} is not one of {', '.join(repr(c) for c in choices)}{did_you_mean(value, choices)}"


def _describe(exc: BaseException, _type) -> str:
    """cattrs' error formatter, keeping the validators' own messages (the default drops them)."""
    if isinstance(exc, ForbiddenExtraKeysError):
        extra = sorted(exc.extra_fields)
        cl = getattr(exc, "cl", None)
        names = [f.name for f in attrs.fields(cl) if f.init] if cl is not None and attrs.has(cl) else []
        return f"unknown parameter(s) {extra}{did_you_mean(extra[0], names) if extra else ''}"
    literal = _literal_message(exc)
    if literal is not None:
        return literal
    return validator_message(exc)


def _messages(exc: BaseException, path: str) -> list[str]:
    """``path.field: message`` for every error in a cattrs validation error."""
    out = []
    for msg in cattrs.transform_error(exc, path=path, format_exception=_describe):
        what, _, where = msg.rpartition(" @ ")  # transform_error's "{description} @ {path}"
        out.append(f"{where}: {what}")
    return out


def structure_component(spec, params: dict, owner: str = "") -> Any:
    """Instantiate ``spec.cls`` from ``params``; errors name the field and valid choices."""
    label = owner or f"{spec.kind} {spec.name!r}"
    valid = sorted(spec.params())
    try:
        return _converter.structure(dict(params), spec.cls)
    except ForbiddenExtraKeysError as exc:
        extra = sorted(exc.extra_fields)
        raise ConfigError(
            f"{label}: unknown parameter(s) {extra}{did_you_mean(extra[0], valid) or ';'} valid parameters: {valid}"
        ) from None
    except (ClassValidationError, IterableValidationError) as exc:
        msgs = _messages(exc, label)
        raise ConfigError("; ".join(msgs) + f" (valid parameters: {valid})") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{label}: {validator_message(exc)} (valid parameters: {valid})") from None
