"""Compiled tensor-core kernels: a generated text becomes a launchable kernel (`Compiled`),
its cubin is built with compile_ptx + nvJitLink (no GPU needed) and kept in the disk cache,
and `build_cubins()` fills that cache for every shipped kernel ahead of the first call
(`python -m tiga_numba.cuda.tc.prebuild`). One `Compiled` per Variant lives in the process-wide
kernel cache (`kernel()`, `delta_kernel()`)."""
from __future__ import annotations

import math
import os

from ... import disk_cache
from ...kernel_cache import KERNELS
from . import device
from . import generator as G
from .tuning import WGMMA_HEAD_DIMS, atomic_shape, atomic_variant, head_dims, variant

_SIGS = {"fwd": (16, 2), "dq": (18, 2), "dkdv": (21, 2)}   # (int64 args, float32 args)


def signature(v):
    """(int64 args, float32 args) of a Variant's kernel: the fused dK/dV/dQ kernel takes dQ, its
    accumulator, the turn counters and dQ's row stride too; a pruned forward its tile counters and
    log2(rho)."""
    ni, nf = _SIGS[v.kind]
    if v.prune:   # the per-CTA tile counters and log2(rho)
        return ni + 1, nf + 1
    return (ni + 4 if v.fuse_dq else ni), nf


def _env(dtype):
    import numba
    from numba import cuda

    from . import ptx
    env = dict(ptx.intrinsics(dtype))
    env.update(cuda=cuda, i64=numba.int64, f32=numba.float32, u32=numba.uint32, u8=numba.uint8,
               fmaxf=max, imin=min, log2f=math.log2)
    return env



def _cache_dir():
    """the tensor-core cache folder (disk_cache.folder("tc")); None when caching is off."""
    return disk_cache.folder("tc")


def _load_cached_module(name, src, dtype):
    """Write the generated source to a real file (once per source hash) and import it, so that
    numba's on-disk cache (cache=True) works: the second process on a machine skips NVVM."""
    import hashlib
    import importlib.util
    import os

    import numba
    header = ("import math\nimport numba\nfrom numba import cuda\n"
              "from tiga_numba.cuda.tc.ptx import intrinsics as _intrinsics\n"
              f"globals().update(_intrinsics({dtype!r}))\n"
              "i64 = numba.int64; f32 = numba.float32; u32 = numba.uint32; u8 = numba.uint8\n"
              "fmaxf = max; imin = min; log2f = math.log2\n\n")
    text = header + src
    h = hashlib.sha1((text + numba.__version__ + str(_numba_cuda_version())).encode()).hexdigest()[:16]
    d = _cache_dir()
    if d is None:
        raise OSError("caching is off (TIGA_NUMBA_CACHE_DIR)")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{name}_{h}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    import sys
    modname = f"_tiga_tc_{name}_{h}"
    if modname in sys.modules:
        return sys.modules[modname].kernel
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod   # numba's cache wants the function's module importable
    # compiled from the file's text rather than through the import system: no .pyc lands in
    # the cache directory (the text is compiled once per process; numba's cache only needs
    # the code object's file name to be the real file)
    with open(path) as fh:
        exec(compile(fh.read(), path, "exec"), mod.__dict__)
    return mod.kernel


def _numba_cuda_version():
    try:
        from importlib.metadata import version
        return version("numba-cuda")
    except Exception:  # noqa: BLE001
        return "?"


