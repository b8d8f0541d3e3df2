"""numba.cuda backend (imported lazily by the dispatcher on the first cupy array).

numba-cuda 0.30.4 still references ``numpy.row_stack``, which numpy 2.5 removed; the alias
is restored here, before anything imports numba.cuda, and only when it is missing (see
numba_fixes.py, which also holds the compile-time fix applied when a kernel is first built).
"""
from .numba_fixes import restore_numpy_row_stack as _restore_numpy_row_stack

_restore_numpy_row_stack()
