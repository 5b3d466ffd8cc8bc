"""Prefill a prompt into a compressed cache once, save it, and continue from the saved file.

    python examples/save_load_cache.py MODEL [--method h2o] [--budget 32] [--file cache.safetensors]

Compressed caches use mlx-lm's file format and loader (mlx-lm's own ``load_prompt_cache`` reads
them); every file carries a digest over its layers and metadata that both loaders check, so a
damaged file is refused. ``mlx_lm.generate`` continues a loaded cache exactly (in a fresh process
too). ``kvcompress generate --save-prompt-cache FILE`` / ``--prompt-cache-file FILE`` do the same.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import mlx_lm

import kvcompress

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big red ball under a tree. She ran to the ball and kicked it high."
)


def continue_from(model, tokenizer, cache, text: str, n: int, first: bool = False) -> str:
    """Feed ``text`` after what ``cache`` holds (BOS only at the very start) and generate ``n`` tokens."""
    tokens = tokenizer.encode(text, add_special_tokens=first)
    return mlx_lm.generate(model, tokenizer, tokens, max_tokens=n, prompt_cache=cache)


def main(argv=None) -> bool:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--method", default="h2o")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--file", default=None, help="where to save (default: a temporary file)")
    ap.add_argument("--max-tokens", type=int, default=30)
    args = ap.parse_args(argv)

    model, tokenizer = mlx_lm.load(args.model)
    cache = kvcompress.make_prompt_cache(model, args.method, budget=args.budget)
    continue_from(model, tokenizer, cache, STORY, 1, first=True)  # prefill the story (one token generated)

    tmp = None
    path = args.file
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, "story.safetensors")
    kvcompress.save_prompt_cache(path, cache, metadata={"method": args.method})
    loaded, meta = kvcompress.load_prompt_cache(path, return_metadata=True)
    first = next(c for c in loaded if isinstance(c, kvcompress.CompressedKVCache))
    print(f"saved {os.path.getsize(path)} bytes; loaded {len(loaded)} layers, method {meta['method']}, "
          f"{first.tokens_kept} of {first.offset} tokens kept per layer")

    a = continue_from(model, tokenizer, cache, " Then", args.max_tokens)
    b = continue_from(model, tokenizer, loaded, " Then", args.max_tokens)
    print(f"original: {a!r}")
    print(f"loaded:   {b!r}")
    print(f"continuations identical: {a == b}")
    if tmp is not None:
        tmp.cleanup()
    return a == b


if __name__ == "__main__":
    main()