class Compiled:
    """One generated kernel with an explicit all-scalar signature; cheap launches.

    The launch path runs a cubin from the cubin cache (`cubin()`: keyed by the generated text,
    the intrinsics it imports (ptx.py), the numba-cuda version and the architecture; built on a miss with compile_ptx + nvJitLink,
    which needs no GPU, so `build_cubins()` can fill the cache on any machine). numba's own
    dispatcher (NVVM compile of the same function) is made only when something needs it: the
    fallback launch paths, or PTX / LLVM / resource inspection without a loaded cubin."""

    def __init__(self, name, src, dtype, ni, nf, dyn_smem=0, wgmma=False):
        import numba
        self.name, self.src, self.dtype, self.dyn_smem = name, src, dtype, dyn_smem
        self.wgmma = wgmma   # sm_90a only: wgmma has no sm_90 (or any other arch) encoding
        self.argtypes = (numba.int64,) * ni + (numba.float32,) * nf
        self.sig = numba.void(*self.argtypes)
        self.disk_cache = None      # numba's cache=True in use (known once the function is made)
        self._fn = None
        self._dispatcher = None
        # launch path per device: a cubin is loaded into one device's context
        self._paths, self._launched = {}, set()

    def _pyfunc(self):
        """the generated kernel as a Python function: imported from a real file when possible, so
        numba's on-disk cache (cache=True) can serve the dispatcher too."""
        if self._fn is None:
            try:
                self._fn, self.disk_cache = _load_cached_module(self.name, self.src, self.dtype), True
            except Exception:  # noqa: BLE001 - read-only home, odd filesystems: compile in memory
                env = _env(self.dtype)
                exec(compile(self.src, f"<{self.name}>", "exec"), env)
                self._fn, self.disk_cache = env["kernel"], False
        return self._fn

    @property
    def dispatcher(self):
        if self._dispatcher is None:
            from numba import cuda
            fn = self._pyfunc()   # sets disk_cache: an exec'd function has no file numba could cache for
            self._dispatcher = cuda.jit(self.sig, fastmath=True, cache=bool(self.disk_cache))(fn)
            if self.dyn_smem:
                self._raise_smem_limit(self.dyn_smem)
        return self._dispatcher

    def _raise_smem_limit(self, nbytes):
        """allow nbytes of dynamic shared memory (above the 48 KB default) for numba's kernel."""
        from numba.cuda.cudadrv.driver import binding, driver
        f = self._dispatcher.overloads[self.argtypes]._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, int(nbytes), f.handle, f.device.id)

    # -- the cubin cache: one record per kernel text x arch (launch.read_cubin / write_cubin)
    def _cubin_file(self, arch):
        import hashlib
        d = _cache_dir()
        if d is None:
            return None
        key = "|".join((self.src, self.dtype, str(self.argtypes), _numba_cuda_version(), arch,
                        _intrinsics_hash(), "cubin-2"))
        return os.path.join(d, f"{self.name}_{hashlib.sha1(key.encode()).hexdigest()[:16]}-{arch}.cubin")

    def _target(self, arch):
        """the arch the kernel is built for: wgmma kernels exist for sm_90a only."""
        if self.wgmma:
            if arch not in ("sm_90", "sm_90a"):
                raise ValueError(f"{self.name}: wgmma kernels run on sm_90a only, not {arch}")
            return "sm_90a"
        return arch

    def _ptx(self, arch):
        """numba's PTX for `arch` (NVVM, no GPU); for sm_90a its `.target sm_90` line is raised."""
        import re

        from numba import cuda
        m = re.fullmatch(r"sm_(\d+)(\d)a?", arch)
        if m is None:
            raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
        ptx, _ = cuda.compile_ptx(self._pyfunc(), self.argtypes, cc=(int(m[1]), int(m[2])), fastmath=True)
        if arch.endswith("a"):
            ptx, n = re.subn(r"^\.target sm_(\d+)\s*$", f".target {arch}", ptx, count=1, flags=re.M)
            assert n == 1, "no .target line in numba's PTX"
        return ptx

    @staticmethod
    def _link(ptx, arch, verbose=False):
        from cuda.core import Linker, LinkerOptions, ObjectCode
        link = Linker(ObjectCode.from_ptx(ptx.encode()), options=LinkerOptions(arch=arch, verbose=verbose))
        return link, link.link("cubin")

    def cubin(self, arch):
        """(entry name, cubin bytes) for `arch` ("sm_90"): from the cache, else compiled here.
        wgmma kernels are built for sm_90a (numba's PTX says sm_90: its target line is raised)."""
        arch = self._target(arch)
        path = self._cubin_file(arch)
        from .. import launch as L   # lazy: numba.cuda loads with the first GPU use
        hit = L.read_cubin(path)
        if hit is not None:
            return hit
        import re
        ptx = self._ptx(arch)
        entry = re.search(r"\.entry\s+([\w$]+)", ptx).group(1)
        linked = self._link(ptx, arch)[1]
        data = bytes(getattr(linked, "code", linked))
        L.write_cubin(path, entry, data)
        return entry, data

    def ptxas(self, arch="sm_90"):
        """ptxas's report for `arch` (nvJitLink, verbose; no GPU): dict(regs, spill_stores,
        spill_loads, serialised (wgmma serialised, warning C7509), ptx, log)."""
        import re
        arch = self._target(arch)
        ptx = self._ptx(arch)
        log = self._link(ptx, arch, verbose=True)[0].get_info_log()
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        return dict(regs=int(regs.group(1)) if regs else None,
                    spill_stores=int(spill.group(1)) if spill else 0, spill_loads=int(spill.group(2)) if spill else 0,
                    serialised="C7509" in log or "serialized" in log, ptx=ptx, log=log)

    def ptx(self):
        return self.dispatcher.inspect_asm(self.argtypes)

    def llvm(self):
        return self.dispatcher.inspect_llvm(self.argtypes)

    def resources(self):
        """registers / static shared / local bytes per thread: read from the loaded cubin when
        the driver path is in use (no NVVM compile), else from numba's kernel."""
        path = self._paths.get(device.current_device()) if self._paths else None
        if path is not None and path[0] == "driver":
            from cupy.cuda import driver
            f = path[2]   # CU_FUNC_ATTRIBUTE_{NUM_REGS, SHARED_SIZE_BYTES, LOCAL_SIZE_BYTES}
            return dict(regs=driver.funcGetAttribute(4, f), smem=driver.funcGetAttribute(1, f),
                        local=driver.funcGetAttribute(3, f))
        d, sig = self.dispatcher, self.sig
        return dict(regs=d.get_regs_per_thread(sig), smem=d.get_shared_mem_per_block(sig),
                    local=d.get_local_mem_per_thread(sig))

    # -- launch paths, fastest first, picked on the first launch (a refused path falls back once):
    #    "driver": cuLaunchKernel (cupy's binding) on the cubin loaded by cupy, parameters packed
    #    into a buffer made once (launch._Params), the path launch.Kernel uses for the CUDA-core
    #    kernels; "cuda.core": cuda.core's launch; "numba": numba's own launch.
    def _driver_path(self):
        import cupy
        from cupy.cuda import driver

        from .. import launch as L
        entry, data = self.cubin(f"sm_{cupy.cuda.Device().compute_capability}")
        module = cupy.cuda.function.Module()
        module.load(data)
        func = module.get_function(entry)
        if self.dyn_smem:
            driver.funcSetAttribute(func.ptr, 8, int(self.dyn_smem))  # ..._MAX_DYNAMIC_SHARED_SIZE_BYTES
        return ("driver", driver.launchKernel, int(func.ptr), module, L._Params(self.argtypes))

    def _core_path(self):
        import ctypes

        from cuda.core import LaunchConfig, launch
        func = self.dispatcher.overloads[self.argtypes]._codelibrary.get_cufunc().kernel
        conv = [ctypes.c_int64 if str(t) == "int64" else ctypes.c_float for t in self.argtypes]
        return ("cuda.core", launch, LaunchConfig, func, conv)

    def _next_path(self, tried):
        if self.wgmma:   # numba's own compile targets sm_90, which has no wgmma: the sm_90a cubin or nothing
            if tried:
                raise RuntimeError(f"{self.name}: the sm_90a cubin could not be launched through cupy's "
                                   "driver binding (TIGA_NUMBA_WGMMA=0 selects the mma.sync kernels)")
            return self._driver_path()
        for name, make in (("driver", self._driver_path), ("cuda.core", self._core_path)):
            if name in tried:
                continue
            try:
                return make()
            except Exception:  # noqa: BLE001 - not available with this cupy / numba-cuda
                tried.append(name)
        return ("numba",)

    def _launch(self, path, grid, block, stream, args):
        kind = path[0]
        if kind == "driver":
            _, launch_kernel, func, _, params = path
            params.launch(launch_kernel, func, grid, block, self.dyn_smem, stream.ptr, args)
        elif kind == "cuda.core":
            _, launch, LaunchConfig, func, conv = path
            launch(stream, LaunchConfig(grid=grid, block=block, shmem_size=self.dyn_smem), func,
                   *[c(a) for c, a in zip(conv, args)])
        else:
            self.dispatcher[grid, block, stream.numba(), self.dyn_smem](*args)

    def __call__(self, grid, block, stream, *args):
        dev = device.current_device()
        path = self._paths.get(dev)
        if path is not None and dev in self._launched:
            self._launch(path, grid, block, stream, args)
            return
        tried = []
        if path is None:
            path = self._paths[dev] = self._next_path(tried)
        while True:   # the first launch on a device may refuse a path: fall back, once each
            try:
                self._launch(path, grid, block, stream, args)
            except Exception:  # noqa: BLE001
                if path[0] == "numba":
                    raise
                tried.append(path[0])
                path = self._paths[dev] = self._next_path(tried)
                continue
            self._launched.add(dev)
            return

    @property
    def launch_path(self):
        """"driver", "cuda.core" or "numba" once launched on the current device, else None."""
        dev = device.current_device()
        return self._paths[dev][0] if dev in self._launched else None



