"""Decode and prefill speed of compressed caches against mlx-lm's ``RotatingKVCache``.

**Workload.** A random-weight mlx-lm Llama of realistic shape (default 8 layers, hidden 1024,
16 query / 4 KV heads, head_dim 64, MLP 2816, vocab 32000) generates from a seeded random
prompt of ``context`` tokens through ``mlx_lm.generate.generate_step`` -- the chunked prefill
(``prefill_step_size``) and pipelined decode loop ``mlx_lm.generate`` uses. For each cache kind:

* ``prefill_s``: time to the first token (the chunked prefill plus the step of the last prompt
  token);
* ``decode_tok_s``: ``decode_tokens / t`` for the next ``decode_tokens`` tokens.

Kinds: every method in ``methods`` (built with ``kvcompress.make_prompt_cache(model, name,
budget=budget)``), ``rotating`` (``RotatingKVCache(budget, keep=keep)``, the reference the
targets are stated against) and ``full`` (``KVCache``). The query-observing attention wrapper is
installed once for all kinds, so every kind pays the same ``isinstance`` check.

**Protocol.** One untimed warm-up generation per kind, then ``rounds`` rounds. In a round every
kind prefills (order rotated by one per round, round-robin), then the decode of all kinds is
timed in blocks of ``decode_block`` tokens, interleaved kind by kind with the order rotated per
block, so bursts of load from other processes hit every kind alike (the machine this was
written on was shared). Ratios are paired -- prefill per round, decode per (round, block) --
and the reported ratio is their median (decode: tokens/s ratio, higher is better, target
>= 0.9; prefill: time ratio, lower is better, target <= 1.3). The same ratios in CPU seconds of
this process are reported alongside as a cross-check.

**Profile** (:func:`profile_decode`). Where the decode time of the compressed caches goes:
(a) per-step decode time of the model with eviction and/or scoring switched off
(``no_evict``: the layer budgets are raised after prefill, so nothing is evicted and tokens
are appended instead; ``no_score``: the scorer is replaced by one that leaves scores
unchanged), (b) a per-layer micro-benchmark of one decode step and of one prefill chunk of one
cache (update + the model's SDPA + observe) and of each component alone, and (c) the number of
MLX primitives one decode step of the cache adds to a layer, counted on the lazy graph with
``mx.export_to_dot``. All timings in the profile are interleaved across variants too.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import tempfile
import time
from typing import Any, Callable, Optional

import attrs
import mlx.core as mx

from ._report import machine_info

__all__ = [
    "SpeedSettings",
    "QUICK",
    "build_model",
    "make_cache",
    "time_generation",
    "run_speed",
    "profile_decode",
    "dtype_probe",
    "summary_table",
    "profile_table",
    "count_ops",
    "markdown_report",
    "plot_speed",
    "add_arguments",
    "run",
    "settings_from_args",
]


@attrs.frozen
class SpeedSettings:
    """Model shape, workload and protocol (defaults: the committed run, ~10 min on 2 cores)."""

    context: int = 4096
    budget: int = 512
    keep: int = 4
    decode_tokens: int = 64
    #: decode is timed in blocks of this many tokens, interleaved across cache kinds
    decode_block: int = 8
    rounds: int = 3
    prefill_step_size: int = 512
    dtype: str = "float32"
    methods: tuple = attrs.field(default=("h2o", "cam"), converter=tuple)
    baselines: tuple = attrs.field(default=("rotating", "full"), converter=tuple)
    n_layers: int = 8
    hidden: int = 1024
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 2816
    vocab: int = 32000
    seed: int = 0
    warmup: bool = True
    profile: bool = True
    #: decode steps timed per profile variant; profile prefill is 2 * budget tokens
    profile_steps: int = 24
    #: compare float32/bfloat16/float16 on a short prefill + a few decode steps first
    dtype_probe: bool = True

    def __attrs_post_init__(self):
        bad = set(self.baselines) - {"rotating", "full"}
        if bad:
            raise ValueError(f"unknown baselines {sorted(bad)}; choose from rotating, full")
        if "rotating" not in self.baselines:
            raise ValueError("the rotating baseline is required: ratios are stated against it")
        if self.context <= self.budget:
            raise ValueError("context must exceed the budget, or nothing is ever evicted")
        if self.decode_block < 2 or self.decode_tokens < self.decode_block:
            raise ValueError("need decode_block >= 2 and decode_tokens >= decode_block")

    def kinds(self) -> list[str]:
        return [*self.methods, *self.baselines]

    def to_dict(self) -> dict:
        return attrs.asdict(self)


#: Small sizes for smoke tests and ``--quick``.
QUICK = dict(
    context=384, budget=128, decode_tokens=8, decode_block=4, rounds=2, prefill_step_size=128, n_layers=2,
    hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, intermediate=512, vocab=1000,
    profile_steps=6, dtype_probe=False,
)


# ------------------------------------------------------------------------------------------------
# Model and caches
# ------------------------------------------------------------------------------------------------


def build_model(s: SpeedSettings, dtype: Optional[str] = None):
    """A seeded random-weight mlx-lm Llama of the settings' shape, weights in ``dtype``."""
    from mlx_lm.models import llama

    mx.random.seed(s.seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=s.hidden,
        num_hidden_layers=s.n_layers,
        intermediate_size=s.intermediate,
        num_attention_heads=s.n_heads,
        num_key_value_heads=s.n_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=1e-5,
        vocab_size=s.vocab,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.set_dtype(getattr(mx, dtype or s.dtype))
    mx.eval(model.parameters())
    return model


def make_cache(kind: str, model, s: SpeedSettings) -> list:
    """Per-layer caches of one kind: a method name, ``"rotating"`` or ``"full"``."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvcompress import make_prompt_cache

    if kind == "full":
        return [KVCache() for _ in model.layers]
    if kind == "rotating":
        return [RotatingKVCache(max_size=s.budget, keep=s.keep) for _ in model.layers]
    return make_prompt_cache(model, kind, budget=s.budget)


def _prompt(s: SpeedSettings, n: int) -> mx.array:
    return mx.random.randint(0, s.vocab, (n,), key=mx.random.key(s.seed + 1)).astype(mx.uint32)


def _release():
    gc.collect()
    mx.clear_cache()


def _generation_stream():
    import importlib

    return importlib.import_module("mlx_lm.generate").generation_stream


def _sync():
    """Wait for all queued work (the default stream and mlx-lm's generation stream)."""
    mx.synchronize()
    mx.synchronize(_generation_stream())


def start_generation(model, prompt: mx.array, cache: list, s: SpeedSettings, max_tokens: int):
    """Start ``generate_step`` and time its first token: ``(generator, {"prefill_s", "prefill_cpu_s"})``."""
    from mlx_lm.generate import generate_step

    gen = generate_step(
        prompt, model, prompt_cache=cache, max_tokens=max_tokens, prefill_step_size=s.prefill_step_size
    )
    _sync()
    c0, t0 = time.process_time(), time.perf_counter()
    next(gen)
    c1, t1 = time.process_time(), time.perf_counter()
    return gen, {"prefill_s": t1 - t0, "prefill_cpu_s": c1 - c0}


def time_block(gen, k: int) -> tuple[float, float]:
    """Wall and CPU seconds per decode token over ``k`` tokens of a running ``generate_step``.

    ``generate_step`` dispatches step ``n + 1`` before it yields token ``n``. After a full
    synchronisation the first ``next`` only dispatches (its token is ready), and each further
    ``next`` waits for one step, so ``k`` calls time ``k - 1`` pipelined decode steps.
    """
    _sync()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(k):
        next(gen)
    c1, t1 = time.process_time(), time.perf_counter()
    return (t1 - t0) / (k - 1), (c1 - c0) / (k - 1)


def time_generation(model, prompt: mx.array, cache: list, s: SpeedSettings, decode_tokens: int) -> dict:
    """One cache alone: time to first token, then ``decode_tokens`` tokens timed as one block."""
    gen, m = start_generation(model, prompt, cache, s, decode_tokens + 2)
    wall, cpu = time_block(gen, decode_tokens + 1)
    gen.close()
    m.update(decode_tok_s=1.0 / wall, decode_cpu_s_per_token=cpu)
    return m


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------


def _rotate(items: list, r: int) -> list:
    r %= len(items)
    return items[r:] + items[:r]


def run_speed(
    settings: Optional[SpeedSettings] = None, *, progress: Optional[Callable[[str], None]] = None
) -> dict:
    """Run the interleaved rounds (and the profile); return the JSON payload.

    Per round: every kind prefills ``context`` tokens through ``generate_step`` (kinds in
    round-robin order), then the decode of all kinds is timed in blocks of ``decode_block``
    tokens, interleaved kind by kind (order rotated every block), so bursts of load from other
    processes hit every kind alike. Ratios are paired: prefill per round, decode per
    (round, block). ``summary[kind]``: medians of ``prefill_s`` and ``decode_tok_s`` and, for
    kinds other than ``rotating``, the medians of the paired ratios with ``target_met``.
    """
    from kvcompress import install

    s = settings or SpeedSettings()
    say = progress or (lambda m: None)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    payload: dict[str, Any] = {"benchmark": "speed", "machine": machine_info(), "settings": s.to_dict()}
    if s.dtype_probe:
        say("dtype probe ...")
        payload["dtype_probe"] = dtype_probe(s)
        say("dtype probe: " + ", ".join(
            f"{k}: prefill {v['prefill_s']:.2f}s, decode step {1e3 * v['decode_step_s']:.0f} ms"
            for k, v in payload["dtype_probe"].items()))

    model = build_model(s)
    install(model)
    prompt = _prompt(s, s.context)
    kinds = s.kinds()
    if s.warmup:
        warm_prompt = _prompt(s, 2 * s.budget + 9)
        for kind in kinds:
            time_generation(model, warm_prompt, make_cache(kind, model, s), s, 4)
            _release()
        say(f"warm-up done ({time.perf_counter() - t_start:.0f}s)")

    n_blocks = s.decode_tokens // s.decode_block
    rounds = []
    for r in range(s.rounds):
        order = _rotate(kinds, r)
        row: dict[str, Any] = {"order": order, "by_kind": {}}
        gens, caches = {}, {}
        for kind in order:
            caches[kind] = make_cache(kind, model, s)
            gens[kind], m = start_generation(model, prompt, caches[kind], s, 1 + n_blocks * s.decode_block + 1)
            m["decode_s_per_token"], m["decode_cpu_s_per_token"] = [], []
            row["by_kind"][kind] = m
            say(f"round {r + 1}/{s.rounds} {kind:>9}: prefill {m['prefill_s']:.2f}s "
                f"({time.perf_counter() - t_start:.0f}s)")
        for b in range(n_blocks):
            for kind in _rotate(order, b):
                wall, cpu = time_block(gens[kind], s.decode_block)
                row["by_kind"][kind]["decode_s_per_token"].append(wall)
                row["by_kind"][kind]["decode_cpu_s_per_token"].append(cpu)
        for kind in order:
            m = row["by_kind"][kind]
            m["decode_tok_s"] = 1.0 / statistics.median(m["decode_s_per_token"])
            m["stored_tokens"] = _stored(caches[kind])
            gens[kind].close()
        say(f"round {r + 1}/{s.rounds} decode tok/s: " + ", ".join(
            f"{k} {row['by_kind'][k]['decode_tok_s']:.2f}" for k in order)
            + f" ({time.perf_counter() - t_start:.0f}s)")
        del gens, caches
        _release()
        rounds.append(row)
    payload["rounds"] = rounds
    payload["summary"] = _summarise(rounds, s)
    payload["machine_after_rounds"] = {"load_average": machine_info()["load_average"]}
    if s.profile:
        say("profile ...")
        payload["profile"] = profile_decode(s, model=model)
    payload["seconds_total"] = time.perf_counter() - t_start
    payload["cpu_seconds_total"] = time.process_time() - cpu_start
    return payload


def _stored(cache: list) -> int:
    c = cache[0]
    if hasattr(c, "size"):
        return int(c.size())
    return int(c.offset)


def _summarise(rounds: list, s: SpeedSettings) -> dict:
    med = statistics.median
    out = {}
    for kind in s.kinds():
        pre = [r["by_kind"][kind]["prefill_s"] for r in rounds]
        dec = [1.0 / t for r in rounds for t in r["by_kind"][kind]["decode_s_per_token"]]
        rec = {
            "prefill_s_median": med(pre),
            "decode_tok_s_median": med(dec),
            "prefill_s": pre,
            "decode_tok_s": [r["by_kind"][kind]["decode_tok_s"] for r in rounds],
        }
        if kind != "rotating":
            def paired(key, inv):
                vals = []
                for r in rounds:
                    for a, b in zip(r["by_kind"][kind][key], r["by_kind"]["rotating"][key]):
                        vals.append(b / a if inv else a / b)
                return vals

            p_ratio = [r["by_kind"][kind]["prefill_s"] / r["by_kind"]["rotating"]["prefill_s"] for r in rounds]
            p_cpu = [r["by_kind"][kind]["prefill_cpu_s"] / r["by_kind"]["rotating"]["prefill_cpu_s"] for r in rounds]
            # decode ratios as tokens/s ratios (higher is better): rotating time / kind time
            d_ratio = paired("decode_s_per_token", inv=True)
            d_cpu = paired("decode_cpu_s_per_token", inv=True)
            rec.update(
                decode_ratio=med(d_ratio),
                prefill_ratio=med(p_ratio),
                decode_ratio_by_block=d_ratio,
                prefill_ratio_by_round=p_ratio,
                decode_ratio_cpu=med(d_cpu),
                prefill_ratio_cpu=med(p_cpu),
            )
            if kind in s.methods:
                rec["decode_target_met"] = rec["decode_ratio"] >= 0.9
                rec["prefill_target_met"] = rec["prefill_ratio"] <= 1.3
        out[kind] = rec
    return out


# ------------------------------------------------------------------------------------------------
# dtype probe
# ------------------------------------------------------------------------------------------------


def interleave(steppers: dict, n_blocks: int, k: int) -> dict:
    """Time ``k`` calls of each stepper per block, blocks round-robin over the steppers (order
    rotated every block); return seconds per call for each block, per stepper."""
    names = list(steppers)
    out: dict[str, list[float]] = {n: [] for n in names}
    for b in range(n_blocks):
        for name in _rotate(names, b):
            _sync()
            t0 = time.perf_counter()
            for _ in range(k):
                steppers[name]()
            out[name].append((time.perf_counter() - t0) / k)
    return out


def _decode_stepper(model, cache: list, y: mx.array):
    """A synchronous greedy decode step of ``model`` on ``cache`` (``mx.eval`` each call)."""
    state = {"y": y}

    def step():
        logits = model(state["y"], cache=cache)
        state["y"] = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
        mx.eval(state["y"])

    return step


def dtype_probe(s: SpeedSettings, prefill_tokens: int = 32, decode_steps: int = 8) -> dict:
    """Per weight dtype: seconds of a ``prefill_tokens`` forward pass, and the median decode
    step (full ``KVCache``, synchronous), the dtypes' decode steps interleaved in blocks of 2."""
    from mlx_lm.models.cache import KVCache

    out, steppers, keep = {}, {}, []
    for dt in ("float32", "bfloat16", "float16"):
        model = build_model(s, dt)
        x = _prompt(s, prefill_tokens)[None]
        mx.eval(model(x[:, :8], cache=[KVCache() for _ in model.layers]))  # warm-up
        cache = [KVCache() for _ in model.layers]
        _sync()
        t0 = time.perf_counter()
        mx.eval(model(x, cache=cache))
        out[dt] = {"prefill_s": time.perf_counter() - t0, "prefill_tokens": prefill_tokens}
        steppers[dt] = _decode_stepper(model, cache, x[:, -1:])
        steppers[dt]()  # untimed first step
        keep.append(model)
    times = interleave(steppers, max(1, decode_steps // 2), 2)
    for dt, ts in times.items():
        out[dt]["decode_step_s"] = statistics.median(ts)
    del keep, steppers
    _release()
    return out


# ------------------------------------------------------------------------------------------------
# Profile
# ------------------------------------------------------------------------------------------------


@attrs.frozen
class _KeepScores:
    """A scorer that leaves the scores unchanged (profiling: 'scoring disabled')."""

    requires = frozenset()
    provides = frozenset({"attention_mass"})

    def observe(self, scores, obs):
        return scores


def _variant_caches(variant: str, model, s: SpeedSettings) -> tuple[list, Callable[[list], None]]:
    """Caches of a profile variant and a hook applied after prefill."""
    name, _, flags = variant.partition("[")
    flags = set(flags.rstrip("]").split(",")) - {""}
    cache = make_cache(name, model, s)

    def after_prefill(caches):
        for c in caches:
            if "no_evict" in flags:
                c.budget = 10**9
            if "no_score" in flags:
                c.method = attrs.evolve(c.method, scorer=_KeepScores())

    return cache, after_prefill


def _model_profile(model, variants: list, s: SpeedSettings) -> dict:
    """Synchronous decode step time per variant after a ``2 * budget`` chunked prefill, the
    variants' steps interleaved in blocks of 4 (median over blocks)."""
    steppers = {}
    prompt = _prompt(s, 2 * s.budget)
    for var in variants:
        cache, after = _variant_caches(var, model, s)
        for i in range(0, prompt.shape[0], s.prefill_step_size):
            model(prompt[None, i: i + s.prefill_step_size], cache=cache)
            mx.eval([c.state for c in cache])
        after(cache)
        steppers[var] = _decode_stepper(model, cache, prompt[None, -1:])
        steppers[var]()  # one untimed step
    k = 4
    times = interleave(steppers, max(1, s.profile_steps // k), k)
    del steppers
    _release()
    return {v: {"step_ms_median": 1e3 * statistics.median(ts), "step_ms_min": 1e3 * min(ts)}
            for v, ts in times.items()}


def count_ops(*arrays: mx.array) -> dict:
    """Primitives in the unevaluated graph behind ``arrays`` (``mx.export_to_dot``)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        text = open(path).read()
    finally:
        os.unlink(path)
    names = re.findall(r'label ="([^"]+)", shape=rectangle', text)
    hist: dict[str, int] = {}
    for n in names:
        hist[n] = hist.get(n, 0) + 1
    return {"n_ops": len(names), "by_op": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))}


def _layer_inputs(s: SpeedSettings, n: int, key: int):
    dt = getattr(mx, s.dtype)
    k = mx.random.normal((1, s.n_kv_heads, n, s.head_dim), key=mx.random.key(key)).astype(dt)
    v = mx.random.normal((1, s.n_kv_heads, n, s.head_dim), key=mx.random.key(key + 1)).astype(dt)
    q = mx.random.normal((1, s.n_heads, n, s.head_dim), key=mx.random.key(key + 2)).astype(dt)
    mx.eval(k, v, q)
    return k, v, q


def _cache_arrays(c) -> list:
    """The arrays a cache step produces (private fields of CompressedKVCache, for counting)."""
    names = ("keys", "values", "_pos", "_score", "_merges")
    return [getattr(c, n) for n in names if isinstance(getattr(c, n, None), mx.array)]


def _filled_layer_cache(kind: str, s: SpeedSettings, flags=()):
    """One layer's cache after a prefill of 2 * budget synthetic tokens (observed)."""
    from mlx_lm.models.cache import RotatingKVCache

    from kvcompress import CompressedKVCache, build_method

    if kind == "rotating":
        c = RotatingKVCache(max_size=s.budget, keep=s.keep)
    else:
        c = CompressedKVCache(build_method(kind, budget=s.budget), s.budget, layer=0)
    k, v, q = _layer_inputs(s, 2 * s.budget, 10)
    for i in range(0, 2 * s.budget, s.budget):
        kk, vv = c.update_and_fetch(k[..., i: i + s.budget, :], v[..., i: i + s.budget, :])
        if kind != "rotating":
            c.observe(q[..., i: i + s.budget, :], s.head_dim**-0.5, "causal")
        mx.eval(kk, vv, _cache_arrays(c))
    # one decode step so the cache is in its steady decode state
    k1, v1, q1 = _layer_inputs(s, 1, 20)
    kk, vv = c.update_and_fetch(k1, v1)
    if kind != "rotating":
        c.observe(q1, s.head_dim**-0.5, None)
    mx.eval(kk, vv, _cache_arrays(c))
    if "no_evict" in flags:
        c.budget = 10**9
    if "no_score" in flags:
        c.method = attrs.evolve(c.method, scorer=_KeepScores())
    return c


def _model_sdpa():
    """mlx-lm's ``scaled_dot_product_attention`` behind kvcompress's wrapper: the exact call a
    model makes (attention through the cache, then ``observe``; a pass-through for others)."""
    from mlx_lm.models import base

    from kvcompress import attention

    fn = base.scaled_dot_product_attention
    return fn if hasattr(fn, attention._MARK) else attention._wrap(fn)


def _layer_steppers(variants: list, s: SpeedSettings, chunk: int) -> dict:
    """Per variant, a callable running one step of ``chunk`` tokens on one layer's cache:
    ``update_and_fetch`` + the model's (wrapped) SDPA, which observes for compressed caches."""
    scale = s.head_dim**-0.5
    sdpa = _model_sdpa()
    steppers = {}
    for var in variants:
        name, _, flags = var.partition("[")
        flags = tuple(flags.rstrip("]").split(",")) if flags else ()
        c = _filled_layer_cache(name, s, flags)
        inputs = [_layer_inputs(s, chunk, 100 + 3 * i) for i in range(4)]
        counter = {"i": 0}

        def step(c=c, name=name, inputs=inputs, counter=counter):
            k, v, q = inputs[counter["i"] % len(inputs)]
            counter["i"] += 1
            if chunk == 1:
                mask = None
            elif name == "rotating":
                mask = c.make_mask(chunk, window_size=None, return_array=False)
            else:
                mask = c.make_mask(chunk, return_array=False)
            kk, vv = c.update_and_fetch(k, v)
            out = sdpa(q, kk, vv, cache=c, scale=scale, mask=mask)
            mx.eval(out, _cache_arrays(c))

        step()  # untimed
        steppers[var] = step
    return steppers


def _layer_step_ms(variants: list, s: SpeedSettings, n: int, chunk: int = 1) -> dict:
    """Median ms of one step of one layer per variant (interleaved blocks of 4 steps)."""
    k = 4 if chunk == 1 else 1
    times = interleave(_layer_steppers(variants, s, chunk), max(1, n // k), k)
    return {v: {"ms": 1e3 * statistics.median(ts)} for v, ts in times.items()}


def _component_ms(kind: str, s: SpeedSettings, n: int) -> dict:
    """Median ms of each component call alone on a full decode-state cache of one layer."""
    from kvcompress import Eviction, Observation, Selection

    c = _filled_layer_cache(kind, s)
    m = c.method
    k, v = c.keys_and_values()
    pos, score = c._pos, c._score
    _, _, q1 = _layer_inputs(s, 1, 7)
    scale = s.head_dim**-0.5

    def timed(fn):
        mx.eval(fn())
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)

    def score_fn():
        obs = Observation(q1, k, pos, 1, scale, None, 0, c.offset)
        return m.scorer.observe(score, obs)

    def select_fn():
        return m.selector.select(Selection(score, pos, 1, c.budget, c.offset, 0))

    evict = select_fn().astype(mx.int32)
    mx.eval(evict)
    protected = m.selector.protected(pos, c.offset, c.budget)

    def dispose_fn():
        return m.disposition.dispose(Eviction(k, v, score, pos, evict, protected, 0, 1))

    def write_fn():  # the slot write of the incoming token (4 put_along_axis)
        b, h = k.shape[:2]
        idx = mx.broadcast_to(evict[..., None], (b, h, 1, k.shape[-1]))
        return [
            mx.put_along_axis(k, idx, k[..., :1, :], axis=2),
            mx.put_along_axis(v, idx, v[..., :1, :], axis=2),
            mx.put_along_axis(pos, evict, pos[..., :1], axis=2),
            mx.put_along_axis(score, evict, mx.zeros(evict.shape, mx.float32), axis=2),
        ]

    out = {
        "scorer.observe": timed(score_fn),
        "selector.select": timed(select_fn),
        "disposition.dispose": timed(dispose_fn),
        "slot_write": timed(write_fn),
    }
    sdpa_q = q1
    out["sdpa (reference)"] = timed(
        lambda: mx.fast.scaled_dot_product_attention(sdpa_q, k, v, scale=scale, mask=None)
    )
    return out


def _prefill_component_ms(s: SpeedSettings, n: int = 5) -> dict:
    """One prefill chunk on one layer (queries = chunk, keys = budget - 1 + chunk): the model's
    SDPA, the scorer's ``attention_mass`` (the same softmax again, in float32), the fused
    ``attention_with_mass`` when the core has it, and a bare ``exp`` over the logits' shape (the
    cost all of them are dominated by on CPU)."""
    from kvcompress._attention_math import attention_mass

    S, T = s.prefill_step_size, s.budget - 1 + s.prefill_step_size
    k, v, _ = _layer_inputs(s, T, 70)
    _, _, q = _layer_inputs(s, S, 80)
    scale = s.head_dim**-0.5
    logits = mx.random.normal((1, s.n_heads, S, T), key=mx.random.key(90))
    mx.eval(logits)
    fns = {
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"),
        "attention_mass": lambda: attention_mass(q, k, scale, "causal"),
        "exp over [H_q, S, T]": lambda: mx.exp(logits),
    }
    try:  # the fused prefill path: output and mass from one softmax
        from kvcompress._attention_math import attention_with_mass

        fns["attention_with_mass (fused)"] = lambda: attention_with_mass(q, k, v, scale, "causal")
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        mx.eval(fn())
    times = interleave({k_: (lambda f=f: mx.eval(f())) for k_, f in fns.items()}, n, 1)
    for name, ts in times.items():
        out[name] = 1e3 * statistics.median(ts)
    out["shape"] = f"H_q={s.n_heads}, S={S}, T={T}"
    return out


def _op_counts(kind: str, s: SpeedSettings, model) -> dict:
    """MLX primitives of one decode step: cache update, observe, and a whole decoder layer."""
    from mlx_lm.models.cache import RotatingKVCache

    scale = s.head_dim**-0.5
    c = _filled_layer_cache(kind, s)
    k1, v1, q1 = _layer_inputs(s, 1, 30)
    kk, vv = c.update_and_fetch(k1, v1)
    upd = count_ops(kk, vv, *_cache_arrays(c))
    mx.eval(kk, vv, _cache_arrays(c))
    res = {"update_and_fetch": upd["n_ops"], "update_by_op": upd["by_op"]}
    if kind != "rotating":
        c.observe(q1, scale, None)
        obs = count_ops(*_cache_arrays(c))
        res["observe"] = obs["n_ops"]
        res["observe_by_op"] = obs["by_op"]
        mx.eval(_cache_arrays(c))
    # a whole decoder layer (attention + MLP) with this cache, for scale
    layer = model.layers[0]
    c2 = _filled_layer_cache(kind, s) if kind != "rotating" else RotatingKVCache(s.budget, s.keep)
    if kind == "rotating":
        kf, vf, _ = _layer_inputs(s, s.budget + 8, 40)
        mx.eval(c2.update_and_fetch(kf, vf))
        k2, v2, _ = _layer_inputs(s, 1, 50)
        mx.eval(c2.update_and_fetch(k2, v2))
    x = mx.random.normal((1, 1, s.hidden), key=mx.random.key(60)).astype(getattr(mx, s.dtype))
    mx.eval(x)
    h = layer(x, mask=None, cache=c2)
    res["decoder_layer_total"] = count_ops(h, *_cache_arrays(c2))["n_ops"]
    mx.eval(h, _cache_arrays(c2))
    return res


def profile_decode(s: Optional[SpeedSettings] = None, model=None) -> dict:
    """Where decode time goes for each method vs ``rotating`` (see module docstring)."""
    from kvcompress import install

    s = s or SpeedSettings()
    if model is None:
        model = build_model(s)
        install(model)
    n = s.profile_steps
    variants = ["rotating"]
    for m in s.methods:
        variants += [m, f"{m}[no_evict]", f"{m}[no_evict,no_score]"]
    model_level = _model_profile(model, variants, s)
    layer_level = _layer_step_ms(variants, s, max(n, 40))
    # prefill: one chunk of prefill_step_size tokens on one layer (cache in eviction steady state)
    pre_vars = ["rotating", *[v for m in s.methods for v in (m, f"{m}[no_score]")]]
    layer_prefill = _layer_step_ms(pre_vars, s, 6, chunk=s.prefill_step_size)
    components, ops = {}, {}
    for m in ["rotating", *s.methods]:
        ops[m] = _op_counts(m, s, model)
        if m != "rotating":
            components[m] = _component_ms(m, s, max(n, 20))
    prefill_parts = _prefill_component_ms(s)
    # the cache's extra time per layer (1-layer micro-benchmark) times the layer count, against
    # the rotating model's decode step: the decode ratio the cache overhead alone predicts
    base_layer = layer_level["rotating"]["ms"]
    base_step = model_level["rotating"]["step_ms_median"]
    predicted = {}
    for m in s.methods:
        extra = s.n_layers * (layer_level[m]["ms"] - base_layer)
        predicted[m] = {"extra_ms_per_token": extra, "decode_ratio": base_step / (base_step + extra)}
    return {
        "context": 2 * s.budget,
        "predicted_from_layer_overhead": predicted,
        "model_step_ms": model_level,
        "layer_step_ms": layer_level,
        "layer_prefill_chunk_ms": layer_prefill,
        "prefill_component_ms": prefill_parts,
        "component_ms": components,
        "ops_per_layer_step": ops,
    }


# ------------------------------------------------------------------------------------------------
# Presentation
# ------------------------------------------------------------------------------------------------


def summary_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    cols = ["cache", "prefill s (median)", "prefill / rotating", "(cpu s)", "decode tok/s (median)",
            "decode / rotating", "(cpu s)", "targets met (wall)"]
    rows = []
    for kind, rec in payload["summary"].items():
        met = "-"
        if "decode_target_met" in rec:
            met = ("decode yes" if rec["decode_target_met"] else "decode NO") + ", " + (
                "prefill yes" if rec["prefill_target_met"] else "prefill NO")
        one = 1.0 if kind == "rotating" else None
        rows.append([
            kind, rec["prefill_s_median"], rec.get("prefill_ratio", one), rec.get("prefill_ratio_cpu", one),
            rec["decode_tok_s_median"], rec.get("decode_ratio", one), rec.get("decode_ratio_cpu", one), met,
        ])
    return cols, rows


def profile_table(payload: dict) -> tuple[list[str], list[list[Any]]]:
    prof = payload["profile"]
    cols = ["variant", "model decode step ms", "vs rotating ms", "1-layer step ms", "ops/layer (update+observe)"]
    base = prof["model_step_ms"]["rotating"]["step_ms_median"]
    rows = []
    for var, r in prof["model_step_ms"].items():
        name = var.partition("[")[0]
        o = prof["ops_per_layer_step"].get(name, {})
        ops = o.get("update_and_fetch", 0) + o.get("observe", 0) if "[" not in var else None
        rows.append([var, r["step_ms_median"], r["step_ms_median"] - base,
                     prof["layer_step_ms"][var]["ms"], ops])
    return cols, rows


def caption(payload: dict) -> str:
    from ._report import machine_summary, settings_summary

    keys = ("context", "budget", "keep", "decode_tokens", "decode_block", "rounds", "prefill_step_size", "dtype",
            "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")
    return "Settings: " + settings_summary(payload["settings"], keys) + ". Machine: " + machine_summary(
        payload["machine"])


def plot_speed(payload: dict, path) -> Any:
    """Bars: decode tokens/s and prefill seconds per cache kind (median, with per-round points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ._report import save_figure

    summ = payload["summary"]
    kinds = list(summ)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, title in (
        (axes[0], "decode_tok_s", "decode tokens/s (higher is better)"),
        (axes[1], "prefill_s", "prefill seconds (lower is better)"),
    ):
        med = [summ[k][key + "_median"] for k in kinds]
        ax.bar(kinds, med, color=["tab:orange" if k in payload["settings"]["methods"] else "tab:gray" for k in kinds])
        for i, k in enumerate(kinds):
            ax.plot([i] * len(summ[k][key]), summ[k][key], "k.", markersize=4)
            ratio = summ[k].get("decode_ratio" if key == "decode_tok_s" else "prefill_ratio")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (i, med[i]), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Speed vs RotatingKVCache (labels: ratio to rotating, median of paired measurements; "
                 "dots: per round)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, caption(payload))
    plt.close(fig)
    return path


def markdown_report(payload: dict) -> str:
    """Markdown tables of a speed payload: ratios, dtype probe, and the decode profile."""
    from ._report import markdown_table

    parts = []
    cols, rows = summary_table(payload)
    parts.append(markdown_table(cols, rows))
    if "dtype_probe" in payload:
        dp = payload["dtype_probe"]
        rows = [[dt, r["prefill_s"], r["prefill_tokens"], 1e3 * r["decode_step_s"]] for dt, r in dp.items()]
        parts.append("Weight dtype probe (full KVCache, synchronous):\n\n" + markdown_table(
            ["weights", "prefill s", "prefill tokens", "decode step ms"], rows))
    if "profile" in payload:
        prof = payload["profile"]
        cols, rows = profile_table(payload)
        parts.append(f"Decode profile, context {prof['context']} (model: whole decode step; "
                     "1-layer: update + SDPA + observe of one layer's cache):\n\n" + markdown_table(cols, rows))
        lp = prof.get("layer_prefill_chunk_ms", {})
        if lp:
            base = lp.get("rotating", {}).get("ms")
            parts.append(f"One prefill chunk ({payload['settings']['prefill_step_size']} tokens) on one layer, "
                         "cache in eviction steady state (update + SDPA + observe):\n\n" + markdown_table(
                             ["variant", "ms", "/ rotating"],
                             [[v, r["ms"], r["ms"] / base if base else None] for v, r in lp.items()]))
        pc = prof.get("prefill_component_ms", {})
        if pc:
            parts.append(f"Prefill chunk pieces, one layer ({pc.get('shape', '')}), ms:\n\n" + markdown_table(
                ["piece", "ms"], [[k, v] for k, v in pc.items() if k != "shape"]))
        comp = prof["component_ms"]
        names = sorted({k for v in comp.values() for k in v})
        parts.append("Component calls alone, one layer, ms (median):\n\n" + markdown_table(
            ["method", *names], [[m, *[v.get(n) for n in names]] for m, v in comp.items()]))
        pred = prof.get("predicted_from_layer_overhead", {})
        if pred:
            parts.append("Decode ratio predicted from the 1-layer overhead (n_layers x extra ms per layer "
                         "vs the rotating model step):\n\n" + markdown_table(
                             ["method", "extra ms / token", "predicted decode ratio"],
                             [[m, v["extra_ms_per_token"], v["decode_ratio"]] for m, v in pred.items()]))
        ops = prof["ops_per_layer_step"]
        rows = [[m, o.get("update_and_fetch"), o.get("observe", 0), o.get("decoder_layer_total")]
                for m, o in ops.items()]
        parts.append("MLX primitives per layer per decode step:\n\n" + markdown_table(
            ["cache", "update_and_fetch", "observe", "whole decoder layer"], rows))
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------
# Command line (``kvcompress bench speed`` and ``benchmarks/speed.py``)
# ------------------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    """Options of the speed workload (defaults: :class:`SpeedSettings`)."""
    parser.add_argument("--quick", action="store_true", help="tiny model and context (seconds)")
    parser.add_argument("--context", type=int, help="prompt tokens (default 4096)")
    parser.add_argument("--budget", type=int, help="tokens kept per layer (default 512)")
    parser.add_argument("--decode-tokens", type=int, help="decode tokens per cache and round (default 64)")
    parser.add_argument("--rounds", type=int, help="rounds (default 3)")
    parser.add_argument("--prefill-step-size", type=int, help="generate_step prefill chunk (default 512)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="weights (default float32)")
    parser.add_argument("--methods", nargs="+", help="registered method names (default: h2o cam)")
    parser.add_argument("--no-full", action="store_true", help="skip the full KVCache reference")
    parser.add_argument("--no-profile", action="store_true", help="skip the decode/prefill profile")
    parser.add_argument("--no-dtype-probe", action="store_true", help="skip the weight dtype probe")
    parser.add_argument("--out", "--out-dir", dest="out", default="docs/results",
                        help="folder for the JSON/PNG (default: docs/results)")
    parser.add_argument("--out-name", default="speed", help="file stem of the outputs (default: speed)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--plain", action="store_true", help="plain-text tables (no rich)")
    parser.add_argument("--markdown", action="store_true", help="also print markdown tables")


def settings_from_args(args) -> SpeedSettings:
    kw = dict(QUICK) if getattr(args, "quick", False) else {}
    for name in ("context", "budget", "decode_tokens", "rounds", "prefill_step_size", "dtype", "methods"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "no_full", False):
        kw["baselines"] = ("rotating",)
    if getattr(args, "no_profile", False):
        kw["profile"] = False
    if getattr(args, "no_dtype_probe", False):
        kw["dtype_probe"] = False
    return SpeedSettings(**kw)


def run(args) -> dict:
    """Run the benchmark from parsed arguments; write ``<out>/<name>.json`` (+ .png); print tables."""
    import sys
    from pathlib import Path

    from ._report import finish, print_table, warn_openblas, write_json

    settings = settings_from_args(args)
    warn_openblas()
    payload = run_speed(settings, progress=lambda m: print(m, file=sys.stderr, flush=True))
    out, name = Path(getattr(args, "out", "docs/results")), getattr(args, "out_name", "speed")
    write_json(out / f"{name}.json", payload)
    plain = getattr(args, "plain", False)
    print_table("Speed vs RotatingKVCache (medians; ratios paired per round / decode block)",
                *summary_table(payload), plain=plain)
    if "profile" in payload:
        print_table(f"Decode profile (context {payload['profile']['context']})", *profile_table(payload),
                    plain=plain)
    if getattr(args, "markdown", False):
        print(markdown_report(payload))
    finish(payload, out / (name + '.json'), plot_speed, args)
    return payload
