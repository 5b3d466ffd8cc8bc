"""``kvcompress generate``: mlx_lm.generate with a compressed cache, and what it saved.

Everything that can be checked without the model (option values, the method, file paths) is
checked before the model loads; every problem is a :class:`~kvcompress.ConfigError` naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

__all__ = [
    "add_arguments", "run", "check_args", "cache_report", "prompt_tokens",
    "load_model",
]

from .method_options import (  # noqa: F401 (re-exported: serve, chat and the benches read them here)
    METHOD_OPTIONS, _float_in, add_method_arguments, method_from_args, param_value, positive_int, seed_int,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local mlx-lm model folder or Hugging Face id")
    p.add_argument("--prompt", "-p", default="Once upon a time", help="prompt text ('-' reads stdin)")
    add_method_arguments(p)
    p.add_argument("--max-tokens", "-m", type=positive_int, default=256, help="tokens to generate (>= 1)")
    p.add_argument("--temp", type=_float_in(0.0, float("inf")), default=0.0, help="sampling temperature (>= 0)")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus, in (0, 1]")
    p.add_argument("--seed", type=seed_int, default=None, help="sampling seed, in [0, 2**64 - 1]")
    p.add_argument("--prefill-step-size", type=positive_int, default=2048)
    p.add_argument("--prompt-cache-file", default=None,
                   help="continue a saved cache (its method comes from the file) with --prompt")
    p.add_argument("--save-prompt-cache", default=None, help="save the cache after generating (.safetensors)")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--verbose", action="store_true", help="print per-layer cache diagnostics")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the model's layers across ranks (default: its heads)")


def check_args(args):
    """Check the options before the model loads; returns the method to build (None with a file)."""
    from .errors import ConfigError
    from .mlxlm.distributed import world

    group = world()
    if group is not None:  # each rank holds its own part of the cache: one file per rank
        for opt in ("prompt_cache_file", "save_prompt_cache"):
            path = getattr(args, opt)
            if path is not None:
                p = Path(path)
                setattr(args, opt, str(p.with_name(f"{p.stem}.rank{group.rank()}{p.suffix or '.safetensors'}")))
    if args.prompt_cache_file is not None:
        given = [f"--{o.replace('_', '-')}" for o in METHOD_OPTIONS if getattr(args, o) not in (None, [])]
        if given:
            raise ConfigError(
                f"--prompt-cache-file continues the saved cache with the method stored in the file; "
                f"drop {', '.join(given)}"
            )
        if Path(args.prompt_cache_file).is_dir():
            raise ConfigError(f"--prompt-cache-file {args.prompt_cache_file!r} is a folder; name a saved "
                              "cache file (.safetensors) written by --save-prompt-cache")
        if not Path(args.prompt_cache_file).is_file():
            raise ConfigError(f"--prompt-cache-file {args.prompt_cache_file!r} does not exist")
    if args.save_prompt_cache is not None:
        out = Path(args.save_prompt_cache)
        if out.is_dir() or args.save_prompt_cache.endswith(("/", "\\")):
            raise ConfigError(f"--save-prompt-cache {str(out)!r} is a folder; name a file in it, "
                              f"e.g. {str(out / 'cache.safetensors')!r}")
        if not out.parent.is_dir():
            raise ConfigError(f"--save-prompt-cache {str(out)!r}: folder {str(out.parent)!r} does not exist")
        if out.suffix != ".safetensors":  # mlx adds it anyway; report the real name
            out = Path(str(out) + ".safetensors")
            args.save_prompt_cache = str(out)
        if out.is_dir():
            raise ConfigError(f"--save-prompt-cache: the file it writes, {str(out)!r}, is a folder; "
                              "name another file")
    if args.prompt != "-":
        prompt_text(args.prompt, "--prompt")  # not UTF-8: refused before the model loads
    if args.prompt_cache_file is not None:
        return None
    return method_from_args(args)


def prompt_text(text, where: str) -> str:
    """``text`` (a str, possibly with the surrogate escapes of undecodable arguments, or bytes)
    as UTF-8 text; a ConfigError naming ``where`` if it is not UTF-8."""
    from .errors import ConfigError

    try:
        if isinstance(text, bytes):
            return text.decode("utf-8")
        text.encode("utf-8")
        return text
    except UnicodeError as exc:
        bad = exc.object[exc.start:exc.end]
        shown = bad.hex() if isinstance(bad, bytes) else bad.encode("utf-8", "surrogateescape").hex()
        raise ConfigError(f"{where} is not UTF-8 text (byte 0x{shown[:2]} at position {exc.start}); "
                          "give the prompt as UTF-8") from None


def read_prompt(args) -> str:
    """The prompt: ``--prompt`` itself, or stdin for ``--prompt -``, as UTF-8 text."""
    if args.prompt == "-":
        return prompt_text(sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read(),
                           "the prompt read from stdin (--prompt -)")
    return prompt_text(args.prompt, "--prompt")


def load_model(name: str, pipeline: bool = False):
    """``mlx_lm.load(name)`` (``sharded_load`` when launched on several ranks with ``mlx.launch``:
    tensor parallelism, or pipeline parallelism with ``pipeline``); a failure is one ConfigError
    naming the model."""
    import mlx_lm

    from .mlxlm.distributed import world

    try:
        group = world()
        if group is not None:
            from mlx_lm.utils import sharded_load

            return sharded_load(name, pipeline_group=group if pipeline else None,
                                tensor_group=None if pipeline else group)
        return mlx_lm.load(name)
    except Exception as exc:  # mlx-lm and huggingface_hub raise many types for a bad name
        raise model_error(name, exc) from exc


def model_error(name: str, exc: BaseException):
    """The ConfigError for a model mlx-lm could not load: a folder it cannot read, or a name that
    is neither a local folder nor a reachable Hugging Face id (``generate``, ``chat``)."""
    from .errors import ConfigError

    why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if Path(name).is_dir():
        return ConfigError(f"model folder {name!r} could not be loaded by mlx-lm ({why})")
    return ConfigError(f"model {name!r} is neither a local mlx-lm folder nor a reachable Hugging Face id ({why})")


def _read_saved_cache(path: str) -> list:
    from .errors import ConfigError, KVCompressError
    from .persistence import load_prompt_cache

    try:
        return load_prompt_cache(path)
    except (KVCompressError, OSError, ValueError, RuntimeError, KeyError) as exc:
        why = " ".join(str(exc).split())
        raise ConfigError(f"--prompt-cache-file {path!r} is not a readable prompt cache ({why})") from exc


def _attach_saved_cache(cache: list, model, path: str) -> list:
    from . import install
    from .errors import ConfigError
    from .mlxlm.fit import CacheMismatch, check_fit

    if len(cache) != len(model.layers):  # (also a file without kvcompress layers)
        raise ConfigError(
            f"--prompt-cache-file {path!r} holds {len(cache)} layers; the model has {len(model.layers)}"
        )
    error = None
    try:
        check_fit(model, cache, where=f"--prompt-cache-file {path!r}")
    except CacheMismatch as exc:
        error = str(exc)
    _agree_saved(cache, error)  # under mlx.launch: every rank's file continues the same run
    if error is not None:
        raise ConfigError(error)
    install(model)
    return cache


def _agree_saved(cache: list, error) -> None:
    """Under ``mlx.distributed``, one collective: the ranks' files hold the same method and the
    same tokens seen, or every rank raises the same ConfigError (a rank whose file is another run's
    would hang in a step's collective or generate differently)."""
    import hashlib

    from .cache import CompressedKVCache
    from .mlxlm.distributed import agree, world

    if world() is None:
        return
    first = next((c for c in cache if isinstance(c, CompressedKVCache)), None)
    what = {} if first is None else {"config": first.method.config.to_dict(), "layers": first.info.n_layers,
                                     "seen": first.offset, "tp": first.info.tp_size, "pp": first.info.pp_size}
    digest = hashlib.blake2b(json.dumps(what, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    summary = "no compressed layer" if first is None else f"{first.method.describe()}; {first.offset} tokens seen"
    agree(summary, digest, error, action="loaded")


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))


def prompt_tokens(tokenizer, text: str, *, chat_template: bool = True, system_prompt: Optional[str] = None,
                  continuation: bool = False) -> list[int]:
    """The token ids to feed for ``text``.

    ``continuation``: the tokens follow a saved cache, so no BOS and, with a chat template, only
    the new user turn and the generation prompt (not the template's opening or system prompt).
    """
    if not (chat_template and _has_chat_template(tokenizer)):
        return list(tokenizer.encode(text, add_special_tokens=not continuation))

    def render(messages, gen):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    turn = {"role": "user", "content": text}
    prompt = render([*head, turn], True)
    if continuation:
        # What the template adds after a finished exchange is the new turn alone.
        before = [*head, {"role": "user", "content": "<query>"}, {"role": "assistant", "content": "<reply>"}]
        done, both = render(before, False), render([*before, turn], True)
        if both.startswith(done):
            prompt = both[len(done):]
        else:  # a template that rewrites earlier turns: mlx-lm's probe (from the user's text on)
            probe = render([*head, {"role": "user", "content": "<query>"}], True)
            prompt = prompt[probe.index("<query>"):]
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def cache_report(cache: list) -> dict[str, int]:
    """Bytes the caches hold vs what mlx-lm's own ``KVCache`` would hold for the same tokens."""
    from .cache import CompressedKVCache

    held = full = 0
    for c in cache:
        n = int(getattr(c, "nbytes", 0) or 0)
        held += n
        if isinstance(c, CompressedKVCache):
            full += c.full_cache_nbytes()
        else:
            full += n  # a layer kvcompress does not compress keeps its own cache either way
    return {"held_bytes": int(held), "full_bytes": int(full)}


def _ratio_words(report: dict) -> str:
    """``"4.00x smaller"``, ``"about the same size"`` or ``"1.25x larger"`` (held vs full bytes)."""
    held, full = report["held_bytes"], report["full_bytes"]
    if not held or not full or abs(full / held - 1) < 0.005:
        return "about the same size"
    return f"{full / held:.2f}x smaller" if held < full else f"{held / full:.2f}x larger"


def run(args) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from .errors import ConfigError
    from .factory import make_prompt_cache
    from .persistence import save_prompt_cache

    method = check_args(args)
    text = read_prompt(args)
    continuing = args.prompt_cache_file is not None
    saved = _read_saved_cache(args.prompt_cache_file) if continuing else None
    model, tokenizer = load_model(args.model, pipeline=args.pipeline)
    from .mlxlm.distributed import world

    group = world()
    quiet = group is not None and group.rank() != 0  # every rank runs the loop; rank 0 prints

    def say(*a, **kw):
        if not quiet:
            print(*a, **kw)
    if continuing:
        cache = _attach_saved_cache(saved, model, args.prompt_cache_file)
    else:
        cache = make_prompt_cache(model, method, tokenizer=tokenizer)
    prompt = prompt_tokens(tokenizer, text, chat_template=not args.ignore_chat_template,
                           system_prompt=args.system_prompt, continuation=continuing)
    if not prompt:
        raise ConfigError("the prompt is empty: give --prompt some text to continue with")
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    last = None
    for resp in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler,
        prompt_cache=cache, prefill_step_size=args.prefill_step_size,
    ):
        say(resp.text, end="", flush=True)
        last = resp
    say()
    report = cache_report(cache)
    if last is not None:
        say("=" * 10)
        say(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        say(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        say(f"Peak memory: {last.peak_memory:.3f} GB")
    say(f"KV cache: {report['held_bytes'] / 1e6:.3f} MB held vs {report['full_bytes'] / 1e6:.3f} MB "
          f"for a full cache ({_ratio_words(report)})")
    if args.verbose:
        for c in cache:
            if hasattr(c, "diagnostics"):
                say(c.diagnostics)
    if group is not None:  # no rank leaves while another still runs the last queued step
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    if args.save_prompt_cache:
        # the metadata mlx-lm's cache_prompt writes, so `mlx_lm.generate --prompt-cache-file` reads it
        meta = {"model": args.model, "tokenizer_config": json.dumps({})}
        if getattr(tokenizer, "chat_template", None):
            meta["chat_template"] = tokenizer.chat_template
        save_prompt_cache(args.save_prompt_cache, cache, meta)
        say(f"saved cache to {args.save_prompt_cache}")
    return {"report": report}