_INTRINSICS_HASH = []


def _intrinsics_hash():
    """sha1 of what the generated text imports but does not contain: ptx.py (the inline-PTX
    intrinsics) and this module's header for the generated file, so an edit of either never
    serves a stale cubin."""
    if not _INTRINSICS_HASH:
        import hashlib
        import inspect

        from . import ptx
        h = hashlib.sha1()
        for text in (inspect.getsource(ptx), inspect.getsource(_load_cached_module), inspect.getsource(_env)):
            h.update(text.encode())
        _INTRINSICS_HASH.append(h.hexdigest()[:16])
    return _INTRINSICS_HASH[0]


def kernel(v):
    """(compiled kernel, cache 'hit'/'miss') for a Variant."""
    before = KERNELS.misses
    ni, nf = signature(v)
    k = KERNELS.get(("tc", v), lambda: Compiled(v.name(), G.gen_source(v), v.dtype, ni, nf,
                                                v.smem_bytes() if v.dynamic_smem else 0, v.wgmma))
    return k, ("miss" if KERNELS.misses > before else "hit")


def delta_kernel(dtype, Dv):
    return KERNELS.get(("tc-delta", dtype, Dv),
                       lambda: Compiled(f"tc_delta_{dtype}_dv{Dv}", G.gen_delta(dtype, Dv), dtype, 12, 0))


