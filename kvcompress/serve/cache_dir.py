"""The folder of ``kvcompress serve --prompt-cache-dir``: cache files by name, atomic writes,
least-recently-used eviction under a size limit, safe for several servers on one folder.

The design has no index to keep consistent. A file's name says what it holds::

    kvc-<identity digest>-<number of tokens>-<digest of the tokens>.safetensors

(the identity digest stands for the model, method and formats, :mod:`.persistent_cache`), so
a server finds the files its prompt extends by listing the folder, and two servers never need
to agree on anything but the names. Writes go to ``.kvc-tmp-<pid>-<random>.safetensors`` in the
same folder and are renamed into place with ``os.replace`` (atomic on POSIX): a reader sees a
whole file or none, never a partial one. A file's modification time is its last use (set when
written, bumped by ``os.utime`` when read or reused), and eviction removes the least recently used
files until the folder holds at most ``max_bytes``; eviction and the rename run under an
exclusive ``fcntl.flock`` on ``.kvc-lock``, so two servers never evict for each other's
space twice. Files whose names are not ours are never counted nor touched. A temporary file left
by a process that died is removed once that process is gone (or after an hour).

No ``fsync``: a file cut short by a power loss is caught by the file's digest when read, and
skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from ..errors import KVCompressError

__all__ = ["CacheDir", "parse_size", "format_size"]

PREFIX, SUFFIX, TMP_PREFIX, LOCK_NAME = "kvc-", ".safetensors", ".kvc-tmp-", ".kvc-lock"
_NAME = re.compile(r"^kvc-([0-9a-f]{20})-(\d{8})-([0-9a-f]{24})\.safetensors$")
_TMP = re.compile(r"^\.kvc-tmp-(\d+)-[0-9a-f]+\.safetensors$")
#: a temporary file of a process that is gone is removed after this many seconds; any after an hour
_STALE_DEAD_S, _STALE_ANY_S = 60.0, 3600.0

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from ``"2GB"``, ``"500MB"``, ``"1.5GiB"``, ``"1000000"`` (k/M/G/T are powers of 1000,
    KiB/MiB/GiB/TiB of 1024); ValueError naming the forms for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 2GB, 500MB, 1.5GiB or 1000000 (bytes), got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def token_digest(tokens: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i8").tobytes(), digest_size=12).hexdigest()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process
        return True
    return True


class CacheDir:
    """The cache files of one folder, at most ``max_bytes`` together (see the module docstring)."""

    def __init__(self, path, max_bytes: int):
        try:
            import fcntl  # noqa: F401  (POSIX only)
        except ImportError:
            raise KVCompressError("--prompt-cache-dir needs POSIX file locks (fcntl), which this platform "
                                  "lacks") from None
        if max_bytes < 1:
            raise KVCompressError(f"--prompt-cache-dir-bytes must be at least 1 byte, got {max_bytes}")
        self.path, self.max_bytes = Path(path).expanduser(), int(max_bytes)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            probe = self.path / f"{TMP_PREFIX}{os.getpid()}-probe{SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise KVCompressError(f"--prompt-cache-dir {str(path)!r}: cannot keep cache files there "
                                  f"({exc.strerror or exc})") from None
        self._thread_lock = threading.Lock()
        #: what the last scan found: our files and their bytes
        self.files, self.bytes, self.evicted = 0, 0, 0
        with self._locked():
            self._evict(0)

    # -- names ---------------------------------------------------------------------------------
    @staticmethod
    def name_for(identity: str, tokens: np.ndarray) -> str:
        """The file name of the cache of ``tokens`` (int64 array) under ``identity`` (20 hex)."""
        return f"{PREFIX}{identity}-{len(tokens):08d}-{token_digest(tokens)}{SUFFIX}"

    def candidates(self, identity: str, tokens: Sequence[int], more_than: int) -> Iterator[tuple[int, Path]]:
        """``(n, file)`` for each file of ``identity`` that holds the first ``n`` tokens of
        ``tokens`` (its name says so; what it holds is checked by the reader), with
        ``more_than < n <= len(tokens)``, longest first."""
        arr = np.asarray(tokens, dtype="<i8")
        found = []
        try:
            with os.scandir(self.path) as it:
                for entry in it:
                    m = _NAME.match(entry.name)
                    if m and m.group(1) == identity and more_than < int(m.group(2)) <= len(arr):
                        found.append((int(m.group(2)), entry.name))
        except OSError:
            return
        for n, name in sorted(found, reverse=True):
            if name == self.name_for(identity, arr[:n]):
                yield n, self.path / name

    def touch(self, name: str) -> bool:
        """Mark file ``name`` as just used; False if it does not exist."""
        try:
            os.utime(self.path / name)
            return True
        except OSError:
            return False

    # -- writing -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, name: str, estimate: int) -> Iterator[Path]:
        """Room for a file of about ``estimate`` bytes is made (least recently used files leave),
        then a temporary path is yielded for the caller to write; on a normal exit the file is
        renamed to ``name`` (room made again for its exact size), on an error it is removed.
        ValueError when the file does not fit in ``max_bytes`` at all (nothing was evicted for it
        when the estimate already said so)."""
        with self._locked():
            self._evict(estimate if estimate <= self.max_bytes else 0, replacing=name)
        tmp = self.path / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}{SUFFIX}"
        try:
            yield tmp
            size = tmp.stat().st_size
            if size > self.max_bytes:
                raise ValueError(f"a cache file of {format_size(size)} exceeds the folder's limit "
                                 f"({format_size(self.max_bytes)})")
            with self._locked():
                self._evict(size, replacing=name, writing=tmp.name)
                os.replace(tmp, self.path / name)
                self.files += 1
                self.bytes += size
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            (self.path / name).unlink()

    # -- eviction ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        import fcntl

        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _scan(self, writing: Optional[str]) -> tuple[list, int]:
        """``([(mtime_ns, size, name)] of our cache files, bytes of others' temporary files)``;
        stale temporary files are removed on the way."""
        files, temps, now = [], 0, time.time()
        with os.scandir(self.path) as it:
            for entry in it:
                name = entry.name
                if not (name.startswith(PREFIX) or name.startswith(TMP_PREFIX)) or name == writing:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if _NAME.match(name):
                    files.append((st.st_mtime_ns, st.st_size, name))
                elif (m := _TMP.match(name)) is not None:
                    age = now - st.st_mtime
                    if age > _STALE_ANY_S or (age > _STALE_DEAD_S and not _alive(int(m.group(1)))):
                        self.remove(name)
                    else:
                        temps += st.st_size
        return files, temps

    def _evict(self, need: int, replacing: Optional[str] = None, writing: Optional[str] = None) -> None:
        """Remove the least recently used files until ours, others' temporary files and ``need``
        more bytes fit in ``max_bytes`` (``replacing``: the name about to be overwritten, whose
        bytes are freed by the rename). Call with the lock held."""
        files, temps = self._scan(writing)
        files.sort()
        total = temps + sum(size for _, size, name in files if name != replacing)
        kept = [f for f in files if f[2] != replacing]
        while kept and total + need > self.max_bytes:
            _, size, name = kept.pop(0)
            self.remove(name)
            total -= size
            self.evicted += 1
        self.files, self.bytes = len(kept), total - temps
