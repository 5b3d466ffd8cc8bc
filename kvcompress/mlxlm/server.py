"""``kvcompress serve``: mlx-lm's OpenAI-compatible server with every cache compressed.

The server is mlx-lm's own (``mlx_lm.server``: ``/v1/chat/completions``, ``/v1/completions``,
streaming, continuous batching, prompt-cache reuse and every one of its flags). kvcompress hooks
into it at two documented points, both names in the ``mlx_lm.server`` module:

* ``ModelProvider`` -- a subclass whose ``_load`` calls mlx-lm's, then
  :func:`kvcompress.attach` es the method to the loaded model, so every cache the server builds
  (``make_prompt_cache(model)``, inside ``BatchGenerator`` and for single requests) is
  compressed. Compressed caches implement ``merge``, so continuous batching stays on. A draft
  model (speculative decoding) keeps mlx-lm's own caches.
* ``LRUPromptCache`` -- :class:`~kvcompress.mlxlm.prompt_cache.CompressedPromptCache`, which reuses
  exact and shorter-prefix hits as mlx-lm does, resumes a conversation that extends a cached
  entry without re-prefilling it, and trims a cached entry only when the trim is exact.

The installed mlx-lm is checked at start-up (:func:`check_mlx_lm`).
"""

from __future__ import annotations

import sys
from typing import Sequence

from ..errors import KVCompressError

__all__ = ["SUPPORTED_MLX_LM", "check_mlx_lm", "run_server", "patch_server"]

#: mlx-lm minor versions whose server/chat internals kvcompress serve and chat were tested with
SUPPORTED_MLX_LM = ("0.32",)


def check_mlx_lm(module: str = "mlx_lm.server", names: Sequence[str] = ("ModelProvider", "LRUPromptCache", "main")):
    """Raise KVCompressError unless the installed mlx-lm is a supported version whose ``module``
    has the hook points ``names``."""
    import importlib

    import mlx_lm

    version = getattr(mlx_lm, "__version__", "?")
    minor = ".".join(version.split(".")[:2])
    if minor not in SUPPORTED_MLX_LM:
        raise KVCompressError(
            f"mlx-lm {version} is not supported by kvcompress serve/chat (supported: "
            f"{', '.join(v + '.x' for v in SUPPORTED_MLX_LM)}); install one with "
            f"pip install 'mlx-lm>={SUPPORTED_MLX_LM[0]},<{_next(SUPPORTED_MLX_LM[-1])}'"
        )
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise KVCompressError(f"mlx-lm {version}: {module} lacks {missing}, which kvcompress hooks into")
    return version


def _next(minor: str) -> str:
    major, m = minor.split(".")
    return f"{major}.{int(m) + 1}"


def patch_server(method) -> None:
    """Install the two hooks into ``mlx_lm.server`` for ``method`` (a built Method)."""
    import mlx_lm.server as srv

    from ..factory import attach
    from .prompt_cache import CompressedPromptCache

    base = getattr(srv.ModelProvider, "_kvcompress_base", srv.ModelProvider)

    class ModelProvider(base):
        _kvcompress_base = base

        def __init__(self, cli_args):
            super().__init__(cli_args)
            if getattr(cli_args, "model", None) is not None:  # refuse a bad model at start-up
                try:
                    self.load_default()
                except KVCompressError:
                    raise
                except Exception as exc:
                    raise KVCompressError(f"cannot load --model {cli_args.model!r}: {type(exc).__name__}: {exc}") from None

        def _load(self, *args, **kwargs):
            super()._load(*args, **kwargs)
            attach(self.model, method)

    srv.ModelProvider = ModelProvider
    srv.LRUPromptCache = CompressedPromptCache


def run_server(method, argv: Sequence[str]) -> int:
    """Run ``mlx_lm.server`` with ``argv`` (its own flags) and every cache compressed by ``method``."""
    import mlx_lm.server as srv

    patch_server(method)
    old = sys.argv
    sys.argv = ["kvcompress serve", *argv]
    try:
        srv.main()
    finally:
        sys.argv = old
    return 0
