"""Blocked streaming attention over a BlockRelation (dense, triangular, segments).

Layout the kernels expect (made by ``layout.py``): head-major contiguous tiles in the
accumulation dtype, ``qh (H, Nq, D)`` already multiplied by ``scale * log2(e)`` so every score
tile is in base 2 (``exp(s - m) == exp2(s2 - m2)``, see ``fastexp.py``), ``kh (Hkv, Nk, D)``,
``vh (Hkv, Nk, Dv)``.  Score and value products of a (BM x BN) tile go through ``np.dot`` with
an ``out=`` buffer, i.e. one BLAS gemm per tile with no allocation; the softmax between them is
a vectorised loop.

Forward: one work item = (head, block, query tile); it walks the key tiles of its block only
(causal blocks: tiles at or left of the diagonal; only tiles crossing the diagonal are
masked) with the FlashAttention-2 recurrence, and writes per-row (out, m, l).
Optional tile pruning (``PRUNE``): after the score tile is computed it is admitted only if
``max(tile) >= m_run_block + log(rho)`` (in base 2: ``+ log2(rho)``), ``m_run_block`` the
running max over every row of the query tile; a rejected tile skips its value product and
softmax update.

Backward (deterministic, no atomics, no N x N scratch): work items = (kv head, block, key tile),
dealt round-robin to ``P`` fixed partitions run in parallel.  Each item owns its dk/dv rows
(summing over the query heads of its GQA group) and adds ``dS @ K`` into its partition's private
dq buffer ``(P, H, Nq, D)`` (O(N) memory); a second parallel loop sums the partitions in
partition order.  The partition an item lands in depends only on its index, so the bits are
the same on every run with the same ``P``.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .fastexp import exp2f

LN2 = math.log(2.0)


def exp2_any(x):
    """exp2 for the kernels: the vectorisable polynomial for float32, libm for float64."""
    raise NotImplementedError  # only callable from jitted code


@overload(exp2_any)
def _exp2_any(x):
    if x == types.float32:
        return lambda x: exp2f(x)
    return lambda x: _exp2d(x)


@njit(inline="always", cache=True)
def _exp2d(x):
    if x > -1100.0:
        return math.exp2(x)
    return 0.0  # -inf (masked / empty) -> 0 without a NaN path


def make_forward(acc, BM, BN, prune):
    """Kernel for accumulation dtype name ``acc``, tile (BM, BN), pruning on/off."""
    dt = np.float32 if acc == "float32" else np.float64
    ln2 = LN2

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def forward(qh, kh, vh, items, dst_off, src_off, causal, group, log2_rho,
                out, m_out, l_out, tiles_total, tiles_pruned):
        D = qh.shape[2]
        Dv = vh.shape[2]
        n_items = items.shape[0]
        for w in prange(n_items):
            h = items[w, 0]
            b = items[w, 1]
            q0 = items[w, 2]
            hk = h // group
            d0 = dst_off[b]
            s0 = src_off[b]
            nd = dst_off[b + 1] - d0
            ns = src_off[b + 1] - s0
            is_causal = causal[b] != 0
            rows = min(BM, nd - q0)
            sbuf = np.empty(BM * BN, dt)
            tbuf = np.empty(BM * Dv, dt)
            acc_ = np.zeros((rows, Dv), dt)
            m = np.full(rows, -np.inf, dt)
            l = np.zeros(rows, dt)
            rmax = np.empty(rows, dt)
            qt = qh[h, d0 + q0:d0 + q0 + rows]
            kend = ns
            if is_causal:
                kend = min(ns, q0 + rows)  # keys j <= i: nothing right of the last row
            m_blk = -np.inf
            n_total = 0
            n_pruned = 0
            for c0 in range(0, kend, BN):
                cols = min(BN, kend - c0)
                n_total += 1
                S = sbuf[:rows * cols].reshape((rows, cols))
                kt = kh[hk, s0 + c0:s0 + c0 + cols]
                if D > 0:
                    np.dot(qt, kt.T, S)
                else:
                    S[:, :] = 0.0
                if is_causal and c0 + cols - 1 > q0:  # tile crosses the diagonal
                    for r in range(rows):
                        for c in range(max(0, q0 + r + 1 - c0), cols):
                            S[r, c] = -np.inf
                tmax = -np.inf
                for r in range(rows):
                    mx = -np.inf
                    for c in range(cols):
                        mx = max(mx, S[r, c])
                    rmax[r] = mx
                    tmax = max(tmax, mx)
                if prune:
                    if tmax < m_blk + log2_rho:
                        n_pruned += 1
                        continue
                    m_blk = max(m_blk, tmax)
                for r in range(rows):
                    mnew = max(m[r], rmax[r])
                    ms = mnew if mnew != -np.inf else dt(0.0)  # row still empty: p = 0, no NaN
                    alpha = exp2_any(m[r] - ms)
                    s = dt(0.0)
                    for c in range(cols):
                        p = exp2_any(S[r, c] - ms)
                        S[r, c] = p
                        s += p
                    l[r] = l[r] * alpha + s
                    m[r] = mnew
                    for d in range(Dv):
                        acc_[r, d] *= alpha
                if Dv > 0:
                    T = tbuf[:rows * Dv].reshape((rows, Dv))
                    np.dot(S, vh[hk, s0 + c0:s0 + c0 + cols], T)
                    for r in range(rows):
                        for d in range(Dv):
                            acc_[r, d] += T[r, d]
            for r in range(rows):
                i = d0 + q0 + r
                inv = dt(1.0) / l[r] if l[r] > 0 else dt(0.0)
                for d in range(Dv):
                    out[i, h, d] = acc_[r, d] * inv
                m_out[i, h] = m[r] * ln2
                l_out[i, h] = l[r]
            tiles_total[w] = n_total
            tiles_pruned[w] = n_pruned

    return forward


def make_backward(acc, BM, BN):
    dt = np.float32 if acc == "float32" else np.float64
    ln2 = LN2

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def backward(qh, kh, vh, doh, m2, linv, delta, kitems, dst_off, src_off, causal, group,
                 n_parts, dq_part, dk, dv):
        D = qh.shape[2]
        Dv = vh.shape[2]
        n_items = kitems.shape[0]
        for part in prange(n_parts):
            sbuf = np.empty(BM * BN, dt)
            pbuf = np.empty(BM * BN, dt)
            kbuf = np.empty(BN * max(D, Dv), dt)
            qbuf = np.empty(BM * D, dt)
            dk_acc = np.empty((BN, D), dt)
            dv_acc = np.empty((BN, Dv), dt)
            for w in range(part, n_items, n_parts):
                hk = kitems[w, 0]
                b = kitems[w, 1]
                c0 = kitems[w, 2]
                if hk < 0:  # padding slot of the round-robin deal
                    continue
                d0 = dst_off[b]
                s0 = src_off[b]
                nd = dst_off[b + 1] - d0
                ns = src_off[b + 1] - s0
                is_causal = causal[b] != 0
                cols = min(BN, ns - c0)
                dk_acc[:cols, :] = 0.0
                dv_acc[:cols, :] = 0.0
                kt = kh[hk, s0 + c0:s0 + c0 + cols]
                vt = vh[hk, s0 + c0:s0 + c0 + cols]
                qstart = 0
                if is_causal:
                    qstart = (c0 // BM) * BM  # first query tile holding a row i >= c0
                for h in range(hk * group, (hk + 1) * group):
                    for q0 in range(qstart, nd, BM):
                        rows = min(BM, nd - q0)
                        qt = qh[h, d0 + q0:d0 + q0 + rows]
                        dot = doh[h, d0 + q0:d0 + q0 + rows]
                        P = pbuf[:rows * cols].reshape((rows, cols))
                        dP = sbuf[:rows * cols].reshape((rows, cols))
                        if D > 0:
                            np.dot(qt, kt.T, P)
                        else:
                            P[:, :] = 0.0
                        if Dv > 0:
                            np.dot(dot, vt.T, dP)
                        else:
                            dP[:, :] = 0.0
                        mask = is_causal and c0 + cols - 1 > q0
                        for r in range(rows):
                            i = d0 + q0 + r
                            mr = m2[h, i]
                            ms = mr if mr != -np.inf else dt(0.0)
                            li = linv[h, i]
                            de = delta[h, i]
                            for c in range(cols):
                                p = exp2_any(P[r, c] - ms) * li
                                P[r, c] = p
                                dP[r, c] = p * (dP[r, c] - de)
                            if mask:
                                for c in range(max(0, q0 + r + 1 - c0), cols):
                                    P[r, c] = 0.0
                                    dP[r, c] = 0.0
                        # dv += P^T dO ; dk += dS^T Q2 ; dq_part += dS K
                        if Dv > 0:
                            T = kbuf[:cols * Dv].reshape((cols, Dv))
                            np.dot(P.T, dot, T)
                            for c in range(cols):
                                for d in range(Dv):
                                    dv_acc[c, d] += T[c, d]
                        if D > 0:
                            T2 = kbuf[:cols * D].reshape((cols, D))
                            np.dot(dP.T, qt, T2)
                            for c in range(cols):
                                for d in range(D):
                                    dk_acc[c, d] += T2[c, d]
                            Q = qbuf[:rows * D].reshape((rows, D))
                            np.dot(dP, kt, Q)
                            for r in range(rows):
                                for d in range(D):
                                    dq_part[part, h, d0 + q0 + r, d] += Q[r, d]
                for c in range(cols):
                    for d in range(D):
                        dk[hk, s0 + c0 + c, d] = dk_acc[c, d] * ln2
                    for d in range(Dv):
                        dv[hk, s0 + c0 + c, d] = dv_acc[c, d]

    return backward


@njit(parallel=True, fastmath=False, cache=True, nogil=True)
def reduce_dq(dq_part, scale, dq):
    """dq[i, h] = scale * sum over partitions, in partition order (deterministic)."""
    P, H, N, D = dq_part.shape
    for i in prange(N):
        for h in range(H):
            for d in range(D):
                s = dq_part[0, h, i, d]
                for p in range(1, P):
                    s += dq_part[p, h, i, d]
                dq[i, h, d] = s * scale
