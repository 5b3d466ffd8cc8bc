"""Run under ``mlx.launch``: greedy generation with every given method on a sharded model.

Usage: ``python dist_worker.py MODEL_DIR {tp,pp} OUT_DIR BUDGET N_TOKENS METHOD [METHOD ...]``
(``tp-agree`` / ``pp-agree``: the METHODs name :data:`AGREE_CASES`). Each rank writes ``OUT_DIR/rank<r>.json``: per method the generated tokens and, per compressed
layer (global index), the sorted token positions each local KV head holds, plus the head offset.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx


def run(model, prompt, method: str, budget: int, n: int) -> dict:
    """``method`` is a name, or ``name:k=v,...`` for non-default integer parameters."""
    import kvcompress
    from mlx_lm.generate import generate_step

    name, _, extra = method.partition(":")
    params = {k: int(v) for k, v in (kv.split("=") for kv in extra.split(",") if kv)}
    cache, last = None, None
    for b in range(budget, budget + 64):  # the smallest budget >= `budget` the method accepts
        try:
            cache = kvcompress.make_prompt_cache(model, name, budget=b, **params)
            break
        except kvcompress.ConfigError as exc:
            last = exc
    if cache is None:
        raise kvcompress.ConfigError(f"{method}: no budget in [{budget}, {budget + 64}) accepted (last: {last})")
    tokens = [t for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache, prefill_step_size=16)]
    layers = {}
    for c in cache:
        if isinstance(c, kvcompress.CompressedKVCache) and c.keys is not None:
            pos = sorted_positions(c)
            layers[str(c.info.layer)] = {"positions": pos, "head_offset": c.info.head_offset}
    return {"tokens": tokens, "layers": layers}


#: agreement cases: ranks that build differently (or that one rank refuses), then one that agrees
AGREE_CASES = {
    "methods": lambda r: ("h2o" if r == 0 else "tova", {"budget": 40}),
    "budgets": lambda r: ("h2o", {"budget": 40 + r}),
    "reuse": lambda r: ("chunkkv", {"budget": 80, "reuse_layers": 3}),
    "agreed": lambda r: ("h2o", {"budget": 40}),
}


def agree_case(model, prompt, case: str, rank: int, n: int) -> dict:
    """Build case ``case``'s cache on this rank: ``{"error": ...}`` or the greedy tokens."""
    import kvcompress
    from mlx_lm.generate import generate_step

    name, params = AGREE_CASES[case](rank)
    try:
        cache = kvcompress.make_prompt_cache(model, name, **params)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"tokens": [t for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache)]}


def sorted_positions(c) -> list:
    import numpy as np

    pos = np.array(c.head_view()[2])[0]  # [H, T] per KV head (head-wise budgets gather each head's slots)
    return [sorted(int(p) for p in row if p >= 0) for row in pos]


def main() -> None:
    from mlx_lm.utils import sharded_load

    model_dir, mode, out_dir, budget, n = sys.argv[1:6]
    methods = sys.argv[6:]
    group = mx.distributed.init()
    mode, _, agreeing = mode.partition("-")  # "tp-agree": run AGREE_CASES named by the methods
    model, _ = sharded_load(model_dir, pipeline_group=group if mode == "pp" else None,
                            tensor_group=group if mode == "tp" else None)
    prompt = mx.array(json.load(open(f"{model_dir}/prompt.json")))
    out = {"rank": group.rank(), "size": group.size(), "methods": {}}
    for m in methods:
        print(f"rank {group.rank()}: {m}", file=sys.stderr, flush=True)
        if agreeing:
            out["methods"][m] = agree_case(model, prompt, m, group.rank(), int(n))
            continue
        try:
            out["methods"][m] = run(model, prompt, m, int(budget), int(n))
        except Exception as exc:  # reported to the test, which decides
            out["methods"][m] = {"error": f"{type(exc).__name__}: {exc}"}
            import traceback

            traceback.print_exc()
            print(f"rank {group.rank()}: {m} failed: {exc}", file=sys.stderr, flush=True)
    # no rank leaves while another still runs the last step mlx-lm's generate_step queued
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    with open(f"{out_dir}/rank{group.rank()}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
