"""How CPU kernels are launched on numba's threads: how many threads a launch gets (`useful`,
`run`) and, on threading layers that are not thread safe, serialised launches (`launch_lock`).

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


# --------------------------------------------------------------------------- threads per launch
# A parallel kernel wakes every numba thread, also those its prange gives nothing to do. Waking a
# thread costs a microsecond or two on an idle machine (numba's threads spin a while after each
# launch) and up to a scheduler time slice when other processes hold the cores. Each launch
# therefore runs on no more threads than it has work items, and no more than one per GRAIN
# scalar operations (multiply-adds, adds or elements moved): below that a second thread costs
# more than the work it takes over, even on an idle machine. The bound is kept that low because a
# higher one (2**16) made small calls up to 12 % slower on an idle 2-core machine, by putting
# their strided copies of a few thousand elements on one thread (benchmarks/bench_small_calls.py;
# benchmarks/results/small-calls-cpu-zen4-2core-2026-12-04.txt). Results never depend on
# the thread count (every kernel's summation order is fixed by the problem, docs/cpu_backend.md),
# so this is a speed rule only.
GRAIN = 1 << 12

_GET = _SET = None   # numba's (get, set) of this thread's count, bound on first use


def _thread_api():
    """(get, set) of numba's thread count for this thread: the threading layer's own entry
    points where available (the public functions re-validate on every call, ~3 us)."""
    global _GET, _SET
    if _GET is None:
        import numba
        api = (numba.get_num_threads, numba.set_num_threads)
        try:
            from numba.np.ufunc import parallel as par
            par._launch_threads()
            get, set_ = par._get_num_threads, par._set_num_threads
            if get is not None and set_ is not None and get() == numba.get_num_threads():
                api = (get, set_)
        except Exception:  # pragma: no cover - other numba versions: the public API
            pass
        _SET = api[1]
        _GET = api[0]
    return _GET, _SET


def useful(items=None, work=None):
    """threads a launch can keep busy: at most `items` (its independent work items) and at most
    one per GRAIN of `work` (its scalar operations); at least 1. (Runs before every launch:
    plain comparisons, no builtins.)"""
    n = 1 << 30 if items is None else items
    if work is not None:
        w = (work + (GRAIN - 1)) // GRAIN
        if w < n:
            n = w
    return int(n) if n > 1 else 1


def run(kernel, threads, *args):
    """kernel(*args) on at most `threads` numba threads (this Python thread's count is restored
    afterwards; numba keeps one count per calling thread)."""
    if _GET is None:
        _thread_api()
    have = _GET()
    if threads >= have:
        return kernel(*args)
    _SET(threads)
    try:
        return kernel(*args)
    finally:
        _SET(have)


def current():
    """numba's thread count for this Python thread (what a launch may use at most)."""
    return _thread_api()[0]()
