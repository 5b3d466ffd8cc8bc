"""Root conftest: on Linux, restart pytest once with OpenBLAS preloaded (MLX CPU matmul ~35x faster).

Set KVCOMPRESS_NO_BLAS_REEXEC=1 to opt out. See kvcompress/_blas.py.
"""

from kvcompress._blas import reexec_with_openblas, will_reexec


def pytest_configure(config):
    if will_reexec():  # stop capturing only for a real restart (KVCOMPRESS_NO_BLAS_REEXEC=1 runs here)
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        reexec_with_openblas(["-m", "pytest", *config.invocation_params.args])
