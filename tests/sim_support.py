"""Set-up shared by the subprocesses that run CUDA kernels in numba's simulator.

The simulator runs every CUDA thread as a Python thread. A short GIL switch interval hands the
GIL on to waiting threads sooner (the cases run 2-3x faster), but finer interleaving also
exposes a check-then-set race in the simulator's `cuda.shared.array`: two threads of a block
can each allocate the array, splitting the block's writes between two copies (a sum then
reads uninitialised memory). The allocation table is made atomic here (a lookup that misses
holds a lock until its entry is stored), so finer interleaving finds races in our kernels, not
in the simulator."""
import sys
import threading


class _AtomicAllocations(dict):
    """The simulator's per-block table of shared arrays: it calls get(caller) and, on a miss,
    stores a new array under caller; the miss holds the lock until that store."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def get(self, key, default=None):
        self._lock.acquire()
        found = dict.get(self, key)
        if found is not None:
            self._lock.release()
            return found
        return default   # the lock stays held until __setitem__

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self._lock.release()


def prepare_simulator():
    sys.setswitchinterval(50e-6)
    from numba.cuda.simulator import kernelapi
    shared = kernelapi.FakeCUDAShared
    if getattr(shared, "_tiga_atomic", False):
        return
    init = shared.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._allocations = _AtomicAllocations()
    shared.__init__ = __init__
    shared._tiga_atomic = True
