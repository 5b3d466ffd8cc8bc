#!/usr/bin/env python
"""Train the small retrieval model shipped in ``kvcompress/assets/retrieval``.

A Llama-style mlx-lm model (``mlx_lm.models.llama``) learns the two synthetic tasks of
:mod:`kvcompress.bench.retrieval_data` -- passkey retrieval and multi-query associative recall
hidden in filler sentences -- from freshly generated, seeded episodes (no data files).

Recipe (defaults; the shipped model): 2 layers, hidden 64, 4 query heads / 2 KV heads
(head_dim 16), SwiGLU 128, tied embeddings, RoPE theta 10000 -- 78,656 parameters. AdamW
(lr 3e-3, weight decay 0.01, 200 linear warm-up steps, cosine decay to 5% over ``--steps``),
gradient norm clipped to 1, about 8k tokens per step (batch ``32 * 256 / length``).
Loss: cross-entropy on every next token, answer tokens weighted 1 and all other tokens 0.1
(the haystack is mostly unpredictable filler; a small weight keeps the model a language model
of it without drowning the answer signal).
Curriculum: context lengths (multiples of 64, so ``mx.compile`` sees few shapes) grow from
``--min-len`` 64 to ``--max-len`` 512 over the first half of training. For the first
``--copy-steps`` (600) steps one step in four is the *copy* task (a random letter/digit string
repeated; every repeat is supervised), which makes the induction-style copy circuit form early;
the other steps cycle mqar, passkey, mqar. Training stops at the first evaluation after half
of ``--steps`` where every task reaches ``--target`` (0.97).

Accuracy is measured teacher-forced (all answer tokens of a question right under the full
causal context; equals greedy exact match when the earlier answers are right) on 64 held-out
episodes per task at ``--eval-len``; training episodes come from a separate seed stream.
The shipped model stopped at step 1150 after 859 s on 2 shared CPU cores (passkey 0.984,
mqar 1.000); ``training.json`` next to the weights has the whole history.

Run: ``LD_PRELOAD=.../libopenblas.so.0 python scripts/train_retrieval_model.py`` (OpenBLAS is
what makes MLX's CPU matmuls fast on Linux; the script restarts itself with it when found).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from kvcompress._blas import reexec_with_openblas
from kvcompress.bench.retrieval_data import (
    TASKS,
    VOCAB,
    batch_tokens,
    hf_tokenizer_json,
    make_sample,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "kvcompress" / "assets" / "retrieval"
TRAIN_SEED_OFFSET = 1_000_000  # training episodes use seeds >= this; evaluation uses small seeds


def model_args(a) -> llama.ModelArgs:
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        intermediate_size=2 * a.hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=len(VOCAB),
        max_position_embeddings=a.max_len + 64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )


def draw_batch(rng: np.random.Generator, task: str, length: int, batch: int):
    if task == "mqar":
        hi = min(10, length // 16)
        kw = {"n_pairs": int(rng.integers(min(6, hi), hi + 1)), "n_queries": 8}
    elif task == "copy":
        kw = {"span": int(rng.choice([8, 16, 24, 32]))}
    else:
        kw = {}
    samples = [make_sample(task, rng, length, **kw) for _ in range(batch)]
    x, y, w = batch_tokens(samples)
    return mx.array(x), mx.array(y), mx.array(w)


def loss_fn(model, x, y, w):
    ce = nn.losses.cross_entropy(model(x), y, reduction="none")
    return (ce * w).sum() / w.sum()


def answer_accuracy(model, task: str, length: int, n: int, seed: int) -> float:
    """Fraction of questions whose answer tokens are all argmax-correct (teacher-forced)."""
    rng = np.random.default_rng(seed)
    samples = [make_sample(task, rng, length) for _ in range(n)]
    toks = np.array([s.tokens() for s in samples], dtype=np.int32)
    pred = np.array(mx.argmax(model(mx.array(toks[:, :-1])), axis=-1))
    ok, total = 0, 0
    for s, p, t in zip(samples, pred, toks[:, 1:]):
        pos = len(s.context) - 1  # p[i] predicts token i + 1
        for q, a in s.rounds:
            pos += len(q)
            sl = slice(pos, pos + len(a))
            ok += int(np.array_equal(p[sl], t[sl]))
            total += 1
            pos += len(a)
    return ok / total


def save(model, args: llama.ModelArgs, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {k: v for k, v in vars(args).items() if v is not None}
    config.update({"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
                   "pad_token_id": 0, "torch_dtype": "float32", "head_dim": args.hidden_size // args.num_attention_heads})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(hf_tokenizer_json(), indent=1) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<pad>", "add_bos_token": True,
        "model_max_length": args.max_position_embeddings, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--eval-len", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument("--copy-steps", type=int, default=600,
                   help="steps during which the copy task is mixed in (1 step in 4)")
    p.add_argument("--target", type=float, default=0.97, help="stop once every task reaches this")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    reexec_with_openblas([__file__, *(sys.argv[1:] if argv is None else argv)])

    mx.random.seed(a.seed)
    rng = np.random.default_rng(TRAIN_SEED_OFFSET + a.seed)
    margs = model_args(a)
    model = llama.Model(margs)
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params:,} parameters", flush=True)

    sched = optim.join_schedules(
        [optim.linear_schedule(1e-5, a.lr, a.warmup),
         optim.cosine_decay(a.lr, max(a.steps - a.warmup, 1), a.lr * 0.05)],
        [a.warmup],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y, w):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y, w)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    tasks = sorted(TASKS)
    early = ["copy", "mqar", "passkey", "mqar"]  # mqar is the harder task: half the steps
    late = ["mqar", "passkey", "mqar"]
    t0 = time.time()
    history = []
    ema = None
    for it in range(1, a.steps + 1):
        frac = min(1.0, it / (0.5 * a.steps))
        top = a.min_len + frac * (a.max_len - a.min_len)
        buckets = list(range(a.min_len, int(top) + 1, 64)) or [a.min_len]
        length = int(rng.choice(buckets))
        task = early[it % len(early)] if it <= a.copy_steps else late[it % len(late)]
        batch = max(8, a.batch * 256 // length)
        x, y, w = draw_batch(rng, task, length, batch)
        loss = step(x, y, w)
        mx.eval(state)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if it % a.eval_every == 0 or it == a.steps:
            acc = {t: answer_accuracy(model, t, a.eval_len, a.eval_n, seed=i) for i, t in enumerate(tasks)}
            el = time.time() - t0
            history.append({"step": it, "seconds": round(el, 1), "loss": round(ema, 4), **acc})
            print(f"step {it:5d}  {el:6.0f}s  max_len {int(top):4d}  loss {ema:.4f}  "
                  + "  ".join(f"{t} {v:.3f}" for t, v in acc.items()), flush=True)
            save(model, margs, a.out, {"step": it, "history": history})  # checkpoint
            if it >= 0.5 * a.steps and min(acc.values()) >= a.target:
                break
    meta = {"recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "out"},
            "parameters": n_params, "train_seconds": round(time.time() - t0, 1),
            "mlx": mx.__version__, "history": history}
    save(model, margs, a.out, meta)
    print(f"saved to {a.out} after {meta['train_seconds']}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
