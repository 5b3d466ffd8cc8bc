import os


def test_blas_preloaded_on_linux():
    from kvcompress._blas import find_openblas

    if find_openblas() and not os.environ.get("KVCOMPRESS_NO_BLAS_REEXEC"):
        assert "openblas" in os.environ.get("LD_PRELOAD", "")
