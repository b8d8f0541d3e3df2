"""Tensor-core attention entry points for the CUDA backend (docs/INTERNALS.md contract).

supports(plan, q, k, v, relation) -> bool      this path can run the request exactly
forward(plan, q, k, v, relation, edge_bias=None) -> (out, m, l)
backward(plan, dout, q, k, v, out, m, l, relation, transpose, edge_bias=None) -> (dq, dk, dv, None)

Scope: BlockRelation (dense rectangular, triangular, segments / cu_seqlens, cat of those),
float16, bfloat16 and float32 inputs, head dims 64 and 128 with Dv == D (on compute capability
9.0, the wgmma kernels: also 32 and 96), any H % Hkv == 0, any
strides (16-byte aligned rows are read in place, anything else is copied once and the copy
recorded), no edge bias (the CUDA-core kernels take that); tile pruning in the forward.
Kernels take raw device addresses and scalars only, so a bfloat16 array needs no numba dtype:
anything with __cuda_array_interface__ whose dtype is named "bfloat16" (ml_dtypes) works.

Accuracy policy. float16 / bfloat16: operands in their own precision, products and the softmax
in float32. float32: fp32-class results, never plain TF32 or bf16. On compute capability 9.0
every product runs on wgmma with each operand split into three bfloat16 parts (x = hi + mid + lo
to ~2^-24, six part products per product, smallest first); elsewhere (or TIGA_NUMBA_WGMMA=0) as
3xTF32 on mma.m16n8k8.tf32 (x = big + small, both tf32 by cvt.rna; C += a_big b_small + a_small
b_big + a_big b_big). Both accumulate in fp32 and sum the P.B products per streamed block in
fresh tiles added in ordinary fp32, because the tensor cores' accumulation truncates. Relative
error against a float64 oracle on the emulator: ~3e-7 (bf16 x 3) and ~1e-6 (3xTF32) forward, a few
times that for gradients; tests hold both to the CUDA-core float32 tolerances, which plain TF32
(~5e-4) and plain bf16 fail. m and l are float32 as the contract says; ex2.approx (2 ulp) is the
only other approximation. run_info["precision"] says which ran.
TIGA_NUMBA_FP32_TENSOR_CORES=0 keeps float32 on the CUDA-core kernels (plain fp32 FMA), e.g. to
reproduce earlier bits; it is read on every call.
"""
from __future__ import annotations

import dataclasses
import math
import os
import weakref

import numpy as np

from ...kernel_cache import KERNELS
from ...plan import defer_counts
from . import generator as G
from . import schedule

TC_DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128)
#: head dims served on compute capability 9.0 by the wgmma kernels, every dtype (rows padded to
#: whole 128-byte sub-tile rows, Variant.row_bytes); elsewhere 32 / 96 go to the CUDA-core kernels
WGMMA_HEAD_DIMS = (32, 64, 96, 128)
#: head dims whose float32 calls come here off sm_90 (3xTF32): only where it measured faster than
#: the CUDA-core float32 kernels (bench_tc.py fp32 section, H200, 2026-11-29); the rest stay on CUDA cores
F32_HEAD_DIMS = (64, 128)

#: per (kernel kind, head dim): warps, m16 tiles per warp, streamed block width, resident operand
#: in shared memory. Chosen by benchmarks/bench_tc.py's sweep on the H200 (2026-11-29); the
#: D = 128 shapes use dynamic shared memory (64-96 KB). Other head dims are not served here.
TUNING = {
    ("fwd", 64): dict(NW=4, MT=2, BN=64),
    ("fwd", 128): dict(NW=4, MT=2, BN=32, a_smem=True),
    ("dq", 64): dict(NW=4, MT=1, BN=64),
    ("dq", 128): dict(NW=4, MT=1, BN=64, a_smem=True),
    ("dkdv", 64): dict(NW=4, MT=1, BN=64),
    ("dkdv", 128): dict(NW=4, MT=1, BN=32, a_smem=True),
}
#: shapes of the fused dK/dV/dQ kernel (Variant.fuse_dq: 5 products, ordered dQ accumulation) per
#: (16-bit or float32, D). Not shipped: on the H200 (benchmarks/results/tc-bwd-h200-2026-11-29.txt)
#: the two-kernel backward was faster in every cell; benchmarks/tuning/bench_tc_bwd.py runs the A/B.
FUSED_DKDV = {
    ("float16", 64): dict(NW=4, MT=1, BN=64, a_smem=True), ("float16", 128): dict(NW=4, MT=1, BN=32, a_smem=True),
    ("float32", 64): dict(NW=4, MT=1, BN=32, a_smem=True), ("float32", 128): dict(NW=4, MT=1, BN=16, a_smem=True),
}


