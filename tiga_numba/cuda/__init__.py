"""numba.cuda backend (imported lazily by the dispatcher on the first cupy array).

numba-cuda 0.30.4 still references ``numpy.row_stack``, which numpy 2.5 removed; the alias
is restored here, before anything imports numba.cuda, and only when it is missing.
"""
import numpy as _np

if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack
