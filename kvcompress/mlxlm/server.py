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

__all__ = ["SUPPORTED_MLX_LM", "check_mlx_lm", "check_server_args", "run_server", "patch_server"]

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


#: mlx-lm server options checked at start-up: name -> (low, high, low excluded), as generate checks its own
_RANGES = {"temp": (0.0, float("inf"), False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
           "top_k": (0, float("inf"), False), "max_tokens": (1, float("inf"), False),
           "decode_concurrency": (1, float("inf"), False), "prompt_concurrency": (1, float("inf"), False),
           "prefill_step_size": (1, float("inf"), False), "prompt_cache_size": (0, float("inf"), False)}


def check_server_args(cli_args) -> None:
    """Raise KVCompressError (one line) unless mlx-lm's server options are usable: sampling and
    size options in range, ``--port`` in 1..65535 and ``--host:--port`` free to listen on. Runs
    before the model loads and before mlx-lm starts its threads (a failure there hangs the process)."""
    import math
    import socket

    for name, (lo, hi, lo_open) in _RANGES.items():
        v = getattr(cli_args, name, None)
        if v is None:
            continue
        if not ((lo < v if lo_open else lo <= v) and v <= hi) or (isinstance(v, float) and math.isnan(v)):
            want = f">= {lo:g}" if hi == float("inf") else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise KVCompressError(f"--{name.replace('_', '-')} must be {want}, got {v:g}")
    host, port = getattr(cli_args, "host", "127.0.0.1"), getattr(cli_args, "port", 8080)
    if not 1 <= port <= 65535:
        raise KVCompressError(f"--port must be in [1, 65535], got {port}")
    try:  # what mlx_lm.server's _run_http_server binds, tried and released
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            sock.bind(address)
    except socket.gaierror as exc:
        raise KVCompressError(f"--host {host!r}: not an address of this machine ({exc.strerror}); "
                              "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    except OSError as exc:
        import errno

        why = {errno.EADDRINUSE: "the port is in use (another server?); choose a free --port",
               errno.EACCES: "permission denied (ports below 1024 need privileges); choose another --port",
               errno.EADDRNOTAVAIL: "the address is not one of this machine's; check --host"}.get(
                   exc.errno, f"{exc.strerror or exc}; check --host and --port")
        raise KVCompressError(f"cannot listen on {host} port {port}: {why}") from None


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
            check_server_args(cli_args)  # before the model loads and mlx-lm starts any thread
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
