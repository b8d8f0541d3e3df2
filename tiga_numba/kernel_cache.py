"""One cache for every compiled kernel specialisation, with hit/miss counters, and for what
the backends derive per call shape (launch geometry, work-item tables).

Kernels are built by factories closed over compile-time constants (dtype, tile sizes,
causal, pruning, ...). The key is the tuple of those constants; `explain()` reports the
counters so a user can see whether a call compiled or reused a kernel.

`derived(owner, key, build)` memoises values computed from an object that lives across calls
(a realised relation record): they are kept as long as the owner lives and dropped with it,
so a new Graph never sees another one's tables, even when Python reuses an id.

Where a kernel came from. A numba kernel is compiled at its first launch, after the lookup
here, and numba may load it from its on-disk cache instead of compiling (`cache=True`).
`source(kernel, memory_hit)` returns a `KernelSource` that reads the dispatchers' disk-cache
counters when it is shown (after the launch): "memory hit" (this process had it),
"disk hit" (loaded from numba's cache) or "compiled".

First compile notice. The first time a kernel family actually compiles in a process, one
line goes to stderr: ``tiga_numba: compiling cpu blocks.forward kernels (once; cached on
disk)``, so that a first call that takes seconds says why. ``TIGA_NUMBA_QUIET=1`` (any value
but "", "0") silences it. ``python -m tiga_numba.precompile`` compiles the CPU kernels ahead
of time.
"""
from __future__ import annotations

import os
import sys
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
            _announce_compiles(kernel, _family(key))
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
            _FAMILY_OF.clear()


_MISSING = object()


# --------------------------------------------------------------------------- where a kernel came from
def dispatchers_in(kernel):
    """The numba dispatchers a cached kernel object holds: itself (with the work items of a CPU
    kernel's parallel driver, score_codegen.jit_driver), the items of a tuple or list, or the
    dispatchers among a module's / record's attributes (generated kernel modules)."""
    if hasattr(kernel, "overloads") and hasattr(kernel, "stats"):
        return [kernel, *getattr(kernel, "work_items", ())]
    if isinstance(kernel, (tuple, list)):
        return [d for item in kernel for d in dispatchers_in(item)]
    attrs = getattr(kernel, "__dict__", None)
    if isinstance(attrs, dict):
        return [v for v in attrs.values() if hasattr(v, "overloads") and hasattr(v, "stats")]
    return []


def _disk_counts(dispatchers):
    """(loads from numba's disk cache, compiles) summed over the dispatchers' signatures."""
    loads = compiles = 0
    for d in dispatchers:
        stats = d.stats
        loads += sum(stats.cache_hits.values())
        compiles += sum(stats.cache_misses.values())
    return loads, compiles


class KernelSource:
    """How the kernel of one call was obtained, resolved when shown (the launch, which compiles
    or loads it, comes after the lookup): "memory hit", "disk hit" or "compiled".

    It compares the dispatchers' disk-cache counters with those at lookup time: a compile
    since then means "compiled", a load from numba's cache "disk hit"; otherwise the kernel
    was already in this process ("memory hit"). Compares equal to its text."""

    __slots__ = ("_dispatchers", "_before", "_memory_hit")

    def __init__(self, kernel, memory_hit):
        self._dispatchers = dispatchers_in(kernel)
        self._before = _disk_counts(self._dispatchers)
        self._memory_hit = bool(memory_hit)

    @property
    def text(self):
        loads, compiles = _disk_counts(self._dispatchers)
        if compiles > self._before[1]:
            return "compiled"
        if loads > self._before[0]:
            return "disk hit"
        if self._memory_hit or self._dispatchers:
            return "memory hit"
        return "built"  # made in this call, with no numba dispatcher to ask

    def __str__(self):
        return self.text

    def __format__(self, spec):
        return format(self.text, spec)

    def __repr__(self):
        return f"KernelSource({self.text!r})"

    def __eq__(self, other):
        return self.text == other if isinstance(other, str) else NotImplemented

    def __hash__(self):
        return hash(self.text)


def source(kernel, memory_hit):
    """A `KernelSource` for `kernel`, looked up with outcome `memory_hit`; take it before the
    launch, show it after."""
    return KernelSource(kernel, memory_hit)


# --------------------------------------------------------------------------- first compile notice
_FAMILY_OF = {}      # id(dispatcher) -> family name, for dispatchers built through a KernelCache
_ANNOUNCED = set()   # families announced in this process
_LISTENING = False


def quiet():
    """True when TIGA_NUMBA_QUIET asks for no compile notice (read at each notice)."""
    return os.environ.get("TIGA_NUMBA_QUIET", "") not in ("", "0")


def _family(key):
    """'cpu blocks.forward' from ("cpu", "blocks.forward", dtype, ...); 'gat-cpu' when the
    second element is not a name (a score-network spec)."""
    if not isinstance(key, tuple) or not key:
        return str(key)
    head = str(key[0])
    return f"{head} {key[1]}" if len(key) > 1 and isinstance(key[1], str) else head


def _announce_compiles(kernel, family):
    dispatchers = dispatchers_in(kernel)
    if not dispatchers:
        return
    for d in dispatchers:
        _FAMILY_OF[id(d)] = family
    _listen()


def _listen():
    global _LISTENING
    if _LISTENING:
        return
    try:
        from numba.core import event
    except ImportError:  # pragma: no cover - numba is a core dependency
        return

    class _CompileNotice(event.Listener):
        def on_start(self, ev):
            data = ev.data if isinstance(ev.data, dict) else {}
            dispatcher = data.get("dispatcher")
            family = _FAMILY_OF.get(id(dispatcher))
            if family is None:
                return
            if "_mod_" in getattr(getattr(dispatcher, "py_func", None), "__qualname__", ""):
                # score_codegen.jit_kernel: one kernel per modifier expression
                family = f"{family} kernels for a score modifier (once per expression; cached on disk)"
            else:
                family = f"{family} kernels (once; cached on disk)"
            if family in _ANNOUNCED:
                return
            _ANNOUNCED.add(family)
            if not quiet():
                sys.stderr.write(f"tiga_numba: compiling {family}\n")
                sys.stderr.flush()

        def on_end(self, ev):
            pass

    event.register("numba:compile", _CompileNotice())
    _LISTENING = True


def _drop(table, oid, ref):
    slot = table.get(oid)
    if slot is not None and slot[0] is ref:  # not a newer owner that reused the id
        del table[oid]


KERNELS = KernelCache()
