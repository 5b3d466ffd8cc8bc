"""``kvcompress generate``: mlx_lm.generate with a compressed cache, and what it saved.

Everything that can be checked without the model (option values, the method, file paths) is
checked before the model loads; every problem is a :class:`~kvcompress.ConfigError` naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "add_arguments", "run", "check_args", "cache_report", "prompt_tokens",
    "load_model",
]

#: options that choose the method; refused with --prompt-cache-file (the file holds the method)
METHOD_OPTIONS = ("method", "budget", "config", "param", "kv_bits", "kv_group_size")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ((lo < value if lo_open else lo <= value) and value <= hi):
            want = f">= {lo:g}" if hi == float("inf") else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a number {want}, got {text!r}")
        return value

    return parse


def seed_int(text: str) -> int:
    """argparse type: a sampling seed, an int in [0, 2**64) (what ``mx.random.seed`` takes)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64 - 1], got {text!r}")
    return value


_PY_WORDS = {"True": True, "False": False, "None": None}


def param_value(raw: str) -> Any:
    """A parameter's command-line value: JSON (``8``, ``0.5``, ``true``, ``[1, 2]``), Python's
    ``True`` / ``False`` / ``None`` as written in the method tables, else the string itself."""
    raw = raw.strip()
    if raw in _PY_WORDS:
        return _PY_WORDS[raw]
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _param(text: str) -> tuple[str, Any]:
    """argparse type: ``NAME=VALUE``, the value as :func:`param_value` reads it."""
    name, eq, raw = text.partition("=")
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), param_value(raw)


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    """``--method/--budget/--config/--param``: the compression, as every command takes it."""
    p.add_argument("--method", default=None, help="a registered method (default cam; see kvcompress methods)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="the method's budget parameter: tokens kept per layer, or the mean over "
                        "layers for per-layer budgets (pyramid, squeeze)")
    p.add_argument("--config", default=None, help="TOML/JSON method config (instead of --method)")
    p.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                   help="extra method parameter, e.g. --param n_sink=4 (repeatable)")
    p.add_argument("--kv-bits", default=None, metavar="BITS",
                   help="store the kept keys and values in low bits: 2, 3, 4, 5, 6 or 8, or keys,values "
                        "(8,4 or K8V4); every kept slot from the first token (default: the model's dtype)")
    p.add_argument("--kv-group-size", default=None, metavar="N",
                   help="with --kv-bits: entries per scale and bias, 32, 64 or 128 (default 64); must "
                        "divide the model's head dimension")
    # mlx-lm's option, refused with a reason (kvcompress quantizes from the first token)
    p.add_argument("--quantized-kv-start", default=None, help=argparse.SUPPRESS)


def method_from_args(args):
    """The method ``--method/--budget/--config/--param`` and ``--kv-bits/--kv-group-size``
    describe (ConfigError if they cannot). The storage options are the method's (its
    ``storage``), never mlx-lm's ``kv_bits``, which would quantize a full cache."""
    from .config import load_config
    from .errors import ConfigError
    from .method import build_method
    from .storage import option_params

    if args.config and args.method:
        raise ConfigError("give either --method or --config, not both")
    if getattr(args, "quantized_kv_start", None) is not None:
        raise ConfigError("--quantized-kv-start is mlx-lm's; kvcompress stores every kept slot in low bits from "
                          "the first token (--kv-bits), so there is no start to choose: drop it")
    params = dict(args.param)
    if args.budget is not None:
        params["budget"] = args.budget
    group = getattr(args, "kv_group_size", None)
    params.update(option_params(getattr(args, "kv_bits", None), group, params))
    method = build_method(load_config(args.config) if args.config else (args.method or "cam"), **params)
    if group is not None and not method.storage.quantized:
        raise ConfigError("--kv-group-size sets the groups of low-bit storage; give --kv-bits too")
    return method


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
        cache = make_prompt_cache(model, method)
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
