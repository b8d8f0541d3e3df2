"""Keep the BLAS that numba's ``np.dot`` calls single-threaded while our kernels run.

numba's ``np.dot`` calls scipy's bundled OpenBLAS (through ``scipy.linalg.cython_blas``).
Our kernels call it on small tiles from every ``prange`` worker; if OpenBLAS also spawns its
own threads for those tiles the two pools oversubscribe the cores (measured: 3-10x slower on
the 2-core machine).  We set OpenBLAS to one thread for the duration of a kernel call and
restore the previous count afterwards.  Process-global: a concurrent BLAS call from another
Python thread runs single-threaded meanwhile.  If scipy's BLAS is not an OpenBLAS we can find
(e.g. a conda MKL build), this is a no-op and ``blas_control()`` says so.
"""
import contextlib
import ctypes
import glob
import os
import threading

_lock = threading.Lock()
_api = None  # (get, set, description) or False when not found


def _find():
    global _api
    if _api is not None:
        return _api
    _api = False
    try:
        import scipy
        import scipy.linalg.cython_blas  # noqa: F401  (loads the library numba will use)
    except Exception:
        return _api
    base = os.path.dirname(os.path.dirname(scipy.__file__))
    for path in sorted(glob.glob(os.path.join(base, "scipy.libs", "*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in (("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
                                   ("openblas_get_num_threads", "openblas_set_num_threads")):
            try:
                get, set_ = getattr(lib, get_name), getattr(lib, set_name)
            except AttributeError:
                continue
            get.restype = ctypes.c_int
            set_.argtypes = [ctypes.c_int]
            set_.restype = None
            _api = (get, set_, f"{os.path.basename(path)}:{set_name}")
            return _api
    return _api


def blas_control():
    """Description of the BLAS thread control in use, or None."""
    api = _find()
    return api[2] if api else None


_depth = 0
_saved = None


@contextlib.contextmanager
def single_threaded_blas():
    """Nestable and shared between Python threads: the first caller in saves and sets one
    thread, the last one out restores the saved count."""
    global _depth, _saved
    api = _find()
    if not api:
        yield
        return
    get, set_, _ = api
    with _lock:
        if _depth == 0:
            _saved = get()
            set_(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                set_(_saved)
