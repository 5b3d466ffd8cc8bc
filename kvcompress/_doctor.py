"""``kvcompress doctor``: MLX, BLAS speed, the CPU kernels and the plugins, checked."""

from __future__ import annotations

import os

__all__ = ["cmd_doctor"]


def cmd_doctor(args) -> int:
    """Print one line per check (the Python and MLX versions, the device, BLAS, the kernel, each plugin)."""
    import platform

    import mlx.core as mx

    from ._blas import FIX_HINT, PRELOAD_COMMANDS, find_openblas, openblas_preloaded
    from ._listing import _registry, _width

    print(f"python     {platform.python_version()} on {platform.system()} {platform.machine()}")
    try:
        import mlx_lm

        lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx_lm is a dependency
        lm_version = "?"
    print(f"mlx        {mx.__version__}   mlx-lm {lm_version}")
    print(f"device     {mx.default_device()}")
    if platform.system() == "Linux":
        lib = find_openblas()
        auto = ", ".join(f"`kvcompress {c}`" for c in PRELOAD_COMMANDS)
        if openblas_preloaded():
            print("blas       OpenBLAS preloaded in this process (fast CPU matmul)")
        elif lib is None:
            print("blas       reference BLAS (~35x slower matmul); OpenBLAS not found")
            print(f"           fix: {FIX_HINT}")
        else:
            off = os.environ.get("KVCOMPRESS_NO_BLAS_REEXEC")
            how = ("not preloaded: KVCOMPRESS_NO_BLAS_REEXEC is set" if off
                   else f"{auto} preload it automatically")
            print(f"blas       OpenBLAS found at {lib}; {how}")
            print(f"           for your own scripts: export LD_PRELOAD={lib}")
    from . import _lowbit

    lowbit = _lowbit.status()
    why = lowbit["reason"] or ""
    print("lowbit     " + ("CPU kernels built (KIVI's low-bit products, the attention softmax)" if lowbit["available"] else (
        "low-bit CPU kernel " if why.startswith("not built yet") else "MLX's quantized_matmul: ") + why))
    reg = _registry(listing=True)
    width = _width((p.name for p in reg.plugins()), 14)
    for p in reg.plugins():
        print(f"plugin     {p.name:<{width}} {p.dist} {p.version} [{p.status}]" + (f" {p.error}" if p.error else ""))
    if reg.failed():
        print(f"{len(reg.failed())} plugin(s) failed to load (why: on its line above); "
              "KVCOMPRESS_STRICT_PLUGINS=1 makes a broken plugin an error instead of a skip")
    return 0
