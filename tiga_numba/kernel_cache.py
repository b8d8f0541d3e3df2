"""One cache for every compiled kernel specialisation, with hit/miss counters.

Kernels are built by factories closed over compile-time constants (dtype, tile sizes,
causal, pruning, ...). The key is the tuple of those constants; `explain()` reports the
counters so a user can see whether a call compiled or reused a kernel.
"""
from __future__ import annotations

import threading


class KernelCache:
    def __init__(self):
        self._kernels = {}
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

    def stats(self):
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._kernels)}

    def clear(self):
        with self._lock:
            self._kernels.clear()
            self.hits = self.misses = 0
            self.last_was_hit = None


KERNELS = KernelCache()
