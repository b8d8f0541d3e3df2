"""Shared test machinery: the GPU marker, the GPU fixtures and the float64 attention oracle.

GPU tests. A test (or a whole module, through ``pytestmark = pytest.mark.gpu``) marked ``gpu``
is skipped here when cupy is not installed or no CUDA device answers, and only then. When cupy
and a device are present, the package's CUDA modules must import: a broken import is an error
of the test that needs it (``cupy_gpu`` fixture), never a skip.

The oracle. `attention_oracle` is the one float64 reference for attention over an explicit
boolean mask (num_dst, num_src): every new test compares against it (fresh random inputs, empty
rows, GQA H != Hkv). Empty rows give out 0, m -inf, l 0, as the contract says.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

# The CPU block kernels' tiles come from the machine (tiga_numba/cpu/tiles.py); the suite pins
# small 64 x 128 tiles so that its small shapes still cross many query and key tiles, tails and
# band edges on any machine. test_cpu_tiles.py runs the machine's own choice and others.
os.environ.setdefault("TIGA_NUMBA_CPU_TILES", "64x128")


def _test_kernels_at_llvm_o1():
    """Compile the suite's CPU kernels at LLVM -O1, into a numba cache of their own.

    A cold run is bound by numba compiles, and -O1 took a fifth off the one timed (a score
    modifier's forward + backward kernels on a 2-core machine: 23.4 s -> 18.6 s,
    benchmarks/results/suite-time-cpu-zen4-2core-2026-12-07b.txt); the tests check results, which do
    not depend on the optimisation level beyond rounding of the same order as -O3's fast-math,
    never speed (benchmarks do). numba's cache key does not hold the optimisation level, so the
    -O1 kernels go to their own NUMBA_CACHE_DIR, never where a script or a benchmark would load
    them. Left alone when NUMBA_OPT or NUMBA_CACHE_DIR is set (the caller chose). The CUDA
    kernels are unaffected: numba-cuda asks NVVM for -O3 at any NUMBA_OPT above 0."""
    if "NUMBA_OPT" in os.environ or "NUMBA_CACHE_DIR" in os.environ:
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ["NUMBA_OPT"] = "1"
    os.environ["NUMBA_CACHE_DIR"] = os.path.join(base, "tiga_numba_tests", "numba_o1")


_test_kernels_at_llvm_o1()

import numpy as np
import pytest


def _one_compile_per_kernel_across_workers():
    """Under pytest-xdist, compile each disk-cached numba specialisation in one worker only.

    Both workers often need the same kernel at about the same time (tests of one file are dealt
    to both), and numba's disk cache only helps the one that asks after the other has saved:
    otherwise both spend the 10-50 s of one compile on it. Here a worker compiles a
    specialisation of a ``cache=True`` dispatcher under an exclusive file lock named after numba's
    cache key for it (index file, signature, bytecode and closure hash); a worker that finds the
    lock taken waits, then loads the kernel from the disk cache. numba's in-process compiler
    lock is taken first, so threads of one worker never wait for each other's file locks; nested
    compiles (a kernel's callees) take their locks in call-graph order, so two workers cannot
    wait for each other. flock locks go with their process, so a crashed worker blocks nobody."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        import fcntl
        import hashlib
        import tempfile

        from numba.core import dispatcher, sigutils
        from numba.core.caching import NullCache
        from numba.core.compiler_lock import global_compiler_lock
    except ImportError:  # not POSIX, or another numba layout: compile as numba does
        return
    original = dispatcher.Dispatcher.compile
    if getattr(original, "_tiga_locked", False):
        return
    lock_dir = os.path.join(tempfile.gettempdir(), f"tiga_numba_compile_locks_{os.getuid()}")
    os.makedirs(lock_dir, exist_ok=True)

    def compile(self, sig):
        cache = getattr(self, "_cache", None)
        if cache is None or isinstance(cache, NullCache):
            return original(self, sig)
        with global_compiler_lock:
            try:
                args, _ = sigutils.normalize_signature(sig)
                if tuple(args) in self.overloads:
                    return original(self, sig)
                key = repr((cache._cache_file._index_path,
                            cache._index_key(sig, self.targetctx.codegen())))
            except Exception:  # noqa: BLE001 - no key: no lock, numba compiles as usual
                return original(self, sig)
            name = hashlib.sha1(key.encode()).hexdigest()
            with open(os.path.join(lock_dir, name), "w") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    return original(self, sig)
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)

    compile._tiga_locked = True
    dispatcher.Dispatcher.compile = compile


