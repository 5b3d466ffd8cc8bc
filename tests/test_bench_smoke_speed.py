"""Smoke tests of the speed benchmark at tiny sizes (seconds): ratios against the baselines, the
op-count profile, JSON/tables, the dtype probe, interleaved timing, settings and speed targets."""

from __future__ import annotations

import json
import math

import pytest

import kvcompress
from kvcompress.bench import _harness, _profile, _profile_report, _report
from kvcompress.bench import speed as speed_mod

TINY_SPEED = dict(
    context=160, budget=64, decode_tokens=4, decode_block=2, rounds=2, prefill_step_size=64, n_layers=2,
    hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate=256, vocab=256,
    profile_steps=3, dtype_probe=False,
)


@pytest.fixture(scope="module")
def speed_payload():
    return speed_mod.run_speed(speed_mod.SpeedSettings(**TINY_SPEED))


def test_speed_covers_methods_and_baselines_with_finite_ratios(speed_payload):
    s = speed_mod.SpeedSettings(**TINY_SPEED)
    summ = speed_payload["summary"]
    assert set(summ) == {"h2o", "cam", "rotating", "full"}
    for kind, rec in summ.items():
        assert len(rec["decode_tok_s"]) == s.rounds
        assert len(rec.get("decode_ratio_by_block", [])) in (0, s.rounds * s.decode_tokens // s.decode_block)
        assert rec["prefill_s_median"] > 0 and math.isfinite(rec["prefill_s_median"])
        assert rec["decode_tok_s_median"] > 0 and math.isfinite(rec["decode_tok_s_median"])
        if kind != "rotating":
            for key in ("decode_ratio", "prefill_ratio", "decode_ratio_cpu", "prefill_ratio_cpu"):
                assert rec[key] > 0 and math.isfinite(rec[key]), (kind, key)
    for m in ("h2o", "cam"):
        assert summ[m]["decode_target_met"] == (summ[m]["decode_ratio"] >= 0.9)
        assert summ[m]["prefill_target_met"] == (summ[m]["prefill_ratio"] <= 1.3)
    # round-robin order: each round starts with a different kind
    starts = [r["order"][0] for r in speed_payload["rounds"]]
    assert len(set(starts)) == len(starts)
    # the bounded caches really are bounded; the full one holds everything
    r0 = speed_payload["rounds"][0]["by_kind"]
    for kind in ("h2o", "cam", "rotating"):
        assert r0[kind]["stored_tokens"] <= s.budget
    # generate_step runs one step ahead of what it yields: the prompt, the first token and
    # decode_tokens more fed back
    assert r0["full"]["stored_tokens"] == s.context + s.decode_tokens + 1
    # decode was timed block by block for every kind
    for kind in summ:
        assert len(r0[kind]["decode_s_per_token"]) == s.decode_tokens // s.decode_block


def test_speed_profile_counts_cache_ops(speed_payload):
    prof = speed_payload["profile"]
    ops = prof["ops_per_layer_step"]
    assert ops["rotating"]["update_and_fetch"] >= 1
    for m in ("h2o", "cam"):
        assert ops[m]["update_and_fetch"] > ops["rotating"]["update_and_fetch"]
        assert ops[m]["decoder_layer_total"] > ops[m]["update_and_fetch"]
        # a compressing decode step: one q k^T and one w v -- the output and the scorer's mass
        # come from one softmax (CaM's step also plans the next merge: the loser's cosine to
        # every key); that softmax is mx.softmax or, on the CPU, ops._softmax's kernels
        assert ops[m]["attend_observe_by_op"].get("Matmul") == (3 if m == "cam" else 2)
        assert ops[m]["attend_observe_by_op"].get("Softmax", 0) <= 1
        for v in prof["component_ms"][m].values():
            assert v > 0 and math.isfinite(v)
    for var in ("rotating", "h2o", "h2o[no_evict]", "h2o[no_evict,no_score]", "cam", "cam[no_evict]"):
        assert prof["model_step_ms"][var]["step_ms_median"] > 0
        assert prof["layer_step_ms"][var]["ms"] > 0
    for var in ("rotating", "h2o", "h2o[no_score]", "cam", "cam[no_score]"):
        assert prof["layer_prefill_chunk_ms"][var]["ms"] > 0
    assert {"sdpa", "attention_mass"} <= set(prof["prefill_component_ms"])
    cols, rows = _profile_report.profile_table(speed_payload)
    assert len(rows) == len(prof["model_step_ms"])


def test_speed_json_and_tables(speed_payload, tmp_path):
    data = json.loads(_report.write_json(tmp_path / "speed.json", speed_payload).read_text())
    assert data["settings"]["context"] == TINY_SPEED["context"]
    assert data["machine"]["openblas_preloaded"] in (True, False)
    cols, rows = speed_mod.summary_table(speed_payload)
    assert [r[0] for r in rows] == ["h2o", "cam", "rotating", "full"]
    pytest.importorskip("matplotlib")
    assert speed_mod.plot_speed(speed_payload, tmp_path / "speed.png").stat().st_size > 10_000


def test_count_ops_counts_primitives():
    import mlx.core as mx

    a = mx.ones((4, 4))
    mx.eval(a)
    out = _profile.count_ops((a @ a + 1).sum())
    assert out["by_op"].get("Matmul") == 1
    assert out["n_ops"] == sum(out["by_op"].values()) >= 3


def test_dtype_probe_reports_each_dtype():
    s = speed_mod.SpeedSettings(**TINY_SPEED)
    probe = speed_mod.dtype_probe(s, prefill_tokens=8, decode_steps=4)
    assert set(probe) == {"float32", "bfloat16", "float16"}
    for rec in probe.values():
        assert rec["prefill_s"] > 0 and rec["decode_step_s"] > 0


def test_interleave_rotates_order_and_times_every_stepper():
    calls = []
    steppers = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    out = _harness.interleave(steppers, n_blocks=3, k=2)
    assert {n: len(v) for n, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in out.values() for t in v)
    # blocks of k calls, the starting stepper rotated each block
    assert calls[::2] == list("abc") + list("bca") + list("cab")


@pytest.mark.parametrize("others", [1, 2, 5])
def test_time_beside_pairs_every_block_with_the_reference_block_next_to_it(others):
    """Each other runner's block is timed right before or after a block of the reference (both
    sides over the rounds), and ``beside`` holds exactly that neighbour's time."""
    names = [f"m{i}" for i in range(others)]
    runners = {n: n for n in [*names[:1], "ref", *names[1:]]}
    calls = []

    def timer(name):
        calls.append(name)
        return float(len(calls))  # a block's time: its position in the sequence

    times, beside = _harness.time_beside(runners, "ref", 4, timer, offset=1)
    assert {n: len(times[n]) for n in names} == {n: 4 for n in names}
    assert len(times["ref"]) == 4 * others == len(calls) // 2
    sides = {n: set() for n in names}
    for n in names:
        for t, r in zip(times[n], beside[n]):
            assert abs(t - r) == 1 and calls[int(r) - 1] == "ref"  # the neighbouring block
            sides[n].add(r < t)
    assert all(s == {True, False} for s in sides.values())
    # no reference (or nothing beside it): the plain rotated round robin
    calls.clear()
    times, beside = _harness.time_beside({"a": "a", "b": "b"}, "ref", 2, timer)
    assert calls == ["a", "b", "b", "a"] and beside == {"a": [], "b": []}


def test_speed_settings_validation():
    with pytest.raises(ValueError, match="decode_block"):
        speed_mod.SpeedSettings(decode_block=1)
    with pytest.raises(ValueError, match="rotating"):
        speed_mod.SpeedSettings(baselines=("full",))
    with pytest.raises(ValueError, match="context"):
        speed_mod.SpeedSettings(context=64, budget=64)
    assert kvcompress.CompressedKVCache  # the library under test is importable alongside


def test_speed_targets_follow_what_a_method_keeps():
    """A method whose disposition keeps and attends the tokens it frees (KIVI) is judged as a
    full cache's replacement (decode >= 0.8x rotating, prefill <= 2x full); an eviction method
    by the bounded-cache targets (decode >= 0.9x, prefill <= 1.3x rotating)."""
    from kvcompress.bench import speed

    rec = {"decode_ratio": 0.85, "prefill_ratio": 1.8, "prefill_ratio_full": 0.9}
    kivi, h2o = speed._targets("kivi", rec), speed._targets("h2o", rec)
    assert (kivi["decode_target_met"], kivi["prefill_target_met"]) == (True, True)
    assert (h2o["decode_target_met"], h2o["prefill_target_met"]) == (False, False)
    assert speed._targets("kivi", {**rec, "prefill_ratio_full": 2.5})["prefill_target_met"] is False
    assert speed._targets("kivi", {"decode_ratio": 0.7, "prefill_ratio": 1.8})["prefill_target_met"] is None
    payload = {"summary": {"kivi": {**rec, **kivi, "prefill_s_median": 1.0, "decode_tok_s_median": 1.0}}}
    row = speed.summary_table(payload)[1][0]
    assert row[-1] == "decode yes, prefill (vs full) yes"
