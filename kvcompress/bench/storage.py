"""Low-bit storage of the kept slots (``kv_bits``): decode speed and bytes against float storage.

For each method and each storage (float, then every ``--kv-bits``), the same prompt of
``context`` tokens is prefilled into the method's cache at ``budget`` tokens per layer; then
greedy decode steps are timed in blocks of ``k`` synchronous steps, round-robin over every
(method, storage) cache with the order rotated each block, so that all of them share the
machine's noise. Reported per cache:

* ``decode_ratio``: the median over blocks of the paired ratio *float-storage time / this
  storage's time* of the same method (speed, higher is better; the target is >= 0.8);
* ``kv_bytes``: what the cache holds (codes, scales and biases, positions, scores, states), and
  ``vs_fp16``: the bytes a full float16 ``KVCache`` holds for the same tokens divided by it.

The model is an mlx-lm model folder (``--model``, dequantized after loading, random prompt ids
from its vocabulary) or a seeded random Llama with head_dim 64. Quality (accuracy, perplexity)
with low-bit storage comes from the long-context workloads: ``kvcompress bench longctx
--variant snapkv:kv_bits=4`` and ``kvcompress bench longppl --variant snapkv:kv_bits=8``.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from ..factory import make_prompt_cache
from ..storage import KVStorage
from ._caches import live_kv_bytes
from ._harness import interleave, median, paired, prefill, release, sync_stepper
from ._model import ModelShape, build_model, random_tokens
from ._options import NameList, add_output_arguments, check_minimums
from ._options import settings_from_args as _settings_from_args
from ._report import finish, machine_info, print_table, pyplot, save_plot, warn_openblas, write_json

__all__ = ["DEFAULTS", "QUICK", "run_storage", "add_arguments", "run"]

DEFAULTS: dict[str, Any] = {
    "model": None, "context": 4096, "budget": 1024, "methods": ("snapkv", "h2o", "kvzip"), "kv_bits": ("8", "4"),
    "kv_group_size": 64, "decode_tokens": 8, "blocks": 6, "prefill_step_size": 512, "n_layers": 8, "out": None,
}
QUICK: dict[str, Any] = {"context": 384, "budget": 96, "methods": ("snapkv", "h2o"), "decode_tokens": 4, "blocks": 3,
                         "n_layers": 2, "prefill_step_size": 128}


def _model(s: dict):
    if s["model"]:
        from .longctx import load_chat_model

        model, tok = load_chat_model(s["model"])
        return model, int(tok.vocab_size) if hasattr(tok, "vocab_size") else 32000
    shape = ModelShape(n_layers=s["n_layers"], hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, intermediate=1024)
    return build_model(shape), shape.vocab


def _fp16_full_bytes(cache: list) -> int:
    """What mlx-lm's float16 ``KVCache`` holds for the tokens these layers saw."""
    return sum(c.full_cache_nbytes() * 2 // c.keys.dtype.size for c in cache)


def run_storage(s: dict, progress: bool = False) -> dict:
    """Measure every (method, storage) cache side by side; returns the JSON payload."""
    t_start = time.perf_counter()
    model, vocab = _model(s)
    ids = random_tokens(ModelShape(vocab=vocab), s["context"])
    storages = [None, *s["kv_bits"]]
    caches, steppers, rows = {}, {}, []
    for method in s["methods"]:
        for bits in storages:
            kw = {} if bits is None else {"kv_bits": bits, "kv_group_size": s["kv_group_size"]}
            name = f"{method}|{'float' if bits is None else KVStorage.of(bits, s['kv_group_size']).describe()}"
            cache = make_prompt_cache(model, method, budget=s["budget"], **kw)
            prefill(model, cache, ids, 0, s["context"] - 1, s["prefill_step_size"])
            caches[name] = cache
            steppers[name] = sync_stepper(model, cache, ids[None, -1:])
            if progress:
                print(f"prefilled {name}", flush=True)
    for step in steppers.values():  # one untimed step each (compiles, builds the low-bit kernel)
        step()
    times = interleave(steppers, s["blocks"], s["decode_tokens"])
    for name, cache in caches.items():
        method, held = name.split("|")
        ref = times[f"{method}|float"]
        nbytes = live_kv_bytes(cache)
        rows.append({
            "method": method, "storage": held, "decode_tok_s": 1.0 / median(times[name]),
            "decode_ratio": median(paired(times[name], ref, invert=True)),
            "decode_ratio_range": [min(paired(times[name], ref, invert=True)), max(paired(times[name], ref, invert=True))],
            "kv_bytes": nbytes, "vs_fp16": _fp16_full_bytes(cache) / nbytes,
        })
    release()
    return {"benchmark": "storage", "machine": machine_info(), "settings": dict(s), "results": rows,
            "seconds_total": round(time.perf_counter() - t_start, 1)}


def results_table(payload: dict) -> tuple[list, list]:
    cols = ["method", "storage", "decode tok/s", "decode vs float (median)", "range", "KV bytes", "full fp16 / bytes"]
    rows = [[r["method"], r["storage"], r["decode_tok_s"], r["decode_ratio"],
             "{:.2f}..{:.2f}".format(*r["decode_ratio_range"]), r["kv_bytes"], r["vs_fp16"]] for r in payload["results"]]
    return cols, rows


def plot_storage(payload: dict, path):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['method']}\n{r['storage']}" for r in payload["results"]]
    a.bar(labels, [r["decode_ratio"] for r in payload["results"]], color="tab:blue")
    a.axhline(0.8, color="tab:red", lw=1, ls="--")
    a.set_ylabel("decode speed vs float storage (paired)")
    b.bar(labels, [r["vs_fp16"] for r in payload["results"]], color="tab:green")
    b.set_ylabel("full float16 cache bytes / cache bytes")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7)
    st = payload["settings"]
    return save_plot(fig, path, f"kv_bits storage: context {st['context']}, budget {st['budget']}")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny random model and context (seconds)")
    parser.add_argument("--model", help="mlx-lm model folder or HF id (default: a random head_dim-64 Llama)")
    parser.add_argument("--context", type=int, help="prompt tokens (default 4096)")
    parser.add_argument("--budget", type=int, help="tokens kept per layer (default 1024)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default: snapkv h2o kvzip)")
    parser.add_argument("--kv-bits", dest="kv_bits", nargs="+", metavar="BITS",
                        help="storages to compare with float: 8, 4, 8,4 (K8V4) ... (default: 8 4)")
    parser.add_argument("--kv-group-size", dest="kv_group_size", type=int, help="entries per scale (default 64)")
    parser.add_argument("--decode-tokens", dest="decode_tokens", type=int, help="decode steps per block (default 8)")
    parser.add_argument("--blocks", type=int, help="timed blocks per cache, round-robin (default 6)")
    parser.add_argument("--prefill-step-size", dest="prefill_step_size", type=int, help="prefill chunk (default 512)")
    parser.add_argument("--n-layers", dest="n_layers", type=int, help="random model's layers (default 8)")
    add_output_arguments(parser, "storage.json/.png")


def run(args) -> dict:
    """``kvcompress bench storage``: run, write ``<out>/storage.json`` (+ .png), print a table."""
    warn_openblas()
    s = _settings_from_args(args, DEFAULTS, QUICK)
    check_minimums(s, {"context": 16, "budget": 2, "decode_tokens": 2, "blocks": 1, "prefill_step_size": 1, "n_layers": 1})
    s["kv_bits"] = tuple(s["kv_bits"])
    for bits in s["kv_bits"]:
        KVStorage.of(bits, s["kv_group_size"])  # a bad value stops here, naming the valid ones
    payload = run_storage(s, progress=True)
    from pathlib import Path

    out = Path(s["out"] or "kvcompress-results")
    out.mkdir(parents=True, exist_ok=True)
    path = write_json(out / "storage.json", payload)
    cols, rows = results_table(payload)
    print_table(f"Low-bit storage vs float storage (context {s['context']}, budget {s['budget']})", cols, rows,
                plain=getattr(args, "plain", False))
    finish(payload, path, plot_storage, args)
    return payload
