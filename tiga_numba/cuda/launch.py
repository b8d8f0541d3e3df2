"""Low-overhead kernel launches: raw pointers in, pre-built launch path out.

Passing cupy arrays to a numba kernel costs tens of microseconds per array (each one is
re-wrapped as a DeviceNDArray). The kernels here therefore take every array as an int64
device address and rebuild a flat 1-D array view inside the kernel (`ptr_array`), so that
all kernel arguments are scalars with an explicit signature. numba compiles the kernel once
to a cubin (kept in an on-disk cache keyed by kernel name, package sources and numba-cuda
version) and launched through cuda.core with ctypes scalars on cupy's current stream, skipping
numba's dispatcher (TIGA_NUMBA_LAUNCHER=cupy: through cupy's RawModule launcher instead,
not yet measured on a GPU). Fallback: numba's own kernel launch (same arguments, slower).

Under the simulator (NUMBA_ENABLE_CUDASIM=1) there are no pointers: the same kernel body is
wrapped to take host arrays directly, so the logic can be checked without a GPU.
"""
from __future__ import annotations

import ctypes
import os

import numba
from numba import cuda

SIM = bool(int(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") or 0))
# Tests may install a block-synchronous emulation of shfl_xor_sync / syncwarp in the simulator
# (valid for kernels whose whole CTA takes every shuffle: the block kernels); factories read
# this flag to compile their multi-lane paths for the simulator too.
SIM_SHUFFLES = False

_CTYPES = {"int64": ctypes.c_int64, "int32": ctypes.c_int32, "float32": ctypes.c_float,
           "float64": ctypes.c_double, "uint64": ctypes.c_uint64}

_PTR_ARRAYS = {}


def ptr_array(nbtype):
    """Intrinsic `f(ptr) -> 1-D C array of nbtype` starting at device address `ptr`.

    The view's length is nominal (2**40): every kernel computes its own in-bounds offsets.
    """
    key = str(nbtype)
    if key in _PTR_ARRAYS:
        return _PTR_ARRAYS[key]
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    arrty = types.Array(nbtype, 1, "C")

    @intrinsic
    def as_array(typingctx, ptr):
        sig = arrty(ptr)

        def codegen(context, builder, sig, args):
            ary = context.make_array(arrty)(context, builder)
            dty = context.get_data_type(nbtype)
            data = builder.inttoptr(args[0], dty.as_pointer())
            intp = context.get_value_type(types.intp)
            itemsize = context.get_abi_sizeof(dty)
            context.populate_array(ary, data=data, shape=[ir.Constant(intp, 1 << 40)],
                                   strides=[ir.Constant(intp, itemsize)],
                                   itemsize=ir.Constant(intp, itemsize), meminfo=None)
            return ary._getvalue()
        return sig, codegen

    _PTR_ARRAYS[key] = as_array
    return as_array


def _identity(x):
    return x


def array_view(nbtype):
    """What a kernel calls on an array argument: the pointer->array intrinsic on the GPU,
    the identity under the simulator (which passes host arrays)."""
    return _identity if SIM else ptr_array(nbtype)


class Kernel:
    """A kernel with a fixed all-scalar signature and a cheap launch.

    `pyfunc` is the kernel's Python function; spec lists its parameters in order as
    (name, kind, nbtype) with kind "a" for an array (an int64 device address on the GPU,
    turned into a view by `array_view` inside the kernel; a host array under the simulator)
    or "s" for a scalar. Compiled on first launch; `compile_ptx` works without a GPU.
    """

    def __init__(self, name, pyfunc, spec, **jit_options):
        pyfunc.__name__ = pyfunc.__qualname__ = name
        self.name = name
        self.spec = spec
        if SIM:
            self.pyfunc = pyfunc
            self._dispatcher = cuda.jit(pyfunc)
            self.sig = None
            self._conv = None
            return
        argtys = tuple(numba.int64 if kind == "a" else ty for _, kind, ty in spec)
        self.pyfunc = pyfunc
        self.sig = numba.void(*argtys)
        self.argtypes = argtys
        self.jit_options = jit_options
        self._dispatcher = None
        self._conv = [_CTYPES[str(t)] for t in argtys]
        self._fast = None
        self._launched = False

    @property
    def dispatcher(self):
        """The numba kernel, compiled on first use (needs a GPU)."""
        if self._dispatcher is None:
            self._dispatcher = cuda.jit(self.sig, **self.jit_options)(self.pyfunc)
        return self._dispatcher

    @dispatcher.setter
    def dispatcher(self, value):
        self._dispatcher = value

    # -- compile-only helpers: work without a GPU (CI)
    def compile_ptx(self, cc=(9, 0)):
        """PTX text for compute capability `cc`, compiled here (no device needed)."""
        ptx, _ = cuda.compile_ptx(self.pyfunc, self.argtypes, cc=cc, **self.jit_options)
        return ptx

    def ptx(self):
        """PTX of the kernel as it runs (compiled for the current device when one exists);
        memoised: explain()/ir() may ask many times."""
        if getattr(self, "_ptx", None) is None:
            try:
                self._ptx = self.dispatcher.inspect_asm(self.argtypes)
            except Exception:
                self._ptx = self.compile_ptx()
        return self._ptx

    def llvm(self):
        if getattr(self, "_llvm", None) is None:
            try:
                self._llvm = self.dispatcher.inspect_llvm(self.argtypes)
            except Exception:
                return "(LLVM IR is produced when the kernel is compiled for a device)"
        return self._llvm

    def resources(self):
        """(registers, static shared bytes, local bytes per thread) of the compiled kernel."""
        k = self.dispatcher.overloads[self.argtypes]
        return (k.get_regs_per_thread(), k.get_shared_mem_per_block(), k.get_local_mem_per_thread())

    def _cubin(self):
        """(entry name, cubin file) of this kernel for the current device: from the on-disk
        cache when this exact kernel (name, package sources, numba-cuda version, device) was
        built before -- no numba compile at all -- else compiled by numba and stored."""
        import cupy
        cc = cupy.cuda.Device().compute_capability
        path = _cache_path(self.name, cc)
        if path is None:
            import tempfile
            path = os.path.join(tempfile.mkdtemp(prefix="tiga_numba_"), f"{self.name}-sm{cc}.cubin")
        entry_path = path + ".entry"
        if os.path.exists(path) and os.path.exists(entry_path):
            with open(entry_path) as f:
                return f.read().strip(), path
        lib = self.dispatcher.overloads[self.argtypes]._codelibrary
        cubin = lib.get_cubin(cc=(int(cc[:-1]), int(cc[-1])))
        cubin = bytes(getattr(cubin, "code", cubin))  # numba-cuda 0.30: a cuda.core ObjectCode
        tag = f".{os.getpid()}.tmp"
        with open(path + tag, "wb") as f:
            f.write(cubin)
        with open(entry_path + tag, "w") as f:
            f.write(lib._entry_name)
        os.replace(path + tag, path)
        os.replace(entry_path + tag, entry_path)
        return lib._entry_name, path

    def _prepare_fast(self):
        """Pick the launch path once per kernel object: cuda.core's launch of the kernel
        (loaded from the cubin cache when present), or with TIGA_NUMBA_LAUNCHER=cupy the
        cubin as a cupy RawModule launched by cupy's Cython launcher."""
        import numpy as np
        if os.environ.get("TIGA_NUMBA_LAUNCHER", "cuda.core") == "cupy":
            conv = {"int64": np.int64, "int32": np.int32, "uint64": np.uint64,
                    "float32": np.float32, "float64": np.float64}
            try:
                import cupy
                entry, path = self._cubin()
                self._module = cupy.RawModule(path=path)
                self._fast = ("cupy", self._module.get_function(entry),
                              [conv[str(t)] for t in self.argtypes])
                return
            except Exception:  # pragma: no cover - fall back to cuda.core
                pass
        try:
            from cuda.core import LaunchConfig, ObjectCode, launch
            try:
                entry, path = self._cubin()
                with open(path, "rb") as f:
                    self._module = ObjectCode.from_cubin(f.read())
                func = self._module.get_kernel(entry)
            except Exception:  # no usable cubin: numba's own loaded module
                func = self.dispatcher.overloads[self.argtypes]._codelibrary.get_cufunc().kernel
            self._fast = ("cuda.core", launch, LaunchConfig, func)
        except Exception:  # pragma: no cover - older numba-cuda / cuda.core
            self._fast = False

    def __call__(self, grid, block, stream, *args):
        """Launch on `stream`: cupy's current stream (StreamRef), None under the simulator."""
        if SIM:
            self.dispatcher[grid, block](*args)
            return
        if self._fast is None:
            self._prepare_fast()
        fast = self._fast
        if fast and fast[0] == "cupy":
            fast[1](grid, block, tuple([c(a) for c, a in zip(fast[2], args)]))
            return
        cargs = [c(a) for c, a in zip(self._conv, args)]
        if fast:
            _, launch, LaunchConfig, func = fast
            try:
                launch(stream.core(), LaunchConfig(grid=grid, block=block), func, *cargs)
                self._launched = True
                return
            except Exception:
                if self._launched:
                    raise
                self._fast = False  # first launch refused: use numba's own launch from now on
        self._launched = True
        k = self.dispatcher.overloads[self.argtypes]
        k.launch(args, grid, block, stream.numba(), 0)

    @property
    def launch_path(self):
        """Which launcher this kernel uses ("cupy", "cuda.core", "numba", or None before use)."""
        if self._fast is None:
            return None
        return self._fast[0] if self._fast else "numba"


_SOURCE_HASH = None


def _cache_path(name, cc):
    """Cubin cache file for kernel `name` (None when caching is off: TIGA_NUMBA_CACHE_DIR=0)."""
    global _SOURCE_HASH
    root = os.environ.get("TIGA_NUMBA_CACHE_DIR", os.path.join(
        os.path.expanduser("~"), ".cache", "tiga_numba", "cuda"))
    if root in ("", "0"):
        return None
    if _SOURCE_HASH is None:
        import hashlib
        h = hashlib.sha1()
        here = os.path.dirname(os.path.abspath(__file__))
        for mod in ("launch.py", "common.py", "tiles.py", "blocks.py", "csr.py"):
            with open(os.path.join(here, mod), "rb") as f:
                h.update(f.read())
        try:
            import numba_cuda
            h.update(numba_cuda.__version__.encode())
        except Exception:
            pass
        _SOURCE_HASH = h.hexdigest()[:16]
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        return None
    return os.path.join(root, f"{name}-{_SOURCE_HASH}-sm{cc}.cubin")


class StreamRef:
    """The caller's cupy stream as cuda.core sees it (the __cuda_stream__ protocol)."""

    __slots__ = ("ptr", "_numba", "_core")

    def __init__(self, ptr):
        self.ptr = int(ptr)
        self._numba = None
        self._core = None

    def core(self):
        """A cuda.core Stream for this handle, made once (passing a foreign object per call
        costs a conversion and a DeprecationWarning in recent cuda.core)."""
        if self._core is None:
            try:
                from cuda.core import Stream
                self._core = Stream.from_handle(self.ptr) if self.ptr else Stream._legacy_default()
            except Exception:  # pragma: no cover - older cuda.core: the protocol object works
                self._core = self
        return self._core

    def __cuda_stream__(self):
        return (0, self.ptr)

    def numba(self):
        if self._numba is None:
            self._numba = cuda.external_stream(self.ptr) if self.ptr else cuda.default_stream()
        return self._numba


_STREAMS = {}


def current_stream():
    """cupy's current stream, wrapped once per stream pointer."""
    import cupy
    ptr = cupy.cuda.get_current_stream().ptr
    s = _STREAMS.get(ptr)
    if s is None:
        s = _STREAMS[ptr] = StreamRef(ptr)
    return s
