"""Shared pieces of the CUDA kernel factories: dtypes and the Delta = rowsum(dO * O)
kernel of the backward."""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import cuda

from .launch import SIM, Kernel, array_view

FULL = 0xFFFFFFFF
U = numba.uint64  # index cast: unsigned indices skip numba's negative-index wraparound code
NEG_INF = -math.inf


def nbtype(name):
    return numba.from_dtype(np.dtype(name))


@cuda.jit(device=True, inline="always")
def part_weight(m_part, l_part, m_all):
    """The weight e^(m_part - m_all) of one partial softmax state (m, l, acc) in a merge whose
    largest m is m_all. A part with m = -inf has no finite score: either it is empty (l = 0,
    weight 0) or it met a NaN score before any finite one (l = NaN, weight NaN), so l itself is
    its weight. A NaN score thus makes its row NaN on every path, as the CPU kernels do; it is
    never dropped with the empty parts."""
    if m_part > NEG_INF:
        return math.exp(m_part - m_all)
    return l_part


def make_delta(dtype, acc):
    """Delta[i, h] = sum_d dO[i, h, d] * O[i, h, d] (accumulation dtype), one warp per row."""
    IN, ACC = nbtype(dtype), nbtype(acc)
    GD = 1 if SIM else 32
    NT = 32 if SIM else 128
    AS_IN, AS_ACC = array_view(IN), array_view(ACC)

    def delta_body(dout_p, out_p, delta_p, ds0, ds1, ds2, os0, os1, os2, nrows, H, DV):
        dout = AS_IN(dout_p)
        out = AS_IN(out_p)
        delta = AS_ACC(delta_p)
        gid = cuda.blockIdx.x * NT + cuda.threadIdx.x
        row = gid // GD
        lane = gid - row * GD
        i = row // H
        h = row - i * H
        a = ACC(0.0)
        if row < nrows:
            for d in range(lane, DV, GD):
                a += ACC(dout[U(i * ds0 + h * ds1 + d * ds2)]) * ACC(out[U(i * os0 + h * os1 + d * os2)])
        off = GD // 2
        while off > 0:
            a += cuda.shfl_xor_sync(FULL, a, off)
            off //= 2
        if lane == 0 and row < nrows:
            delta[U(row)] = a

    i64 = numba.int64
    spec = [("dout", "a", IN), ("out", "a", IN), ("delta", "a", ACC)] + [
        (n, "s", i64) for n in ("ds0", "ds1", "ds2", "os0", "os1", "os2", "nrows", "H", "DV")]
    kern = Kernel(f"delta_{dtype}", delta_body, spec)
    kern.rows_per_cta = NT // GD
    kern.NT = NT
    return kern


