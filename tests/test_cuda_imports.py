"""The CUDA backend imports wherever its stack is installed: with cupy or numba-cuda present, a
broken import of tiga_numba.cuda (or of its tensor-core package, which cuda/api.py would
otherwise drop silently to the CUDA-core kernels) is a failure, not a skip."""
import importlib
import importlib.util

import pytest

#: import with numba-cuda alone (kernels compile for a GPU this machine need not have)
NUMBA_CUDA_MODULES = ["tiga_numba.cuda.launch", "tiga_numba.cuda.blocks", "tiga_numba.cuda.csr",
                      "tiga_numba.cuda.gat", "tiga_numba.cuda.neighbors", "tiga_numba.cuda.tc",
                      "tiga_numba.cuda.tc.api", "tiga_numba.cuda.tc.build", "tiga_numba.cuda.tc.prebuild"]
#: the backend's entry module also needs cupy
CUPY_MODULES = ["tiga_numba.cuda.api"]


def _present(*names):
    return all(importlib.util.find_spec(m) is not None for m in names)


@pytest.mark.parametrize("name", NUMBA_CUDA_MODULES + CUPY_MODULES)
def test_cuda_module_imports(name):
    needs = ("numba_cuda", "cupy") if name in CUPY_MODULES else ("numba_cuda",)
    if not _present("cupy") and not _present(*needs):
        pytest.skip(f"{' and '.join(needs)} not installed")
    import tiga_numba  # noqa: F401  (first: shields tiga_numba.cuda from numba-cuda's import redirector)
    importlib.import_module(name)


def test_tensor_core_package_is_wired_into_the_backend():
    if not _present("cupy"):
        pytest.skip("cupy is not installed")
    import tiga_numba  # noqa: F401
    from tiga_numba.cuda import api, tc
    assert api._tc is tc, "cuda/api.py dropped the tensor-core kernels: their import failed"
