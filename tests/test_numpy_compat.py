"""numba-cuda 0.30.4 calls numpy.row_stack, which numpy 2.5 removed: importing the CUDA backend
must restore the alias (and only when it is missing), without needing a GPU."""
import subprocess
import sys
import textwrap


def test_cuda_backend_restores_row_stack_when_numpy_lacks_it():
    code = textwrap.dedent("""
        import numpy
        if hasattr(numpy, "row_stack"):
            del numpy.row_stack          # simulate numpy >= 2.5
        import tiga_numba                # must not import numba.cuda or touch the alias
        assert not hasattr(numpy, "row_stack")
        import sys
        assert "numba.cuda" not in sys.modules
        import tiga_numba.cuda
        assert numpy.row_stack is numpy.vstack
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
