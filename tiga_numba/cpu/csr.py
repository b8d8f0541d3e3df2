"""Row-streaming attention over a CSRRelation (general graphs).

Arrays are node-major contiguous in the accumulation dtype: ``q (Nq, H, D)``, ``k (Nk, Hkv, D)``,
``v (Nk, Hkv, Dv)``: one gathered source row brings every head at once. Each dot product is
multiplied by ``qscale`` (``scale * log2(e)``: scores in base 2, see ``fastexp.py``) as it is
made, one multiply per (edge, head): q is read in place, with no q-sized scaled copy per call.
``bias`` is ``(E, H)`` in natural units (multiplied by log2(e) here) or an empty ``(0, H)`` array.

Work is divided by edges (``split.py``): a ``prange`` item is a run of short rows or one piece
of a long row, all heads; a row's edges are streamed in chunks of ``CH`` with the online-softmax
recurrence, so scratch is O(H * (CH + Dv)) per item. A piece leaves its partial (acc, m, l) in a
slot and a second parallel loop merges each long row's slots in order (deterministic, no
atomics). The row max is written in base 2 (m2), as the kernel found it; ``api.py`` derives
the natural m. Empty rows: out 0, m2 = -inf, l = 0.

Backward (deterministic, no atomics, no (E,)-sized scratch):
  * pass 1, by destination rows: dq_i = scale * sum_e ds_e k_j and, when there is a bias,
    dbias[e] = ds_e (an output, not scratch);
  * pass 2, by source rows over the transposed CSR (entries in increasing edge id):
    dv_j = sum p_e dO_i, dk_j = scale * sum ds_e q_i, with ``perm`` locating the edge's bias.
  Both passes cut long rows into the same kind of pieces, whose partial sums are added in
  slot order.
  p and ds are recomputed in both passes rather than stored.

Score modifiers (``mod``, score_codegen.Generated): ``qscale`` is then ``scale`` only,
the kernels apply ``f = mod.value(s, i, j, e, h, ...)`` to each natural-unit score and continue
in base 2 with ``f * log2(e)``. The backward turns ``dF = p (dp - Delta)`` into ``dF * df/ds``
(``mod.grad``), which also accumulates the gradients of the modifier's fields: dst fields and
per-head params in pass 1 (per row / per work item, pieces of long rows in slots merged in
order), edge fields per edge, src fields in pass 2. Without a modifier the code is the plain
kernel (the hooks are compiled out).
"""
import math

import numpy as np
from numba import prange

from .blocks import EMPTY, NEG, exp2_any, merge_parts
from .fastexp import denormals_off, fmax, restore_mxcsr
from .layout import kv_heads
from .prefetch import prefetch_row
from .score_codegen import jit_driver, jit_kernel, no_grad, no_value

# the modifier hooks of the kernels (score_codegen.jit_kernel rebinds them per modifier)
MOD_VALUE = no_value
MOD_GRAD = no_grad
MOD_GRAD_SRC = no_grad
# the per-item functions the kernels' parallel drivers call (score_codegen.jit_driver binds them
# per kernel; a kernel's body is compiled without numba's parallel passes, its driver with them)
CSR_FORWARD_ITEM = CSR_FORWARD_MERGE = CSR_DST_ITEM = CSR_DST_MERGE = CSR_SRC_ITEM = CSR_SRC_MERGE = None

LOG2E = 1.0 / math.log(2.0)
CH = 16  # edges per online-softmax step (scores of one chunk stay in registers/L1)
AHEAD = 8  # backward: prefetch the gathered rows of the edge this many edges ahead
RB = 32  # rows per prange iteration (amortises scratch allocation)


