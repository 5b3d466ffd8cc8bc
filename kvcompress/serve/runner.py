"""Start ``kvcompress serve``: options checked, model loaded and compressed, generation loop
started, then uvicorn listening -- and the exit code a supervisor can act on (0 after a normal
shutdown, 1 when the generation loop failed beyond its restarts)."""

from __future__ import annotations

import logging
from typing import Sequence

from ..errors import KVCompressError

__all__ = ["run_server"]

log = logging.getLogger("kvcompress.serve")


def _fingerprint() -> str:
    try:
        from mlx_lm.server import get_system_fingerprint

        return get_system_fingerprint()
    except Exception:
        return "kvcompress"


def _server_class():
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, for which SIGINT / SIGTERM is a normal shutdown: the requests in
        flight finish (10 s at most), the generation loop stops, the exit status is 0 (uvicorn
        would re-raise the signal and skip that)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return Server


def _cache_folder(cli):
    """The ``--prompt-cache-dir`` folder, checked (None without the option)."""
    if not getattr(cli, "prompt_cache_dir", None):
        return None
    import mlx.core as mx

    from .cache_dir import CacheDir
    from .options import DEFAULT_DIR_BYTES

    if mx.distributed.init().size() > 1:
        raise KVCompressError("--prompt-cache-dir is not supported under mlx.distributed (every rank would have "
                              "to find the same files at the same moment); drop it")
    return CacheDir(cli.prompt_cache_dir, cli.prompt_cache_dir_bytes or DEFAULT_DIR_BYTES)


def _prompt_cache(cli, folder=None, method=None, provider=None):
    """The server's prompt cache: in memory, and with a cache ``folder`` on disk too (a
    :class:`~.persistent_cache.PersistentPromptCache` whose files are identified by ``provider``'s
    loaded models and ``method``)."""
    from ..mlxlm.prompt_cache import CompressedPromptCache

    if folder is None:
        return CompressedPromptCache(cli.prompt_cache_size)
    from .identity import provider_identity
    from .persistent_cache import PersistentPromptCache

    known: dict = {}
    cache = PersistentPromptCache(cli.prompt_cache_size, folder,
                                  lambda key: provider_identity(provider, method, key, known))
    log.info("kvcompress serve: prompt caches kept in %s", cache.describe())
    return cache


def run_server(method, argv: Sequence[str]) -> int:
    """Serve with every cache compressed by ``method`` (a built Method); ``argv`` holds the
    server's options (mlx-lm's and :mod:`.options`'). Returns the exit code; KVCompressError
    (one line) for a problem found before the server listens."""
    import mlx.core as mx
    import uvicorn

    from ..mlxlm.server import model_provider
    from .admission import Admission
    from .app import AppState, build_app
    from .generator import SupervisedGenerator
    from .options import check_server_args, check_storage_args, parse_server_args
    from .persistent_cache import PersistentPromptCache

    cli = parse_server_args(argv)
    check_storage_args(cli)  # mlx-lm's --kv-bits would quantize a full cache: the method's storage does it
    check_server_args(cli)
    logging.basicConfig(level=getattr(logging, cli.log_level.upper()), format="%(asctime)s - %(levelname)s - %(message)s")
    try:
        from mlx_lm.utils import maybe_set_recommended_wired_limit

        maybe_set_recommended_wired_limit()
    except Exception:
        pass
    folder = _cache_folder(cli)  # an unusable --prompt-cache-dir stops here
    provider = model_provider(method)(cli)  # loads --model: a bad model or budget stops here
    server_box: dict = {}

    def fatal(reason: str) -> None:
        log.error("kvcompress serve: exiting with status 1 (%s)", reason)
        if "server" in server_box:
            server_box["server"].should_exit = True

    prompt_cache = _prompt_cache(cli, folder, method, provider)
    persistent = isinstance(prompt_cache, PersistentPromptCache)
    generator = SupervisedGenerator(provider, prompt_cache, on_fatal=fatal,
                                    on_idle=prompt_cache.write_pending if persistent else None,
                                    on_exit=prompt_cache.close if persistent else None)
    if mx.distributed.init().rank() != 0:  # other ranks only generate (mlx-lm's arrangement)
        generator.join()
        return 1 if generator.failed else 0
    batch = max(cli.decode_concurrency, cli.prompt_concurrency)
    state = AppState(generator=generator, provider=provider, cli=cli, fingerprint=_fingerprint(),
                     admission=Admission(cli.max_concurrent_requests, batch),
                     disk_cache=prompt_cache if persistent else None)
    level = cli.log_level.lower()
    config = uvicorn.Config(build_app(state), host=cli.host, port=cli.port, log_level=level,
                            access_log=level in ("debug", "info"), timeout_graceful_shutdown=10,
                            backlog=max(2048, 4 * cli.max_concurrent_requests))
    server = _server_class()(config)
    server_box["server"] = server
    if generator.failed:  # failed before the server could start
        return 1
    log.info("kvcompress serve: %s with %s on http://%s:%d", cli.model or "(no model yet)", method.name, cli.host,
             cli.port)
    try:
        server.run()
    finally:
        generator._stop = True
        generator.join()
    return 1 if generator.failed else 0
