"""Low-overhead kernel launches: raw pointers in, pre-built launch path out.

`Kernel` is the one launch class of the package: the CUDA-core kernels (blocks.py, csr.py,
decode.py, common.py, neighbors.py, gat.py) are Kernels, and the generated tensor-core kernels
are a subclass (tc/build.py: `TensorCoreKernel`) that only says how its cubin is built.

Passing cupy arrays to a numba kernel costs tens of microseconds per array (each one is
re-wrapped as a DeviceNDArray). The kernels here therefore take every array as an int64
device address and rebuild a flat 1-D array view inside the kernel (`ptr_array`), so that
all kernel arguments are scalars with an explicit signature. numba compiles the kernel once
to a cubin (kept in an on-disk cache keyed by kernel name, package sources and numba-cuda
version; a later process loads it without compiling). cupy loads the cubin, and a launch is
one `struct.pack_into` of the scalars into a parameter buffer made once per kernel plus one
cuLaunchKernel (cupy's driver binding) on cupy's current stream: no per-argument objects,
no numba dispatcher. Fallbacks, tried in order when a path cannot be set up or its first
launch on a device fails: cupy's Function call, cuda.core's launch, numba's own launch
(TIGA_NUMBA_LAUNCHER names the first one to try; benchmarks/tuning/bench_overhead.py compares them).

Under the simulator (NUMBA_ENABLE_CUDASIM=1) there are no pointers: the same kernel body is
wrapped to take host arrays directly, so the logic can be checked without a GPU.

numba and numba.cuda are imported on first use, so the tensor-core package (which subclasses
`Kernel`) still imports with numpy alone.
"""
from __future__ import annotations

import ctypes
import os
import struct
import threading

from .. import disk_cache

