"""Compressed caches on several ranks: what compression adds to the traffic, and decode speed.

Under tensor parallelism a per-KV-head method (H2O, CaM, SnapKV, KIVI, StreamingLLM) needs no
communication: each rank decides for its own heads. A decision over all heads of a layer (TOVA's
head mean) or over a KV cache every rank holds while the query heads are split (MLA) needs the
ranks to agree their scores: kvcompress does it in **one** ``all_sum`` per decode step for all
layers (step ``t``'s scores are agreed at the start of step ``t + 1``, before any layer evicts).
Under pipeline parallelism whole layers are local: nothing is added (a data-driven budget such as
SqueezeAttention's gathers every layer's statistics once per prompt).

The workload runs 2 ranks on loopback (``mlx.launch --backend ring``) for a tensor-parallel Llama,
a pipeline-parallel Qwen2 and a tensor-parallel MLA model (random weights, the embedded retrieval
tokenizer), and measures, per method against mlx-lm's uncompressed cache in the same run
(interleaved decode blocks): decode tokens/s, and kvcompress's collectives and bytes per decode
step next to the model's own tensor-parallel traffic. It then projects the bytes per step for
Llama-3-8B and DeepSeek-V3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._options import NameList, add_output_arguments, check_minimums, out_dir, settings_from_args
from ._report import caption, finish, machine_info, print_table, pyplot, save_plot, write_json

__all__ = ["add_arguments", "run", "run_distributed", "write_model", "projections", "DEFAULTS", "QUICK"]

DEFAULTS: dict[str, Any] = {
    "context": 1024, "budget": 128, "methods": ("h2o", "snapkv", "tova"), "blocks": 3, "block_tokens": 16,
    "prefill_step_size": 256, "hidden": 256, "n_layers": 8, "ranks": 2,
}
QUICK = {"context": 96, "budget": 48, "blocks": 2, "block_tokens": 4, "prefill_step_size": 32, "hidden": 64,
         "n_layers": 2}
CONFIGS = (("llama", "tp"), ("qwen2", "pp"), ("mla", "tp"))
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "retrieval"
#: public shapes for the projection: layers, KV heads (None: MLA latent), hidden, dtype bytes
PROJECTED = {"Llama-3-8B": (32, 8, 4096, 2), "DeepSeek-V3 (MLA)": (61, None, 7168, 2)}


def write_model(kind: str, folder: Path, hidden: int = 64, n_layers: int = 4, seed: int = 0) -> Path:
    """A random-weight mlx-lm model folder (``llama``, ``qwen2`` or ``mla``: DeepSeek-V3) with the
    embedded retrieval tokenizer; weights scaled up so greedy decoding is not one repeated token."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import deepseek_v3, llama, qwen2
    from mlx_lm.utils import save_config, save_model

    mx.random.seed(seed)
    if kind == "mla":
        args = deepseek_v3.ModelArgs(
            vocab_size=72, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=32,
            num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
            q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=None,
            first_k_dense_replace=n_layers)
        model = deepseek_v3.Model(args)
    else:
        mod = llama if kind == "llama" else qwen2
        args = mod.ModelArgs(model_type=kind, hidden_size=hidden, num_hidden_layers=n_layers,
                             intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=4,
                             rms_norm_eps=1e-5, vocab_size=72, rope_theta=10000.0, tie_word_embeddings=True)
        model = mod.Model(args)
    model.update(tree_map(lambda p: p * 8 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    cfg = {k: v for k, v in vars(args).items() if not k.startswith("_") and v is not None}
    cfg.setdefault("max_position_embeddings", 4096)
    save_config(cfg, folder / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, folder / f)
    return folder


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def _model_bytes(kind: str, mode: str, s: dict, ranks: int) -> int:
    """The model's own collective payload per decode token (bf16-free: float32 random models)."""
    if mode == "tp":  # attention o_proj and MLP down_proj: one all_sum of [1, hidden] each per layer
        return 2 * s["n_layers"] * s["hidden"] * 4
    return (ranks - 1) * s["hidden"] * 4 + ranks * s["hidden"] * 4  # hand-off + final all_gather


def projections(budgets=(1024, 4096), tp=2) -> list:
    """Bytes per decode token kvcompress adds vs the model's own tensor-parallel all_sums."""
    rows = []
    for name, (layers, kv_heads, hidden, item) in PROJECTED.items():
        model = 2 * layers * hidden * item
        for c in budgets:
            shared = layers * c * 4  # one head row of float32 scores per layer
            per_head = 0 if kv_heads else shared  # MLA: every scorer agrees its one latent row
            rows.append({"model": name, "tp": tp, "budget": c, "model_bytes": model,
                         "per_head_method_bytes": per_head, "head_shared_method_bytes": shared,
                         "collectives_added": 1, "model_collectives": 2 * layers})
    return rows


def run_distributed(settings: dict, progress=print) -> dict:
    s = {**DEFAULTS, **settings}
    check_minimums(s, {k: 1 for k in ("context", "budget", "blocks", "block_tokens", "prefill_step_size",
                                      "hidden", "n_layers")})
    if s["hidden"] % 16:  # write_model's Llama/Qwen2: 8 attention heads of an even size (RoPE)
        raise ValueError(f"hidden must be a multiple of 16 (the random models: 8 attention heads of an even "
                         f"size), got {s['hidden']}")
    from kvcompress import build_method

    for m in s["methods"]:
        sel = build_method(m, budget=s["budget"]).selector
        if sel.reserved(s["budget"]) >= s["budget"]:
            raise ValueError(f"budget {s['budget']} leaves {m} no room to evict (it always keeps "
                             f"{sel.reserved(s['budget'])} tokens); use a larger --budget")
    if s["ranks"] != 2:
        raise ValueError(f"ranks must be 2 (loopback ring), got {s['ranks']}")
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        raise ValueError("mlx.launch is not on PATH (it comes with mlx)")
    t0 = time.perf_counter()
    configs = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, mode in CONFIGS:
            folder = write_model(kind, Path(tmp) / kind, s["hidden"], s["n_layers"])
            out = Path(tmp) / f"{kind}.json"
            progress(f"{kind} ({mode}) on {s['ranks']} ranks ...")
            worker = Path(__file__).with_name("_dist_worker.py")
            cmd = [launcher, "-n", str(s["ranks"]), "--backend", "ring", "--python", sys.executable, str(worker),
                   str(folder), mode, str(out), json.dumps({**s, "methods": list(s["methods"])})]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if not out.exists():
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-12:])
                raise RuntimeError(f"mlx.launch failed for {kind}:\n{tail}")
            res = json.loads(out.read_text())
            full = res["runs"]["full"]
            rows = []
            for name, run in res["runs"].items():
                ratios = [f / m for f, m in zip(full["seconds"], run["seconds"])]
                rows.append({
                    "cache": name, "tok_s": s["block_tokens"] / _median(run["seconds"]),
                    "decode_vs_full": _median(ratios), "collectives_per_step": run["calls"] / run["steps"],
                    "bytes_per_step": run["bytes"] / run["steps"],
                })
            configs.append({"model": kind, "mode": mode, "model_bytes_per_step": _model_bytes(kind, mode, s, s["ranks"]),
                            "rows": rows})
    return {"benchmark": "distributed", "machine": machine_info(), "settings": {**s, "methods": list(s["methods"])},
            "configs": configs, "projections": projections(), "seconds_total": round(time.perf_counter() - t0, 1)}