#: opt-in, not deterministic (TIGA_NUMBA_DETERMINISTIC=0): the fused dK/dV/dQ kernel adding dQ with
#: float atomics, for the (dtype, D) where it beat the deterministic two-kernel backward in every
#: cell on the H200 (benchmarks/results/tc-bwd-h200-2026-11-29.txt; final kernels: float32 D=64
#: 16-33 %, D=128 2-25 % faster). 16-bit: within 2 % at D=64 but for one cell, slower at D=128: not offered.
ATOMIC_DQ = {("float32", 64): dict(NW=4, MT=1, BN=32, a_smem=True),
             ("float32", 128): dict(NW=4, MT=1, BN=16, a_smem=True)}
#: the same opt-in on sm_90a (16-bit; D -> shape, the whole wgmma Variant fields as in TUNING_WGMMA):
#: the fused wgmma kernel with dQ added by red.global. Empty: it was not faster than the overlapped
#: two-kernel backward (results/wgmma-fused-bwd-h200-2026-11-30.txt)
ATOMIC_DQ_WGMMA = {}


#: float32 (3xTF32) shapes, same keys: fp32 tiles take twice the shared memory and each A/B
#: fragment twice the registers (big and small halves), so MT = 1; the CTA's own operand stays in
#: shared memory but for the D = 64 forward. 8 warps (BM = 128: each streamed block feeds twice the
#: warps) won for the forwards and the D = 128 backward in the --wide sweep on the H200
#: (2026-11-29, benchmarks/results/tc-fp32-h200-2026-11-29.txt, --wide sweep: fwd D=128 5.45 -> 5.08 ms,
#: bwd D=128 25.7 -> 22.2 ms, fwd D=64 2.52 -> 2.49 ms; bwd D=64 stayed with 4 warps: 10.7 vs 11.2).
TUNING_F32 = {
    ("fwd", 64): dict(NW=8, MT=1, BN=64),
    ("fwd", 128): dict(NW=8, MT=1, BN=32, a_smem=True),
    ("dq", 64): dict(NW=4, MT=1, BN=32, a_smem=True),
    ("dq", 128): dict(NW=8, MT=1, BN=32, a_smem=True),
    ("dkdv", 64): dict(NW=4, MT=1, BN=32, a_smem=True),
    ("dkdv", 128): dict(NW=8, MT=1, BN=16, a_smem=True),
}
# dq D = 128: BN = 64 was 3% faster in the first sweep (before per-block partials) but then
# spilled and did not finish compiling within 190 s on the H200 in the second sweep; BN = 32 did.


#: 16-bit shapes on compute capability 9.0 (H100 / H200): warpgroup wgmma products, compiled
#: for sm_90a (generator "wgmma"); each warpgroup owns 64 rows (NW = 4: one group, 8: two).
#: Chosen by benchmarks/tuning/bench_wgmma.py's sweep on the H200 (2026-11-29, results/wgmma-h200-2026-11-29.txt;
#: sum over N = 4096 / 16384 x causal 0 / 1): fwd D=64 4.35 ms (NW=4 BN=64: 4.36,
#: NW=8 BN=128: 5.51), fwd D=128 8.27 (NW=4 BN=64 8.54, NW=4 BN=128 11.0), bwd D=64 18.1 (BN=64: 20.4;
#: 8 warps 18.6-30.4), bwd D=128 29.4 (dK/dV with 8 warps: 31.2; 4 warps BN=64 / 32 throughout: 37.1).
TUNING_WGMMA = {
    ("fwd", 64): dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True),
    ("fwd", 128): dict(NW=8, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dq", 64): dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dq", 128): dict(NW=8, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dkdv", 64): dict(NW=4, MT=1, BN=128, a_smem=True, wgmma=True),
    ("dkdv", 128): dict(NW=4, MT=1, BN=64, a_smem=True, wgmma=True),
}


def _padded_dims(table):
    """D = 32 / 96 run the shapes of D = 64 / 128 (rows padded to whole 128-byte sub-tile rows)."""
    table.update({(kind, d): dict(table[(kind, like)]) for kind in ("fwd", "dq", "dkdv")
                  for d, like in ((32, 64), (96, 128))})


# 16-bit: a sweep of their own candidates (results/wgmma-h200-2026-11-29.txt) chose the same ones (no spills at 159-253 /
# 176-246 registers, ptxas report)
_padded_dims(TUNING_WGMMA)


