"""Reusable host buffers for arrays that live inside one call.

A large numpy array freshly allocated is mapped page by page on first write: filling 512 MB of
new memory took 0.14 s on a 2-vCPU Xeon where copying into memory already mapped took 0.04 s
(and about eight times that, 0.42 GiB/s, on a virtual machine whose host backs memory lazily).
A task that assembles a big temporary on every call (a Dask CSR task's halo of k and v, up to
all of k and v) pays that each time. `ScratchPool` keeps such buffers after use and lends them
again to a request of the same size, the way a caching allocator does; cupy already pools device
memory, so only numpy buffers come from here.

A buffer lent by ``borrow`` belongs to the borrower until the ``with`` block ends; nothing
computed from it may keep a view of it. ``lend`` hands out an array that lives as long as any view
of it does: its buffer comes back when the last one is garbage collected. Idle buffers are kept up
to ``max_idle_bytes`` per pool (least recently returned dropped first; a number, or a function
read at each return, so that the owner's setting can change at run time); the memory they hold is
the price of the reuse, and ``clear()`` drops them.

``lending(pool)`` makes ``empty`` / ``zeros`` below lend arrays of at least ``LEND_MIN_BYTES``
from `pool` for the code it wraps (a context variable: per thread and task); the CPU kernels
allocate their large outputs and copies through them, so a Dask worker (tiga_numba.dask) reuses
the memory of its previous tasks' results instead of mapping fresh memory on every call.
Elsewhere they are ``np.empty`` / ``np.zeros``.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
import weakref

import numpy as np

#: arrays smaller than this are never lent (fresh small allocations cost nothing worth saving)
LEND_MIN_BYTES = 16 << 20


class ScratchPool:
    """Buffers lent by exact byte size; thread-safe (each borrower gets its own buffer)."""

    def __init__(self, max_idle_bytes):
        self._limit = max_idle_bytes if callable(max_idle_bytes) else (lambda: max_idle_bytes)
        self._idle = collections.OrderedDict()   # nbytes -> [uint8 buffers], most recent last
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def max_idle_bytes(self):
        return int(self._limit())

    @property
    def idle_bytes(self):
        return self._idle_bytes

    def _take(self, nbytes):
        """an idle buffer of exactly `nbytes`, else a new one."""
        with self._lock:
            stack = self._idle.get(nbytes)
            if stack:
                buf = stack.pop()
                self._idle_bytes -= nbytes
                if not stack:
                    del self._idle[nbytes]
                return buf
        return np.empty(nbytes, np.uint8)

    @contextlib.contextmanager
    def borrow(self, shape, dtype):
        """An uninitialised C-contiguous array of `shape` and `dtype`, for the ``with`` block."""
        dtype = np.dtype(dtype)
        buf = self._take(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        try:
            yield buf.view(dtype).reshape(shape)
        finally:
            self._give_back(buf)

    def lend(self, shape, dtype):
        """An uninitialised C-contiguous array of `shape` and `dtype` whose buffer returns to the
        pool when the array and every view of it are gone."""
        dtype = np.dtype(dtype)
        buf = self._take(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        lease = _Lease(buf)
        # the lease is the array's base: views keep it alive, and its end gives the buffer back
        weakref.finalize(lease, self._give_back, buf)
        return np.asarray(lease).view(dtype).reshape(shape)

    def _give_back(self, buf):
        nbytes = buf.nbytes
        limit = self.max_idle_bytes
        with self._lock:
            if 0 < nbytes <= limit:
                self._idle.setdefault(nbytes, []).append(buf)
                self._idle.move_to_end(nbytes)
                self._idle_bytes += nbytes
            # also when the buffer is not kept: the limit may have been lowered since
            while self._idle_bytes > limit:
                size, stack = next(iter(self._idle.items()))
                stack.pop(0)
                self._idle_bytes -= size
                if not stack:
                    del self._idle[size]

    def clear(self):
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


class _Lease:
    """The base object of a lent array: exposes the pooled buffer's memory (numpy keeps the
    object an array was made from as its base) and can be weakly referenced."""
    __slots__ = ("buffer", "__array_interface__", "__weakref__")

    def __init__(self, buffer):
        self.buffer = buffer
        self.__array_interface__ = buffer.__array_interface__


_LENDER = contextvars.ContextVar("tiga_numba_scratch_lender", default=None)


@contextlib.contextmanager
def lending(pool):
    """Within the block (this thread / task), `empty` and `zeros` lend large arrays from `pool`."""
    token = _LENDER.set(pool)
    try:
        yield pool
    finally:
        _LENDER.reset(token)


def empty(shape, dtype):
    """np.empty, or an array lent from the pool of the enclosing `lending` block when it holds at
    least LEND_MIN_BYTES."""
    pool = _LENDER.get()
    if pool is not None:
        dtype = np.dtype(dtype)
        shape = tuple(int(n) for n in (shape if isinstance(shape, tuple) else (shape,)))
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize >= LEND_MIN_BYTES:
            return pool.lend(shape, dtype)
    return np.empty(shape, dtype)


def zeros(shape, dtype):
    """np.zeros, or a zero-filled lent array (see `empty`)."""
    if _LENDER.get() is None:
        return np.zeros(shape, dtype)
    a = empty(shape, dtype)
    a.fill(0)
    return a


def full(shape, value, dtype):
    """np.full, or a filled lent array (see `empty`)."""
    if _LENDER.get() is None:
        return np.full(shape, value, dtype)
    a = empty(shape, dtype)
    a.fill(value)
    return a
