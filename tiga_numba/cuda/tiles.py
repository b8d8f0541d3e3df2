"""Launch geometry of the CUDA-core kernels (compile-time constants of each specialisation).

Every kernel maps a query (or key) row to a *lane group* of G consecutive lanes of one warp;
lane s of the group owns a strided slice of the head dimension (see VEC below), so a
row's q / accumulator slices stay in registers (about 16 elements each) and the group's
partial dot products meet through G-1 xor shuffles. A thread owns R rows, which lets one
shared-memory read of a key element feed R fused multiply-adds.

Block (dense / causal / segments) kernels stage a BN-key tile of K and V in shared memory
(converted to the accumulation dtype once per tile) and, in the forward, a BM x BN score
tile; BN is the largest of 64/32/16/8 whose tiles fit in 46 KiB of static shared memory
(no opt-in beyond the 48 KiB default is needed, so no cuFuncSetAttribute call).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

SMEM_BUDGET = 46 * 1024


def _pow2ceil(x):
    p = 1
    while p < x:
        p *= 2
    return p


@dataclass(frozen=True)
class Tiles:
    dtype: str  # input dtype name (float16/float32/float64)
    acc: str  # accumulation dtype name
    D: int
    DV: int
    G: int  # lanes per row
    R: int  # rows per thread
    NT: int  # threads per CTA
    BN: int  # keys (or queries, for dk/dv) per shared-memory tile
    VEC: int = 1  # contiguous elements per lane and step (16-byte shared-memory loads)
    UE: int = 1  # CSR forward: edges per step of a lane group
    REGS: int = 0  # register cap per thread (0: the compiler's choice)

    @property
    def BM(self):
        return self.NT // self.G * self.R

    @property
    def DSQ(self):
        w = self.G * self.VEC
        return -(-self.D // w) * self.VEC

    @property
    def DSV(self):
        w = self.G * self.VEC
        return -(-self.DV // w) * self.VEC

    @property
    def DP(self):
        return self.DSQ * self.G

    @property
    def DVP(self):
        return self.DSV * self.G

    @functools.cached_property
    def _describe(self):
        return (f"BM={self.BM} BN={self.BN} (threads={self.NT}, lanes/row={self.G}, "
                f"rows/thread={self.R})")

    def describe(self):
        return self._describe

    @functools.cached_property
    def _describe_csr(self):
        return f"{self.G} lanes per (row, head), {self.NT} threads per CTA"

    def describe_csr(self):
        return self._describe_csr


def acc_of(dtype):
    return "float64" if str(dtype) == "float64" else "float32"


def _lanes(D, DV, per_lane=16):
    return min(32, _pow2ceil(-(-max(D, DV, 1) // per_lane)))


def block_tiles(kind, dtype, D, DV):
    """kind: "fwd", "dq" or "dkdv"."""
    acc = acc_of(dtype)
    wide = acc == "float64"
    asz = 8 if wide else 4
    G = _lanes(D, DV)
    if kind == "fwd":
        R = 2 if wide else 4
    else:
        R = 1 if wide else 2
    NT = max(32, min(256, 64 * G // R))
    BM = NT // G * R
    VEC = 16 // asz
    DP = -(-D // (G * VEC)) * G * VEC
    DVP = -(-DV // (G * VEC)) * G * VEC
    for BN in (64, 32, 16, 8):
        if kind == "fwd":
            need = (BN * (DP + DVP) + BM * (BN + 4)) * asz
        else:
            need = BN * (DP + DVP + 3) * asz
        if need <= SMEM_BUDGET:
            break
    return Tiles(str(dtype), acc, D, DV, G, R, NT, BN, VEC)


def csr_tiles(kind, dtype, D, DV):
    """Gathered rows come straight from global memory: ~4 elements per lane keeps many rows
    (and so many independent loads) in flight.

    The forward walks one edge per step with at most 40 registers per thread (float32
    accumulation): what keeps the gathers in flight is the number of lane groups resident per
    SM, not the rows one group loads at once. Measured on the H200 (1M nodes, 16M edges, H=4,
    D=32, float32; uniform / power-law / one row with 3/4 of the edges): four edges per step
    at the compiler's 80 registers 58 / 62 / 67 % of the copy bandwidth, one edge per step
    capped at 40 registers 82 / 78 / 83 % (benchmarks/results/gpu-h200-2026-12-03.txt)."""
    acc = acc_of(dtype)
    G = _lanes(D, DV, per_lane=4)
    if kind == "fwd":
        return Tiles(str(dtype), acc, D, DV, G, 1, 128, 0, UE=1, REGS=40 if acc == "float32" else 0)
    return Tiles(str(dtype), acc, D, DV, G, 1, 128, 0)
