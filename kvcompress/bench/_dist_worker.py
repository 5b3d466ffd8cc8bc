"""One rank of ``kvcompress bench distributed`` (run by ``mlx.launch``; see distributed.py).

Usage: ``python _dist_worker.py MODEL_DIR {tp,pp} OUT_JSON SETTINGS_JSON``. Each configuration
(``full`` = mlx-lm's KVCache, or a method at the budget) prefills the same prompt, then decodes
in interleaved blocks; for each it records decode seconds per block and the collectives
kvcompress issued per decode step (:data:`kvcompress.mlxlm.distributed.STATS`).
"""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache as mlx_cache
    from mlx_lm.utils import sharded_load

    import kvcompress
    from kvcompress.mlxlm.distributed import STATS

    model_dir, mode, out, settings = sys.argv[1:5]
    s = json.loads(settings)
    group = mx.distributed.init()
    model, _ = sharded_load(model_dir, pipeline_group=group if mode == "pp" else None,
                            tensor_group=group if mode == "tp" else None)
    prompt = mx.array([(7 * i + 3) % 60 + 3 for i in range(s["context"])])[None]
    runs = {}
    for name in ["full", *s["methods"]]:
        cache = mlx_cache(model) if name == "full" else kvcompress.make_prompt_cache(model, name, budget=s["budget"])
        for i in range(0, s["context"], s["prefill_step_size"]):
            model(prompt[:, i : i + s["prefill_step_size"]], cache=cache)
            mx.eval([c.state for c in cache])
        runs[name] = {"cache": cache, "y": prompt[:, -1:], "seconds": [], "calls": 0, "bytes": 0, "steps": 0}
    for _ in range(s["blocks"]):
        for name, r in runs.items():
            calls, nbytes = STATS["calls"], STATS["bytes"]
            t0 = time.perf_counter()
            y = r["y"]
            for _ in range(s["block_tokens"]):
                logits = model(y, cache=r["cache"])
                y = mx.argmax(logits[:, -1:], axis=-1)
                mx.eval(y)
            r["seconds"].append(time.perf_counter() - t0)
            r["y"] = y
            r["calls"] += STATS["calls"] - calls
            r["bytes"] += STATS["bytes"] - nbytes
            r["steps"] += s["block_tokens"]
    result = {
        "rank": group.rank(),
        "size": group.size(),
        "runs": {n: {k: v for k, v in r.items() if k not in ("cache", "y")} for n, r in runs.items()},
    }
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    if group.rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
