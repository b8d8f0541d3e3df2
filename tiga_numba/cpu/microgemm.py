"""Register-blocked float32 tile products of our own, and the per-machine choice between them and BLAS.

The block kernels multiply small tiles: S = Q K^T is (BM x D) @ (D x BN), O += P V is
(BM x BN) @ (BN x Dv), with D, Dv = 64 or 128 and BM, BN = 64..256, each call single-threaded
inside a prange worker. On such shapes a BLAS spends a visible share of each call packing both
operands and handling edges; on a 2-vCPU Intel Xeon (AVX-512) scipy's OpenBLAS ran them at
~110-127 GFLOP/s per core where MKL reached ~155-160 (benchmarks/results/
cpu-dense-xeon-2core-2026-12-03.txt). The product here reads A in place (row-major, unit inner
stride, any row stride; possibly transposed) and B either in place or as the column panels the
block kernels pack once per call (product_panels), and keeps an MR x NR block of C in vector
registers while it walks k: per k step NR / W vector loads of B, MR broadcasts of A and MR x NR / W
fused multiply-adds (AVX-512: 6 x 64 = 24 zmm accumulators; AVX2: 6 x 16 = 12 ymm). Each element
of C sums its k terms in order with one fused multiply-add each, so the result does not depend
on the thread count (bits may differ from the BLAS's).

Which one runs is decided per machine (`choice()`): "own" only where a short timing of the two
tile shapes, done once and cached on disk, found it faster than the BLAS; the run option
`cpu_products` ("own" / "blas" / "auto"; default from `TIGA_NUMBA_CPU_PRODUCTS`) overrides it. The
kernels are compiled per choice (the choice is part of their cache key), explain() reports it
(run_info["products"]).
"""
from __future__ import annotations

import json
import os
import time
import warnings

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import disk_cache
from .gemm import mm

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def target_features():
    """The CPU features numba compiles for: NUMBA_CPU_FEATURES where set (a portable or foreign
    target), else the host's, less AVX where NUMBA_ENABLE_AVX=0 (numba's own rule)."""
    try:
        from numba.core import config
        from numba.core.codegen import get_host_cpu_features
        flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    except Exception:  # noqa: BLE001 - no feature query: no own kernel
        return frozenset()
    return frozenset(f.strip()[1:] for f in flat.split(",") if f.strip().startswith("+"))


def target_cpu():
    """The CPU name numba compiles for (NUMBA_CPU_NAME, else the host's)."""
    from numba.core import config
    if config.CPU_NAME is not None:
        return config.CPU_NAME
    import llvmlite.binding as llb
    return llb.get_host_cpu_name()


def _lanes():
    """float32 lanes of the widest vector numba's target has: 16 (AVX-512F), 8 (AVX2 + FMA), else
    0. The target's, not the host's: code for vectors the target lacks would be split into
    narrower ones or, for the fused multiply-add, into library calls."""
    feats = target_features()
    if "avx512f" in feats:
        return 16
    if "avx2" in feats and "fma" in feats:
        return 8
    return 0


#: vector lanes, vectors per block row, rows of the main block
LANES = _lanes()
NV = 4 if LANES == 16 else 2
MR = 6
#: columns of C one block covers: the product runs where C's column count is a multiple of it
NR = NV * max(LANES, 1)


