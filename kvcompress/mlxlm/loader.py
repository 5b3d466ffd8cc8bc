"""Make mlx-lm's own prompt-cache functions read and write kvcompress caches.

mlx-lm's ``load_prompt_cache`` rebuilds each layer with ``globals()[class_name].from_state`` in
``mlx_lm.models.cache``; :func:`register` puts the kvcompress cache classes there. It also wraps
that module's ``load_prompt_cache`` / ``save_prompt_cache`` so that a kvcompress file read or a
kvcompress cache list written through mlx-lm gets the same digest check as through
:func:`kvcompress.load_prompt_cache` / :func:`kvcompress.save_prompt_cache` (other files and
lists go to mlx-lm unchanged), and mlx-lm's generation entry points
(:mod:`kvcompress.mlxlm.entry_points`). Importing kvcompress registers them; so does the
``kvcompress-autoload.pth`` hook installed with the package, the moment anything imports
``mlx_lm.models.cache`` (so ``mlx_lm.generate --prompt-cache-file`` reads a kvcompress file
without importing kvcompress itself).
"""

from __future__ import annotations

import sys

from mlx_lm.models import cache as mlx_cache

from .._autoload import CACHE_CLASSES, original, wrap_file_functions
from ..batch_cache import BatchCompressedKVCache
from ..cache import CompressedKVCache
from ..persistence import load_prompt_cache, save_prompt_cache
from . import entry_points
from .attention import install

__all__ = ["register", "CACHE_CLASSES", "original"]


def register() -> None:
    """Expose the kvcompress cache classes to ``mlx_lm.models.cache.load_prompt_cache`` and wrap
    mlx-lm's prompt-cache file functions and generation entry points (idempotent)."""
    mlx_cache.CompressedKVCache = CompressedKVCache
    mlx_cache.BatchCompressedKVCache = BatchCompressedKVCache
    wrap_file_functions(mlx_cache, load_prompt_cache, save_prompt_cache)
    # modules that imported mlx-lm's functions by name before they were wrapped (mlx_lm.generate)
    for fn_name in ("load_prompt_cache", "save_prompt_cache"):
        own = original(getattr(mlx_cache, fn_name))
        for name, mod in list(sys.modules.items()):
            if name.startswith("mlx_lm.") and mod is not None and vars(mod).get(fn_name) is own:
                setattr(mod, fn_name, getattr(mlx_cache, fn_name))
    entry_points.wrap(install)
