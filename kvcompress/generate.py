"""``kvcompress generate``: mlx_lm.generate with a compressed cache, and what it saved."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["add_arguments", "run", "cache_report", "full_cache_bytes"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local mlx-lm model folder or Hugging Face id")
    p.add_argument("--prompt", "-p", default="Once upon a time", help="prompt text ('-' reads stdin)")
    p.add_argument("--method", default=None, help="a registered method (default cam; see kvcompress methods)")
    p.add_argument("--budget", type=int, default=None, help="tokens kept per layer")
    p.add_argument("--config", default=None, help="TOML/JSON method config (instead of --method)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="extra method parameter, e.g. --param n_sink=4 (repeatable)")
    p.add_argument("--max-tokens", "-m", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--prompt-cache-file", default=None,
                   help="load a saved (compressed) cache and continue from it with --prompt")
    p.add_argument("--save-prompt-cache", default=None, help="save the cache after generating")
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--verbose", action="store_true", help="print per-layer cache diagnostics")


def _parse_params(items: list[str]) -> dict[str, Any]:
    import json

    from .errors import ConfigError

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--param expects NAME=VALUE, got {item!r}")
        name, raw = item.split("=", 1)
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def full_cache_bytes(offset: int, keys, values, step: Optional[int] = None) -> int:
    """Bytes mlx-lm's ``KVCache`` holds after ``offset`` tokens with keys/values shaped like
    ``keys``/``values`` ``[B, H, *, D]``: it allocates ``step`` (256) tokens at a time."""
    if step is None:
        from mlx_lm.models.cache import KVCache

        step = KVCache.step
    b, h = keys.shape[:2]
    capacity = -(-int(offset) // step) * step
    return capacity * b * h * (keys.shape[-1] * keys.dtype.size + values.shape[-1] * values.dtype.size)


def cache_report(cache: list) -> dict[str, int]:
    """Bytes the caches hold vs what mlx-lm's own ``KVCache`` would hold for the same tokens."""
    from .cache import CompressedKVCache

    held = full = 0
    for c in cache:
        n = int(getattr(c, "nbytes", 0) or 0)
        held += n
        if isinstance(c, CompressedKVCache):
            if c.keys is not None:
                full += full_cache_bytes(c.offset, c.keys, c.values)
        else:
            full += n  # a layer kvcompress does not compress keeps its own cache either way
    return {"held_bytes": int(held), "full_bytes": int(full)}


def _prompt_tokens(tokenizer, args) -> list[int]:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.ignore_chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else [])
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text)


def run(args) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from .config import load_config
    from .factory import make_prompt_cache
    from .persistence import load_prompt_cache, save_prompt_cache

    model, tokenizer = mlx_lm.load(args.model)
    if args.prompt_cache_file and Path(args.prompt_cache_file).exists():
        cache = load_prompt_cache(args.prompt_cache_file)
        from .attention import install

        install(model)
    else:
        params = _parse_params(args.param)
        if args.budget is not None:
            params["budget"] = args.budget
        if args.config and args.method:
            from .errors import ConfigError

            raise ConfigError("give either --method or --config, not both")
        method = load_config(args.config) if args.config else (args.method or "cam")
        cache = make_prompt_cache(model, method, **params)
    if args.seed is not None:
        mx.random.seed(args.seed)
    prompt = _prompt_tokens(tokenizer, args)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    last = None
    for resp in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler,
        prompt_cache=cache, prefill_step_size=args.prefill_step_size,
    ):
        print(resp.text, end="", flush=True)
        last = resp
    print()
    report = cache_report(cache)
    if last is not None:
        print("=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    ratio = report["full_bytes"] / report["held_bytes"] if report["held_bytes"] else 1.0
    print(f"KV cache: {report['held_bytes'] / 1e6:.3f} MB held vs {report['full_bytes'] / 1e6:.3f} MB "
          f"for a full cache ({ratio:.2f}x smaller)")
    if args.verbose:
        for c in cache:
            if hasattr(c, "diagnostics"):
                print(c.diagnostics)
    if args.save_prompt_cache:
        save_prompt_cache(args.save_prompt_cache, cache)
        print(f"saved cache to {args.save_prompt_cache}")
    return {"report": report}
