"""From ``mlx_lm.load`` to a compressed generation in three lines.

    python examples/generate_compressed.py MODEL [--method cam] [--budget 64] [--prompt TEXT]

MODEL is a local mlx-lm model folder or a Hugging Face id. On Linux CPUs preload OpenBLAS for
~35x faster matmuls (``kvcompress doctor`` shows whether it is active):
``LD_PRELOAD=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0``.
"""

from __future__ import annotations

import argparse

import mlx_lm

import kvcompress


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--method", default="cam", help="a registered method (kvcompress methods)")
    ap.add_argument("--budget", type=int, default=32, help="tokens kept per layer")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-tokens", type=int, default=100)
    args = ap.parse_args(argv)

    model, tokenizer = mlx_lm.load(args.model)
    cache = kvcompress.make_prompt_cache(model, args.method, budget=args.budget)
    text = mlx_lm.generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens, prompt_cache=cache)

    print(text)
    first = next(c for c in cache if isinstance(c, kvcompress.CompressedKVCache))
    d = first.diagnostics
    print(f"layer {d['layer']}: kept {d['tokens_kept']} of {d['offset']} tokens "
          f"({d['compression_tokens']:.2f}x fewer tokens, {d['compression_bytes']:.2f}x fewer bytes than "
          f"mlx-lm's KVCache), {d['evictions']} evicted, {d.get('merges', 0.0):.1f} merged per KV head, "
          f"scores from {d['score_source']}")
    return text


if __name__ == "__main__":
    main()