def plot_distributed(payload: dict, path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for i, cfg in enumerate(payload["configs"]):
        names = [r["cache"] for r in cfg["rows"]]
        xs = [j + 0.27 * i for j in range(len(names))]
        ax.bar(xs, [r["decode_vs_full"] for r in cfg["rows"]], width=0.27, label=f"{cfg['model']} ({cfg['mode']})")
        ax.set_xticks([j + 0.27 for j in range(len(names))], names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("decode tokens/s vs uncompressed (2 ranks)")
    ax.legend(fontsize=8)
    ax = axes[1]
    proj = payload["projections"]
    labels = [f"{p['model']}\nC={p['budget']}" for p in proj]
    xs = range(len(proj))
    ax.bar([x - 0.27 for x in xs], [p["model_bytes"] for p in proj], width=0.27, label="model's own all_sums")
    ax.bar(list(xs), [max(p["per_head_method_bytes"], 1) for p in proj], width=0.27, label="per-KV-head methods")
    ax.bar([x + 0.27 for x in xs], [p["head_shared_method_bytes"] for p in proj], width=0.27,
           label="head-shared scores (TOVA)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("bytes per decode token, TP=2 (projected)")
    ax.legend(fontsize=8)
    return save_plot(fig, path, caption(payload, ["context", "budget", "hidden", "n_layers"],
                                        lead="kvcompress bench distributed"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--context", type=int, help="prompt tokens (default 1024)")
    parser.add_argument("--budget", type=int, help="tokens kept per layer (default 128)")
    parser.add_argument("--methods", nargs="+", action=NameList, metavar="METHOD",
                        help="methods, by commas or spaces (default h2o,snapkv,tova)")
    parser.add_argument("--blocks", type=int, help="interleaved decode blocks (default 3)")
    parser.add_argument("--block-tokens", type=int, help="decode tokens per block (default 16)")
    parser.add_argument("--hidden", type=int, help="hidden size of the random models (default 256)")
    parser.add_argument("--n-layers", type=int, help="layers of the random models (default 8)")
    add_output_arguments(parser, "distributed.json/.png")


def run(args) -> dict:
    s = settings_from_args(args, {**DEFAULTS, "out": None}, QUICK)
    s.pop("out", None)
    payload = run_distributed(s, progress=lambda m: print(m, file=sys.stderr, flush=True))
    rows = [[c["model"], c["mode"], r["cache"], r["tok_s"], r["decode_vs_full"], r["collectives_per_step"],
             r["bytes_per_step"], c["model_bytes_per_step"]] for c in payload["configs"] for r in c["rows"]]
    print_table("Decode on 2 ranks (loopback), kvcompress's collectives per step",
                ["model", "parallel", "cache", "tok/s", "vs full", "collectives/step", "bytes/step",
                 "model bytes/step"], rows, plain=args.plain)
    proj = [[p["model"], p["budget"], p["model_bytes"], p["per_head_method_bytes"], p["head_shared_method_bytes"]]
            for p in payload["projections"]]
    print_table("Projected bytes per decode token, tensor parallel (2 ranks)",
                ["model", "budget", "model all_sums", "per-KV-head method", "head-shared method"], proj,
                plain=args.plain)
    path = out_dir(args) / "distributed.json"
    write_json(path, payload)
    finish(payload, path, plot_distributed, args)
    return payload
