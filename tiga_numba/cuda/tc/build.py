"""Compiled tensor-core kernels: a generated text becomes a launchable kernel
(`TensorCoreKernel`, a launch.Kernel that knows how its cubin is built), its cubin is built
with compile_ptx + nvJitLink (no GPU needed) and kept in the disk cache, and `build_cubins()`
fills that cache for every shipped kernel ahead of the first call
(`python -m tiga_numba.cuda.tc.prebuild`). One `TensorCoreKernel` per Variant lives in the
process-wide kernel cache (`kernel()`, `delta_kernel()`)."""
from __future__ import annotations

import math
import os

from ... import disk_cache
from ... import score_mod as sm
from ...kernel_cache import KERNELS
from ..launch import CUBIN_LAUNCHERS, Kernel
from . import generator as G
from .tuning import (WGMMA_HEAD_DIMS, atomic_shape, atomic_variant, head_dims, narrow, narrow_kinds, variant,
                     with_modifier)

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
               fmaxf=max, imin=min, imax=max, log2f=math.log2)
    return env



def _cache_dir():
    """the tensor-core cache folder (disk_cache.folder("tc")); None when caching is off."""
    return disk_cache.folder("tc")


#: the generated file's header (what its text imports but does not contain), per dtype
_HEADER = ("import math\nimport numba\nfrom numba import cuda\n"
           "from tiga_numba.cuda.tc.ptx import intrinsics as _intrinsics\n"
           "globals().update(_intrinsics({dtype!r}))\n"
           "i64 = numba.int64; f32 = numba.float32; u32 = numba.uint32; u8 = numba.uint8\n"
           "fmaxf = max; imin = min; imax = max; log2f = math.log2\n\n")


def _load_cached_module(name, src, dtype):
    """Write the generated source to a real file (once per source hash) and import it, so that
    numba's on-disk cache (cache=True) works: the second process on a machine skips NVVM."""
    import hashlib
    import importlib.util
    import os

    import numba
    text = _HEADER.format(dtype=dtype) + src
    h = hashlib.sha1((text + numba.__version__ + str(_numba_cuda_version())).encode()).hexdigest()[:16]
    d = _cache_dir()
    if d is None:
        raise OSError("caching is off (TIGA_NUMBA_CACHE_DIR)")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{name}_{h}.py")
    if not disk_cache.holds(path, text):   # missing or damaged: written again, never imported as is
        disk_cache.publish(path, text)
    import sys
    modname = f"_tiga_tc_{name}_{h}"
    if modname in sys.modules:
        return sys.modules[modname].kernel
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod   # numba's cache wants the function's module importable
    # compiled from the text (which the file now holds) rather than through the import system:
    # no .pyc lands in the cache directory (numba's cache only needs the code object's file
    # name to be the real file)
    exec(compile(text, path, "exec"), mod.__dict__)
    return mod.kernel


def _numba_cuda_version():
    try:
        from importlib.metadata import version
        return version("numba-cuda")
    except Exception:  # noqa: BLE001
        return "?"