#: float32 on compute capability 9.0: the same wgmma kernels on bf16 x 3 operand parts
#: (generator "split": 6 passes per product, per-block partials). Three bf16 parts take 1.5x the
#: shared memory of a float32 tile and a float32 staging tile is added, so blocks are narrower
#: than the 16-bit ones; D = 128 backward kernels hold one warpgroup (two would not fit).
#: Chosen by benchmarks/tuning/bench_fp32_wgmma.py's sweep on the H200 (2026-11-30,
#: results/fp32-wgmma-h200-2026-11-30.txt; sum over N = 4096 / 16384 x causal 0 / 1): fwd D=64
#: 19.5 ms (NW=4 BN=64: 23.2, BN=128: 31.1), fwd D=128 43.8 (NW=4 BN=64: 59.1, BN=32: 66.6), bwd D=64
#: 86.4 (4 warps: 88.3-96.5), bwd D=128 225 (dK/dV BN=16: 296); a later sweep: dK/dV D=128 with 32-column
#: P B chains (pb_cols, fewer partial registers: 236 B of spills instead of 328) 220.3.
TUNING_WGMMA_F32 = {
    ("fwd", 64): dict(NW=8, MT=1, BN=64, a_smem=True, wgmma=True),
    ("fwd", 128): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dq", 64): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dq", 128): dict(NW=4, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dkdv", 64): dict(NW=8, MT=1, BN=32, a_smem=True, wgmma=True),
    ("dkdv", 128): dict(NW=4, MT=1, BN=32, a_smem=True, wgmma=True, pb_cols=32),
}
_padded_dims(TUNING_WGMMA_F32)   # not swept separately

#: the wgmma backward overlaps its dP chain (16-bit dK/dV: and dV) with the softmax / dS work
#: (Variant.overlap), measured per kernel against the serial twin on the H200 (bench_tc_bwd.py
#: --wgmma --no-fused, results/wgmma-fused-bwd-h200-2026-11-30.txt runs 2-3): faster at D = 32 / 64 /
#: 96 (16-bit 1-11 %, float32 2-6 %; one D = 64 cell 2 % slower); at D = 128 the dK/dV kernel is
#: slower overlapped (16-bit up to 16 %; both twins run at 255 registers and ptxas reports fewer spill
#: bytes for the overlapped one, 8 vs 20 B (bench_tc_bwd.py --wgmma --no-fused --spills sm_90), so
#: the cause is not the spills; no profiler run yet) while the dQ kernel gains a little, so the
#: D = 128 dK/dV kernels keep every chain serial
for _table in (TUNING_WGMMA, TUNING_WGMMA_F32):
    _table[("dkdv", 128)]["overlap"] = False


def head_dims(dtype, wgmma):
    """the head dims (D == Dv) the tensor-core kernels of `dtype` serve, on wgmma or mma.sync."""
    if wgmma:
        return WGMMA_HEAD_DIMS
    return F32_HEAD_DIMS if dtype == "float32" else HEAD_DIMS


def tuning_table(dtype, wgmma=None):
    """the shape table for a dtype and engine: mma.sync (16-bit, or float32 as 3xTF32) or wgmma on
    sm_90 (16-bit, or float32 as bf16 x 3 splits); wgmma None: the table this call's routing uses
    (use_wgmma)."""
    if wgmma is None:
        wgmma = use_wgmma(dtype)
    if dtype == "float32":
        return TUNING_WGMMA_F32 if wgmma else TUNING_F32
    return TUNING_WGMMA if wgmma else TUNING


_VARIANTS = {}


def _entry_variant(key, shape, kind, D, Dv, dtype, **fixed):
    """the Variant of one table entry (`shape`: its Variant fields), memoised per entry object:
    asked several times per call, and a sweep that assigns a new shape dict gets a new Variant."""
    hit = _VARIANTS.get(key)
    if hit is None or hit[0] is not shape:
        hit = _VARIANTS[key] = (shape, G.Variant(kind, D, Dv, dtype=dtype, **fixed, **shape))
    return hit[1]


def variant(kind, D, Dv, dtype, wgmma=None):
    """the shipped Variant of (kind, D, dtype); wgmma None: as use_wgmma(dtype) decides now."""
    table = tuning_table(dtype, wgmma)
    return _entry_variant((kind, D, Dv, dtype, id(table)), table[(kind, D)], kind, D, Dv, dtype)


_WGMMA_DEVICES = {}


def use_wgmma(dtype):
    """True on a compute capability 9.0 device (sm_90a: H100 / H200) unless TIGA_NUMBA_WGMMA=0
    (read per call): the warpgroup kernels (float32: on bf16 x 3 splits); else the mma.sync ones
    (float32: 3xTF32)."""
    if os.environ.get("TIGA_NUMBA_WGMMA", "1") == "0":
        return False
    try:
        dev = _device()
    except Exception:  # noqa: BLE001 - no GPU / no cupy: nothing to launch on
        return False
    hit = _WGMMA_DEVICES.get(dev)
    if hit is None:
        import cupy
        hit = _WGMMA_DEVICES[dev] = cupy.cuda.Device(dev).compute_capability == "90"
    return hit


