"""``kvcompress bench restart`` at tiny sizes (the embedded model, ~20 s): servers started and
stopped with status 0, the resumed turn served from the folder, the fresh one prefilled, the
folder under its limit with files evicted, the latest conversation resumed after the folder
phase's restart; bad settings are one error line before any server starts."""

from __future__ import annotations

import argparse
import json

import pytest

from kvcompress.bench import restart

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("restart")
    ap = argparse.ArgumentParser()
    restart.add_arguments(ap)
    payload = restart.run(ap.parse_args(["--quick", "--plain", "--out", str(out)]))
    return out, payload


def test_quick_run_resumes_after_the_restart_and_keeps_the_limit(quick_run):
    out, payload = quick_run
    assert (out / "restart.png").stat().st_size > 10_000
    data = json.loads((out / "restart.json").read_text())
    assert data["benchmark"] == "restart" and data["settings"]["turns"] == restart.QUICK["turns"]
    r = data["restart"]
    assert len(r["turns"]) == restart.QUICK["turns"] + 1  # A's turns, then the last turn on both servers
    resumed, fresh = r["resumed"], r["fresh"]
    assert resumed["prompt_tokens"] == fresh["prompt_tokens"] and fresh["cached_tokens"] == 0
    new = restart.QUICK["turn_tokens"] + restart.QUICK["answer_tokens"] + 8  # the last answer, the new turn
    assert resumed["prompt_tokens"] - new <= resumed["cached_tokens"] < resumed["prompt_tokens"]
    assert r["files"] > 0 and r["bytes"] > 0 and r["ttft_ratio_fresh_over_resumed"] > 0
    f = data["folder"]
    assert f["under_limit"] and 0 < f["peak_bytes"] <= f["limit_bytes"] == restart.QUICK["dir_bytes"]
    assert f["server"]["written"] > 0 and f["server"]["evicted"] > 0 and f["server"]["skipped"] == 0
    assert len(f["requests"]) == restart.QUICK["conversations"] * restart.QUICK["conversation_turns"]
    assert all(q["folder_bytes"] <= f["limit_bytes"] for q in f["requests"])
    assert f["resumed_after_restart"][0]["cached_tokens"] > 0  # the most recent conversation
    assert [s["returncode"] for s in data["servers"]] == [0] * 5


@pytest.mark.parametrize("argv, message", [
    (["--phases", "restart,nope"], "phases must be among restart, folder"),
    (["--method", "snapkv", "--budget", "8"], "budget 8"),
    (["--method", "no_such_method"], "no_such_method"),
])
def test_bad_settings_are_one_line_before_any_server(argv, message, tmp_path, capsys):
    from kvcompress.cli import main

    assert main(["bench", "restart", "--quick", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "restart: turn" not in err