class TensorCoreKernel(Kernel):
    """One generated tensor-core kernel: how its cubin and its numba dispatcher are built.
    Launching is launch.Kernel's (the raw-pointer driver path and its fallbacks), with
    `dyn_smem` bytes of dynamic shared memory at every launch.

    The launch path runs a cubin from the cubin cache (`cubin()`: keyed by the generated text,
    the intrinsics it imports (ptx.py), the numba-cuda version and the architecture; built on a
    miss with compile_ptx + nvJitLink, which needs no GPU, so `build_cubins()` can fill the
    cache on any machine). numba's own dispatcher (NVVM compile of the same function) is made
    only when something needs it: the fallback launch paths, or PTX / LLVM / resource
    inspection without a loaded cubin. wgmma kernels exist for sm_90a only, which numba's own
    compile (sm_90) cannot target: they launch from their cubin or not at all."""

    def __init__(self, name, src, dtype, ni, nf, dyn_smem=0, wgmma=False, tail=()):
        import numba
        self.name, self.src, self.dtype, self.dyn_smem = name, src, dtype, dyn_smem
        self.wgmma = wgmma   # sm_90a only: wgmma has no sm_90 (or any other arch) encoding
        if wgmma:
            self.launchers = CUBIN_LAUNCHERS
        self.jit_options = dict(fastmath=True)
        self.disk_cache = None      # numba's cache=True in use (known once the function is made)
        self._fn = None
        self._dispatcher = None
        # tail: a score modifier's arguments (msc float32, then H and three addresses)
        self._set_signature((numba.int64,) * ni + (numba.float32,) * nf
                            + tuple(numba.float32 if t == "f" else numba.int64 for t in tail))

    @property
    def pyfunc(self):
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

    def _make_dispatcher(self):
        from numba import cuda
        fn = self.pyfunc   # sets disk_cache: an exec'd function has no file numba could cache for
        dispatcher = cuda.jit(self.sig, cache=bool(self.disk_cache), **self.jit_options)(fn)
        if self.dyn_smem:
            self._raise_smem_limit(dispatcher, self.dyn_smem)
        return dispatcher

    def _raise_smem_limit(self, dispatcher, nbytes):
        """allow nbytes of dynamic shared memory (above the 48 KB default) for numba's kernel."""
        from numba.cuda.cudadrv.driver import binding, driver
        f = dispatcher.overloads[self.argtypes]._codelibrary.get_cufunc()
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, int(nbytes), f.handle, f.device.id)

    def _device_cubin(self, cc):
        return self.cubin(f"sm_{cc}")

    def _no_launch_path(self):
        if self.wgmma:
            return (f"{self.name}: the sm_90a cubin could not be launched through cupy "
                    "(TIGA_NUMBA_WGMMA=0 selects the mma.sync kernels)")
        return super()._no_launch_path()

    # -- the cubin cache: one record per kernel text x arch (disk_cache.read_cubin / write_cubin)
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
        m = re.fullmatch(r"sm_(\d+)(\d)a?", arch)
        if m is None:
            raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
        ptx = self.compile_ptx(cc=(int(m[1]), int(m[2])))
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
        hit = disk_cache.read_cubin(path)
        if hit is not None:
            return hit
        import re
        ptx = self._ptx(arch)
        entry = re.search(r"\.entry\s+([\w$]+)", ptx).group(1)
        linked = self._link(ptx, arch)[1]
        data = bytes(getattr(linked, "code", linked))
        disk_cache.write_cubin(path, entry, data)
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


_INTRINSICS_HASH = []


def _intrinsics_hash():
    """sha1 of what the generated text imports but does not contain: ptx.py (the inline-PTX
    intrinsics), the generated file's header (_HEADER) and _env, so an edit of either never
    serves a stale cubin (the code that writes and imports the file is not in it: changing how
    a file is written does not re-key every cubin)."""
    if not _INTRINSICS_HASH:
        import hashlib
        import inspect

        from . import ptx
        h = hashlib.sha1()
        for text in (inspect.getsource(ptx), _HEADER, inspect.getsource(_env)):
            h.update(text.encode())
        _INTRINSICS_HASH.append(h.hexdigest()[:16])
    return _INTRINSICS_HASH[0]


def kernel(v):
    """(compiled kernel, cache 'hit'/'miss') for a Variant."""
    before = KERNELS.misses
    ni, nf = signature(v)
    tail = "fiiii" if v.mod is not None else ""   # generator.modifier.ARGS
    k = KERNELS.get(("tc", v), lambda: TensorCoreKernel(v.name(), G.gen_source(v), v.dtype, ni, nf,
                                                v.smem_bytes() if v.dynamic_smem else 0, v.wgmma, tail))
    return k, ("miss" if KERNELS.misses > before else "hit")