def precision(v):
    """run_info["precision"]: what the tensor cores of Variant v computed in."""
    if v.split:
        return ("bf16 x 3 splits (fp32-class: x = hi + mid + lo bfloat16 parts, 6 wgmma passes per product, "
                "fp32 accumulation, value products summed per block)")
    if v.tf32:
        return ("3xTF32 (fp32-class: x = big + small tf32 halves, 3 mma.m16n8k8.tf32 passes per product, "
                "fp32 accumulation)")
    return f"{v.dtype} operands, fp32 accumulation and softmax (mma.m16n8k16 or, on sm_90, wgmma m64nNk16)"


# ----------------------------------------------------------------------------- admission
_DTYPE_NAMES = {}


def _dtype_name(x):
    dt = getattr(x, "dtype", None)
    name = _DTYPE_NAMES.get(dt)
    if name is None:   # str(dtype) costs ~2 us per call: once per dtype object
        name = _DTYPE_NAMES[dt] = str(dt) if dt is not None else ""
    return name


def supports(plan, q, k, v, relation):
    """True when the tensor-core kernels compute this request exactly as the contract says."""
    try:
        if type(relation).__name__ != "BlockRelation":
            return False
        if getattr(plan, "score", "dot") != "dot":
            return False
        dn = _dtype_name(q)
        if dn not in TC_DTYPES or _dtype_name(k) != dn or _dtype_name(v) != dn:
            return False
        # the type first: cupy's property builds the interface dict on every instance access
        if not all(hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__")
                   for x in (q, k, v)):
            return False
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            return False
        D, Dv = int(q.shape[2]), int(v.shape[2])
        if Dv != D or int(k.shape[2]) != D:
            return False
        if D not in head_dims(dn, use_wgmma(dn)):
            return False
        if dn == "float32" and os.environ.get("TIGA_NUMBA_FP32_TENSOR_CORES", "1") == "0":
            return False   # the user's opt-out: float32 stays on the CUDA-core (SIMT fp32) kernels
        H, Hkv = int(q.shape[1]), int(k.shape[1])
        if Hkv < 1 or H % Hkv:
            return False
        scale = float(plan.scale)
        if not (scale > 0 and math.isfinite(scale)):
            return False   # the running max is taken on raw scores, then scaled
        if max(int(q.shape[0]), int(k.shape[0])) >= 2 ** 31 - 1024:
            return False
        return _device_can_run(D, Dv, dn)
    except Exception:  # noqa: BLE001 - anything unexpected means "not this path"
        return False


_DEVICE_OK = {}


def _device_can_run(D, Dv, dtype):
    """mma.sync m16n8k16 (f16/bf16) / m16n8k8 (tf32), cp.async and ldmatrix need sm_80+; every kernel's shared
    memory must fit the device's opt-in per-block limit (99 KB on sm_86/89, 227 KB on sm_90)."""
    try:
        import cupy
        key = (cupy.cuda.runtime.getDevice(), D, Dv, dtype)
        if key not in _DEVICE_OK:
            dev = cupy.cuda.Device(key[0])
            cc = int(dev.compute_capability)
            # opt-in per-block shared memory by architecture, refined by the runtime when it answers
            limit = {80: 163, 87: 163, 90: 227, 100: 227, 103: 227}.get(cc, 99) * 1024
            try:
                limit = int(cupy.cuda.runtime.deviceGetAttribute(97, dev.id))  # ...SharedMemoryPerBlockOptin
            except Exception:  # noqa: BLE001
                pass
            need = max(variant(kind, D, Dv, dtype).smem_bytes() for kind in ("fwd", "dq", "dkdv"))
            _DEVICE_OK[key] = cc >= 80 and need <= limit
        return _DEVICE_OK[key]
    except Exception:  # noqa: BLE001 - anything unexpected means "not this path"
        return False


# ----------------------------------------------------------------------------- compiled kernels
_SIGS = {"fwd": (15, 2), "dq": (18, 2), "dkdv": (21, 2)}   # (int64 args, float32 args)


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
    """$TIGA_NUMBA_CACHE_DIR/tc (default ~/.cache/tiga_numba/tc); None when caching is off
    (TIGA_NUMBA_CACHE_DIR set to "" or "0", as for the CUDA-core cubin cache)."""
    d = os.environ.get("TIGA_NUMBA_CACHE_DIR")
    if d is None:
        d = os.path.join(os.path.expanduser("~"), ".cache", "tiga_numba")
    if d in ("", "0"):
        return None
    return os.path.join(d, "tc")


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
        path = self._paths.get(_device()) if self._paths else None
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
        dev = _device()
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
        dev = _device()
        return self._paths[dev][0] if dev in self._launched else None


def _device():
    """the current CUDA device id (launch.py's, bound to cupy's runtime call on first use)."""
    from .. import launch as L
    return L._get_device()


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


# ----------------------------------------------------------------------------- streams
def current_stream():
    """cupy's current stream (launch.StreamRef: one wrapper per stream, shared with the CUDA-core path)."""
    from .. import launch as L   # lazy: numba.cuda loads with the first GPU use
    return L.current_stream()


