"""One cache for every compiled kernel specialisation, with hit/miss counters, and for what
the backends derive per call shape (launch geometry, work-item tables).

Kernels are built by factories closed over compile-time constants (dtype, tile sizes,
causal, pruning, ...). The key is the tuple of those constants; `explain()` reports the
counters so a user can see whether a call compiled or reused a kernel.

`derived(owner, key, build)` memoises values computed from an object that lives across calls
(a realised relation record): they are kept as long as the owner lives and dropped with it,
so a new Graph never sees another one's tables, even when Python reuses an id.
"""
from __future__ import annotations

import threading
import weakref


class KernelCache:
    def __init__(self):
        self._kernels = {}
        self._derived = {}  # id(owner) -> (weakref to owner or None, {key: value})
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.last_was_hit = None

    def get(self, key, build):
        """Return the kernel cached under `key`, calling `build()` once on a miss."""
        with self._lock:
            if key in self._kernels:
                self.hits += 1
                self.last_was_hit = True
                return self._kernels[key]
        kernel = build()  # outside the lock: numba compiles can take seconds
        with self._lock:
            if key in self._kernels:  # another thread built it meanwhile: keep the first
                self.hits += 1
                self.last_was_hit = True
                return self._kernels[key]
            self._kernels[key] = kernel
            self.misses += 1
            self.last_was_hit = False
            return kernel

    def count_hits(self, n):
        """Record n kernel reuses that bypassed get() (a memoised launch record holds them)."""
        self.hits += n
        self.last_was_hit = True

    def derived(self, owner, key, build):
        """`build()` once per (owner, key); owner None means "depends on the key only".
        An owner that cannot be weakly referenced gets no memo (built on every call)."""
        slot = self._derived.get(id(owner) if owner is not None else None)
        if slot is not None and (slot[0] is None or slot[0]() is owner):
            table = slot[1]
            value = table.get(key, _MISSING)
            if value is not _MISSING:
                return value
        else:
            table = {}
            if owner is None:
                self._derived[None] = (None, table)
            else:
                oid = id(owner)
                try:
                    ref = weakref.ref(owner, lambda _r, oid=oid, d=self._derived: _drop(d, oid, _r))
                except TypeError:
                    return build()
                self._derived[oid] = (ref, table)
        value = table[key] = build()
        return value

    def stats(self):
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._kernels)}

    def clear(self):
        with self._lock:
            self._kernels.clear()
            self._derived.clear()
            self.hits = self.misses = 0
            self.last_was_hit = None


_MISSING = object()


def _drop(table, oid, ref):
    slot = table.get(oid)
    if slot is not None and slot[0] is ref:  # not a newer owner that reused the id
        del table[oid]


KERNELS = KernelCache()
