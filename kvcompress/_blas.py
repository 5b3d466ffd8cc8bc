"""Linux CPU speed: run MLX's CPU matmuls on Debian's OpenBLAS instead of the bundled reference BLAS.

The ``mlx[cpu]`` wheel bundles a reference BLAS (~5 GFLOP/s on 2 cores). Preloading the
``libopenblas.so.0`` of Debian's ``libopenblas0-pthread`` package gives ~190 GFLOP/s with the
same results. Preloading must happen before the process starts, so :func:`reexec_with_openblas`
restarts the current command once with ``LD_PRELOAD`` set.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Optional, Sequence

__all__ = ["find_openblas", "openblas_preloaded", "will_reexec", "reexec_with_openblas", "FIX_HINT", "PRELOAD_COMMANDS"]

#: Commands that restart themselves once with OpenBLAS preloaded (Linux, when it is installed).
PRELOAD_COMMANDS = ("bench", "generate", "serve", "chat", "tune")

_PATTERNS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
)
FIX_HINT = (
    "sudo apt-get install libopenblas0-pthread && export LD_PRELOAD="
    "/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0"
)
_GUARD = "KVCOMPRESS_BLAS_REEXEC"


def find_openblas() -> Optional[str]:
    """Path of an OpenBLAS shared library suitable for ``LD_PRELOAD``, or None."""
    if not sys.platform.startswith("linux"):
        return None
    for pattern in _PATTERNS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def openblas_preloaded() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def will_reexec() -> bool:
    """Whether :func:`reexec_with_openblas` restarts the process: on Linux with OpenBLAS found and
    not preloaded, unless ``KVCOMPRESS_NO_BLAS_REEXEC`` is set or this is the restarted process."""
    if os.environ.get("KVCOMPRESS_NO_BLAS_REEXEC") or os.environ.get(_GUARD) or openblas_preloaded():
        return False
    return find_openblas() is not None


def reexec_with_openblas(argv: Sequence[str]) -> None:
    """Restart ``argv`` with OpenBLAS preloaded when :func:`will_reexec` (else do nothing)."""
    if not will_reexec():
        return
    lib = find_openblas()
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_GUARD] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)
