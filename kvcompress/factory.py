"""Build per-layer compressed caches for an mlx-lm model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Union

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from ._model import default_cache, model_info
from .cache import CompressedKVCache
from .components import KINDS
from .config import MethodConfig, load_config
from .contexts import LayerInfo, ModelInfo
from .engine.rows import room_to_evict
from .errors import ConfigError, KVCompressError, PluginError
from .group import new_group
from .method import Method, build_method
from .mlxlm.attention import base_class, install, install_layer_io
from .mlxlm.distributed import agree, topology, world
from .registry import Registry

__all__ = ["make_prompt_cache", "smallest_budget", "check_room_to_evict", "model_info", "default_cache", "attach",
           "detach", "KVCacheConfig", "KVCacheBuilder"]


def _windowed(model: nn.Module, default: list) -> bool:
    """Whether the model masks full-attention KVCache layers with a sliding window."""
    args = getattr(model, "args", None) or getattr(getattr(model, "model", None), "args", None)
    window = getattr(args, "sliding_window", None)
    if not window:
        return False
    if any(isinstance(c, RotatingKVCache) for c in default):
        return False  # the window is served by its own rotating layers (Gemma 3, Cohere 2, ...)
    types = getattr(args, "layer_types", None)
    return types is None or all(t != "full_attention" for t in types)


def _bind(m: Method, model, compressed: list) -> None:
    """Each component's ``bind(model, layers, states)``: its states of this process's compressed
    layers, as returned (None: unchanged), set once at build."""
    hooks = m.hook_set()
    for kind in KINDS:
        bind = hooks.of(kind).bind
        if bind is None:
            continue
        new = bind(model, [c.info for c in compressed], [c.component_state(kind) for c in compressed])
        if new is None:
            continue
        new = list(new)
        if len(new) != len(compressed):
            raise PluginError(
                f"{kind} {type(m.component(kind)).__name__}.bind returned {len(new)} states for "
                f"{len(compressed)} layers; return one per layer, in order, or None"
            )
        for c, st in zip(compressed, new):
            c.set_component_state(kind, st)


def _shared_array_mask(model: nn.Module) -> bool:
    """Whether the model builds one array mask from its first cache for all layers."""
    import inspect

    for obj in (model, getattr(model, "model", None)):
        try:
            if obj is not None and "return_array=True" in inspect.getsource(base_class(obj).__call__):
                return True
        except (OSError, TypeError):
            continue
    return False


class _DefaultMethod(str):
    """The default method name ("cam"), told apart from an explicit ``"cam"`` so that a method
    given together with ``config=`` is refused whatever its name."""


#: ``method``'s default in :func:`make_prompt_cache` and :func:`attach`
DEFAULT_METHOD = _DefaultMethod("cam")


def _method_or_config(method, config):
    """``method``, or the config it must not be given with (a ConfigError when both are)."""
    if config is None:
        return str(method) if isinstance(method, _DefaultMethod) else method
    if method is not None and not isinstance(method, _DefaultMethod):
        raise ConfigError(f"give either a method or config=..., not both (got method {_label(method)} "
                          "and a config)")
    return config if isinstance(config, MethodConfig) else load_config(config)


def _label(method) -> str:
    return repr(method) if isinstance(method, str) else type(method).__name__


def smallest_budget(method: Method, info: ModelInfo, start: int, limit: int = 1 << 24) -> Optional[int]:
    """The smallest size above ``start`` for ``method``'s budget component (its ``budget``
    parameter) that gives every layer room to evict past the selector's protected tokens, or None
    (no ``budget`` parameter, or none up to ``limit``). The protected window may grow with the
    budget (``recent_ratio``), so this is found by trying sizes, not read off one layer."""
    import attrs

    comp = method.budget
    if not (attrs.has(type(comp)) and "budget" in attrs.fields_dict(type(comp))):
        return None

    def ok(size: int) -> bool:
        try:
            budgets = attrs.evolve(comp, budget=size).layer_budgets(info)
        except Exception:  # a size the budget component refuses
            return False
        return all(room_to_evict(method.selector, b) for b in budgets)

    lo, hi = max(start, 0), max(start, 1) * 2
    while not ok(hi):  # the first working size is in (lo, hi]
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def check_room_to_evict(method: Method, info: ModelInfo, budgets) -> None:
    """Raise ConfigError unless every layer budget exceeds the tokens the selector always keeps;
    the message names the smallest budget that builds (:func:`smallest_budget`)."""
    for layer, b in enumerate(budgets):
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            continue  # the cache itself reports a budget that is not a positive int
        if room_to_evict(method.selector, b):
            continue
        reserved = method.selector.reserved(b)
        size = getattr(method.budget, "budget", None)
        least = smallest_budget(method, info, size) if isinstance(size, int) else None
        hint = (f"the smallest budget that builds is {least}" if least is not None
                else "raise the budget")
        raise ConfigError(
            f"layer {layer}: budget {b} leaves no room to evict: the selector always keeps {reserved} "
            f"tokens (sinks + recent window, which may grow with the budget); {hint}, or protect "
            "fewer tokens"
        )


def make_prompt_cache(
    model: nn.Module,
    method: Union[str, MethodConfig, Method, dict, None] = DEFAULT_METHOD,
    *,
    config: Union[str, Path, dict, MethodConfig, None] = None,
    registry: Optional[Registry] = None,
    tokenizer: Any = None,
    **params: Any,
) -> list:
    """A prompt cache for ``mlx_lm.generate(..., prompt_cache=...)`` with every full-attention
    layer compressed by ``method``.

    ``make_prompt_cache(model, method="cam", budget=64)``; a config file or dict:
    ``make_prompt_cache(model, config="cam.toml")``; or a composition:
    ``make_prompt_cache(model, None, scorer="h2o", selector="lowest", disposition="gated_merge",
    budget={"name": "uniform", "budget": 64})``. ``tokenizer``: the model's (mlx-lm's ``load``
    returns it), for components whose parameters name token ids symbolically
    (:meth:`Method.with_tokenizer`). Layers whose default cache is not a plain
    ``KVCache`` (sliding-window, SSM state) keep their default cache. Installs the
    query-observing attention wrapper (:func:`kvcompress.install`).

    Under ``mlx.distributed`` the ranks agree the build with one small collective
    (:func:`kvcompress.mlxlm.distributed.agree`): a rank that refuses its part, or ranks that
    built different methods, parameters or budgets, raise the same ConfigError on every rank.
    """
    if world() is None:
        return _build(model, method, config, registry, params, tokenizer)[0]
    failure = None
    try:
        caches, summary, digest = _build(model, method, config, registry, params, tokenizer)
    except Exception as exc:  # every rank must reach the agreement, whatever this one hit
        failure, caches, summary, digest = exc, None, "", ""
    error = None if failure is None else str(failure) if isinstance(failure, KVCompressError) else (
        f"{type(failure).__name__}: {failure}")
    try:
        agree(summary, digest, error)  # raises on every rank if one refused
    except ConfigError as agreed:
        raise agreed from failure
    return caches


def _build(model, method, config, registry, params: dict, tokenizer=None) -> tuple:
    """``(caches, summary, digest)``: :func:`make_prompt_cache`'s caches, and what the ranks of
    a distributed run must agree on."""
    method = _method_or_config(method, config)
    m = method if isinstance(method, Method) else build_method(method, registry=registry, **params)
    if isinstance(method, Method) and params:
        raise ConfigError("pass parameters to build_method, not with an already built Method")
    m = m.with_tokenizer(tokenizer)
    default = default_cache(model)
    slots = [i for i, c in enumerate(default) if type(c) is KVCache]
    if not slots:
        raise ConfigError(f"{type(model).__name__} has no full-attention KVCache layers to compress")
    if _windowed(model, default):
        raise ConfigError(
            f"{type(model).__name__} masks its full-attention layers with a sliding window; "
            "kvcompress caches do not support sliding-window attention"
        )
    topo = topology(model)  # under pipeline parallelism model.layers is this rank's layers
    n_total = topo.n_layers or len(slots)
    info = model_info(model, n_layers=n_total)
    if topo.kv_heads:
        info = ModelInfo(n_total, topo.kv_heads, info.head_dim, info.model_type)
    budgets = m.budget.layer_budgets(info)
    if len(budgets) != n_total:
        raise ConfigError(
            f"budget {m.config.budget.name!r} returned {len(budgets)} layer budgets for {n_total} layers"
        )
    check_room_to_evict(m, info, budgets)
    if m.storage.quantized and info.head_dim:  # a group size the heads cannot take: refused now, not at a step
        m.storage.check_head_dim(int(info.head_dim), int(info.head_dim))
    blocks = slots
    if _shared_array_mask(model) and ("layer_io" in m.budget.requires or len(set(budgets)) > 1):
        raise ConfigError(
            f"{type(model).__name__} applies one array attention mask to every layer, so its layers must "
            f"keep the same number of tokens; budget {m.config.budget.name!r} gives layers different "
            "budgets. Use a uniform budget with this model"
        )
    install(model)
    if "layer_io" in m.budget.requires:
        install_layer_io(model, blocks)
    caches = list(default)
    group = new_group()
    for j, (i, block) in enumerate(zip(slots, blocks)):
        layer = topo.layer_offset + j
        li = LayerInfo(
            layer=layer, n_layers=n_total, head_offset=topo.head_offset, n_kv_heads=info.n_kv_heads,
            model_type=info.model_type, block=block, tp_size=topo.tp_size, kv_replicated=topo.kv_replicated,
            pp_size=topo.pp_size,
        )
        caches[i] = CompressedKVCache(m, int(budgets[layer]), info=li, group=group)
    compressed = [caches[i] for i in slots]
    _bind(m, model, compressed)
    what = {"config": m.config.to_dict(), "budgets": [int(b) for b in budgets], "layers": n_total,
            "kv_heads": info.n_kv_heads, "tp": topo.tp_size, "pp": topo.pp_size}
    digest = hashlib.blake2b(json.dumps(what, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    sizes = sorted(set(int(b) for b in budgets))
    span = f"budget {sizes[0]}" if len(sizes) == 1 else f"budgets {sizes[0]}..{sizes[-1]}"
    return caches, f"{m.describe()}; {span} over {n_total} layers", digest


class KVCacheConfig:
    """The design note's configuration, unchanged in spirit.

    ``KVCacheConfig(method="cam", head_dim=64, cam_budget=512, cam_n_sink=4,
    cam_merge="sim_weighted", cam_merge_gate=True, cam_merge_keys=False, seed=0)``:
    options are ``<method>_<parameter>``; ``seed`` goes to every seeded component.
    """

    def __init__(self, method: str = "cam", head_dim: Optional[int] = None, seed: int = 0, **options):
        if not isinstance(method, str):
            raise ConfigError(f"method must be a method name, got {method!r}")
        prefix = f"{method}_"
        bad = [k for k in options if not k.startswith(prefix)]
        if bad:
            raise ConfigError(
                f"unknown KVCacheConfig option(s) {bad}; options for method {method!r} are "
                f"'{prefix}<parameter>' (e.g. {prefix}budget), plus head_dim and seed"
            )
        self.method = method
        self.head_dim = head_dim
        self.seed = seed
        self.params = {k[len(prefix):]: v for k, v in options.items()}
        self.params["seed"] = seed
        self.build()  # validate now, not at first use

    def build(self, registry: Optional[Registry] = None) -> Method:
        return build_method(self.method, registry=registry, **self.params)

    def __repr__(self) -> str:
        opts = ", ".join(f"{self.method}_{k}={v!r}" for k, v in self.params.items() if k != "seed")
        return f"KVCacheConfig(method={self.method!r}, head_dim={self.head_dim}, {opts}, seed={self.seed})"


class KVCacheBuilder:
    """``KVCacheBuilder.for_model(model, config)`` -> per-layer caches (design-note API)."""

    @staticmethod
    def for_model(model: nn.Module, config: KVCacheConfig, registry: Optional[Registry] = None,
                  tokenizer: Any = None) -> list:
        info = model_info(model)
        if config.head_dim is not None and info.head_dim is not None and config.head_dim != info.head_dim:
            raise ConfigError(
                f"KVCacheConfig.head_dim={config.head_dim} but the model's head_dim is {info.head_dim}"
            )
        return make_prompt_cache(model, config.build(registry), registry=registry, tokenizer=tokenizer)


def attach(model: nn.Module, method: Union[str, MethodConfig, Method, dict, None] = DEFAULT_METHOD,
           **kwargs: Any) -> Method:
    """Make ``model.make_cache()`` return compressed caches, so every mlx-lm entry point that
    builds its own caches (``mlx_lm.models.cache.make_prompt_cache``, ``BatchGenerator``,
    ``batch_generate``, the server, chat) compresses them. Takes the same arguments as
    :func:`make_prompt_cache` (``tokenizer`` included); returns the built method, its token
    ids resolved. :func:`detach` undoes it."""
    registry = kwargs.pop("registry", None)
    tokenizer = kwargs.pop("tokenizer", None)
    method = _method_or_config(method, kwargs.pop("config", None))
    m = method if isinstance(method, Method) else build_method(method, registry=registry, **kwargs)
    m = m.with_tokenizer(tokenizer)
    make_prompt_cache(model, m)  # validate against this model now, not at the first request

    def make_cache() -> list:
        return make_prompt_cache(model, m)

    model.make_cache = make_cache
    return m


def detach(model: nn.Module) -> None:
    """Give ``model`` its own ``make_cache`` back (see :func:`attach`)."""
    if "make_cache" in vars(model):
        del vars(model)["make_cache"]
