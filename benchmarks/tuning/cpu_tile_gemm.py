"""Where the CPU block kernels' time goes on this machine: the rate of the BLAS the kernels call
(scipy's OpenBLAS through numba, one thread, as each prange worker calls it) and of the package's
own tile product (cpu/microgemm.py, where this CPU has AVX2 / AVX-512; B read in place, and as the
column panels the block kernels pack) on the two tile products for several tile shapes, beside torch.mm (MKL) on the same shapes when torch is installed; then
paired rounds of whole calls with each tile shape (options(cpu_tiles=...)),
every shape timed back to back in each round so that the machine's drift cancels. First, the
ceiling these rates are measured against: the cores' fused multiply-add peak (a register-only
loop of independent FMA chains in the widest vectors numba's target has), one core and all.

    python benchmarks/tuning/cpu_tile_gemm.py [--n 4096] [--tiles 256x256,512x512,512x256] [--rounds 3]
    python benchmarks/tuning/cpu_tile_gemm.py --band   # a window's score product: K^T in place vs panels
"""
import argparse
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

import tiga_numba as tg
from tiga_numba.cpu import blas
from tiga_numba.cpu import microgemm

D, H = 64, 4


@njit
def _products(q, kt, vv, ktp, vvp, S, A, reps, which, how):
    """how: 0 the BLAS, 1 the own product with B in place, 2 with B as column panels (the kernels'
    layout: microgemm.product_panels)."""
    for _ in range(reps):
        if which == 0:   # S = Q K^T (K packed transposed, as the kernels hold it)
            if how == 2:
                microgemm.product_panels(q, ktp, S, 0.0, False)
            else:
                microgemm.product(q, kt, S, 0.0, False, False, how == 1)
        else:            # acc += P V
            if how == 2:
                microgemm.product_panels(S, vvp, A, 1.0, False)
            else:
                microgemm.product(S, vv, A, 1.0, False, False, how == 1)


def _panels(b):
    """B (K, N) as column panels (N / NR, K, NR)."""
    K, N = b.shape
    W = microgemm.NR
    return np.ascontiguousarray(b.reshape(K, N // W, W).transpose(1, 0, 2))


CHAINS = 12   # independent accumulators: more than FMA latency x pipes on current x86 cores


@intrinsic
def _fma_chains(typingctx, n):
    """n steps of CHAINS independent vector FMAs (acc = acc * b + c) held in registers; returns
    the lanes' sum so that nothing is optimised away."""
    W = max(microgemm.LANES, 1)
    VT = ir.VectorType(ir.FloatType(), W)

    def codegen(context, builder, sig, args):
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VT, [VT, VT, VT]),
                                             f"llvm.fma.v{W}f32")
        b = ir.Constant(VT, [1.0000001] * W)
        c = ir.Constant(VT, [1e-7] * W)
        acc = [cgutils.alloca_once_value(builder, ir.Constant(VT, [float(i)] * W)) for i in range(CHAINS)]
        with cgutils.for_range(builder, args[0]):
            for a in acc:
                builder.store(builder.call(fma, [builder.load(a), b, c]), a)
        total = builder.load(acc[0])
        for a in acc[1:]:
            total = builder.fadd(total, builder.load(a))
        out = builder.extract_element(total, ir.Constant(ir.IntType(32), 0))
        for i in range(1, W):
            out = builder.fadd(out, builder.extract_element(total, ir.Constant(ir.IntType(32), i)))
        return out
    return types.float32(types.int64), codegen


@njit
def _fma_one(n):
    return _fma_chains(n)


@njit(parallel=True)
def _fma_all(n, workers):
    out = np.zeros(workers, np.float32)
    for w in prange(workers):
        out[w] = _fma_chains(n)
    return out


def fma_peak():
    """GFLOP/s of the FMA loop on one core and on every numba thread at once (best of 5)."""
    import numba
    W = max(microgemm.LANES, 1)
    n = 20_000_000
    flops = 2 * W * CHAINS * n
    workers = numba.get_num_threads()
    _fma_one(1000)
    _fma_all(1000, workers)
    one = all_ = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        _fma_one(n)
        one = min(one, time.perf_counter() - t)
        t = time.perf_counter()
        _fma_all(n, workers)
        all_ = min(all_, time.perf_counter() - t)
    print(f"# FMA peak ({W}-lane float32 vectors, {CHAINS} chains): one core {flops / one / 1e9:.0f} GFLOP/s, "
          f"{workers} threads {workers * flops / all_ / 1e9:.0f} GFLOP/s", flush=True)


