"""``kvcompress bench serve`` at tiny sizes: both servers run as subprocesses on 127.0.0.1 and are
stopped afterwards, the results are complete and finite, the conversation's later turns are
served from the prompt cache, and impossible settings are one error line (~30 s)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import pytest

from kvcompress.bench import _serving as srv
from kvcompress.bench import serve

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    ap = argparse.ArgumentParser()
    serve.add_arguments(ap)
    payload = serve.run(ap.parse_args(["--quick", "--plain", "--out", str(out)]))
    return out, payload


def _numbers(x, path=""):
    """Every number in a JSON tree, with its path."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


def test_quick_run_writes_json_and_png_with_every_field(quick_run):
    out, payload = quick_run
    assert (out / "serve.png").stat().st_size > 10_000
    data = json.loads((out / "serve.json").read_text())
    assert data["benchmark"] == "serve" and data["settings"]["clients"] == serve.QUICK["clients"]
    assert data["machine"]["cpu_count"] and "git_commit" in data["machine"]
    summ = data["summary"]
    for key in ("throughput_ratio", "decode_ratio", "ttft_p50_ratio", "ttft_p99_ratio", "peak_memory_ratio",
                "memory_limit_mb"):
        assert summ[key] is not None and math.isfinite(summ[key]) and summ[key] > 0, key
    assert summ["throughput_target_met"] == (summ["throughput_ratio"] >= 0.9)
    for name in serve.NAMES:
        s = data["load"]["servers"][name]
        for key in ("tok_s", "decode_tok_s", "ttft_p50_s", "ttft_p99_s", "peak_mb", "rss_end_mb"):
            assert s[key] is not None and math.isfinite(s[key]) and s[key] > 0, (name, key)
        assert s["ttft_p99_s"] >= s["ttft_p50_s"]
        assert s["rss_curve"]["rss_mb"] and max(s["rss_curve"]["rss_mb"]) <= s["peak_mb"] + 1
        assert summ["fits_tokens"][name] > 0
    for path, v in _numbers(data):  # None would be a non-finite value written as null
        assert math.isfinite(v), path
    n_requests = serve.QUICK["clients"] * serve.QUICK["rounds"]
    for name in serve.NAMES:
        reqs = [q for row in data["load"]["rounds"] for q in row[name]["requests"]]
        assert len(reqs) == n_requests
        assert all(q["completion_tokens"] == serve.QUICK["new_tokens"] for q in reqs)
        assert all(q["prompt_tokens"] == serve.QUICK["prompt_tokens"] for q in reqs)


def test_both_servers_were_started_and_stopped(quick_run):
    _, payload = quick_run
    assert set(payload["servers"]) == {"load", "conversation"}
    pids = []
    for phase, servers in payload["servers"].items():
        assert set(servers) == set(serve.NAMES)
        for name, rec in servers.items():
            assert rec["startup_s"] > 0 and rec["returncode"] is not None, (phase, name)
            assert "127.0.0.1" in rec["cmd"]
            pids.append(rec["pid"])
        assert servers["compressed"]["cmd"][1:4] == ["-m", "kvcompress", "serve"]
        assert servers["plain"]["cmd"][1:4] == ["-m", "mlx_lm", "server"]
    assert len(set(pids)) == 4
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    model_dir = payload["servers"]["load"]["plain"]["cmd"][payload["servers"]["load"]["plain"]["cmd"].index("--model") + 1]
    assert not os.path.exists(model_dir)  # the temporary model folder is gone


def test_conversation_later_turns_reuse_the_prompt_cache(quick_run):
    _, payload = quick_run
    conv = payload["conversation"]
    for name in serve.NAMES:
        turns = conv["servers"][name]["turns"]
        assert len(turns) == serve.QUICK["max_turns"]
        assert turns[0]["cached_tokens"] == 0
        for prev, t in zip(turns, turns[1:]):
            # each turn extends the previous prompt + answer exactly: all of it is resumed
            assert t["cached_tokens"] == prev["tokens"], (name, t)
            assert t["prompt_tokens"] == prev["tokens"] + serve.QUICK["turn_tokens"] - 1  # new text, no BOS
        assert turns[-1]["tokens"] > payload["settings"]["budget"]  # the compressed cache evicted
        assert all(t["rss_mb"] > 0 for t in turns)
    assert conv["memory_limit_auto"] and conv["memory_limit_mb"] > 0


def test_haystack_prompts_have_the_requested_length():
    tok = srv.load_tokenizer(srv.ASSET)
    for n in (16, 100, 333):
        text = srv.haystack_text(tok, n, seed=n)
        assert text.endswith("\n") and len(tok.encode(text)) == n
    assert srv.haystack_text(tok, 100, 1) == srv.haystack_text(tok, 100, 1)
    assert srv.haystack_text(tok, 100, 1) != srv.haystack_text(tok, 100, 2)


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    p = srv.ServerProcess("broken", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                          dict(os.environ), tmp_path / "broken.log")
    try:
        p.start()
        with pytest.raises(RuntimeError, match="exited with status 3.*\n.*no model here"):
            p.wait_healthy(30)
    finally:
        assert p.stop() == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--clients", "0"], "clients must be an integer >= 1, got 0"),
        (["--budget", "0"], "budget must be an integer >= 1, got 0"),
        (["--new-tokens", "1"], "new_tokens must be an integer >= 2, got 1"),
        (["--max-turns", "1"], "max_turns must be an integer >= 2, got 1"),
        (["--memory-limit-mb", "0"], "memory_limit_mb must be an integer >= 1, got 0"),
        (["--prompt-tokens", "200", "--budget", "256"], "prompt_tokens must exceed the budget (256)"),
        (["--method", "no_such_method"], "unknown methods ['no_such_method']"),
        (["--quick", "--budget", "8"], "method 'snapkv' with budget 8"),
        (["--model", "/no/such/model"], "model must be an mlx-lm model folder"),
        (["--n-layers", "0"], "n_layers must be an integer >= 1, got 0"),
    ],
)
def test_impossible_settings_are_one_error_line(argv, message, tmp_path, capsys):
    from kvcompress.cli import main

    assert main(["bench", "serve", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcompress bench serve: error: ") and "\n" not in err, err
    assert message in err, err
    assert not list(tmp_path.iterdir())