SIM = bool(int(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") or 0))


def simulator_has(*intrinsics):
    """Under the simulator: whether its `cuda` module offers every one of `intrinsics` (e.g.
    "shfl_xor_sync"). numba's simulator has no warp shuffles, so kernel factories compile their
    one-lane paths for it; an emulation installed on the simulator's module
    (numba.cuda.simulator.kernelapi.FakeCUDAModule) lets them check the multi-lane paths too.
    False outside the simulator."""
    if not SIM:
        return False
    from numba.cuda.simulator import kernelapi
    return all(hasattr(kernelapi.FakeCUDAModule, name) for name in intrinsics)

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
    """A kernel with a fixed all-scalar signature and a cheap launch: the one launch class.

    Every GPU kernel of the package goes through it: the CUDA-core kernels made here from a
    Python function and a parameter spec, and the generated tensor-core kernels
    (cuda/tc/build.py: `TensorCoreKernel`, a subclass that only says how its cubin and numba
    dispatcher are built). A subclass may set `dyn_smem` (dynamic shared-memory bytes passed
    at every launch and allowed on the loaded function) and `launchers` (the launch paths it
    may take, in `_LAUNCHERS` order).

    `pyfunc` is the kernel's Python function; spec lists its parameters in order as
    (name, kind, nbtype) with kind "a" for an array (an int64 device address on the GPU,
    turned into a view by `array_view` inside the kernel; a host array under the simulator)
    or "s" for a scalar. Compiled on first launch; `compile_ptx` works without a GPU.
    """

    #: dynamic shared memory of every launch, in bytes
    dyn_smem = 0
    #: the launch paths this kernel may take (a subset of _LAUNCHERS)
    launchers = None

    def __init__(self, name, pyfunc, spec, **jit_options):
        pyfunc.__name__ = pyfunc.__qualname__ = name
        self.name = name
        self.spec = spec
        self.pyfunc = pyfunc
        self.jit_options = jit_options
        import numba
        from numba import cuda
        if SIM:
            self._dispatcher = cuda.jit(pyfunc)
            self.sig = None
            return
        self._dispatcher = None
        self._set_signature(tuple(numba.int64 if kind == "a" else ty for _, kind, ty in spec))

    def _set_signature(self, argtypes):
        """The all-scalar signature, and no launch path picked yet on any device."""
        import numba
        from .numba_fixes import install
        install()   # before this kernel (or any) is compiled: see numba_fixes.py
        self.argtypes = tuple(argtypes)
        self.sig = numba.void(*self.argtypes)
        self._paths = {}  # device id -> launch path (see _LAUNCHERS)
        self._launched = set()  # devices where a launch went through (no more fallbacks)
        # (device, launcher, error text) of each launcher this kernel left for the next one:
        # what names the cause when a kernel runs on a slower path than the driver's
        self.fallbacks = []

    # -- how the kernel is built: the hooks a subclass replaces
    @property
    def dispatcher(self):
        """The numba kernel, compiled on first use (needs a GPU)."""
        if self._dispatcher is None:
            self._dispatcher = self._make_dispatcher()
        return self._dispatcher

    @dispatcher.setter
    def dispatcher(self, value):
        self._dispatcher = value

    def _make_dispatcher(self):
        from numba import cuda
        return cuda.jit(self.sig, **self.jit_options)(self.pyfunc)

    def _device_cubin(self, cc):
        """(entry name, cubin bytes) of this kernel for compute capability `cc` (cupy's "90"):
        from the on-disk cache when this exact kernel (name, package sources, numba-cuda
        version, device) was built before -- no numba compile at all -- else compiled by
        numba and stored."""
        path = _cache_path(self.name, cc, self.pyfunc.__code__.co_filename)
        hit = disk_cache.read_cubin(path)
        if hit is not None:
            return hit
        lib = self.dispatcher.overloads[self.argtypes]._codelibrary
        cubin = lib.get_cubin(cc=(int(cc[:-1]), int(cc[-1])))
        cubin = bytes(getattr(cubin, "code", cubin))  # numba-cuda 0.30: a cuda.core ObjectCode
        disk_cache.write_cubin(path, lib._entry_name, cubin)
        return lib._entry_name, cubin

    def _no_launch_path(self):
        """The message when no launch path can be set up or launched on a device."""
        return f"no launch path could be set up for kernel {self.name}"

    # -- compile-only methods: work without a GPU (CI)
    def compile_ptx(self, cc=(9, 0)):
        """PTX text for compute capability `cc`, compiled here (no device needed)."""
        from numba import cuda
        # a register cap is an option of ptxas, applied when the PTX is assembled (the GPU
        # path's cubin); the PTX text does not carry it and compile_ptx does not take it
        opts = {k: v for k, v in self.jit_options.items() if k != "max_registers"}
        ptx, _ = cuda.compile_ptx(self.pyfunc, self.argtypes, cc=cc, **opts)
        return ptx

    def ptx(self):
        """PTX of the kernel as it runs (compiled for the current device when one exists);
        memoised: explain()/ir() may ask many times."""
        if getattr(self, "_ptx_text", None) is None:
            try:
                self._ptx_text = self.dispatcher.inspect_asm(self.argtypes)
            except Exception:
                self._ptx_text = self.compile_ptx()
        return self._ptx_text

    def llvm(self):
        if getattr(self, "_llvm_text", None) is None:
            try:
                self._llvm_text = self.dispatcher.inspect_llvm(self.argtypes)
            except Exception:
                return "(LLVM IR is produced when the kernel is compiled for a device)"
        return self._llvm_text

    def resources(self):
        """dict(regs, smem, local): registers, static shared bytes and local bytes per thread,
        read from the loaded cubin when a cubin path runs on the current device (no NVVM
        compile), else from numba's kernel."""
        path = self._paths.get(_get_device()) if self._paths else None
        if path is not None and path[0] in ("driver", "cupy"):
            from cupy.cuda import driver
            f = path[2] if path[0] == "driver" else path[1].ptr
            # CU_FUNC_ATTRIBUTE_{NUM_REGS, SHARED_SIZE_BYTES, LOCAL_SIZE_BYTES}
            return dict(regs=driver.funcGetAttribute(4, f), smem=driver.funcGetAttribute(1, f),
                        local=driver.funcGetAttribute(3, f))
        k = self.dispatcher.overloads[self.argtypes]
        return dict(regs=k.get_regs_per_thread(), smem=k.get_shared_mem_per_block(),
                    local=k.get_local_mem_per_thread())

    # -- launch paths, picked once per kernel and device (see _LAUNCHERS)
    def _load_function(self):
        """(cupy Module, CUfunction) of this kernel on the current device, its dynamic
        shared-memory limit raised to `dyn_smem` (above the 48 KB default when asked)."""
        import cupy
        entry, cubin = self._device_cubin(cupy.cuda.Device().compute_capability)
        module = cupy.cuda.function.Module()
        module.load(cubin)
        func = module.get_function(entry)
        if self.dyn_smem:
            from cupy.cuda import driver
            driver.funcSetAttribute(func.ptr, 8, int(self.dyn_smem))  # ..._MAX_DYNAMIC_SHARED_SIZE_BYTES
        return module, func

    def _make_path(self, name):
        """Set up launch path `name` on the current device (raises when it is not available)."""
        if name == "driver":
            from cupy.cuda import driver
            module, func = self._load_function()
            return ("driver", driver.launchKernel, int(func.ptr), module, _Params(self.argtypes))
        if name == "cupy":
            module, func = self._load_function()
            return ("cupy", func, [_NP_SCALARS[str(t)] for t in self.argtypes], module)
        if name == "cuda.core":
            from cuda.core import LaunchConfig, launch
            func = self.dispatcher.overloads[self.argtypes]._codelibrary.get_cufunc().kernel
            return ("cuda.core", launch, LaunchConfig, func, [_CTYPES[str(t)] for t in self.argtypes])
        self.dispatcher.overloads[self.argtypes]  # noqa: B018 - compiles numba's kernel now
        return ("numba",)

    def _prepare(self, dev, skip=()):
        """The launch path for device `dev`: the first of this kernel's launchers (from
        TIGA_NUMBA_LAUNCHER on) that can be set up, minus those in `skip`."""
        allowed = self.launchers or _LAUNCHERS
        first = os.environ.get("TIGA_NUMBA_LAUNCHER", "driver")
        order = _LAUNCHERS[_LAUNCHERS.index(first):] if first in _LAUNCHERS else _LAUNCHERS
        order = [n for n in order if n in allowed] or list(allowed)
        error = None
        for name in order:
            if name in skip:
                continue
            try:
                path = self._make_path(name)
            except Exception as exc:  # this path is not available here: try the next one
                error = exc
                self.fallbacks.append((dev, name, f"set-up: {type(exc).__name__}: {exc}"))
                continue
            self._paths[dev] = path
            return path
        raise RuntimeError(self._no_launch_path()) from error

    def __call__(self, grid, block, stream, *args):
        """Launch on `stream` (a StreamRef for cupy's current stream; None under the
        simulator) with grid and block as 1- to 3-tuples."""
        if SIM:
            self.dispatcher[grid, block](*args)
            return
        if 0 in grid:   # no blocks: nothing to run (cuLaunchKernel would refuse a zero dimension)
            return
        dev = _get_device()
        if dev not in getattr(_THREAD, "devices", ()):
            _bind_context(dev)
        path = self._paths.get(dev)
        if path is not None and dev in self._launched:
            self._launch(path, grid, block, stream, args)
            return
        if path is None:
            path = self._prepare(dev)
        tried = []
        while True:  # the first launch on a device may refuse a path: fall back, once each
            try:
                self._launch(path, grid, block, stream, args)
            except (TypeError, struct.error):  # wrong arguments: a caller's bug, not the path's
                raise
            except Exception as exc:
                tried.append(path[0])
                self.fallbacks.append((dev, path[0], f"launch: {type(exc).__name__}: {exc}"))
                if path[0] == "numba":
                    raise
                path = self._prepare(dev, skip=tried)
                continue
            self._launched.add(dev)
            return

    def _launch(self, path, grid, block, stream, args):
        kind = path[0]
        if kind == "driver":
            _, launch_kernel, func, _, params = path
            params.launch(launch_kernel, func, grid, block, self.dyn_smem, stream.ptr, args)
        elif kind == "cupy":
            _, func, conv, _ = path
            func(tuple(grid), tuple(block), tuple([c(a) for c, a in zip(conv, args)]), self.dyn_smem, stream)
        elif kind == "cuda.core":
            _, launch, LaunchConfig, func, conv = path
            launch(stream.core(), LaunchConfig(grid=grid, block=block, shmem_size=self.dyn_smem), func,
                   *[c(a) for c, a in zip(conv, args)])
        else:
            self.dispatcher.overloads[self.argtypes].launch(args, grid, block, stream.numba(), self.dyn_smem)

    @property
    def launch_path(self):
        """Which launcher this kernel uses on the current device ("driver", "cupy",
        "cuda.core", "numba") once a launch went through there, else None."""
        if SIM:
            return None
        dev = _get_device()
        return self._paths[dev][0] if dev in self._launched else None


#: launch paths, fastest first. "driver": cuLaunchKernel (cupy's binding) on the cubin loaded
#: by cupy, the parameters packed into a buffer made once per kernel; "cupy": cupy's
#: RawModule-style Function call on the same cubin (converts each argument); "cuda.core":
#: cuda.core's launch of numba's compiled kernel; "numba": numba's own launch of it.
#: TIGA_NUMBA_LAUNCHER picks the first one tried (benchmarks compare them).
_LAUNCHERS = ("driver", "cupy", "cuda.core", "numba")
#: the paths that launch the cubin itself, for kernels numba's own compile cannot target
CUBIN_LAUNCHERS = ("driver", "cupy")

_FORMATS = {"int64": "q", "uint64": "Q", "int32": "i", "float32": "f", "float64": "d"}


def _np_scalars():
    import numpy as np
    return {"int64": np.int64, "uint64": np.uint64, "int32": np.int32,
            "float32": np.float32, "float64": np.float64}


_NP_SCALARS = _np_scalars()


class _Params:
    """A kernel's scalar parameters for cuLaunchKernel: one buffer holding every value at its
    natural alignment and the table of pointers to them (`kernelParams`), both made once;
    a launch only packs the values (`struct.pack_into`, one C call). The driver reads each
    parameter through its own pointer, with its size from the cubin, so the buffer layout is
    this class's alone."""

    __slots__ = ("offsets", "_struct", "_buf", "_table", "address", "_lock")

    def __init__(self, argtypes):
        fmt, off, offsets = "=", 0, []
        for t in argtypes:
            code = _FORMATS[str(t)]
            size = struct.calcsize("=" + code)
            pad = -off % size
            fmt += f"{pad}x{code}" if pad else code
            off += pad
            offsets.append(off)
            off += size
        self.offsets = tuple(offsets)
        self._struct = struct.Struct(fmt)
        self._buf = ctypes.create_string_buffer(max(off, 8))
        base = ctypes.addressof(self._buf)
        self._table = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
        self.address = ctypes.addressof(self._table)
        self._lock = threading.Lock()

    def pack(self, args):
        """Write the values (TypeError/struct.error on a wrong type or an out-of-range value)."""
        self._struct.pack_into(self._buf, 0, *args)

    def launch(self, launch_kernel, func, grid, block, smem, stream_ptr, args):
        """cuLaunchKernel (cupy's `driver.launchKernel`) of `func` with `args` packed into this
        buffer; grid/block: 1- to 3-tuples. Packing and launching hold one lock, because the
        buffer is shared by every launch of the kernel (the driver copies it at the call)."""
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        with self._lock:
            self._struct.pack_into(self._buf, 0, *args)
            launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream_ptr, self.address, 0)

    def buffer(self):
        """The packed bytes (tests read the values back through the pointer table)."""
        return self._buf.raw


#: per thread: the devices whose primary context this thread has made current
_THREAD = threading.local()


def _bind_context(dev):
    """Make device `dev`'s primary context current on this thread, once per thread. The driver
    launch path calls cuLaunchKernel directly, and a thread that has only taken cached memory
    from cupy's pool has no current context yet (CUDA_ERROR_INVALID_CONTEXT): dask's threaded
    scheduler runs tasks on such threads. cudaSetDevice initialises and binds the primary
    context, the one cupy and numba use."""
    import cupy
    cupy.cuda.runtime.setDevice(dev)
    _THREAD.devices = getattr(_THREAD, "devices", frozenset()) | {dev}


def _get_device():
    """The current device id; rebinds itself to cupy's getDevice on first use (no import or
    attribute chain per launch)."""
    global _get_device
    import cupy
    _get_device = cupy.cuda.runtime.getDevice
    return _get_device()


_SOURCE_HASH = {}  # source file (or None for the shared part) -> sha1 prefix


def _file_hash(path):
    """sha1 prefix of a file's bytes, memoised per process ('' when it cannot be read)."""
    h = _SOURCE_HASH.get(path)
    if h is None:
        import hashlib
        try:
            with open(path, "rb") as f:
                h = hashlib.sha1(f.read()).hexdigest()[:16]
        except OSError:
            h = ""
        _SOURCE_HASH[path] = h
    return h


def _shared_hash():
    """Sources every kernel of this package depends on, and the numba-cuda version."""
    h = _SOURCE_HASH.get(None)
    if h is None:
        import hashlib
        here = os.path.dirname(os.path.abspath(__file__))
        parts = [_file_hash(os.path.join(here, m)) for m in ("launch.py", "common.py", "tiles.py")]
        try:
            import numba_cuda
            parts.append(numba_cuda.__version__)
        except Exception:
            pass
        h = _SOURCE_HASH[None] = hashlib.sha1("/".join(parts).encode()).hexdigest()[:16]
    return h


def _cache_path(name, cc, source=None):
    """Cubin cache file for kernel `name` defined in file `source` (None when caching is off:
    TIGA_NUMBA_CACHE_DIR=0; disk_cache.py holds the folder). The key holds the shared sources' hash and the defining file's
    own hash, so an edit of any module that defines kernels (blocks.py, csr.py, neighbors.py,
    ...) never loads a stale cubin under an unchanged kernel name."""
    root = disk_cache.folder("cuda")
    if root is None:
        return None
    key = _shared_hash() + (_file_hash(source) if source else "")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        return None
    return os.path.join(root, f"{name}-{key}-sm{cc}.cubin")


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
            from numba import cuda
            self._numba = cuda.external_stream(self.ptr) if self.ptr else cuda.default_stream()
        return self._numba


_STREAMS = {}
_GET_STREAM = []
#: wrappers kept at most: code that makes a fresh cupy stream per call would otherwise grow the
#: table without end (a wrapper holds only the handle, so dropping them all is always safe)
MAX_STREAMS = 64


def current_stream():
    """cupy's current stream, wrapped once per stream pointer."""
    if not _GET_STREAM:
        import cupy
        _GET_STREAM.append(cupy.cuda.get_current_stream)
    ptr = _GET_STREAM[0]().ptr
    s = _STREAMS.get(ptr)
    if s is None:
        if len(_STREAMS) >= MAX_STREAMS:
            _STREAMS.clear()
        s = _STREAMS[ptr] = StreamRef(ptr)
    return s
