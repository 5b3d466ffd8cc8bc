"""Compose a method from registered components by name, inspect it, and generate with it.

    python examples/compose_method.py MODEL [--budget 48]

Builds SnapKV's choice of loser + CaM's gated merge + PyramidKV's per-layer budgets from their
names (the same composition the registry names ``snapkv_merge``), shows how each flat
parameter reached the components, and what a composition that cannot work reports.
"""

from __future__ import annotations

import argparse

import mlx_lm

import kvcompress


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--budget", type=int, default=48, help="mean tokens kept per layer")
    ap.add_argument("--max-tokens", type=int, default=60)
    args = ap.parse_args(argv)

    # One component of each kind, by name; flat parameters go to every component that has them
    # (`recent` sizes SnapKV's observation window, the selector's protected window and the pyramid).
    method = kvcompress.build_method(
        scorer="snapkv", selector="lowest", disposition="gated_merge",
        budget={"name": "pyramid", "budget": args.budget},
        recent=8, n_sink=2, merge="mean", seed=0,
    )
    print(method.describe())

    # A composition whose parts cannot work together fails when it is built, not mid-decode.
    try:
        kvcompress.build_method(scorer="recency", selector="lowest", disposition="gated_merge", budget="uniform")
    except kvcompress.CompositionError as exc:
        print(f"CompositionError: {exc}")

    model, tokenizer = mlx_lm.load(args.model)
    cache = kvcompress.make_prompt_cache(model, method)
    text = mlx_lm.generate(model, tokenizer, "Once upon a time, a little fox", max_tokens=args.max_tokens,
                           prompt_cache=cache)
    print(text)
    layers = [c for c in cache if isinstance(c, kvcompress.CompressedKVCache)]
    print("layer budgets:", [c.budget for c in layers])
    print("tokens kept:  ", [c.tokens_kept for c in layers])
    print("merges:       ", [c.diagnostics["merges"] for c in layers])  # per KV head, from the merge state


if __name__ == "__main__":
    main()