def shipped_kernels(dtypes=("float16", "bfloat16", "float32")):
    """every kernel the dispatcher can launch for `dtypes`: (kind, D, dtype) triples of the
    tuning tables plus the Delta pre-pass ("delta", Dv, dtype) and the opt-in float-atomic backward
    ("dkdv_atomic", D, dtype; "wg:dkdv_atomic" on sm_90a)."""
    out = []
    for dt in dtypes:
        dims = head_dims(dt, False)
        out += [(kind, D, dt) for kind in ("fwd", "dq", "dkdv") for D in dims
                if not (kind == "dq" and variant("dkdv", D, D, dt, wgmma=False).fuse_dq)]   # fused: no dQ kernel
        # the sm_90a (H100 / H200) kernels
        out += [("wg:" + kind, D, dt) for kind in ("fwd", "dq", "dkdv") for D in WGMMA_HEAD_DIMS
                if not (kind == "dq" and variant("dkdv", D, D, dt, wgmma=True).fuse_dq)]
        out += [("delta", D, dt) for D in WGMMA_HEAD_DIMS if D not in dims]
        out += [("delta", D, dt) for D in dims]
        out += [("dkdv_atomic", D, dt) for D in dims if atomic_shape(D, dt, False)]   # the opt-ins
        out += [("wg:dkdv_atomic", D, dt) for D in WGMMA_HEAD_DIMS if atomic_shape(D, dt, True)]
    return out


def build_one(kind, D, dtype, arch, shape=None):
    """compile one kernel's cubin for `arch` into the cubin cache (no GPU needed): the shipped
    shape of (kind, D, dtype), or the tile `shape` given (a dict of Variant fields)."""
    if kind == "delta":
        k = delta_kernel(dtype, D)
    elif kind in ("dkdv_atomic", "wg:dkdv_atomic"):
        k = kernel(atomic_variant(D, dtype, kind.startswith("wg:")))[0]
    elif kind.startswith("wg:"):   # built for sm_90a whatever `arch` says (Compiled.cubin)
        k = kernel(variant(kind[3:], D, D, dtype, wgmma=True))[0]
    else:
        v = G.Variant(kind, D, D, dtype=dtype, **shape).check() if shape else variant(kind, D, D, dtype, wgmma=False)
        k = kernel(v)[0]
    k.cubin(arch)
    return k.name


def build_cubins(dtypes=("float16", "bfloat16", "float32"), arch="sm_90", jobs=None, specs=None):
    """fill the cubin cache (TIGA_NUMBA_CACHE_DIR) for `arch` in parallel processes: every
    shipped kernel of `dtypes`, or the `specs` given ((kind, D, dtype[, shape]) tuples, e.g. a
    sweep's candidates); returns the kernel names. Works on a machine without a GPU, so a
    deployment (or a CI job) can pay the minutes of NVVM time once, ahead of the first call."""
    import concurrent.futures as cf
    import multiprocessing as mp
    todo = list(specs) if specs is not None else shipped_kernels(dtypes)
    if arch not in ("sm_90", "sm_90a"):   # wgmma kernels exist for sm_90a only
        todo = [s for s in todo if not s[0].startswith("wg:") and not (len(s) > 3 and s[3].get("wgmma"))]
    jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    if jobs == 1:
        return [build_one(*spec, arch=arch) if len(spec) == 3 else build_one(*spec[:3], arch, spec[3])
                for spec in todo]
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(build_one, *spec[:3], arch, spec[3] if len(spec) > 3 else None) for spec in todo]
        return [f.result() for f in futs]
