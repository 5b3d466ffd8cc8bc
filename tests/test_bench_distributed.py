"""``kvcompress bench distributed --quick``: 2 ranks on loopback, what compression adds.

Per-KV-head methods issue no collective under tensor or pipeline parallelism; a head-shared
scorer (TOVA) under tensor parallelism, and every scorer on an MLA model (latent cache
replicated on every rank), issue exactly one ``all_sum`` per decode step for all layers.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvcompress.cli import main

#: mlx.launch listens on fixed ports: one launch at a time (see tests/test_distributed.py)
pytestmark = pytest.mark.xdist_group("mlx_launch")


def test_quick_run_counts_one_collective_per_step_where_needed(tmp_path, capsys):
    if shutil.which("mlx.launch") is None:
        if os.environ.get("KVCOMPRESS_REQUIRE_DISTRIBUTED") == "1":
            pytest.fail("mlx.launch is not on PATH")
        pytest.skip("mlx.launch is not on PATH")
    assert main(["bench", "distributed", "--quick", "--out", str(tmp_path), "--plain"]) == 0
    payload = json.loads((tmp_path / "distributed.json").read_text())
    assert (tmp_path / "distributed.png").exists()
    seen = set()
    for cfg in payload["configs"]:
        for row in cfg["rows"]:
            seen.add((cfg["model"], row["cache"]))
            needs = row["cache"] != "full" and cfg["mode"] == "tp" and (cfg["model"] == "mla" or row["cache"] == "tova")
            assert row["collectives_per_step"] == (1.0 if needs else 0.0), (cfg["model"], row)
            assert (row["bytes_per_step"] > 0) == needs
            assert row["tok_s"] > 0 and row["decode_vs_full"] > 0
    assert {("llama", "tova"), ("qwen2", "h2o"), ("mla", "snapkv")} <= seen
    assert all(p["head_shared_method_bytes"] > 0 for p in payload["projections"])
    err = capsys.readouterr().err
    assert "wrote" in err


def test_a_budget_a_method_cannot_hold_is_one_error_line(capsys):
    assert main(["bench", "distributed", "--quick", "--budget", "8", "--methods", "snapkv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no room to evict" in err[0]