def _micro(rows):
    """intrinsic micro(a, ars, aks, b, bks, c, crs, K, add): C[rows, NR] (+ C if add) = A[rows, K] @
    B[K, NR] on float32 addresses: A(i, k) at a + 4 (i ars + k aks), B(k, j) at b + 4 (k bks + j),
    C(i, j) at c + 4 (i crs + j). The accumulators are allocas that LLVM promotes to registers."""
    W = max(LANES, 1)
    VT = ir.VectorType(_F32, W)

    @intrinsic
    def micro(typingctx, a, ars, aks, b, bks, c, crs, K, add):
        sig = types.void(*([types.int64] * 9))

        def codegen(context, builder, signature, args):
            a_, ars_, aks_, b_, bks_, c_, crs_, K_, add_ = (context.cast(builder, x, t, types.int64)
                                                            for x, t in zip(args, signature.args))
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VT, [VT, VT, VT]),
                                                 f"llvm.fma.v{W}f32")
            A, B, C = (builder.inttoptr(x, _F32.as_pointer()) for x in (a_, b_, c_))
            vp = VT.as_pointer()
            zero = ir.Constant(VT, [0.0] * W)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(NV)] for _ in range(rows)]
            undef = ir.Constant(VT, ir.Undefined)
            splat = ir.Constant(ir.VectorType(_I32, W), [0] * W)
            with cgutils.for_range(builder, K_) as loop:
                k = loop.index
                brow = builder.mul(k, bks_)
                bv = [builder.load(builder.bitcast(builder.gep(B, [builder.add(brow, ir.Constant(_I64, v * W))]), vp),
                                   align=4) for v in range(NV)]
                ak = builder.mul(k, aks_)
                for r in range(rows):
                    x = builder.load(builder.gep(A, [builder.add(builder.mul(ir.Constant(_I64, r), ars_), ak)]), align=4)
                    s = builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(_I32, 0)), undef, splat)
                    for v in range(NV):
                        builder.store(builder.call(fma, [s, bv[v], builder.load(acc[r][v])]), acc[r][v])
            adding = builder.icmp_signed("!=", add_, ir.Constant(_I64, 0))
            for r in range(rows):
                for v in range(NV):
                    off = builder.add(builder.mul(ir.Constant(_I64, r), crs_), ir.Constant(_I64, v * W))
                    p = builder.bitcast(builder.gep(C, [off]), vp)
                    with builder.if_then(adding):
                        builder.store(builder.fadd(builder.load(acc[r][v]), builder.load(p, align=4)), acc[r][v])
                    builder.store(builder.load(acc[r][v]), p, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return micro


_m6, _m4, _m2, _m1 = (_micro(r) for r in (MR, 4, 2, 1))


def panel_tiles(own, BN):
    """whether packed key tiles of BN keys are held as column panels (product_panels): with the own
    products and BN a whole number of NR-column blocks. The forward, the backward and the packer
    decide with this one rule (the kernels index the packed array by it)."""
    return bool(own) and NR > 0 and BN % NR == 0


@njit(inline="always", cache=True)
def whole_blocks(cols, limit):
    """`cols` columns rounded up to whole NR-column blocks, at most `limit`: the width of a score
    product that the forward and the backward both compute (over columns past the keys, never read)
    so that the own kernel, not the BLAS, makes every score of the tile."""
    return min(limit, -(-cols // NR) * NR)


@njit(inline="always", cache=True)
def fits(a, b, c):
    """whether mm_own takes this product: float32 (4-byte unit strides, so float64 never), C's
    columns a whole number of blocks, every operand read with unit element stride along its rows."""
    return (LANES > 0 and c.shape[1] % NR == 0 and c.strides[1] == 4 and b.strides[1] == 4
            and a.strides[1] == 4 and c.shape[0] > 0)


@njit(cache=True)   # a call, not inlined: its four row-block kernels would be copied into every call site
def mm_blocks(a, bp, bks, bps, c, beta, trans_a):
    """c = op(a) @ B + beta c (beta 0 or 1), a and c float32 row-major views, op(a) = a.T when
    trans_a, B (K x C's columns) at address bp: B(k, j) at bp + 4 ((j // NR) bps + k bks + j % NR).
    One function for both layouts of B: rows in place (bks = the row stride, bps = NR) and column
    panels (bks = NR, bps = one panel's stride; see product_panels). C's column count a multiple of NR.

    Rows of C outer, column blocks inner: the MR rows of A a block reads stay in L1 while they
    meet every column block of B."""
    M = c.shape[0]
    N = c.shape[1]
    K = a.shape[0] if trans_a else a.shape[1]
    ars = 1 if trans_a else a.strides[0] // 4
    aks = a.strides[0] // 4 if trans_a else 1
    crs = c.strides[0] // 4
    ap = a.ctypes.data
    cp = c.ctypes.data
    add = 1 if beta != 0.0 else 0
    i0 = 0
    while i0 + MR <= M:
        for j0 in range(0, N, NR):
            _m6(ap + 4 * i0 * ars, ars, aks, bp + 4 * (j0 // NR) * bps, bks, cp + 4 * (i0 * crs + j0), crs, K, add)
        i0 += MR
    for j0 in range(0, N, NR):
        b0 = bp + 4 * (j0 // NR) * bps
        i = i0
        if i + 4 <= M:
            _m4(ap + 4 * i * ars, ars, aks, b0, bks, cp + 4 * (i * crs + j0), crs, K, add)
            i += 4
        if i + 2 <= M:
            _m2(ap + 4 * i * ars, ars, aks, b0, bks, cp + 4 * (i * crs + j0), crs, K, add)
            i += 2
        if i < M:
            _m1(ap + 4 * i * ars, ars, aks, b0, bks, cp + 4 * (i * crs + j0), crs, K, add)


@njit(inline="always", cache=True)
def mm_own(a, b, c, beta, trans_a):
    """c = op(a) @ b + beta c (beta 0 or 1), float32 row-major views, op(a) = a.T when trans_a;
    C's column count a multiple of NR (fits())."""
    mm_blocks(a, b.ctypes.data, b.strides[0] // 4, NR, c, beta, trans_a)


@njit(inline="always", cache=True)
def product_panels(a, bpan, c, beta, trans_a):
    """c = op(a) @ B + beta c with B held as column panels, bpan[j // NR, k, j % NR] = B(k, j)
    (panels(): each NR-column block of B contiguous, as a BLAS packs it, so that the block a
    micro-kernel walks down k is one run of memory instead of K rows a whole row stride apart,
    whose cache lines fall into a few L1 sets and evict each other). C's column count a multiple
    of NR, at most bpan.shape[0] NR; float32 only."""
    mm_blocks(a, bpan.ctypes.data, bpan.strides[1] // 4, bpan.strides[0] // 4, c, beta, trans_a)


# ----------------------------------------------------------------------------- the choice
#: the tile products timed: (M, K, N) of S = Q K^T and O += P V at a 256 x 256 tile, D = 64
CALIBRATION_SHAPES = ((256, 64, 256), (256, 256, 64))
_CHOICE = {}


@njit(inline="always", cache=True)
def product(a, b, c, beta, trans_a, trans_b, own):
    """mm(a, b, c, beta, trans_a, trans_b) through mm_own when `own` (the machine's choice,
    compiled into the kernel) and the product fits it, else through the BLAS."""
    if own and not trans_b and fits(a, b, c):
        mm_own(a, b, c, beta, trans_a)
    else:
        mm(a, b, c, beta, trans_a, trans_b)


@njit(cache=True)
def _time_products(a, b, c, reps, own):
    for _ in range(reps):
        if own:
            mm_own(a, b, c, 0.0, False)
        else:
            mm(a, b, c, 0.0, False, False)


def _machine():
    """what a calibration is valid for: the CPU, the vector width, numba and the BLAS numba calls."""
    import numba

    from .blas import blas_control
    return {"cpu": target_cpu(), "lanes": LANES, "numba": numba.__version__,
            "blas": blas_control() or "unknown", "version": 1}


def _path():
    root = disk_cache.root()
    return None if root is None else os.path.join(root, "cpu_products.json")


def calibrate(reps=30):
    """Time both products on CALIBRATION_SHAPES (one thread, as the kernels call them): (own GF/s,
    BLAS GF/s), each over the shapes' summed flops."""
    import numpy as np

    from .blas import single_threaded_blas
    rng = np.random.default_rng(0)
    flops, times = 0, [0.0, 0.0]
    with single_threaded_blas():
        for M, K, N in CALIBRATION_SHAPES:
            a, b = rng.random((M, K), dtype=np.float32), rng.random((K, N), dtype=np.float32)
            c = np.empty((M, N), np.float32)
            flops += 2 * M * K * N * reps
            for i, own in enumerate((True, False)):
                _time_products(a, b, c, 2, own)
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    _time_products(a, b, c, reps, own)
                    best = min(best, time.perf_counter() - t)
                times[i] += best
    return flops / times[0] / 1e9, flops / times[1] / 1e9


def choice(forced="auto"):
    """("own" | "blas", why): the products the float32 block kernels use on this machine; `forced`
    is the run option cpu_products ("auto": the timing)."""
    hit = _CHOICE.get(forced)
    if hit is not None:
        return hit
    if LANES == 0:
        hit = ("blas", "BLAS (no AVX2 / AVX-512 here for the own kernel)")
    elif forced != "auto":
        hit = (forced, f"{'own' if forced == 'own' else 'BLAS'} (cpu_products={forced!r})")
    else:
        hit = _calibrated()
    _CHOICE[forced] = hit
    return hit


def _calibrated():
    machine = _machine()
    path = _path()
    rec = None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                rec = json.load(f)
            if not isinstance(rec, dict) or rec.get("machine") != machine or rec.get("choice") not in ("own", "blas") \
                    or not all(isinstance(rec.get(k), (int, float)) for k in ("own_gflops", "blas_gflops")):
                warnings.warn(f"tiga_numba: ignoring the tile-product calibration in {path} (made for another "
                              "machine or package, or malformed); timing again", RuntimeWarning, stacklevel=3)
                rec = None
        except (OSError, ValueError) as exc:
            warnings.warn(f"tiga_numba: ignoring the unreadable tile-product calibration {path} ({exc}); "
                          "timing again", RuntimeWarning, stacklevel=3)
            rec = None
    if rec is None:
        own, blas = calibrate()
        rec = {"machine": machine, "own_gflops": round(own, 1), "blas_gflops": round(blas, 1),
               "choice": "own" if own > 1.05 * blas else "blas"}
        if path is not None:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                disk_cache.publish(path, json.dumps(rec))
            except OSError:
                pass
    which = "own" if rec["choice"] == "own" else "BLAS"
    return rec["choice"], (f"{which} (timed on this machine: own {rec['own_gflops']} vs BLAS "
                           f"{rec['blas_gflops']} GFLOP/s per core on 256-tile products)")
