"""Run at interpreter start-up by ``kvcompress-autoload.pth`` (installed with the package).

It imports nothing heavy: it only waits for ``mlx_lm.models.cache`` to be imported and then puts
two small placeholder classes there, so mlx-lm's own ``load_prompt_cache`` (and its CLIs'
``--prompt-cache-file``) can read a kvcompress file without the user importing kvcompress. A
placeholder imports kvcompress on first use, which replaces it with the real class.
"""

import importlib.util
import sys
from importlib.abc import MetaPathFinder

_TARGET = "mlx_lm.models.cache"


def _placeholder(name):
    def from_state(cls, state, meta_state=None):
        import kvcompress  # noqa: F401  (registers the real classes with mlx-lm)

        return getattr(sys.modules[_TARGET], name).from_state(state)

    return type(name, (), {"from_state": classmethod(from_state), "__doc__": "kvcompress placeholder"})


class _Finder(MetaPathFinder):
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
            for cls_name in ("CompressedKVCache", "BatchCompressedKVCache"):
                module.__dict__.setdefault(cls_name, _placeholder(cls_name))

        spec.loader.exec_module = exec_module
        return spec


if _TARGET not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
