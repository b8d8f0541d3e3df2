"""Row-streaming attention over a CSRRelation (general graphs).

Arrays are node-major contiguous in the accumulation dtype: ``q (Nq, H, D)`` pre-multiplied by
``scale * log2(e)`` (scores in base 2, see ``fastexp.py``), ``k (Nk, Hkv, D)``,
``v (Nk, Hkv, Dv)``: one gathered source row brings every head at once.  ``bias`` is
``(E, H)`` in natural units (multiplied by log2(e) here) or an empty ``(0, H)`` array.

Forward: one destination row per ``prange`` iteration, all heads; its edges are streamed in
chunks of ``CH`` with the online-softmax recurrence, so scratch is O(H * (CH + Dv)) per row.
Empty rows: out 0, m = -inf, l = 0.

Backward (deterministic, no atomics, no (E,)-sized scratch):
  * pass 1, by destination rows: dq_i = scale * sum_e ds_e k_j and, when there is a bias,
    dbias[e] = ds_e (an output, not scratch);
  * pass 2, by source rows over the transposed CSR (entries in increasing edge id):
    dv_j = sum p_e dO_i, dk_j = scale * sum ds_e q_i, with ``perm`` locating the edge's bias.
  p and ds are recomputed in both passes rather than stored.
"""
import math

import numpy as np
from numba import njit, prange

from .blocks import exp2_any

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
CH = 16


def make_forward(acc):
    dt = np.float32 if acc == "float32" else np.float64
    ln2, log2e = LN2, LOG2E

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def forward(q, k, v, indptr, indices, bias, group, out, m_out, l_out):
        Nq, H, D = q.shape
        Dv = v.shape[2]
        has_bias = bias.shape[0] > 0
        for i in prange(Nq):
            acc_ = np.zeros((H, Dv), dt)
            m = np.full(H, -np.inf, dt)
            l = np.zeros(H, dt)
            s = np.empty((H, CH), dt)
            e0 = indptr[i]
            e1 = indptr[i + 1]
            for c0 in range(e0, e1, CH):
                n = min(CH, e1 - c0)
                for t in range(n):
                    j = indices[c0 + t]
                    for h in range(H):
                        hk = h // group
                        x = dt(0.0)
                        for d in range(D):
                            x += q[i, h, d] * k[j, hk, d]
                        if has_bias:
                            x += bias[c0 + t, h] * log2e
                        s[h, t] = x
                for h in range(H):
                    mx = m[h]
                    for t in range(n):
                        mx = max(mx, s[h, t])
                    ms = mx if mx != -np.inf else dt(0.0)
                    alpha = exp2_any(m[h] - ms)
                    tot = dt(0.0)
                    for t in range(n):
                        p = exp2_any(s[h, t] - ms)
                        s[h, t] = p
                        tot += p
                    l[h] = l[h] * alpha + tot
                    m[h] = mx
                    for d in range(Dv):
                        acc_[h, d] *= alpha
                for t in range(n):
                    j = indices[c0 + t]
                    for h in range(H):
                        hk = h // group
                        p = s[h, t]
                        for d in range(Dv):
                            acc_[h, d] += p * v[j, hk, d]
            for h in range(H):
                inv = dt(1.0) / l[h] if l[h] > 0 else dt(0.0)
                for d in range(Dv):
                    out[i, h, d] = acc_[h, d] * inv
                m_out[i, h] = m[h] * ln2
                l_out[i, h] = l[h]

    return forward


def make_backward(acc):
    dt = np.float32 if acc == "float32" else np.float64
    ln2, log2e = LN2, LOG2E

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def backward_dst(q, k, v, do, m2, linv, delta, indptr, indices, bias, group, scale,
                     dq, dbias):
        """dq (and dbias) by destination rows."""
        Nq, H, D = q.shape
        Dv = v.shape[2]
        has_bias = bias.shape[0] > 0
        for i in prange(Nq):
            acc_ = np.zeros((H, D), dt)
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
                for h in range(H):
                    hk = h // group
                    x = dt(0.0)
                    for d in range(D):
                        x += q[i, h, d] * k[j, hk, d]
                    if has_bias:
                        x += bias[e, h] * log2e
                    mr = m2[i, h]
                    p = exp2_any(x - (mr if mr != -np.inf else dt(0.0))) * linv[i, h]
                    dp = dt(0.0)
                    for d in range(Dv):
                        dp += do[i, h, d] * v[j, hk, d]
                    ds = p * (dp - delta[i, h])
                    if has_bias:
                        dbias[e, h] = ds
                    for d in range(D):
                        acc_[h, d] += ds * k[j, hk, d]
            for h in range(H):
                for d in range(D):
                    dq[i, h, d] = acc_[h, d] * scale

    @njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def backward_src(q, k, v, do, m2, linv, delta, t_indptr, t_indices, perm, bias, group,
                     dk, dv):
        """dk, dv by source rows over the transposed relation."""
        Nk, Hkv, D = k.shape
        H = q.shape[1]
        Dv = v.shape[2]
        has_bias = bias.shape[0] > 0
        for j in prange(Nk):
            dk_acc = np.zeros((Hkv, D), dt)
            dv_acc = np.zeros((Hkv, Dv), dt)
            for t in range(t_indptr[j], t_indptr[j + 1]):
                i = t_indices[t]
                for h in range(H):
                    hk = h // group
                    x = dt(0.0)
                    for d in range(D):
                        x += q[i, h, d] * k[j, hk, d]
                    if has_bias:
                        x += bias[perm[t], h] * log2e
                    mr = m2[i, h]
                    p = exp2_any(x - (mr if mr != -np.inf else dt(0.0))) * linv[i, h]
                    dp = dt(0.0)
                    for d in range(Dv):
                        dp += do[i, h, d] * v[j, hk, d]
                        dv_acc[hk, d] += p * do[i, h, d]
                    ds = p * (dp - delta[i, h])
                    for d in range(D):
                        dk_acc[hk, d] += ds * q[i, h, d]
            for hk in range(Hkv):
                for d in range(D):
                    dk[j, hk, d] = dk_acc[hk, d] * ln2
                for d in range(Dv):
                    dv[j, hk, d] = dv_acc[hk, d]

    return backward_dst, backward_src