def delta_kernel(dtype, Dv):
    return KERNELS.get(("tc-delta", dtype, Dv),
                       lambda: TensorCoreKernel(f"tc_delta_{dtype}_dv{Dv}", G.gen_delta(dtype, Dv), dtype, 12, 0))


#: a spec's kind names its engine by a prefix (none: mma.sync, "wg:": wgmma on sm_90a) and a
#: narrow-band forward (tuning.NARROW) by the suffix "@narrow"
WGMMA_PREFIX, NARROW_SUFFIX = "wg:", "@narrow"


def _spec_kind(kind):
    """(wgmma, kernel kind, narrow-band shape) of a spec's kind."""
    wg, narrow_band = kind.startswith(WGMMA_PREFIX), kind.endswith(NARROW_SUFFIX)
    return wg, kind[len(WGMMA_PREFIX) if wg else 0:len(kind) - (len(NARROW_SUFFIX) if narrow_band else 0)], narrow_band


def _engine_kinds(dt):
    """(spec kind, D) of the forward, dQ and dK/dV kernels of dtype `dt` on both engines."""
    return ([(kind, D) for kind in ("fwd", "dq", "dkdv") for D in head_dims(dt, False)]
            + [(WGMMA_PREFIX + kind, D) for kind in ("fwd", "dq", "dkdv") for D in WGMMA_HEAD_DIMS])


def shipped_kernels(dtypes=("float16", "bfloat16", "float32")):
    """every kernel the dispatcher can launch for `dtypes`: (kind, D, dtype) triples of the
    tuning tables plus the Delta pre-pass ("delta", Dv, dtype), the opt-in float-atomic backward
    ("dkdv_atomic", D, dtype; "wg:dkdv_atomic" on sm_90a) and the narrow-band forwards
    ("wg:fwd@narrow")."""
    out = []
    for dt in dtypes:
        dims = head_dims(dt, False)
        for kind, D in _engine_kinds(dt):   # a fused dK/dV/dQ kernel has no dQ kernel beside it
            wg, base, _ = _spec_kind(kind)
            if not (base == "dq" and variant("dkdv", D, D, dt, wgmma=wg).fuse_dq):
                out.append((kind, D, dt))
        out += [("delta", D, dt) for D in WGMMA_HEAD_DIMS if D not in dims]
        out += [("delta", D, dt) for D in dims]
        out += [("dkdv_atomic", D, dt) for D in dims if atomic_shape(D, dt, False)]   # the opt-ins
        out += [(WGMMA_PREFIX + "dkdv_atomic", D, dt) for D in WGMMA_HEAD_DIMS if atomic_shape(D, dt, True)]
        out += [((WGMMA_PREFIX if wg else "") + kind + NARROW_SUFFIX, D, dt) for wg, kind, D in narrow_kinds(dt)]
        plain = [D for D in head_dims(dt, True, "forward") if D not in WGMMA_HEAD_DIMS]   # plain calls only
        out += [(WGMMA_PREFIX + kind, D, dt) for D in plain for kind in ("fwd", "dq", "dkdv")]
        out += [("delta", D, dt) for D in plain if D not in dims]
    return out


#: a modifier name's suffix in modified_kernels: the forward a call on an ordered relation runs
#: (its ALiBi distance split: modifier.Split; api.ordered)
ORDERED_SUFFIX = "@ordered"


