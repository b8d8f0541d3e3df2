"""Reusable host buffers for arrays that live inside one call.

A large numpy array freshly allocated is mapped page by page on first write: filling 512 MB of
new memory took 0.14 s on a 2-vCPU Xeon where copying into memory already mapped took 0.04 s
(and about eight times that, 0.42 GiB/s, on a virtual machine whose host backs memory lazily).
A task that assembles a big temporary on every call (a Dask CSR task's halo of k and v, up to
all of k and v) pays that each time. `ScratchPool` keeps such buffers after use and lends them
again to a request of the same size, the way a caching allocator does; cupy already pools device
memory, so only numpy buffers come from here.

A lent buffer belongs to the borrower until the ``with`` block ends; nothing computed from it
may keep a view of it. Idle buffers are kept up to ``max_idle_bytes`` per pool (least recently
returned dropped first; a number, or a function read at each return, so that the owner's setting
can change at run time); the memory they hold is the price of the reuse, and ``clear()`` drops
them.

`OutputPool` does the same for arrays that outlive the call that made them (a Dask task's
results: its output, its partial gradients, a chunk's sum), which cannot be lent for a ``with``
block: an array it hands out is a view of a buffer the pool keeps, and the buffer is lent again
only once nothing else refers to it (no array, view or pickling buffer: its reference count says
so), so reuse never overwrites memory that is still readable. Kernels allocate their outputs
through `output_empty` / `output_zeros`, which take them from the pool of the enclosing
``outputs_from(pool)`` block and are plain `np.empty` / `np.zeros` elsewhere.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading

import numpy as np


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

    @contextlib.contextmanager
    def borrow(self, shape, dtype):
        """An uninitialised C-contiguous array of `shape` and `dtype`, for the ``with`` block."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = None
        with self._lock:
            stack = self._idle.get(nbytes)
            if stack:
                buf = stack.pop()
                self._idle_bytes -= nbytes
                if not stack:
                    del self._idle[nbytes]
        if buf is None:
            buf = np.empty(nbytes, np.uint8)
        try:
            yield buf.view(dtype).reshape(shape)
        finally:
            self._give_back(buf)

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


def _refcount_alone():
    """What sys.getrefcount reports, in this interpreter, for an object that only a list holds,
    read the way OutputPool reads its buffers (interpreters differ in whether the argument
    itself is counted)."""
    stack = [np.empty(1, np.uint8)]
    return sys.getrefcount(stack[0])


_ALONE = _refcount_alone()


class OutputPool:
    """Buffers for arrays that outlive a call, lent again once nothing refers to them.

    Holds at most ``max_bytes`` of buffers (lent or idle; a number, or a function read at each
    request); a request that finds no free buffer of its exact size beyond that gets a plain new
    array the pool does not keep. Thread-safe."""

    def __init__(self, max_bytes):
        self._limit = max_bytes if callable(max_bytes) else (lambda: max_bytes)
        self._bufs = collections.OrderedDict()   # nbytes -> [uint8 buffers], most recent size last
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self):
        """Bytes of the buffers the pool keeps, lent or not."""
        return self._bytes

    @staticmethod
    def _free(stack, i):
        # more references than a buffer held by the stack alone: an array, a view or an
        # exported buffer can still read the memory
        return sys.getrefcount(stack[i]) <= _ALONE

    def empty(self, shape, dtype):
        """An uninitialised C-contiguous array of `shape` and `dtype`."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        with self._lock:
            stack = self._bufs.get(nbytes)
            buf = None
            if stack:
                for i in range(len(stack)):
                    if self._free(stack, i):
                        buf = stack[i]
                        break
            if buf is None:
                buf = self._new(nbytes)
            else:
                self._bufs.move_to_end(nbytes)
        return buf.view(dtype).reshape(shape)

    def _new(self, nbytes):
        """A new buffer, kept when it fits under the limit after dropping free ones of other
        sizes, least recently requested first (called with the lock held)."""
        limit = int(self._limit())
        buf = np.empty(nbytes, np.uint8)
        if nbytes > limit:
            return buf
        for size in list(self._bufs):
            if self._bytes + nbytes <= limit:
                break
            stack = self._bufs[size]
            for i in range(len(stack) - 1, -1, -1):
                if self._free(stack, i) and self._bytes + nbytes > limit:
                    del stack[i]
                    self._bytes -= size
            if not stack:
                del self._bufs[size]
        if self._bytes + nbytes <= limit:
            self._bufs.setdefault(nbytes, []).append(buf)
            self._bufs.move_to_end(nbytes)
            self._bytes += nbytes
        return buf

    def clear(self):
        """Forget every buffer (those still lent stay valid: their arrays keep them alive)."""
        with self._lock:
            self._bufs.clear()
            self._bytes = 0


_CURRENT = threading.local()


@contextlib.contextmanager
def outputs_from(pool):
    """Within the block, on this thread, `output_empty` / `output_zeros` take from `pool`
    (None: plain numpy arrays)."""
    saved = getattr(_CURRENT, "pool", None)
    _CURRENT.pool = pool
    try:
        yield
    finally:
        _CURRENT.pool = saved


def output_empty(shape, dtype):
    """np.empty, or the enclosing outputs_from block's pool."""
    pool = getattr(_CURRENT, "pool", None)
    return np.empty(shape, dtype) if pool is None else pool.empty(shape, dtype)


def output_zeros(shape, dtype):
    """np.zeros, or a zero-filled array from the enclosing outputs_from block's pool."""
    pool = getattr(_CURRENT, "pool", None)
    if pool is None:
        return np.zeros(shape, dtype)
    out = pool.empty(shape, dtype)
    out.fill(0)
    return out
