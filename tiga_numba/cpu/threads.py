"""Serialised CPU kernel launches on numba threading layers that are not thread safe.

numba runs ``parallel=True`` kernels on one of three threading layers: ``tbb`` and ``omp``
accept launches from several Python threads at once, ``workqueue`` does not (two concurrent
launches terminate the process).  Every CPU entry point of the package therefore holds
``launch_lock()`` while its kernels run: on ``workqueue`` that is one process-wide lock (calls
from several threads take turns, each still runs on all numba threads), on the other layers a
no-op.  numba picks the layer on the first parallel launch (``NUMBA_THREADING_LAYER``, else
tbb, omp, workqueue in that order), so the choice is read once, after starting the threads.
"""
from __future__ import annotations

import contextlib
import functools
import threading

THREAD_SAFE_LAYERS = ("tbb", "omp")

_LOCK = threading.RLock()  # re-entrant: entry points call each other
_NO_LOCK = contextlib.nullcontext()
_CHOICE = []  # [lock or no-op], set on first use


def active_layer():
    """The threading layer numba uses in this process ('tbb', 'omp' or 'workqueue');
    starts numba's threads if no parallel kernel has run yet."""
    import numba
    try:
        return numba.threading_layer()
    except ValueError:  # not started yet
        from numba.np.ufunc import parallel
        parallel._launch_threads()
        return numba.threading_layer()


def launch_lock():
    """Context to hold while parallel kernels run: a process-wide lock where the threading
    layer is not thread safe, else a no-op."""
    if not _CHOICE:
        _CHOICE.append(_NO_LOCK if active_layer() in THREAD_SAFE_LAYERS else _LOCK)
    return _CHOICE[0]


def serialised(fn):
    """Decorator: run fn under launch_lock()."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with launch_lock():
            return fn(*args, **kwargs)
    return wrapper
