"""Two per-cell costs of the CPU block kernels on this machine, one thread:

(1) the score product of a narrow band's span tile (64 query rows x the band's keys, D = 64): the
    BLAS with K rows as the transposed operand (what unpacked tiles took before K^T was kept),
    the BLAS's A @ B on K^T, and the own tile product on K^T over a whole number of its column
    blocks (cpu/microgemm.py; where this CPU has AVX2 / AVX-512);
(2) ns per score cell of the float32 math the kernels run per cell: exp2 (the softmax), the
    soft-cap value cap * tanh(s / cap) as the generated modifier computes it, and the same value
    with the exp2-based tanh form (1 - t) / (1 + t), t = exp(-2|x|), with its odd series below
    1/16, for comparison.

    python benchmarks/tuning/cpu_span_and_tanh.py [--keys 319] [--reps 2000]
"""
import argparse
import time

import numpy as np
from numba import njit

from tiga_numba import score_mod as sm
from tiga_numba.cpu import blas, microgemm
from tiga_numba.cpu import score_codegen as sc
from tiga_numba.cpu.fastexp import exp2f
from tiga_numba.cpu.gemm import mm

LOG2E = np.float32(1.4426950408889634)


@njit
def _scores(q, k, kT, S, reps, how, cols):
    for _ in range(reps):
        if how == 0:
            mm(q, k[100:100 + cols], S[:, :cols], 0.0, False, True)
        elif how == 1:
            mm(q, kT[:, 100:100 + cols], S[:, :cols], 0.0, False, False)
        else:
            microgemm.mm_own(q, kT[:, 100:100 + cols], S[:, :cols], 0.0, False)


@njit(fastmath=True)
def _exp_cells(S, reps):
    for _ in range(reps):
        for r in range(S.shape[0]):
            Sr = S[r]
            for c in range(S.shape[1]):
                Sr[c] = exp2f(Sr[c] - np.float32(3.0))


@njit(inline="always", fastmath=True)
def _tanh_exp2_form(x):
    ax = abs(x)
    t = exp2f(np.float32(-2.0 * 1.4426950408889634) * ax)
    r = (np.float32(1.0) - t) / (np.float32(1.0) + t)
    x2 = ax * ax
    p = ax * (np.float32(1.0) + x2 * (np.float32(-1.0 / 3.0) + x2 * (np.float32(2.0 / 15.0) + x2 * (
        np.float32(-17.0 / 315.0) + x2 * np.float32(62.0 / 2835.0)))))
    r = p if ax < np.float32(0.0625) else r
    return r if x >= 0 else -r


def _cells(value):
    @njit(fastmath=True)
    def run(S, reps, scal, hp, nd, ns, ef):
        for _ in range(reps):
            for r in range(S.shape[0]):
                Sr = S[r]
                for c in range(S.shape[1]):
                    Sr[c] = value(Sr[c], r, c, -1, 0, scal, hp, nd, ns, ef) * LOG2E
    return run


class _Exp2Form(sc.Generated):
    """the soft-cap value generated exactly as the shipped one, with the exp2-based tanh"""

    def _globals(self, dt):
        g = super()._globals(dt)
        g["_tanh"] = _tanh_exp2_form
        return g


def best(fn, *args):
    fn(*args)   # warm-up: compiles
    t = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn(*args)
        t = min(t, time.perf_counter() - t0)
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=319, help="keys of one span tile (W + 64 - 1)")
    p.add_argument("--reps", type=int, default=2000)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    rows, D, cols = 64, 64, a.keys
    wide = -(-cols // max(microgemm.NR, 1)) * max(microgemm.NR, 1)
    q = rng.standard_normal((rows, D)).astype(np.float32)
    k = rng.standard_normal((4096, D)).astype(np.float32)
    kT = np.ascontiguousarray(k.T)
    S = np.empty((rows, 1024), np.float32)
    print(f"# span tile score product, {rows} x {D} x keys, one thread (GFLOP/s)")
    with blas.single_threaded_blas():
        for how, name, n in ((0, "BLAS, K rows transposed", cols), (1, "BLAS A @ B on K^T", cols),
                             (2, f"own on K^T ({wide} keys)", wide)):
            if how == 2 and microgemm.LANES == 0:
                continue
            t = best(_scores, q, k, kT, S, a.reps, how, n)
            print(f"{name:<28} {2 * rows * D * cols * a.reps / t / 1e9:7.1f}  (useful flops of {cols} keys)")
    print("# float32 ns per score cell, one thread (256 x 256 tile, values in [-100, 100])")
    tile = ((rng.random((256, 256)) - 0.5) * 200).astype(np.float32)
    _, hp, nd, ns, ef = sc.empty_context(np.float32)
    scal = np.array([30.0], np.float32)
    gen = sc.generated(sm.flash_tree(True, False, False), (), "float32")
    reps = 100
    t = best(_exp_cells, tile.copy(), reps)
    print(f"exp2 (softmax)                {t / (reps * tile.size) * 1e9:6.2f}")
    tree = sm.flash_tree(True, False, False)
    for name, fn in (("soft-cap value (shipped)", _cells(gen.value)),
                     ("soft-cap, exp2-based tanh", _cells(_Exp2Form(tree, (), "float32").value))):
        t = best(fn, tile.copy(), reps, scal, hp, nd, ns, ef)
        print(f"{name:<29} {t / (reps * tile.size) * 1e9:6.2f}")


if __name__ == "__main__":
    main()
