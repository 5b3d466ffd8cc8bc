"""``kvcompress serve`` and ``kvcompress chat``: mlx-lm's server and chat with compressed caches.

Both take the compression as ``--method NAME [--budget N] [--param K=V ...]`` or ``--config FILE``,
with ``--kv-bits B [--kv-group-size G]`` for the method's low-bit storage of the kept slots (taken
here, never passed to mlx-lm, whose ``kv_bits`` would quantize a full cache), and pass every other
flag to mlx-lm unchanged (``kvcompress serve --help`` lists both). The
method is built, and the installed mlx-lm checked, before anything starts; ``serve`` also loads
its ``--model`` up front so a bad model or a budget the model cannot hold is refused at start-up.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import KVCompressError

__all__ = ["main"]

_DESCRIPTIONS = {
    "serve": "an OpenAI-compatible server (mlx-lm's generation, an ASGI front) with every KV cache compressed",
    "chat": "mlx-lm's terminal chat (mlx_lm.chat) with a compressed KV cache kept across turns",
}


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"kvcompress {command}", description=_DESCRIPTIONS[command], add_help=False,
        epilog=("Every other option is the server's: mlx_lm.server's and kvcompress serve's (listed below)."
                if command == "serve" else "Every other option is mlx_lm.chat's (listed below)."),
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help and mlx-lm's options")
    from ..generate import add_method_arguments

    add_method_arguments(p)
    return p


def _mlx_help(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    old = sys.argv
    sys.argv = [module, "--help"]
    try:
        mod.main()
    except SystemExit:
        pass
    finally:
        sys.argv = old


def _serve_help() -> None:
    from ..serve.options import server_parser

    server_parser().print_help()


def main(command: str, argv: Sequence[str]) -> int:
    """Run ``kvcompress serve|chat`` with ``argv``; returns the exit code."""
    from .server import SERVER_NAMES, check_mlx_lm

    parser = _parser(command)
    try:
        args, rest = parser.parse_known_args(list(argv))
    except SystemExit as exc:  # argparse printed its one-line error
        return int(exc.code or 0)
    module = "mlx_lm.server" if command == "serve" else "mlx_lm.chat"
    if args.help:
        parser.print_help()
        if command == "serve":
            print("\n--- server options (mlx_lm.server's, then kvcompress serve's) ---")
            _serve_help()
        else:
            print(f"\n--- {module} options ---")
            _mlx_help(module)
        return 0
    prog = f"kvcompress {command}"
    try:
        names = SERVER_NAMES if command == "serve" else ("load", "main")
        check_mlx_lm(module, names)
        from ..generate import method_from_args

        method = method_from_args(args)
        if command == "serve":
            from ..serve import run_server

            return run_server(method, rest)
        return _run_chat(method, rest)
    except KVCompressError as exc:
        print(f"{prog}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


def _run_chat(method, argv: Sequence[str]) -> int:
    """mlx_lm.chat with its ``load``/``sharded_load`` followed by :func:`kvcompress.attach`."""
    import mlx_lm.chat as chat

    from ..factory import attach

    def attached(loader):
        def load(*args, **kwargs):
            from ..generate import model_error

            name = str(args[0] if args else kwargs.get("path_or_hf_repo", kwargs.get("repo", "?")))
            try:
                model, tokenizer = loader(*args, **kwargs)[:2]
            except KVCompressError:
                raise
            except Exception as exc:  # as generate and serve: one line naming the model
                raise model_error(name, exc) from None
            if getattr(tokenizer, "chat_template", None) is None:
                raise KVCompressError(
                    "the model's tokenizer has no chat template, which chat needs (as mlx_lm.chat "
                    "does); use kvcompress generate, or pass a model with a chat template"
                )
            attach(model, method, tokenizer=tokenizer)
            return model, tokenizer

        return load

    saved = chat.load, chat.sharded_load
    chat.load, chat.sharded_load = attached(chat.load), attached(chat.sharded_load)
    old = sys.argv
    sys.argv = ["kvcompress chat", *argv]
    try:
        chat.main()
    finally:
        sys.argv = old
        chat.load, chat.sharded_load = saved
    return 0