def make_forward(acc, mod=None):
    dt = np.float32 if acc == "float32" else np.float64
    log2e = dt(LOG2E)
    MOD = mod is not None
    hooks = {} if not MOD else {"MOD_VALUE": mod.value}

    def forward_item(w, q, k, v, indptr, indices, bias, group, qscale, items, splits, part_acc, part_m, part_l,
                     out, m_out, l_out, mctx):
        """work item w of forward (a run of short rows or one piece of a long one)."""
        sc, hp, nd, ns, ef = mctx
        Nq, H, D = q.shape
        Dv = v.shape[2]
        has_bias = bias.shape[0] > 0
        kv_head = kv_heads(H, group)
        mxcsr = denormals_off()
        r0 = items[w, 0]
        r1 = items[w, 1]
        lo_e = items[w, 2]
        hi_e = items[w, 3]
        slot = items[w, 4]
        # scratch once per item; element loops run over contiguous 1-D views
        acc_ = np.empty((H, Dv), dt)
        m = np.empty(H, dt)
        l = np.empty(H, dt)
        s = np.empty((H, CH), dt)
        item_end = min(indptr[r1], hi_e)  # the item's last edge + 1: prefetch runs up to it
        for i in range(r0, r1):
            acc_[:, :] = 0.0
            m[:] = NEG
            l[:] = 0.0
            qi = q[i]
            e0 = max(indptr[i], lo_e)
            e1 = min(indptr[i + 1], hi_e)
            for c0 in range(e0, e1, CH):
                n = min(CH, e1 - c0)
                # the next chunk's source rows (maybe the next row's) while this one computes
                for t in range(c0 + CH, min(c0 + 2 * CH, item_end)):
                    if D > 0:
                        prefetch_row(k, indices[t])
                    prefetch_row(v, indices[t])
                for t in range(n):
                    j = indices[c0 + t]
                    kj = k[j]
                    for h in range(H):
                        qr = qi[h]
                        kr = kj[kv_head[h]]
                        x = dt(0.0)
                        for d in range(D):
                            x += qr[d] * kr[d]
                        x *= qscale
                        if MOD:
                            x = MOD_VALUE(x, i, j, c0 + t, h, sc, hp, nd, ns, ef) * log2e
                        elif has_bias:
                            x += bias[c0 + t, h] * log2e
                        s[h, t] = x
                for h in range(H):
                    sr = s[h]
                    mx = m[h]
                    for t in range(n):
                        mx = fmax(mx, sr[t])
                    ms = mx if mx > EMPTY else dt(0.0)
                    alpha = exp2_any(m[h] - ms)
                    tot = dt(0.0)
                    for t in range(n):
                        p = exp2_any(sr[t] - ms)
                        sr[t] = p
                        tot += p
                    l[h] = l[h] * alpha + tot
                    m[h] = mx
                    if alpha != 1.0:
                        ar = acc_[h]
                        for d in range(Dv):
                            ar[d] *= alpha
                # acc += P V four edges per accumulator update: updated once per edge, the
                # accumulator row's loads and stores cost as much as the edge's multiply-adds
                t = 0
                while t + 3 < n:
                    v0, v1 = v[indices[c0 + t]], v[indices[c0 + t + 1]]
                    v2, v3 = v[indices[c0 + t + 2]], v[indices[c0 + t + 3]]
                    for h in range(H):
                        hk = kv_head[h]
                        r0_, r1_, r2_, r3_ = v0[hk], v1[hk], v2[hk], v3[hk]
                        ar = acc_[h]
                        p0, p1, p2, p3 = s[h, t], s[h, t + 1], s[h, t + 2], s[h, t + 3]
                        for d in range(Dv):
                            ar[d] += (p0 * r0_[d] + p1 * r1_[d]) + (p2 * r2_[d] + p3 * r3_[d])
                    t += 4
                while t < n:
                    vj = v[indices[c0 + t]]
                    for h in range(H):
                        vr = vj[kv_head[h]]
                        ar = acc_[h]
                        p = s[h, t]
                        for d in range(Dv):
                            ar[d] += p * vr[d]
                    t += 1
            if slot >= 0:  # one piece of a long row: its partial state, merged below
                for h in range(H):
                    part_m[slot, h] = m[h]
                    part_l[slot, h] = l[h]
                    pa = part_acc[slot, h]
                    ar = acc_[h]
                    for d in range(Dv):
                        pa[d] = ar[d]
                continue
            for h in range(H):
                inv = dt(1.0) / l[h] if l[h] > 0 else dt(0.0)
                ar = acc_[h]
                o = out[i, h]
                for d in range(Dv):
                    o[d] = ar[d] * inv
                m_out[i, h] = m[h] if l[h] > 0 else -np.inf  # base 2, as found
                l_out[i, h] = l[h]
        restore_mxcsr(mxcsr)

    def forward_merge(t, q, k, v, indptr, indices, bias, group, qscale, items, splits, part_acc, part_m, part_l,
                      out, m_out, l_out, mctx):
        """the pieces of split row t, in slot order (deterministic)."""
        H = q.shape[1]
        i = splits[t, 0]
        first = splits[t, 1]
        last = first + splits[t, 2]
        for h in range(H):
            m_out[i, h], l_out[i, h] = merge_parts(part_m[first:last, h], part_l[first:last, h],
                                                   part_acc[first:last, h], out[i, h])

    def forward(q, k, v, indptr, indices, bias, group, qscale, items, splits, part_acc, part_m, part_l,
                out, m_out, l_out, mctx):
        for w in prange(items.shape[0]):
            # int64: one signature of the item in the driver and in its outlined loop body
            CSR_FORWARD_ITEM(np.int64(w), q, k, v, indptr, indices, bias, group, qscale, items, splits, part_acc,
                             part_m, part_l, out, m_out, l_out, mctx)
        # merge the pieces of every split row, in slot order (deterministic)
        for t in prange(splits.shape[0]):
            CSR_FORWARD_MERGE(np.int64(t), q, k, v, indptr, indices, bias, group, qscale, items, splits, part_acc,
                              part_m, part_l, out, m_out, l_out, mctx)

    return jit_driver(forward, mod, hooks,
                      CSR_FORWARD_ITEM=jit_kernel(forward_item, mod, parallel=False, **hooks),
                      CSR_FORWARD_MERGE=jit_kernel(forward_merge, mod, parallel=False, exact=True, **hooks))


