"""Build the low-bit CPU kernel (``csrc/``) once per source / mlx / nanobind / Python version.

The extension is an MLX custom primitive (C++, nanobind), so it is compiled against the mlx
that is installed: the first use on a Linux x86-64 CPU runs CMake (~40 s), later processes load
the cached module. Where a prerequisite is missing (CMake, a C++ compiler, nanobind) or the
build fails, the reason is recorded next to the cache entry, so no process retries a failed
build, and callers fall back to ``mx.quantized_matmul``. Delete the folder to rebuild.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx

CSRC = Path(__file__).with_name("csrc")
MODULE = "_lowbit_qmm"
#: seconds a CMake step may take before the build counts as failed
BUILD_TIMEOUT = 900


class BuildError(RuntimeError):
    """The kernel could not be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """``$KVCOMPRESS_CACHE_DIR`` or ``$XDG_CACHE_HOME/kvcompress`` (``~/.cache/kvcompress``)."""
    root = os.environ.get("KVCOMPRESS_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcompress"


def build_key() -> str:
    """What the binary depends on: the sources and the versions it is compiled against."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(f"{mx.__version__}|{_nanobind_version()}|{sys.version}|{platform.machine()}".encode())
    return h.hexdigest()[:16]


def entry_dir() -> Path:
    return cache_dir() / "lowbit" / build_key()


def _nanobind_version() -> str:
    try:
        import nanobind
    except ImportError:
        return "missing"
    return nanobind.__version__


def _missing() -> str | None:
    """The first missing build prerequisite, as a sentence, else None."""
    if _nanobind_version() == "missing":
        return "nanobind is not installed (pip install nanobind)"
    if not _cmake():
        return "CMake is not installed (apt-get install cmake, or pip install cmake)"
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "no C++ compiler found (apt-get install g++)"
    return None


def _cmake() -> str | None:
    return shutil.which("cmake")


def load():
    """The compiled module, building it first if needed; raises :class:`BuildError` with the
    reason (also recorded, so later processes fail fast) when it cannot be had."""
    entry = entry_dir()
    so = entry / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    failed = entry / "FAILED"
    if not so.exists():
        if failed.exists():
            raise BuildError(failed.read_text().strip())
        missing = _missing()
        if missing:
            raise BuildError(missing)
        entry.mkdir(parents=True, exist_ok=True)
        with open(entry / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build; other processes wait, then load it
            if not so.exists() and not failed.exists():
                try:
                    _build(entry, so)
                except BuildError as e:
                    failed.write_text(str(e) + "\n")
                    raise
            if failed.exists():
                raise BuildError(failed.read_text().strip())
    spec = importlib.util.spec_from_file_location(f"kvcompress._lowbit.{MODULE}", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(entry: Path, so: Path) -> None:
    _say(f"kvcompress: building the low-bit CPU kernel once (about a minute; cached in {entry})")
    t0 = time.perf_counter()
    log = entry / "build.log"
    with tempfile.TemporaryDirectory(prefix="build-", dir=entry) as tmp:
        out = Path(tmp) / "out"
        steps = [
            [_cmake(), "-S", str(CSRC), "-B", str(Path(tmp) / "build"), "-DCMAKE_BUILD_TYPE=Release",
             f"-DPython_EXECUTABLE={sys.executable}", f"-DLOWBIT_OUT={out}"],
            [_cmake(), "--build", str(Path(tmp) / "build"), "-j", str(max(os.cpu_count() or 1, 1))],
        ]
        with open(log, "w") as f:
            for cmd in steps:
                f.write("$ " + " ".join(cmd) + "\n")
                f.flush()
                try:
                    r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT)
                except (OSError, subprocess.TimeoutExpired) as e:
                    raise BuildError(f"building the low-bit kernel failed ({e}); log: {log}") from None
                if r.returncode:
                    raise BuildError(f"building the low-bit kernel failed (exit {r.returncode}); log: {log}")
        built = out / so.name
        if not built.exists():
            raise BuildError(f"building the low-bit kernel produced no {so.name}; log: {log}")
        os.replace(built, so)
    _say(f"kvcompress: low-bit CPU kernel built in {time.perf_counter() - t0:.0f} s")


def _say(line: str) -> None:
    """``line`` on stderr on a line of its own, above any tqdm progress bar (a benchmark's)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(line, file=sys.stderr, flush=True)
        return
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()