# ----------------------------------------------------------------------------- operands
def _cai(x):
    return x.__cuda_array_interface__


def _operand(x, name, copies):
    """(array, address, row stride, head stride) in bytes, reading x in place when every row of
    every head starts on a 16-byte boundary with unit element stride; else one contiguous copy."""
    cai = _cai(x)
    ptr = int(cai["data"][0])
    shape = tuple(cai["shape"])
    item = int(np.dtype(cai["typestr"]).itemsize)
    strides = cai.get("strides") or (shape[1] * shape[2] * item, shape[2] * item, item)
    ok = (strides[2] == item or shape[2] <= 1) and ptr % 16 == 0 and strides[0] % 16 == 0 \
        and strides[1] % 16 == 0 and strides[0] >= 0 and strides[1] >= 0
    if not ok:
        import cupy
        x = cupy.ascontiguousarray(x)
        copies.append(f"{name}: copied to a contiguous array (strides {tuple(strides)} bytes, "
                      f"address % 16 = {ptr % 16}): tensor-core tiles load 16-byte row chunks")
        cai = _cai(x)
        ptr = int(cai["data"][0])
        strides = cai.get("strides") or (shape[1] * shape[2] * item, shape[2] * item, item)
    return x, ptr, int(strides[0]), int(strides[1])


def _empty(shape, dtype):
    import cupy
    return cupy.empty(shape, dtype=dtype)


def _ptr(x):
    return int(_cai(x)["data"][0])


# ----------------------------------------------------------------------------- schedules (cached)
_TABLES = {}


def _host_relation(relation):
    key = id(relation)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is relation:
        return hit[1]
    def host(a):
        return a.get() if hasattr(a, "get") else np.asarray(a)
    rec = dict(dst=host(relation.dst_offsets).astype(np.int64), src=host(relation.src_offsets).astype(np.int64),
               causal=host(relation.causal).astype(np.uint8), tables={})
    try:
        ref = weakref.ref(relation, lambda _r, k=key: _TABLES.pop(k, None))
    except TypeError:   # not weak-referenceable: cache nothing, recompute next call
        return rec
    _TABLES[key] = (ref, rec)
    return rec


def _work(rec, which, BM):
    import cupy
    key = (which, BM)
    t = rec["tables"].get(key)
    if t is None:
        f = schedule.query_tiles if which == "q" else schedule.key_tiles
        host = f(rec["dst"], rec["src"], rec["causal"], BM)
        t = rec["tables"][key] = (cupy.asarray(host), len(host))
    return t


def _covers(rec, which, n):
    """True when the relation's blocks tile [0, n) of `which` ("dst"/"src") without gaps, so every
    output row is written by a kernel (no zero-fill needed); memoised on the relation record."""
    key = ("covers", which, n)
    hit = rec["tables"].get(key)
    if hit is None:
        offsets = rec[which]
        hit = rec["tables"][key] = bool(len(offsets) > 0 and offsets[0] == 0 and offsets[-1] == n
                                        and np.all(np.diff(offsets) >= 0))
    return hit


def _info(plan, **kw):
    info = getattr(plan, "run_info", None)
    if info is None:
        return
    info.update(kw)


# ----------------------------------------------------------------------------- raw launches
def relation_record(dst_offsets, src_offsets, causal):
    """host-side relation (numpy offsets) for launch_forward / launch_backward callers."""
    return dict(dst=np.asarray(dst_offsets, np.int64), src=np.asarray(src_offsets, np.int64),
                causal=np.asarray(causal, np.uint8), tables={})


