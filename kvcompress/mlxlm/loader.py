"""Make mlx-lm's own prompt-cache loader read kvcompress caches.

mlx-lm's ``load_prompt_cache`` rebuilds each layer with ``globals()[class_name].from_state`` in
``mlx_lm.models.cache``; :func:`register` puts the kvcompress cache classes there. Importing
kvcompress registers them; so does the ``kvcompress-autoload.pth`` hook installed with the
package, the moment anything imports ``mlx_lm.models.cache`` (so ``mlx_lm.generate
--prompt-cache-file`` reads a kvcompress file without importing kvcompress itself).
"""

from __future__ import annotations

__all__ = ["register", "CACHE_CLASSES"]

CACHE_CLASSES = ("CompressedKVCache", "BatchCompressedKVCache")


def register() -> None:
    """Expose the kvcompress cache classes to ``mlx_lm.models.cache.load_prompt_cache``."""
    from mlx_lm.models import cache as mlx_cache

    from ..batch_cache import BatchCompressedKVCache
    from ..cache import CompressedKVCache

    mlx_cache.CompressedKVCache = CompressedKVCache
    mlx_cache.BatchCompressedKVCache = BatchCompressedKVCache
