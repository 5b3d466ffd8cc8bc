"""The options of ``kvcompress serve``: every one of ``mlx_lm.server``'s, and ours.

mlx-lm's parser is taken from ``mlx_lm.server.main`` itself (stopped where it would parse), so
each of its flags keeps its name, type, default and help; kvcompress adds its own group
(:data:`OWN_OPTIONS`). :func:`check_server_args` refuses impossible values before the model
loads.
"""

from __future__ import annotations

import argparse
import math
import socket
from typing import Sequence

from ..errors import KVCompressError

__all__ = ["server_parser", "parse_server_args", "check_server_args", "check_storage_args", "OWN_OPTIONS"]

#: kvcompress serve's own options (besides --method/--budget/--config/--param)
OWN_OPTIONS = ("max_concurrent_requests", "prompt_cache_dir", "prompt_cache_dir_bytes")


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__("parser captured")
        self.parser = parser


def _mlx_parser() -> argparse.ArgumentParser:
    import mlx_lm.server as srv

    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        srv.main()
    except _Captured as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise KVCompressError("mlx_lm.server.main did not build its argument parser as expected")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _size(text: str) -> int:
    from .cache_dir import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return value


#: --prompt-cache-dir-bytes when not given
DEFAULT_DIR_BYTES = 10 * 10**9


def server_parser() -> argparse.ArgumentParser:
    """mlx-lm's server parser with kvcompress serve's options added."""
    p = _mlx_parser()
    p.prog, p.description = "kvcompress serve", "mlx-lm's OpenAI-compatible server with every KV cache compressed"
    for action in p._actions:
        if action.dest in _MLX_STORAGE:  # kvcompress serve's own --kv-bits / --kv-group-size say it
            action.help = argparse.SUPPRESS
        if action.dest == "prompt_cache_size":
            action.help = ("prompt-cache sequences kept (default: 10): entries no other extends -- a finished "
                           "request, a conversation's last turn; with them, up to as many shorter compressed "
                           "entries they extend (a prompt before its answer, a system prompt), since a "
                           "compressed cache cannot be trimmed back to those")
    own = p.add_argument_group("kvcompress serve")
    own.add_argument("--max-concurrent-requests", type=_positive, default=128, metavar="N",
                     help="generations held at once (each choice of each request, decoding or queued); "
                          "more are refused with 503 and Retry-After (default: 128)")
    own.add_argument("--prompt-cache-dir", metavar="DIR",
                     help="keep the prompt caches on disk too, in DIR (created if missing; several servers may "
                          "share it): a restarted server resumes a conversation from there, prefilling only "
                          "the new turn. Files are written when the server is idle and at shutdown")
    own.add_argument("--prompt-cache-dir-bytes", type=_size, metavar="SIZE",
                     help="the most the cache files in --prompt-cache-dir hold together, e.g. 2GB, 500MB, "
                          "1.5GiB; the least recently used files are removed first (default: 10GB)")
    return p


#: mlx_lm.server's options that quantize a full cache; ``kvcompress serve`` takes ``--kv-bits`` and
#: ``--kv-group-size`` as the method's storage instead (:func:`kvcompress.generate.method_from_args`)
_MLX_STORAGE = ("kv_bits", "kv_group_size", "quantized_kv_start")


def check_storage_args(cli_args) -> None:
    """Raise KVCompressError if mlx-lm's own ``--kv-bits`` / ``--kv-group-size`` /
    ``--quantized-kv-start`` reached the server's options: with a kvcompress cache they are the
    method's (built before the server), never mlx-lm's, which would quantize a full cache."""
    try:
        from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START as start
    except ImportError:  # pragma: no cover - another mlx-lm
        start = None
    defaults = {"kv_bits": None, "kv_group_size": 64, "quantized_kv_start": start}
    for dest in _MLX_STORAGE:
        value = getattr(cli_args, dest, None)
        if value is None or value == defaults[dest]:
            continue
        flag = "--" + dest.replace("_", "-")
        if dest == "quantized_kv_start":
            raise KVCompressError(f"{flag} is mlx-lm's; kvcompress stores every kept slot in low bits from the "
                                  "first token (--kv-bits), so there is no start to choose: drop it")
        raise KVCompressError(f"{flag} reached mlx-lm's server options, where it would quantize a full cache; "
                              f"it is the method's storage: give it on the kvcompress serve command line, or "
                              f"build the method with {dest}=...")


def parse_server_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; argparse's own one-line error (exit code 2) for an unknown flag or value."""
    return server_parser().parse_args(list(argv))


#: mlx-lm server options checked at start-up: name -> (low, high, low excluded)
_RANGES = {"temp": (0.0, float("inf"), False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
           "top_k": (0, float("inf"), False), "max_tokens": (1, float("inf"), False),
           "decode_concurrency": (1, float("inf"), False), "prompt_concurrency": (1, float("inf"), False),
           "prefill_step_size": (1, float("inf"), False), "prompt_cache_size": (0, float("inf"), False),
           "num_draft_tokens": (0, float("inf"), False)}


def check_server_args(cli_args) -> None:
    """Raise KVCompressError (one line) unless the options are usable: sampling and size options
    in range, ``--port`` in 1..65535 and ``--host:--port`` free to listen on."""
    for name, (lo, hi, lo_open) in _RANGES.items():
        v = getattr(cli_args, name, None)
        if v is None:
            continue
        if not ((lo < v if lo_open else lo <= v) and v <= hi) or (isinstance(v, float) and math.isnan(v)):
            want = f">= {lo:g}" if hi == float("inf") else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise KVCompressError(f"--{name.replace('_', '-')} must be {want}, got {v:g}")
    if getattr(cli_args, "prompt_cache_bytes", None) is not None and cli_args.prompt_cache_bytes < 0:
        raise KVCompressError(f"--prompt-cache-bytes must be >= 0, got {cli_args.prompt_cache_bytes}")
    given_bytes = getattr(cli_args, "prompt_cache_dir_bytes", None) is not None
    if given_bytes and not getattr(cli_args, "prompt_cache_dir", None):
        raise KVCompressError("--prompt-cache-dir-bytes limits the folder of --prompt-cache-dir; give that folder too")
    host, port = getattr(cli_args, "host", "127.0.0.1"), getattr(cli_args, "port", 8080)
    if not 1 <= port <= 65535:
        raise KVCompressError(f"--port must be in [1, 65535], got {port}")
    try:  # what the server will bind, tried and released
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
