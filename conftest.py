"""Root conftest: on Linux, restart pytest once with OpenBLAS preloaded (MLX CPU matmul ~35x faster).

Set KVCOMPRESS_NO_BLAS_REEXEC=1 to opt out. See kvcompress/_blas.py.
"""

import sys

from kvcompress._blas import find_openblas, openblas_preloaded, reexec_with_openblas


def pytest_configure(config):
    if find_openblas() and not openblas_preloaded():
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        reexec_with_openblas(["-m", "pytest", *config.invocation_params.args])
