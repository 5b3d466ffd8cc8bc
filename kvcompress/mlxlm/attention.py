"""Let compressed caches see the real queries: a thin wrapper around mlx-lm's attention.

mlx-lm models call ``scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)``, a function each model module imports from ``mlx_lm.models.base``. The wrapper
installed here replaces that name in ``mlx_lm.models.base`` (so every model module imported
later gets it) and in every model module already imported. For a kvcompress cache it runs the
cache's attention (the exact slot mask, or the disposition's own attention), hands the step's
queries to the cache and returns the output made to depend (``mx.depends``) on the scores and
state the step updated, so that evaluating the model's output evaluates them (mlx-lm's decode
evaluates nothing else); for any other cache it calls the original function unchanged.

The wrapper holds no state and is installed on first use of any kvcompress cache, so a cache
loaded in a fresh process scores with real queries exactly as the uninterrupted run did: the
engine runs :func:`ensure_wrapped` before every update (this module registers it with the engine
when imported, and importing kvcompress imports this module; the engine imports nothing from
:mod:`kvcompress.mlxlm`), which also wraps a model module imported later.

Budgets that require ``layer_io`` (SqueezeAttention) also need each layer's input and
attention output in a prompt's first forward: :func:`install_layer_io` gives the model's blocks
and attention modules stateless subclasses that pass those to the cache the block was called
with, and nothing else (:mod:`kvcompress.mlxlm._hooks`).
"""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import mlx.nn as nn

from ..engine import Engine
from ..engine.engine import before_update
from ..engine.passes import PassView, after_call, before_call, wants_head
from . import entry_points
from ._hooks import base_class, install_layer_io, subclass
from .head import capture, install_head_capture
from .fit import prepare_call

__all__ = ["install", "is_installed", "ensure_wrapped", "install_layer_io", "install_model_hook", "base_class"]

_MARK = "__kvcompress_wrapped__"
_LOCK = threading.Lock()
_scanned = 0


def _wrap(original):
    engine = (Engine, PassView)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if not isinstance(cache, engine):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw)
        out = cache.attend(original, queries, keys, values, scale, mask, sinks)
        cache.observe(queries, scale)
        tie = cache.step_arrays()  # evaluated with the output: never an unbounded lazy graph
        return mx.depends([out], tie)[0] if tie else out

    setattr(scaled_dot_product_attention, _MARK, original)
    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def _patch(mod) -> bool:
    fn = getattr(mod, "scaled_dot_product_attention", None)
    if fn is None or not callable(fn):
        return False
    if not hasattr(fn, _MARK):
        setattr(mod, "scaled_dot_product_attention", _wrap(fn))
    return True


def ensure_wrapped() -> None:
    """Wrap mlx-lm's attention function in ``mlx_lm.models.base``, every loaded mlx-lm model module
    and every other module that imported mlx-lm's function (a model defined outside mlx-lm), and
    mlx-lm's generation entry points (:mod:`kvcompress.mlxlm.entry_points`)."""
    global _scanned
    if len(sys.modules) == _scanned:
        return
    with _LOCK:
        import mlx_lm.models.base as base

        _patch(base)
        original = getattr(base.scaled_dot_product_attention, _MARK)
        for name, mod in list(sys.modules.items()):
            if mod is None:
                continue
            try:
                held = name.startswith("mlx_lm.models.") or vars(mod).get("scaled_dot_product_attention") is original
            except TypeError:  # an object without a __dict__ in sys.modules
                continue
            if held:
                _patch(mod)
        entry_points.wrap(install)
        _scanned = len(sys.modules)


def _modules_of(model: nn.Module) -> set:
    names = {type(model).__module__}
    for _, child in model.named_modules():
        names.add(type(child).__module__)
    return {n for n in names if n in sys.modules}


def install(model: nn.Module) -> list:
    """Wrap the attention function for ``model`` (idempotent); returns the module names that use
    it. Models whose attention does not go through mlx-lm's function are left alone (their
    single-sequence caches fall back to a key-as-query proxy, reported by ``score_source``).

    Also gives ``model`` the model hook (:func:`install_model_hook`): a stateless subclass whose
    call checks that a kvcompress cache list fits the model, hands the input token ids to caches
    whose scorer requires ``"tokens"`` and first runs the scoring passes their scorer asks for
    (:mod:`kvcompress.engine.passes`). mlx-lm's ``generate_step`` and ``BatchGenerator`` install
    it themselves when given kvcompress caches (:mod:`kvcompress.mlxlm.entry_points`)."""
    ensure_wrapped()
    install_model_hook(model)
    return sorted(n for n in _modules_of(model) if _patch(sys.modules[n]))


def is_installed(model: nn.Module) -> bool:
    """Whether some module of ``model`` routes attention through the wrapper."""
    for name in _modules_of(model):
        fn = getattr(sys.modules.get(name), "scaled_dot_product_attention", None)
        if fn is not None and hasattr(fn, _MARK):
            return True
    return False


# --------------------------------------------------------------------------------------------
# The model hook
# --------------------------------------------------------------------------------------------


def _model_call(base, model, args, kwargs):
    cache = kwargs["cache"] if "cache" in kwargs else (args[1] if len(args) > 1 else None)
    if isinstance(cache, (list, tuple)) and cache:
        prepare_call(model, cache)  # a list made for another model is refused before anything changes
        inputs = args[0] if args else kwargs.get("inputs")
        before_call(lambda ids, views: base.__call__(model, ids, cache=views), cache, inputs)
        if not wants_head(cache):
            out = base.__call__(model, *args, **kwargs)
            after_call(cache, out)
            return out
        with capture() as seen:
            out = base.__call__(model, *args, **kwargs)
        # the head's input, if the model returned exactly what its head made
        head = seen[0][:2] if len(seen) == 1 and seen[0][2] is out else None
        after_call(cache, out, head)
        return out
    return base.__call__(model, *args, **kwargs)


def install_model_hook(model: nn.Module) -> None:
    """Give ``model`` a stateless subclass whose ``__call__(inputs, cache=...)``, for a cache
    list holding kvcompress caches, first checks that the list fits the model
    (:func:`kvcompress.mlxlm.fit.check_fit`), routes layer input/output to caches whose budget
    needs it, runs the scorer's scoring passes and hands ``inputs`` to the caches whose scorer
    requires ``"tokens"`` (idempotent; a call with other caches is the model's own)."""
    if not callable(getattr(type(model), "__call__", None)):
        return
    model.__class__ = subclass(base_class(model), _model_call)
    install_head_capture(model)


# the engine runs this before every update (it imports no mlx-lm glue itself): a cache loaded in a
# fresh process, or a model module imported after the caches were built, finds the wrapper too
before_update(ensure_wrapped)