def modified_kernels(trees, dtypes=("float16", "bfloat16", "float32")):
    """(kind, D, dtype, None, tree name) of the forward, dQ and dK/dV kernels that a call with
    one of the score modifiers `trees` (names of score_mod.FLASH_TREES) launches, on either engine;
    for a tree with ALiBi also the forwards a call on an ordered relation (causal, causal windows,
    bottom-right causal varlen) launches: name + ORDERED_SUFFIX."""
    out = []
    for name in trees:
        if name not in sm.FLASH_TREES:
            raise ValueError(f"unknown modifier {name!r}: one of {', '.join(sm.FLASH_TREES)}")
        out += [(kind, D, dt, None, name) for dt in dtypes for kind, D in _engine_kinds(dt)]
        _, alibi, _, *per_sequence = sm.FLASH_TREES[name]
        # ALiBi with the head's slopes (a per-sequence slope changes from row to row: no split)
        if alibi and not any(per_sequence):
            out += [(kind, D, dt, None, name + ORDERED_SUFFIX) for dt in dtypes for kind, D in _engine_kinds(dt)
                    if _spec_kind(kind)[1] == "fwd"]
    return out


def modified_variant(kind, D, dtype, modifier, fold=True):
    """the Variant a call with flash-attn's modifier `modifier` (a name of score_mod.FLASH_TREES,
    with ORDERED_SUFFIX: the forward of an ordered relation) launches for (kind, D, dtype); kind
    "wg:..." on the wgmma engine; fold=False: the kernel a call whose values the fold does not
    hold for takes (modifier.Fold)."""
    wg, base, _ = _spec_kind(kind)
    name, ordered = (modifier[:-len(ORDERED_SUFFIX)], True) if modifier.endswith(ORDERED_SUFFIX) else (modifier, False)
    mod = G.Modifier(sm.flash_tree(*sm.FLASH_TREES[name]), G.modifier.TANH[dtype], fold, ordered)
    return with_modifier(variant(base, D, D, dtype, wgmma=wg), mod)


def build_one(kind, D, dtype, arch, shape=None, modifier=None):
    """compile one kernel's cubin for `arch` into the cubin cache (no GPU needed): the shipped
    shape of (kind, D, dtype), or the tile `shape` given (a dict of Variant fields); with
    `modifier` (a name of score_mod.FLASH_TREES), that score modifier compiled in as a call
    compiles it (tuning.with_modifier, the dtype's tanh). wgmma kernels are built for sm_90a
    whatever `arch` says (TensorCoreKernel.cubin)."""
    wg, base, narrow_band = _spec_kind(kind)
    if modifier is not None:
        v = modified_variant(kind, D, dtype, modifier)
    elif base == "delta":
        v = None
    elif base == "dkdv_atomic":
        v = atomic_variant(D, dtype, wg)
    elif shape:
        v = G.Variant(base, D, D, dtype=dtype, **shape).check()
    else:   # narrow_band: the shape tuning.narrow gives any band it serves (0 keys wide: every one)
        v = variant(base, D, D, dtype, wgmma=wg)
        v = narrow(v, 0) if narrow_band else v
    k = delta_kernel(dtype, D) if v is None else kernel(v)[0]
    k.cubin(arch)
    return k.name


def build_cubins(dtypes=("float16", "bfloat16", "float32"), arch="sm_90", jobs=None, specs=None):
    """fill the cubin cache (TIGA_NUMBA_CACHE_DIR) for `arch` in parallel processes: every
    shipped kernel of `dtypes`, or the `specs` given ((kind, D, dtype[, shape[, modifier]])
    tuples, e.g. a sweep's candidates or modified_kernels()); returns the kernel names. Works on a machine without a GPU, so a
    deployment (or a CI job) can pay the minutes of NVVM time once, ahead of the first call."""
    import concurrent.futures as cf
    import multiprocessing as mp
    todo = list(specs) if specs is not None else shipped_kernels(dtypes)
    if arch not in ("sm_90", "sm_90a"):   # wgmma kernels exist for sm_90a only
        todo = [s for s in todo if not _spec_kind(s[0])[0] and not (len(s) > 3 and s[3] and s[3].get("wgmma"))]
    jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    if jobs == 1:
        return [build_one(*spec[:3], arch, *spec[3:]) for spec in todo]
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(build_one, *spec[:3], arch, *spec[3:]) for spec in todo]
        return [f.result() for f in futs]
