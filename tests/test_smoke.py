import os

from conftest import fresh_pytest_env


def test_blas_preloaded_on_linux():
    from kvcompress._blas import find_openblas

    if find_openblas() and not os.environ.get("KVCOMPRESS_NO_BLAS_REEXEC"):
        assert "openblas" in os.environ.get("LD_PRELOAD", "")


def test_the_blas_opt_out_still_runs_the_tests():
    """``KVCOMPRESS_NO_BLAS_REEXEC=1 python -m pytest`` (the documented opt-out) used to stop
    pytest's capture for a restart that never came: an INTERNALERROR and no test run."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVCOMPRESS_NO_BLAS_REEXEC": "1"}
    env.pop("KVCOMPRESS_BLAS_REEXEC", None)  # not the restarted process
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "tests/test_smoke.py::test_blas_preloaded_on_linux"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


def test_the_tests_run_without_pytest_xdist():
    """pyproject's ``addopts`` asks pytest-xdist for ``-n auto --dist loadgroup``; without the
    plugin (not installed, or ``-p no:xdist``) conftest accepts those options and the tests run in
    one process instead of stopping at "unrecognized arguments"."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "-W", "error::pytest.PytestUnknownMarkWarning",
                        "tests/test_bench_distributed.py::test_a_budget_a_method_cannot_hold_is_one_error_line"],
                       cwd=repo, env=fresh_pytest_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "created:" not in r.stdout  # no xdist workers