_one_compile_per_kernel_across_workers()


def _gpu_state():
    """(cupy module or None, reason when the GPU tests cannot run)."""
    if importlib.util.find_spec("cupy") is None:
        return None, "cupy is not installed"
    import cupy
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return cupy, "no CUDA device"
    except Exception as exc:  # noqa: BLE001 - no driver / no device: the only reasons to skip
        return cupy, f"no CUDA device ({type(exc).__name__})"
    return cupy, None


CUPY, NO_GPU = _gpu_state()


def pytest_collection_modifyitems(config, items):
    """Skip every test marked gpu, with the reason, when cupy or a device is missing."""
    if NO_GPU is None:
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cupy_gpu():
    """cupy, with the package's CUDA backend imported: skipped only without cupy or a device;
    an ImportError of tiga_numba.cuda (or its tensor-core package) fails the test."""
    if NO_GPU is not None:
        pytest.skip(NO_GPU)
    import tiga_numba.cuda.api  # noqa: F401  (must import when a GPU is present)
    import tiga_numba.cuda.tc  # noqa: F401
    return CUPY


# ----------------------------------------------------------------------------- the oracle
def attention_oracle(q, k, v, mask, scale=None, dout=None):
    """Materialised float64 attention over `mask` (num_dst, num_src) booleans.

    q (num_dst, H, D), k (num_src, Hkv, D), v (num_src, Hkv, Dv); query head h reads key/value
    head h // (H // Hkv). Returns (out, m, l) with out (num_dst, H, Dv), m the row max of the
    scaled scores and l the softmax denominator (num_dst, H); with `dout` also (dq, dk, dv), the
    gradients of sum(out * dout)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask = np.asarray(mask, bool)
    nd, H, D = q.shape
    ns, Hkv = k.shape[:2]
    g = H // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.where(mask[None], np.einsum("ihd,jhd->hij", q, kk) * scale, -np.inf)
    m = s.max(axis=-1) if ns else np.full((H, nd), -np.inf)
    p = np.where(mask[None], np.exp(s - np.where(np.isfinite(m), m, 0.0)[..., None]), 0.0)
    l = p.sum(axis=-1)
    P = p / np.where(l > 0, l, 1.0)[..., None]
    out = np.einsum("hij,jhd->ihd", P, vv)
    if dout is None:
        return out, m.T, l.T
    dout = np.asarray(dout, np.float64)
    dp = np.einsum("ihd,jhd->hij", dout, vv)
    delta = np.einsum("ihd,ihd->hi", dout, out)
    ds = P * (dp - delta[..., None]) * scale
    dq = np.einsum("hij,jhd->ihd", ds, kk)
    dk = np.einsum("hij,ihd->jhd", ds, q).reshape(ns, Hkv, g, D).sum(axis=2)
    dv = np.einsum("hij,ihd->jhd", P, dout).reshape(ns, Hkv, g, v.shape[2]).sum(axis=2)
    return out, m.T, l.T, dq, dk, dv


@pytest.fixture
def oracle():
    """The float64 attention oracle (attention_oracle) for tests that take it as a fixture."""
    return attention_oracle


def set_run_option(monkeypatch, name, value):
    """Set one run option (tiga_numba.run_options) for the rest of a test, undone with the
    monkeypatch: the environment variables are only read once, as defaults."""
    import contextvars
    import dataclasses
    from tiga_numba import run_options
    new = dataclasses.replace(run_options.current(), **{name: value not in ("0", False)})
    monkeypatch.setattr(run_options, "_CURRENT",
                        contextvars.ContextVar("tiga_numba_options", default=new))


@contextlib.contextmanager
def numba_threads(n):
    """numba's thread count set to `n` inside the block, restored after (bits-per-thread-count
    tests)."""
    import numba
    have = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(have)
