"""Run at interpreter start-up by ``kvcompress-autoload.pth`` (installed with the package).

It imports nothing heavy: it only waits for ``mlx_lm.models.cache`` to be imported and then

* puts two small placeholder classes there, so mlx-lm's own ``load_prompt_cache`` (and its CLIs'
  ``--prompt-cache-file``) can read a kvcompress file without the user importing kvcompress (a
  placeholder imports kvcompress on first use, which replaces it with the real class);
* wraps that module's ``load_prompt_cache`` and ``save_prompt_cache`` (:func:`wrap_file_functions`):
  a file naming a kvcompress class or carrying a kvcompress digest is read by
  :func:`kvcompress.load_prompt_cache` (which checks the digest), a cache list holding kvcompress
  caches is written by :func:`kvcompress.save_prompt_cache` (which writes it); every other file
  and cache list goes to mlx-lm's functions unchanged (after one read of the file's header).

``kvcompress.mlxlm.loader.register`` applies the same wrappers when kvcompress is imported in a
process started without this hook. Imported as a module (``kvcompress._autoload``, by the loader
and :mod:`kvcompress.persistence`) this file imports nothing of kvcompress: the wrappers call the
functions they are given, and only the code run by the ``.pth`` file (the ``__name__`` guard at
the end) imports kvcompress, on first use.
"""

import importlib.util
import json
import struct
import sys
from importlib.abc import MetaPathFinder

_TARGET = "mlx_lm.models.cache"
CACHE_CLASSES = ("CompressedKVCache", "BatchCompressedKVCache")
DIGEST_KEY = "kvcompress_digest"
_MARK = "__kvcompress_file__"


def _placeholder(name, real_class):
    def from_state(cls, state, meta_state=None):
        return real_class(name).from_state(state)

    return type(name, (), {"from_state": classmethod(from_state), "__doc__": "kvcompress placeholder"})


def file_metadata(file_name):
    """The ``__metadata__`` of a ``.safetensors`` file's header (``{}`` if it has none), or None
    when the header cannot be read (mlx's loader then says why)."""
    try:
        with open(file_name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error, TypeError):
        return None
    if not isinstance(header, dict):
        return None
    meta = header.get("__metadata__") or {}
    return meta if isinstance(meta, dict) else None


def is_kvcompress_file(file_name) -> bool:
    """Whether a prompt-cache file holds a kvcompress layer (by its class names) or a digest."""
    meta = file_metadata(file_name)
    if not meta:
        return False
    return "0." + DIGEST_KEY in meta or any(
        k.startswith("1.") and v in CACHE_CLASSES for k, v in meta.items())


def original(fn):
    """mlx-lm's own function behind a wrapper made here (the function itself if not wrapped)."""
    return getattr(fn, _MARK, fn)


def _load_wrapper(fn, load):
    def load_prompt_cache(file_name, return_metadata=False):
        if is_kvcompress_file(file_name):
            return load(file_name, return_metadata=return_metadata)
        return fn(file_name, return_metadata=return_metadata)

    return load_prompt_cache


def _save_wrapper(fn, save):
    def save_prompt_cache(file_name, cache, metadata=None):
        engine = sys.modules.get("kvcompress.engine.engine")
        if engine is not None and any(isinstance(c, engine.Engine) for c in cache):
            return save(file_name, cache, metadata)
        return fn(file_name, cache, metadata)

    return save_prompt_cache


def wrap_file_functions(module, load, save) -> None:
    """Wrap ``module``'s ``load_prompt_cache`` / ``save_prompt_cache`` (idempotent): a kvcompress
    file goes to ``load(file_name, return_metadata=...)`` and a cache list holding kvcompress
    caches to ``save(file_name, cache, metadata)`` (kvcompress's own two functions)."""
    for name, make, to in (("load_prompt_cache", _load_wrapper, load), ("save_prompt_cache", _save_wrapper, save)):
        fn = module.__dict__.get(name)
        if fn is None or hasattr(fn, _MARK):
            continue
        new = make(fn, to)
        new.__doc__, new.__module__ = fn.__doc__, fn.__module__
        setattr(new, _MARK, fn)
        module.__dict__[name] = new


class _Finder(MetaPathFinder):
    """Waits for ``mlx_lm.models.cache``; then puts the placeholders there (``real_class(name)``:
    the class a placeholder stands for) and wraps its file functions (``load``, ``save``)."""

    def __init__(self, load, save, real_class):
        self.load, self.save, self.real_class = load, save, real_class

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for cls_name in CACHE_CLASSES:
                module.__dict__.setdefault(cls_name, _placeholder(cls_name, self.real_class))
            wrap_file_functions(module, self.load, self.save)

        spec.loader.exec_module = exec_module
        return spec


if __name__ == "kvcompress_autoload":  # run by the .pth file (not when imported as a module)

    def _load(file_name, return_metadata=False):
        from kvcompress.persistence import load_prompt_cache

        return load_prompt_cache(file_name, return_metadata=return_metadata)

    def _save(file_name, cache, metadata=None):
        from kvcompress.persistence import save_prompt_cache

        return save_prompt_cache(file_name, cache, metadata)

    def _real_class(name):
        import kvcompress  # noqa: F401  (registers the real classes with mlx-lm)

        return getattr(sys.modules[_TARGET], name)

    if _TARGET not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(_load, _save, _real_class))