def make_backward(acc, mod=None):
    dt = np.float32 if acc == "float32" else np.float64
    log2e = dt(LOG2E)
    MOD = mod is not None
    hooks = {} if not MOD else {"MOD_VALUE": mod.value,
                                "MOD_GRAD": mod.grad(("head", "dst", "edge")),
                                "MOD_GRAD_SRC": mod.grad(("src",))}

    def backward_dst_item(w, q, k, v, do, m2, linv, delta, indptr, indices, bias, group, qscale, scale, items,
                          splits, part_dq, dq, dbias, mctx, mgrad):
        """work item w of backward_dst (a run of short rows or one piece of a long one)."""
        sc, hp, nd, ns, ef = mctx
        ghp_items, gnd, part_gnd, gef = mgrad
        n_nd = gnd.shape[0]
        Nq, H, D = q.shape
        Dv = v.shape[2]
        has_bias = bias.shape[0] > 0
        kv_head = kv_heads(H, group)
        mxcsr = denormals_off()
        r0 = items[w, 0]
        r1 = items[w, 1]
        lo_e = items[w, 2]
        hi_e = items[w, 3]
        slot = items[w, 4]
        acc_ = np.empty((H, D), dt)
        row_nd = np.zeros((n_nd, 1, H), dt)  # this row's dst-field gradient
        item_end = min(indptr[r1], hi_e)
        ghp = ghp_items[w]
        for i in range(r0, r1):
            acc_[:, :] = 0.0
            if MOD:
                row_nd[:, :, :] = 0.0
            qi = q[i]
            doi = do[i]
            for e in range(max(indptr[i], lo_e), min(indptr[i + 1], hi_e)):
                if e + AHEAD < item_end:  # source rows AHEAD edges on (see prefetch.py)
                    jn = indices[e + AHEAD]
                    if D > 0:
                        prefetch_row(k, jn)
                    prefetch_row(v, jn)
                j = indices[e]
                kj = k[j]
                vj = v[j]
                for h in range(H):
                    qr = qi[h]
                    kr = kj[kv_head[h]]
                    vr = vj[kv_head[h]]
                    dr = doi[h]
                    x = dt(0.0)
                    for d in range(D):
                        x += qr[d] * kr[d]
                    x *= qscale
                    x2 = x
                    if MOD:
                        x2 = MOD_VALUE(x, i, j, e, h, sc, hp, nd, ns, ef) * log2e
                    elif has_bias:
                        x2 += bias[e, h] * log2e
                    mr = m2[i, h]
                    p = exp2_any(x2 - (mr if mr > EMPTY else dt(0.0))) * linv[i, h]
                    dp = dt(0.0)
                    for d in range(Dv):
                        dp += dr[d] * vr[d]
                    ds = p * (dp - delta[i, h])
                    if MOD:
                        ds = MOD_GRAD(x, i, j, e, h, sc, hp, nd, ns, ef, ds, ghp, row_nd, 0,
                                   row_nd, 0, gef)
                    elif has_bias:
                        dbias[e, h] = ds
                    ar = acc_[h]
                    for d in range(D):
                        ar[d] += ds * kr[d]
            for h in range(H):
                ar = acc_[h]
                o = part_dq[slot, h] if slot >= 0 else dq[i, h]
                f = dt(1.0) if slot >= 0 else scale
                for d in range(D):
                    o[d] = ar[d] * f
            if MOD:
                for c in range(n_nd):
                    for h in range(H):
                        if slot >= 0:
                            part_gnd[slot, c, h] = row_nd[c, 0, h]
                        else:
                            gnd[c, i, h] = row_nd[c, 0, h]
        restore_mxcsr(mxcsr)

    def backward_dst_merge(t, q, k, v, do, m2, linv, delta, indptr, indices, bias, group, qscale, scale, items,
                           splits, part_dq, dq, dbias, mctx, mgrad):
        """the pieces of split row t, in slot order (deterministic)."""
        ghp_items, gnd, part_gnd, gef = mgrad
        n_nd = gnd.shape[0]
        Nq, H, D = q.shape
        i = splits[t, 0]
        first = splits[t, 1]
        last = first + splits[t, 2]
        for h in range(H):
            o = dq[i, h]
            for d in range(D):
                x = part_dq[first, h, d]
                for p in range(first + 1, last):
                    x += part_dq[p, h, d]
                o[d] = x * scale
            if MOD:
                for c in range(n_nd):
                    x = part_gnd[first, c, h]
                    for p in range(first + 1, last):
                        x += part_gnd[p, c, h]
                    gnd[c, i, h] = x

    def backward_dst(q, k, v, do, m2, linv, delta, indptr, indices, bias, group, qscale, scale,
                     items, splits, part_dq, dq, dbias, mctx, mgrad):
        """dq (and dbias) by destination rows; long rows in pieces summed in slot order.
        With a modifier, mgrad = (ghp per item (n_items, n, H), gnd (n, Nq, H), part_gnd per
        slot (n_slots, n, H), gef (n, E, H)) receives the dst/edge/head gradients."""
        for w in prange(items.shape[0]):
            # int64: one signature of the item in the driver and in its outlined loop body
            CSR_DST_ITEM(np.int64(w), q, k, v, do, m2, linv, delta, indptr, indices, bias, group, qscale, scale,
                         items, splits, part_dq, dq, dbias, mctx, mgrad)
        for t in prange(splits.shape[0]):
            CSR_DST_MERGE(np.int64(t), q, k, v, do, m2, linv, delta, indptr, indices, bias, group, qscale, scale,
                          items, splits, part_dq, dq, dbias, mctx, mgrad)

    def backward_src_item(w, q, k, v, do, m2, linv, delta, t_indptr, t_indices, perm, bias, group, qscale, scale,
                          items, splits, part_dk, part_dv, dk, dv, mctx, mgrad):
        """work item w of backward_src (a run of short rows or one piece of a long one)."""
        sc, hp, nd, ns, ef = mctx
        gns, part_gns = mgrad
        n_ns = gns.shape[0]
        Nk, Hkv, D = k.shape
        H = q.shape[1]
        Dv = v.shape[2]
        has_bias = bias.shape[0] > 0
        kv_head = kv_heads(H, group)
        mxcsr = denormals_off()
        r0 = items[w, 0]
        r1 = items[w, 1]
        lo_e = items[w, 2]
        hi_e = items[w, 3]
        slot = items[w, 4]
        dk_acc = np.empty((Hkv, D), dt)
        dv_acc = np.empty((Hkv, Dv), dt)
        row_ns = np.zeros((n_ns, 1, H), dt)  # this source's src-field gradient
        item_end = min(t_indptr[r1], hi_e)
        for j in range(r0, r1):
            dk_acc[:, :] = 0.0
            dv_acc[:, :] = 0.0
            if MOD:
                row_ns[:, :, :] = 0.0
            kj = k[j]
            vj = v[j]
            for t in range(max(t_indptr[j], lo_e), min(t_indptr[j + 1], hi_e)):
                if t + AHEAD < item_end:  # destination rows AHEAD edges on, and their
                    inext = t_indices[t + AHEAD]  # row statistics and edge bias: every
                    if D > 0:                     # one a random line in this pass
                        prefetch_row(q, inext)
                    prefetch_row(do, inext)
                    prefetch_row(m2, inext)
                    prefetch_row(linv, inext)
                    prefetch_row(delta, inext)
                    if has_bias:
                        prefetch_row(bias, perm[t + AHEAD])
                i = t_indices[t]
                qi = q[i]
                doi = do[i]
                for h in range(H):
                    hk = kv_head[h]
                    qr = qi[h]
                    kr = kj[hk]
                    vr = vj[hk]
                    dr = doi[h]
                    x = dt(0.0)
                    for d in range(D):
                        x += qr[d] * kr[d]
                    x *= qscale
                    x2 = x
                    if MOD:
                        x2 = MOD_VALUE(x, i, j, perm[t], h, sc, hp, nd, ns, ef) * log2e
                    elif has_bias:
                        x2 += bias[perm[t], h] * log2e
                    mr = m2[i, h]
                    p = exp2_any(x2 - (mr if mr > EMPTY else dt(0.0))) * linv[i, h]
                    dp = dt(0.0)
                    for d in range(Dv):
                        dp += dr[d] * vr[d]
                    ds = p * (dp - delta[i, h])
                    if MOD:
                        ds = MOD_GRAD_SRC(x, i, j, perm[t], h, sc, hp, nd, ns, ef, ds,
                                          row_ns[0], row_ns, 0, row_ns, 0, row_ns)
                    va = dv_acc[hk]
                    for d in range(Dv):
                        va[d] += p * dr[d]
                    ka = dk_acc[hk]
                    for d in range(D):
                        ka[d] += ds * qr[d]
            for hk in range(Hkv):
                ka = dk_acc[hk]
                va = dv_acc[hk]
                ok = part_dk[slot, hk] if slot >= 0 else dk[j, hk]
                ov = part_dv[slot, hk] if slot >= 0 else dv[j, hk]
                f = dt(1.0) if slot >= 0 else scale
                for d in range(D):
                    ok[d] = ka[d] * f
                for d in range(Dv):
                    ov[d] = va[d]
            if MOD:
                for c in range(n_ns):
                    for h in range(H):
                        if slot >= 0:
                            part_gns[slot, c, h] = row_ns[c, 0, h]
                        else:
                            gns[c, j, h] = row_ns[c, 0, h]
        restore_mxcsr(mxcsr)

    def backward_src_merge(t, q, k, v, do, m2, linv, delta, t_indptr, t_indices, perm, bias, group, qscale, scale,
                           items, splits, part_dk, part_dv, dk, dv, mctx, mgrad):
        """the pieces of split row t, in slot order (deterministic)."""
        gns, part_gns = mgrad
        n_ns = gns.shape[0]
        Nk, Hkv, D = k.shape
        H = q.shape[1]
        Dv = v.shape[2]
        j = splits[t, 0]
        first = splits[t, 1]
        last = first + splits[t, 2]
        for hk in range(Hkv):
            ok = dk[j, hk]
            ov = dv[j, hk]
            for d in range(D):
                x = part_dk[first, hk, d]
                for p in range(first + 1, last):
                    x += part_dk[p, hk, d]
                ok[d] = x * scale
            for d in range(Dv):
                x = part_dv[first, hk, d]
                for p in range(first + 1, last):
                    x += part_dv[p, hk, d]
                ov[d] = x
        if MOD:
            for c in range(n_ns):
                for h in range(H):
                    x = part_gns[first, c, h]
                    for p in range(first + 1, last):
                        x += part_gns[p, c, h]
                    gns[c, j, h] = x

    def backward_src(q, k, v, do, m2, linv, delta, t_indptr, t_indices, perm, bias, group, qscale, scale,
                     items, splits, part_dk, part_dv, dk, dv, mctx, mgrad):
        """dk, dv by source rows over the transposed relation; a source read by very many
        destinations is cut into pieces summed in slot order. With a modifier, mgrad =
        (gns (n, Nk, H), part_gns per slot (n_slots, n, H)) receives the src-field gradients."""
        for w in prange(items.shape[0]):
            # int64: one signature of the item in the driver and in its outlined loop body
            CSR_SRC_ITEM(np.int64(w), q, k, v, do, m2, linv, delta, t_indptr, t_indices, perm, bias, group,
                         qscale, scale, items, splits, part_dk, part_dv, dk, dv, mctx, mgrad)
        for t in prange(splits.shape[0]):
            CSR_SRC_MERGE(np.int64(t), q, k, v, do, m2, linv, delta, t_indptr, t_indices, perm, bias,
                          group, qscale, scale, items, splits, part_dk, part_dv, dk, dv, mctx, mgrad)

    def driver(fn, item, merge, glob):
        return jit_driver(fn, mod, hooks, **{f"{glob}_ITEM": jit_kernel(item, mod, parallel=False, **hooks),
                                             f"{glob}_MERGE": jit_kernel(merge, mod, parallel=False, exact=True,
                                                                           **hooks)})
    return (driver(backward_dst, backward_dst_item, backward_dst_merge, "CSR_DST"),
            driver(backward_src, backward_src_item, backward_src_merge, "CSR_SRC"))