def gemm_rates(shapes):
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    print("# one thread, float32, D = 64: GF/s of S = Q K^T and acc += P V per tile shape")
    with blas.single_threaded_blas():
        for BM, BN in shapes:
            rng = np.random.default_rng(0)
            q, kt, vv = (rng.random(s, dtype=np.float32) for s in ((BM, D), (D, BN), (BN, D)))
            S, A = rng.random((BM, BN), dtype=np.float32), np.zeros((BM, D), np.float32)
            n = max(20, int(1e9 / (4 * BM * BN * D)))
            line = f"{BM:5} x {BN:<5}"
            panels = microgemm.LANES and BN % microgemm.NR == 0 and D % microgemm.NR == 0
            ktp, vvp = (_panels(kt), _panels(vv)) if panels else (kt[None], vv[None])
            names = ("BLAS (numba mm)", "own, B in place", "own, B as panels")
            for how in (0, 1, 2)[:3 if panels else 2 if microgemm.LANES else 1]:
                rates = []
                for which in (0, 1):
                    _products(q, kt, vv, ktp, vvp, S, A, 1, which, how)
                    t = time.perf_counter()
                    _products(q, kt, vv, ktp, vvp, S, A, n, which, how)
                    rates.append(2 * BM * BN * D / ((time.perf_counter() - t) / n) / 1e9)
                line += f" {names[how]}: {rates[0]:5.0f} {rates[1]:5.0f} "
            if torch is not None:
                tq, tk, tv, tS, tA = (torch.from_numpy(x) for x in (q, kt, vv, S, A))
                tr = []
                for f in (lambda: torch.mm(tq, tk, out=tS), lambda: torch.mm(tS, tv, out=tA)):
                    f()
                    t = time.perf_counter()
                    for _ in range(n):
                        f()
                    tr.append(2 * BM * BN * D / ((time.perf_counter() - t) / n) / 1e9)
                line += f"   torch.mm: {tr[0]:5.0f} {tr[1]:5.0f}"
            print(line, flush=True)


def paired_rounds(N, shapes, rounds):
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, H, D)).astype(np.float32) for _ in range(4))

    def run(causal, tiles):
        g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N, N)
        with tg.options(cpu_tiles=tiles):
            t = time.perf_counter()
            o, st = tg.attention(q, k, v, g, return_stats=True)
            tf = time.perf_counter() - t
            t = time.perf_counter()
            tg.attention_backward(do, q, k, v, o, st, g)
            return tf, time.perf_counter() - t
    for s in shapes:
        for c in (False, True):
            run(c, s)   # compile, warm
    res = {}
    for _ in range(rounds):
        for c in (False, True):
            for s in shapes:
                res.setdefault((c, s), []).append(run(c, s))
    print(f"# paired rounds ({rounds}), best per cell, N = {N}, H = {H}, D = {D}, float32")
    for c in (False, True):
        for s in shapes:
            tf = min(x[0] for x in res[c, s]) * 1e3
            tb = min(x[1] for x in res[c, s]) * 1e3
            print(f"{'causal' if c else 'dense '} tiles {s[0]}x{s[1]:<5} fwd {tf:7.1f} ms  bwd {tb:7.1f} ms  "
                  f"f+b {tf + tb:7.1f} ms", flush=True)


@njit
def _band_products(a, kT, c0, width, kTp, c, reps, panels):
    """16 span tiles' score products along the keys (one window's 48-row strip each): B = K^T
    read in place (rows a whole K^T row apart) or from column panels."""
    for _ in range(reps):
        for t in range(16):
            s = c0 + t * 256
            if panels:
                microgemm.product_panels(a, kTp[s // microgemm.NR:], c, 0.0, False)
            else:
                microgemm.product(a, kT[:, s:s + width], c, 0.0, False, False, True)


def band_rates(n, rounds=5):
    """GF/s of a 256-key window's score product (48 x D @ D x 304) with K^T in place, as unpacked
    blocks hold it, and as the column panels the kernels copy each tile into (blocks.panels_of_columns)."""
    rng = np.random.default_rng(0)
    W = microgemm.NR
    N = n + 512
    a = rng.random((48, D), dtype=np.float32)
    kT = rng.random((D, N), dtype=np.float32)
    kTp = np.ascontiguousarray(kT.reshape(D, N // W, W).transpose(1, 0, 2))
    width = 304
    c = np.empty((48, width), np.float32)
    for panels in (False, True):
        _band_products(a, kT, 16, width, kTp, c, 1, panels)
    rates = {False: [], True: []}
    reps = 300
    for _ in range(rounds):
        for panels in (False, True):
            t = time.perf_counter()
            _band_products(a, kT, 16, width, kTp, c, reps, panels)
            rates[panels].append(2 * 48 * D * width * 16 * reps / (time.perf_counter() - t) / 1e9)
    print(f"# one thread: a 256-key window's score product 48 x {D} @ {D} x {width}, median of {rounds}: "
          f"K^T in place (row stride {N * 4} B) {np.median(rates[False]):.1f} GFLOP/s, "
          f"as column panels {np.median(rates[True]):.1f} GFLOP/s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--tiles", default="256x256,512x512,512x256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-calls", action="store_true", help="BLAS rates only")
    p.add_argument("--band", action="store_true",
                   help="only a window's score product with K^T in place and as column panels")
    a = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.tiles.split(",")]
    if a.band:
        fma_peak()
        band_rates(a.n)
        return
    fma_peak()
    gemm_rates([(128, 128)] + shapes)
    if not a.no_calls:
        paired_rounds(a.n, shapes, a.rounds)


if __name__ == "__main__":
    main()