def launch_forward(vr, rec, H, Hkv, q, k, v, outp, mp, lp, scale, stream=None, rho=None):
    """Launch the forward on raw operands: q, k, v = (address, row stride, head stride) in bytes;
    out (num_dst, H, Dv) contiguous, m, l (num_dst, H) float32 contiguous. Returns (kernel, cache,
    tile counts): vr.prune (admission threshold `rho`) also returns the device array of per-CTA
    (pruned, visited) tile counts, else None."""
    kern, cache = kernel(vr)
    work, W = _work(rec, "q", vr.BM)
    counts = None
    if W and H:
        args = (q[0], k[0], v[0], outp, mp, lp, _ptr(work), q[1], q[2], k[1], k[2], v[1], v[2],
                H * vr.Dv * vr.GB, H // Hkv)
        if vr.prune:
            import cupy
            counts = cupy.empty((W * H, 2), cupy.int32)   # every CTA writes its slot (the emulator poisons it)
            args += (_ptr(counts), scale * G.LOG2E, -math.inf, math.log2(rho))
        else:
            args += (scale * G.LOG2E, -math.inf)
        kern((W, H), (vr.NT,), stream or current_stream(), *args)
    return kern, cache, counts


def launch_backward(vq, vk, rec, nd, H, Hkv, q, k, v, do, o, mp, lp, deltap, lse2p, dqp, dkp, dvp, scale,
                    stream=None):
    """Delta pre-pass, then dQ and dK/dV on raw operands ((address, row stride, head stride) tuples;
    outputs contiguous; delta, lse2 float32 (num_dst, H) scratch): two kernels, or one when
    vk.fuse_dq (vq is None then; dQ rows no key tile visits are left as they are: zero them).
    Returns (the main kernel, the kernels' cache state)."""
    st = stream or current_stream()
    sc = scale * G.LOG2E
    kd = delta_kernel(vk.dtype, vk.Dv)
    if nd * H:
        kd(((nd * H + 3) // 4,), (128,), st, o[0], do[0], mp, lp, deltap, lse2p, nd, H, o[1], o[2], do[1], do[2])
    states = []
    if vq is not None:
        kq, c = kernel(vq)
        states.append(c)
        work, W = _work(rec, "q", vq.BM)
        if W and H:
            kq((W, H), (vq.NT,), st, q[0], k[0], v[0], do[0], lse2p, deltap, dqp, _ptr(work),
               q[1], q[2], k[1], k[2], v[1], v[2], do[1], do[2], H * vq.D * vq.GB, H // Hkv, sc, scale)
    kk, c = kernel(vk)
    states.append(c)
    work, W = _work(rec, "k", vk.BM)
    cache = "hit" if all(x == "hit" for x in states) else "miss"
    if not (W and Hkv) and not vk.dq_atomic:   # atomic: the convert pass still writes dQ (zeros)
        return (kk if vq is None else kq), cache
    strides = (q[1], q[2], k[1], k[2], v[1], v[2], do[1], do[2], Hkv * vk.D * vk.GB, Hkv * vk.Dv * vk.GB)
    if vq is not None:
        kk((W, Hkv), (vk.NT,), st, q[0], k[0], v[0], do[0], lse2p, deltap, dkp, dvp, _ptr(work), *strides,
           H // Hkv, H, sc, scale)
        return kq, cache
    import contextlib

    import cupy
    with (cupy.cuda.ExternalStream(st.ptr) if stream is not None else contextlib.nullcontext()):
        # ordered: float32 running sums (the first visitor of a block writes before anyone reads)
        # and one turn counter per (query row, head), zeroed; atomic: zeroed sums, no counters
        acc = (cupy.zeros if vk.dq_atomic else cupy.empty)(max(nd * H * vk.D, 1), cupy.float32)
        turns = acc if vk.dq_atomic else cupy.zeros(max(nd * H, 1), cupy.int32)   # atomic: not read
        # flat grid, heads interleaved: block b = (key tile b // Hkv, kv head b % Hkv)
        if W and Hkv:
            kk((W * Hkv,), (vk.NT,), st, q[0], k[0], v[0], do[0], lse2p, deltap, dkp, dvp, dqp, _ptr(acc),
               _ptr(turns), _ptr(work), *strides, H * vk.D * vk.GB, H // Hkv, H, sc, scale)
        if vk.dq_atomic:
            _dq_from_accumulator(acc, dqp, nd * H * vk.D, vk.dtype, scale)
    return kk, cache


def _dq_from_accumulator(acc, dqp, n, dtype, scale):
    """dq_atomic's last pass: dQ = scale * float32 accumulator, in q's dtype, at raw address dqp."""
    import cupy
    if n == 0:
        return
    store = {"float16": "float16", "float32": "float32", "bfloat16": "uint16"}[dtype]
    mem = cupy.cuda.UnownedMemory(dqp, n * np.dtype(store).itemsize, None)
    out = cupy.ndarray((n,), dtype=store, memptr=cupy.cuda.MemoryPointer(mem, 0))
    if dtype == "bfloat16":   # round to nearest even on the bits (no bf16 dtype needed)
        k = _KERN.get("bf16") or _KERN.setdefault("bf16", cupy.ElementwiseKernel(
            "float32 a, float32 s", "uint16 d",
            "unsigned int b = __float_as_uint(a * s); d = (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)",
            "tiga_dq_bf16"))
    else:
        k = _KERN.get("cast") or _KERN.setdefault("cast", cupy.ElementwiseKernel(
            "float32 a, float32 s", "T d", "d = (T)(a * s)", "tiga_dq_cast"))
    k(acc[:n], np.float32(scale), out)


_KERN = {}


def backward_variants(D, Dv, dtype, deterministic=True):
    """(dQ variant, dK/dV variant) of the shipped tuning: (None, fused) when the dK/dV kernel also
    computes dQ (Variant.fuse_dq). deterministic=False picks the float-atomic fused kernel where
    the engine's atomic table (ATOMIC_DQ, ATOMIC_DQ_WGMMA) has a shape (it measured faster there),
    else the same as True."""
    if not deterministic and Dv == D:
        va = atomic_variant(D, dtype, use_wgmma(dtype))
        if va is not None:
            return None, va
    vk = variant("dkdv", D, Dv, dtype)
    return (None if vk.fuse_dq else variant("dq", D, Dv, dtype)), vk


def atomic_shape(D, dtype, wgmma):
    """the opt-in float-atomic backward's tile shape for (D, dtype) on an engine, or None."""
    if wgmma:
        return None if dtype == "float32" else ATOMIC_DQ_WGMMA.get(D)
    return ATOMIC_DQ.get((dtype, D))


def atomic_variant(D, dtype, wgmma=False):
    """the opt-in float-atomic backward's Variant, or None where none is offered."""
    shape = atomic_shape(D, dtype, wgmma)
    if shape is None:
        return None
    return _entry_variant(("dkdv_atomic", D, dtype, wgmma), shape, "dkdv", D, D, dtype, fuse_dq=True, dq_atomic=True)


def deterministic():
    """False when the user opted out of bit-reproducible backward passes (TIGA_NUMBA_DETERMINISTIC=0,
    read per call, like torch.use_deterministic_algorithms(False))."""
    return os.environ.get("TIGA_NUMBA_DETERMINISTIC", "1") != "0"


def _dq_zero_fill(rec, nd, fused):
    """True when some dQ row is written by no kernel: outside every block, or (fused backward: only
    key tiles write dQ) in a block without sources."""
    if not _covers(rec, "dst", nd):
        return True
    if not fused:
        return False
    key = ("dq-unvisited", nd)
    hit = rec["tables"].get(key)
    if hit is None:
        hit = rec["tables"][key] = bool(schedule.rows_without_keys(rec["dst"], rec["src"], nd).any())
    return hit


# ----------------------------------------------------------------------------- forward
def _engine(v):
    """which tensor-core instruction a Variant's products use (explain())."""
    if v.split:
        return "wgmma m64nNk16 warpgroups on bf16 x 3 splits, 6 passes per product, sm_90a"
    if v.wgmma:
        return "wgmma m64nNk16 warpgroups, sm_90a"
    return "mma.sync m16n8k8 tf32 x3" if v.tf32 else "mma.sync m16n8k16"


def forward(plan, q, k, v, relation, edge_bias=None):
    if edge_bias is not None:
        raise NotImplementedError("edge_bias: the tensor-core path serves BlockRelation dot scores only")
    import cupy
    copies = []
    dt = _dtype_name(q)
    nd, H, D = (int(s) for s in q.shape)
    Hkv, Dv = int(v.shape[1]), int(v.shape[2])
    vr = variant("fwd", D, Dv, dt)
    rho = getattr(plan, "prune_threshold", None)
    if rho is not None:   # the admission rule compiled in (a separate kernel; exact calls never see it)
        vr = dataclasses.replace(vr, prune=True)
    q, qp, q_rs, q_hs = _operand(q, "q", copies)
    k, kp, k_rs, k_hs = _operand(k, "k", copies)
    v, vp, v_rs, v_hs = _operand(v, "v", copies)
    rec = _host_relation(relation)
    cover = _covers(rec, "dst", nd)
    out = _empty((nd, H, Dv), q.dtype) if cover else cupy.zeros((nd, H, Dv), dtype=q.dtype)
    m = cupy.empty((nd, H), cupy.float32) if cover else cupy.full((nd, H), -np.inf, cupy.float32)
    l = cupy.empty((nd, H), cupy.float32) if cover else cupy.zeros((nd, H), cupy.float32)
    kern, cache, counts = launch_forward(vr, rec, H, Hkv, (qp, q_rs, q_hs), (kp, k_rs, k_hs), (vp, v_rs, v_hs),
                                         _ptr(out), _ptr(m), _ptr(l), float(plan.scale), rho=rho)
    if rho is not None and getattr(plan, "run_info", None) is not None:
        # explain()'s tile counts, summed and read back only when asked (RunInfo), on the
        # stream that wrote them
        defer_counts(plan.run_info, lambda s=cupy.cuda.get_current_stream(): _tile_totals(counts, s))
    tc_key = ("counts", vr.BM, vr.BN)
    if tc_key not in rec["tables"]:
        rec["tables"][tc_key] = schedule.tile_counts(rec["dst"], rec["src"], rec["causal"], vr.BM, vr.BN)
    visited, total = rec["tables"][tc_key]
    _info(plan, kernel=f"tensor-core FA2 forward ({dt}, {_engine(vr)}, cp.async double buffer"
                       + (", tile pruning: near key blocks first)" if vr.prune else ")"),
          precision=precision(vr),
          tiles=f"BM={vr.BM} BN={vr.BN} warps={vr.NW}; {visited} of {total} tiles visited "
                f"(above-diagonal tiles of causal blocks skipped, masks only on diagonal/tail tiles)",
          copies=copies, cache=cache, ir={"llvm": kern.llvm, "ptx": kern.ptx})
    return out, m, l


def _tile_totals(counts, stream):
    """(pruned, visited) tiles of a pruned forward from its per-CTA counts (None: no CTA ran)."""
    if counts is None:
        return 0, 0
    with stream:   # the sum runs on the stream that wrote the counts, after the kernel
        totals = counts.sum(0, dtype="int64")
    return tuple(int(x) for x in totals.get(stream=stream))


# ----------------------------------------------------------------------------- backward
def backward(plan, dout, q, k, v, out, m, l, relation, transpose=None, edge_bias=None):
    if getattr(plan, "prune_threshold", None) is not None:
        raise NotImplementedError("tile pruning is forward-only (approximation is never dropped)")
    if edge_bias is not None:
        raise NotImplementedError("edge_bias: the tensor-core path serves BlockRelation dot scores only")
    import cupy
    copies = []
    dt = _dtype_name(q)
    nd, H, D = (int(s) for s in q.shape)
    ns, Hkv, Dv = int(v.shape[0]), int(v.shape[1]), int(v.shape[2])
    vq, vk = backward_variants(D, Dv, dt, deterministic())
    q, qp, q_rs, q_hs = _operand(q, "q", copies)
    k, kp, k_rs, k_hs = _operand(k, "k", copies)
    v, vp, v_rs, v_hs = _operand(v, "v", copies)
    for name, x in (("dout", dout), ("out", out)):
        if _dtype_name(x) != dt:   # the kernels read dO and O in q's element type
            copies.append(f"{name}: {_dtype_name(x)} -> {dt} copy (the kernels read q's element type)")
    dout = dout if _dtype_name(dout) == dt else dout.astype(q.dtype)
    out = out if _dtype_name(out) == dt else out.astype(q.dtype)
    dout, dop, do_rs, do_hs = _operand(dout, "dout", copies)
    out, op, o_rs, o_hs = _operand(out, "out", copies)
    m = cupy.ascontiguousarray(m, dtype=cupy.float32)
    l = cupy.ascontiguousarray(l, dtype=cupy.float32)
    rec = _host_relation(relation)
    zq = not vk.dq_atomic and _dq_zero_fill(rec, nd, vq is None)   # atomic: the convert pass writes every row
    zk = not _covers(rec, "src", ns)
    dq = (cupy.zeros if zq else cupy.empty)((nd, H, D), dtype=q.dtype)
    dk = (cupy.zeros if zk else cupy.empty)((ns, Hkv, D), dtype=q.dtype)
    dv = (cupy.zeros if zk else cupy.empty)((ns, Hkv, Dv), dtype=q.dtype)
    delta = cupy.empty((nd, H), cupy.float32)
    lse2 = cupy.empty((nd, H), cupy.float32)
    kq, cache = launch_backward(vq, vk, rec, nd, H, Hkv, (qp, q_rs, q_hs), (kp, k_rs, k_hs), (vp, v_rs, v_hs),
                                (dop, do_rs, do_hs), (op, o_rs, o_hs), _ptr(m), _ptr(l), _ptr(delta), _ptr(lse2),
                                _ptr(dq), _ptr(dk), _ptr(dv), float(plan.scale))
    if vq is None and vk.dq_atomic:
        how = ("Delta pre-pass, one kernel per key tile: dK/dV (GQA heads summed in-CTA) and dQ (5 products; "
               "dQ blocks added with float atomics: NOT deterministic, opted in by TIGA_NUMBA_DETERMINISTIC=0), "
               "float32 -> dtype pass")
        tiles = f"dK/dV/dQ BM={vk.BM} BN={vk.BN} warps={vk.NW}"
    elif vq is None:
        how = ("Delta pre-pass, one kernel per key tile: dK/dV (GQA heads summed in-CTA) and dQ (5 products; "
               "dQ blocks added to a float32 accumulator in a fixed key-tile order: deterministic, no atomics)")
        tiles = f"dK/dV/dQ BM={vk.BM} BN={vk.BN} warps={vk.NW}"
    else:
        how = "Delta pre-pass, dQ by query tiles, dK/dV by key tiles (GQA heads summed in-CTA, no atomics)"
        tiles = f"dQ BM={vq.BM} BN={vq.BN}; dK/dV BM={vk.BM} BN={vk.BN}"
    _info(plan, kernel=f"tensor-core FA2 backward ({dt}, {_engine(vk)}): {how}",
          precision=precision(vk), tiles=tiles,
          copies=copies, cache=cache, ir={"llvm": kq.llvm, "ptx": kq.ptx})
    return dq, dk, dv, None