def make_stats(dtype, acc):
    """st[i, h] = (m, log(l), Delta) interleaved (m = +inf and log(l) = 0 for an empty row),
    Delta as in make_delta. The CSR backward reads one 12/24-byte record per gathered
    (row, head) instead of three scattered scalars. m and log(l) stay apart: their sum rounded
    once would lose log(l) against a large m."""
    IN, ACC = nbtype(dtype), nbtype(acc)
    GD = 1 if SIM else 32
    NT = 32 if SIM else 128
    AS_IN, AS_ACC = array_view(IN), array_view(ACC)

    def stats_body(dout_p, out_p, mo_p, lo_p, st_p, ds0, ds1, ds2, os0, os1, os2, nrows, H, DV):
        dout = AS_IN(dout_p)
        out = AS_IN(out_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        st = AS_ACC(st_p)
        gid = cuda.blockIdx.x * NT + cuda.threadIdx.x
        row = gid // GD
        lane = gid - row * GD
        i = row // H
        h = row - i * H
        a = ACC(0.0)
        if row < nrows:
            for d in range(lane, DV, GD):
                a += ACC(dout[U(i * ds0 + h * ds1 + d * ds2)]) * ACC(out[U(i * os0 + h * os1 + d * os2)])
        off = GD // 2
        while off > 0:
            a += cuda.shfl_xor_sync(FULL, a, off)
            off //= 2
        if lane == 0 and row < nrows:
            lv = lo[U(row)]
            mx = ACC(math.inf)
            lgl = ACC(0.0)
            if lv > 0 or lv != lv:   # NaN l: NaN probabilities and gradient shares, as on the CPU
                mx = mo[U(row)]
                lgl = math.log(lv)
            st[U(3 * row)] = mx
            st[U(3 * row + 1)] = lgl
            st[U(3 * row + 2)] = a

    i64 = numba.int64
    spec = [("dout", "a", IN), ("out", "a", IN), ("mo", "a", ACC), ("lo", "a", ACC),
            ("st", "a", ACC)] + [
        (n, "s", i64) for n in ("ds0", "ds1", "ds2", "os0", "os1", "os2", "nrows", "H", "DV")]
    kern = Kernel(f"stats_{dtype}", stats_body, spec)
    kern.rows_per_cta = NT // GD
    kern.NT = NT
    return kern


# Threads of a merge CTA: the pieces of one merged row are spread over them, so a row cut into
# thousands of pieces (a hub destination, a long decode range) is merged by the whole CTA.
MERGE_NT = 32 if SIM else 512


def make_softmax_merge(dtype, acc, DV, table):
    """Kernel: merge the partial online-softmax states of rows cut into pieces (tiga_numba.merge
    has the algebra), one CTA per merged row with all MERGE_NT threads on that row:

        merge(pacc, pm, pl, rows, out, mo, lo, nrows, P)

    Piece p of a merged row has its state at slot base + p * stride: m = pm[slot],
    l = pl[slot], unnormalised acc = pacc[slot * DV : (slot + 1) * DV]. With `table` (CSR split
    rows) merged row x = (si, h), si < nrows, is destination rows[3 si] head h of P heads, its
    pieces the slots rows[3 si + 1] + [0, rows[3 si + 2]) times P plus h; without it (split-key
    decode) merged row x < nrows has pieces x * P + [0, P) and `rows` is not read. Writes
    out[orow * DV + d] (input dtype), mo[orow] = M, lo[orow] = L:
        M = max_p m_p,  L = sum_p l_p e^(m_p - M),  out = sum_p acc_p e^(m_p - M) / L.
    Pieces with m = -inf (no edges) add nothing; a row with none left gets out = 0, M = -inf,
    L = 0. The threads take the pieces in a fixed strided assignment and their partial sums
    meet in fixed-order reductions, so the bits never depend on scheduling: M and L by trees
    over all threads; out with thread (j, c) = (tid // DW, tid % DW) summing pieces j, j + PL,
    ... for columns c, c + DW, ..., then the PL partial sums of each column in order of j.

    The kernel is latency-bound (a decode call merges 16 pieces of a few hundred bytes per
    row), so each thread loads its first piece's acc values before the barriers of M and L,
    and every column's partial sums meet in one exchange through shared memory: one round trip
    to memory for a row of up to PL pieces, where a pass per DW columns waited on one each."""
    IN, ACC = nbtype(dtype), nbtype(acc)
    AS_IN, AS_ACC, AS_I64 = array_view(IN), array_view(ACC), array_view(numba.int64)
    i64 = numba.int64
    NT = MERGE_NT
    DVM = max(DV, 1)
    DW = 1
    while DW < min(DVM, 8 if SIM else 32):
        DW *= 2
    PL = NT // DW
    NK = -(-DVM // DW)   # columns per thread
    # columns per thread and exchange: NT x KP partial sums in shared memory (<= 16 KB)
    KP = max(1, min(NK, 16384 // (NT * np.dtype(acc).itemsize)))
    NS = NT * KP
    TABLE = bool(table)

    def body(pacc_p, pm_p, pl_p, rows_p, out_p, mo_p, lo_p, nrows, P):
        pacc = AS_ACC(pacc_p)
        pm = AS_ACC(pm_p)
        pl = AS_ACC(pl_p)
        out = AS_IN(out_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        x = i64(cuda.blockIdx.x)
        if TABLE:
            rows = AS_I64(rows_p)
            si = x // P
            h = x - si * P
            if si >= nrows:
                return
            orow = rows[U(3 * si)] * P + h
            base = rows[U(3 * si + 1)] * P + h
            n = rows[U(3 * si + 2)]
            stride = P
        else:
            if x >= nrows:
                return
            orow = x
            base = x * P
            n = P
            stride = i64(1)
        red = cuda.shared.array(NT, ACC)
        sums = cuda.shared.array(NS, ACC)
        tid = cuda.threadIdx.x
        c = tid % DW
        j = tid // DW
        neg = ACC(NEG_INF)
        zero = ACC(0.0)
        # piece j's acc values of this thread's first KP columns, loaded now (used last)
        first = cuda.local.array(KP, ACC)
        for k in range(KP):
            d = c + k * DW
            first[k] = zero
            if j < n and d < DV:
                first[k] = pacc[U((base + j * stride) * DV + d)]
        mt = neg
        for p in range(tid, n, NT):
            mt = max(mt, pm[U(base + p * stride)])
        red[tid] = mt
        cuda.syncthreads()
        w = NT // 2
        while w > 0:
            if tid < w:
                red[tid] = max(red[tid], red[tid + w])
            cuda.syncthreads()
            w //= 2
        M = red[0]
        cuda.syncthreads()
        lt = zero
        for p in range(tid, n, NT):
            lp = pl[U(base + p * stride)]
            lt += lp * part_weight(pm[U(base + p * stride)], lp, M)
        red[tid] = lt
        cuda.syncthreads()
        w = NT // 2
        while w > 0:
            if tid < w:
                red[tid] += red[tid + w]
            cuda.syncthreads()
            w //= 2
        L = red[0]
        inv = zero
        if L > 0 or L != L:
            inv = ACC(1.0) / L
        a = cuda.local.array(KP, ACC)
        for k0 in range(0, NK, KP):   # one pass where NT x NK sums fit in 16 KB (DV <= 256, float32)
            for k in range(KP):
                a[k] = zero
            for p in range(j, n, PL):
                slot = base + p * stride
                wp = part_weight(pm[U(slot)], pl[U(slot)], M)
                if wp != 0:   # an empty part's acc is 0 anyway; skip its load
                    for k in range(KP):
                        d = c + (k0 + k) * DW
                        if d < DV:
                            v = first[k] if k0 == 0 and p == j else pacc[U(slot * DV + d)]
                            a[k] += v * wp
            for k in range(KP):
                sums[k * NT + tid] = a[k]
            cuda.syncthreads()
            # column d of this pass: the PL partial sums in order of j
            for e in range(tid, KP * DW, NT):
                k = e // DW
                cc = e - k * DW
                d = cc + (k0 + k) * DW
                if d < DV:
                    tot = zero
                    for jj in range(PL):
                        tot += sums[k * NT + jj * DW + cc]
                    out[U(orow * DV + d)] = IN(tot * inv)
            cuda.syncthreads()
        if tid == 0:
            mo[U(orow)] = M
            lo[U(orow)] = L

    spec = [("pacc", "a", ACC), ("pm", "a", ACC), ("pl", "a", ACC), ("rows", "a", i64),
            ("out", "a", IN), ("mo", "a", ACC), ("lo", "a", ACC), ("nrows", "s", i64),
            ("P", "s", i64)]
    kern = Kernel(f"softmax_merge_{'rows' if TABLE else 'splits'}_{dtype}_dv{DV}", body, spec)
    kern.NT = NT
    return kern
