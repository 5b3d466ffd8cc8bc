"""kvcompress: composable KV-cache compression for mlx-lm.

Three lines from a loaded model to a compressed generation::

    import kvcompress, mlx_lm
    model, tokenizer = mlx_lm.load("path/or/hf-id")
    cache = kvcompress.make_prompt_cache(model, method="cam", budget=512)
    mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)
"""

from . import ops
from ._state import derived_field, rows_field
from .batch_cache import BatchCompressedKVCache
from .cache import CompressedKVCache
from .components import Budget, ComponentSpec, Disposition, MethodSpec, Scorer, Selector
from .contexts import Eviction, LayerInfo, ModelInfo, Observation, Predictions, Selection
from .config import ComponentConfig, MethodConfig, load_config
from .errors import CompositionError, ConfigError, KVCompressError, PluginError
from .factory import KVCacheBuilder, KVCacheConfig, attach, detach, make_prompt_cache, model_info
from .hookspecs import hookimpl
from .method import Method, build_method
from .mlxlm.attention import install, is_installed
from .mlxlm.fit import CacheMismatch
from .mlxlm.loader import register as _register_with_mlx_lm
from .persistence import CorruptCacheFile, load_prompt_cache, save_prompt_cache
from .registry import Registry, get_registry

_register_with_mlx_lm()

__version__ = "0.1.0"

__all__ = [
    "BatchCompressedKVCache",
    "Budget",
    "CacheMismatch",
    "ComponentConfig",
    "ComponentSpec",
    "CompositionError",
    "CompressedKVCache",
    "ConfigError",
    "CorruptCacheFile",
    "Disposition",
    "Eviction",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCompressError",
    "LayerInfo",
    "Method",
    "MethodConfig",
    "MethodSpec",
    "ModelInfo",
    "Observation",
    "PluginError",
    "Predictions",
    "Registry",
    "Scorer",
    "Selection",
    "Selector",
    "attach",
    "build_method",
    "detach",
    "get_registry",
    "hookimpl",
    "install",
    "is_installed",
    "load_config",
    "load_prompt_cache",
    "make_prompt_cache",
    "model_info",
    "ops",
    "rows_field",
    "derived_field",
    "save_prompt_cache",
]
