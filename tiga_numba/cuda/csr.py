"""CUDA-core kernels for CSR relations (graph attention).

One lane group of G consecutive lanes per (destination row, head) in the forward and the dq
pass, per (source row, key/value head) in the dk/dv pass; lane s owns head-dimension slice
d = s, s+G, ... . Consecutive groups are consecutive heads of the same row, so a warp reads
a gathered key/value row as a few fully used 32-byte sectors: the kernels are bound by the
gather bandwidth (each edge reads one key row and one value row), which is what they aim at.

forward: online softmax over the row's edges, `t.UE` edges per step (2 UE gathered rows in
flight per lane group, the running max rescaled once per step; tiles.csr_tiles picks one edge
per step under a register cap: more resident lane groups beat more rows per group);
edge_bias (E, H) is added to the scaled score; D = 0 (precomputed per-edge scores) works: the
dot product is empty.

backward, deterministic without atomics, reading (m, log l, Delta) triples from common.make_stats
(p = exp((s - m) - log l): s - m is exact for a row's largest score, which a single rounded
lse = m + log l is not once |m| * eps exceeds log l's own size). Every kernel computes a
score as (q * scale) . k with the same lane slices and shuffle tree, so the backward's score
equals the forward's bit for bit:
dq (and dbias, one writer per edge) by destination rows over the CSR; dk/dv by source rows over the transposed CSR (rows = sources, `perm` maps
each entry to its edge id for the bias), summing a GQA group's query heads in a fixed order.

Score modifiers (`mod`, cuda/score_codegen.Generated) take the place of the bias: each score s
of edge e = (i, j) becomes f = value(s, i, j, e, h, ...); the backward turns
dF = p (dp - Delta) into ds = dF * df/ds with `grad`. Gradients without float atomics: the dq
pass owns per-head params and dst fields, summed per (row, head) in registers and written once
(rows in `mg`, pieces of split rows in `mgp`, merged in slot order by make_sum_merge), and edge
fields, written per edge into `mge`; the dk/dv pass owns src fields, summed per (source row,
query head) the same way (the kernel is then compiled for the call's GQA group size, which
sizes its register sums).
"""
from __future__ import annotations

import math

import numba
from numba import cuda

from .common import NEG_INF, nbtype
from .common import make_softmax_merge as _softmax_merge
from .launch import SIM, Kernel, array_view
from . import score_codegen as _mods

i64 = numba.int64
U = numba.uint64  # index cast: unsigned indices skip numba's negative-index wraparound code
i32 = numba.int32
u32 = numba.uint32


def _strides(prefix):
    return [(f"{prefix}s{n}", "s", i64) for n in range(3)]


def register_cap(t, mod):
    """(kernel name suffix, numba-cuda options) of the tiles' register cap: registers bound the
    lane groups (and so the gathered rows) in flight per SM. A modifier's expression needs
    registers of its own: its kernels keep the compiler's choice."""
    regs = t.REGS if t.REGS and mod is None else 0
    return (f"_r{regs}", {"max_registers": regs}) if regs else ("", {})


def make_forward(t, bias, items=False, mod=None):
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    MOD = mod is not None
    MOD_VALUE = mod.value if MOD else _mods.no_value
    AS_IN, AS_ACC, AS_I64, AS_I32 = (array_view(x) for x in (IN, ACC, i64, i32))
    D, DV, G, NT = t.D, t.DV, t.G, t.NT
    DSQ, DSV = t.DSQ, t.DSV
    QS, VS = max(1, DSQ), max(1, DSV)
    BIAS = bool(bias)
    ITEMS = bool(items)
    GM = (1 << G) - 1
    UE = t.UE  # edges per step: 2 * UE gathered rows in flight per lane group
    UVS = UE * VS

    def csr_fwd(q_p, k_p, v_p, out_p, mo_p, lo_p, indptr_p, indices_p, bias_p,
                qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, nrows, H, grp, scale,
                items_p, pacc_p, pm_p, pl_p, mv_p, mnd_p, mns_p, mef_p, mg_p, mgp_p, mge_p):
        mod_v = AS_ACC(mv_p)
        mod_nd = AS_ACC(mnd_p)
        mod_ns = AS_ACC(mns_p)
        mod_ef = AS_ACC(mef_p)
        q = AS_IN(q_p)
        k = AS_IN(k_p)
        v = AS_IN(v_p)
        out = AS_IN(out_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        indptr = AS_I64(indptr_p)
        indices = AS_I32(indices_p)
        eb = AS_ACC(bias_p)
        witems = AS_I64(items_p)
        pacc = AS_ACC(pacc_p)
        pm = AS_ACC(pm_p)
        pl = AS_ACC(pl_p)
        tid = cuda.threadIdx.x
        neg = ACC(NEG_INF)
        gid = i64(cuda.blockIdx.x) * NT + tid
        gi = gid // G
        lane = gid - gi * G
        w = gi // H
        h = gi - w * H
        if w >= nrows:
            return
        if ITEMS:  # work item w: edges [e, e1) of row i; slot >= 0: one piece of a long row
            i = witems[U(4 * w)]
            e = witems[U(4 * w + 1)]
            e1 = witems[U(4 * w + 2)]
            slot = witems[U(4 * w + 3)]
        else:
            i = w
            e = indptr[U(i)]
            e1 = indptr[U(i + 1)]
            slot = i64(-1)
        mask = u32(GM << ((tid % 32) - lane))
        hk = h // grp
        qr = cuda.local.array(QS, ACC)
        acc = cuda.local.array(VS, ACC)
        vv = cuda.local.array(UVS, ACC)
        sc = cuda.local.array(UE, ACC)
        kb = cuda.local.array(UE, i64)
        vbase = cuda.local.array(UE, i64)
        ju = cuda.local.array(UE, i64)
        qb = i * qs0 + h * qs1
        for c in range(DSQ):
            d = c * G + lane
            x = ACC(0.0)
            if d < D:
                x = ACC(q[U(qb + d * qs2)]) * scale
            qr[U(c)] = x
        for c in range(DSV):
            acc[U(c)] = ACC(0.0)
        m = neg
        l = ACC(0.0)
        while e < e1:
            # UE edges per step: 2*UE gathered rows in flight, one rescale per step; slots
            # past the row's end repeat its first edge (valid addresses) and get p = 0
            nu = min(UE, e1 - e)
            for u in range(UE):
                eu = e
                if u < nu:
                    eu = e + u
                jb = i64(indices[U(eu)])
                ju[U(u)] = jb
                kb[U(u)] = jb * ks0 + hk * ks1
                vbase[U(u)] = jb * vs0 + hk * vs1
                sc[U(u)] = ACC(0.0)
            for c in range(DSQ):
                d = c * G + lane
                if d < D:
                    qv = qr[U(c)]
                    for u in range(UE):
                        sc[U(u)] += qv * ACC(k[U(kb[U(u)] + d * ks2)])
            for c in range(DSV):
                d = c * G + lane
                for u in range(UE):
                    x = ACC(0.0)
                    if d < DV:
                        x = ACC(v[U(vbase[U(u)] + d * vs2)])
                    vv[U(u * DSV + c)] = x
            for u in range(UE):
                x = sc[U(u)]
                off = G // 2
                while off > 0:
                    x += cuda.shfl_xor_sync(mask, x, off)
                    off //= 2
                if BIAS and u < nu:
                    x += eb[U((e + u) * H + h)]
                if MOD and u < nu:
                    x = MOD_VALUE(x, i, ju[U(u)], e + u, h, H, mod_v, mod_nd, mod_ns, mod_ef)
                sc[U(u)] = x
            mn = m
            nan = False
            for u in range(UE):
                if u < nu:
                    mn = max(mn, sc[U(u)])
                    nan = nan or sc[U(u)] != sc[U(u)]
            # a NaN score makes the row NaN (as on the CPU), also before its first finite score
            if mn > neg or nan:
                alpha = ACC(1.0)
                if mn > neg:
                    alpha = math.exp(m - mn)
                l = l * alpha
                for u in range(UE):
                    p = ACC(0.0)
                    if u < nu:
                        p = math.exp(sc[U(u)] - mn)
                    sc[U(u)] = p
                    l += p
                for c in range(DSV):
                    a_ = acc[U(c)] * alpha
                    for u in range(UE):
                        a_ += sc[U(u)] * vv[U(u * DSV + c)]
                    acc[U(c)] = a_
                m = mn
            e += nu
        if slot >= 0:  # unnormalised partial state of one piece; make_softmax_merge combines
            pb = slot * H + h
            for c in range(DSV):
                d = c * G + lane
                if d < DV:
                    pacc[U(pb * DV + d)] = acc[U(c)]
            if lane == 0:
                pm[U(pb)] = m
                pl[U(pb)] = l
            return
        inv = ACC(0.0)
        if l > 0:
            inv = ACC(1.0) / l
        ob = (i * H + h) * DV
        for c in range(DSV):
            d = c * G + lane
            if d < DV:
                out[U(ob + d)] = IN(acc[U(c)] * inv)
        if lane == 0:
            mo[U(i * H + h)] = m
            lo[U(i * H + h)] = l

    spec = ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("out", "a", IN),
             ("mo", "a", ACC), ("lo", "a", ACC), ("indptr", "a", i64), ("indices", "a", i32),
             ("bias", "a", ACC)]
            + _strides("q") + _strides("k") + _strides("v")
            + [("nrows", "s", i64), ("H", "s", i64), ("grp", "s", i64), ("scale", "s", ACC)]
            + _ITEM_ARGS(ACC) + _mods.kernel_args(ACC))
    cap, opts = register_cap(t, mod)
    return Kernel(f"csr_fwd_{t.dtype}_d{D}_dv{DV}_g{G}_nt{t.NT}_ue{UE}" + cap
                  + ("_bias" if BIAS else "") + ("_items" if ITEMS else "") + _mods.tag(mod),
                  csr_fwd, spec, **opts)


def make_dq(t, bias, items=False, mod=None):
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    MOD = mod is not None
    MOD_VALUE = mod.value if MOD else _mods.no_value
    MOD_GRAD, rows_, edges_ = (mod.grad(("head", "dst", "edge")) if MOD
                               else (_mods.no_grad, (), ()))
    NG = len(rows_)     # per (row, head) sums: per-head params, dst fields
    NGE = len(edges_)   # per edge: edge fields
    GA = max(1, NG)
    GE = max(1, NGE)
    AS_IN, AS_ACC, AS_I64, AS_I32 = (array_view(x) for x in (IN, ACC, i64, i32))
    D, DV, G, NT = t.D, t.DV, t.G, t.NT
    DSQ, DSV = t.DSQ, t.DSV
    QS, VS = max(1, DSQ), max(1, DSV)
    BIAS = bool(bias)
    ITEMS = bool(items)
    GM = (1 << G) - 1

    def csr_dq(q_p, k_p, v_p, dout_p, st_p, dq_p, dbias_p, indptr_p, indices_p,
               bias_p, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2,
               nrows, H, grp, scale, items_p, pdq_p, unused1_p, unused2_p,
               mv_p, mnd_p, mns_p, mef_p, mg_p, mgp_p, mge_p):
        mod_v = AS_ACC(mv_p)
        mod_nd = AS_ACC(mnd_p)
        mod_ns = AS_ACC(mns_p)
        mod_ef = AS_ACC(mef_p)
        mod_g = AS_ACC(mg_p)
        mod_gp = AS_ACC(mgp_p)
        mod_ge = AS_ACC(mge_p)
        q = AS_IN(q_p)
        k = AS_IN(k_p)
        v = AS_IN(v_p)
        dout = AS_IN(dout_p)
        st = AS_ACC(st_p)
        dq = AS_IN(dq_p)
        dbias = AS_ACC(dbias_p)
        indptr = AS_I64(indptr_p)
        indices = AS_I32(indices_p)
        eb = AS_ACC(bias_p)
        witems = AS_I64(items_p)
        pdq = AS_ACC(pdq_p)
        tid = cuda.threadIdx.x
        gid = i64(cuda.blockIdx.x) * NT + tid
        gi = gid // G
        lane = gid - gi * G
        w = gi // H
        h = gi - w * H
        if w >= nrows:
            return
        if ITEMS:
            i = witems[U(4 * w)]
            e = witems[U(4 * w + 1)]
            e1 = witems[U(4 * w + 2)]
            slot = witems[U(4 * w + 3)]
        else:
            i = w
            e = indptr[U(i)]
            e1 = indptr[U(i + 1)]
            slot = i64(-1)
        mask = u32(GM << ((tid % 32) - lane))
        hk = h // grp
        qr = cuda.local.array(QS, ACC)
        ka = cuda.local.array(QS, ACC)
        kb = cuda.local.array(QS, ACC)
        dqa = cuda.local.array(QS, ACC)
        dor = cuda.local.array(VS, ACC)
        ga = cuda.local.array(GA, ACC)
        ge = cuda.local.array(GE, ACC)
        for xg in range(GA):
            ga[U(xg)] = ACC(0.0)
        for c in range(DSQ):
            d = c * G + lane
            x = ACC(0.0)
            if d < D:
                x = ACC(q[U(i * qs0 + h * qs1 + d * qs2)]) * scale
            qr[U(c)] = x
            dqa[U(c)] = ACC(0.0)
        for c in range(DSV):
            d = c * G + lane
            x = ACC(0.0)
            if d < DV:
                x = ACC(dout[U(i * os0 + h * os1 + d * os2)])
            dor[U(c)] = x
        row = i * H + h
        mx = st[U(3 * row)]
        lgl = st[U(3 * row + 1)]
        dl = st[U(3 * row + 2)]
        live = mx < math.inf
        while e < e1:
            two = e + 1 < e1  # two edges per step: four gathered rows in flight
            j0 = i64(indices[U(e)])
            j1 = j0
            if two:
                j1 = i64(indices[U(e + 1)])
            k0 = j0 * ks0 + hk * ks1
            k1 = j1 * ks0 + hk * ks1
            v0 = j0 * vs0 + hk * vs1
            v1 = j1 * vs0 + hk * vs1
            s0 = ACC(0.0)
            s1 = ACC(0.0)
            dp0 = ACC(0.0)
            dp1 = ACC(0.0)
            for c in range(DSQ):
                d = c * G + lane
                x0 = ACC(0.0)
                x1 = ACC(0.0)
                if d < D:
                    x0 = ACC(k[U(k0 + d * ks2)])
                    x1 = ACC(k[U(k1 + d * ks2)])
                ka[U(c)] = x0
                kb[U(c)] = x1
                s0 += qr[U(c)] * x0
                s1 += qr[U(c)] * x1
            for c in range(DSV):
                d = c * G + lane
                if d < DV:
                    dp0 += dor[U(c)] * ACC(v[U(v0 + d * vs2)])
                    dp1 += dor[U(c)] * ACC(v[U(v1 + d * vs2)])
            off = G // 2
            while off > 0:
                s0 += cuda.shfl_xor_sync(mask, s0, off)
                s1 += cuda.shfl_xor_sync(mask, s1, off)
                dp0 += cuda.shfl_xor_sync(mask, dp0, off)
                dp1 += cuda.shfl_xor_sync(mask, dp1, off)
                off //= 2
            if BIAS:
                s0 += eb[U(e * H + h)]
                if two:
                    s1 += eb[U((e + 1) * H + h)]
            ds0 = ACC(0.0)
            ds1 = ACC(0.0)
            if live and MOD:  # f = value(s); ds = p (dp - Delta) * df/ds, edge by edge
                f = MOD_VALUE(s0, i, j0, e, h, H, mod_v, mod_nd, mod_ns, mod_ef)
                ds0 = MOD_GRAD(s0, i, j0, e, h, H, mod_v, mod_nd, mod_ns, mod_ef,
                               math.exp((f - mx) - lgl) * (dp0 - dl), ga, 0, ge)
                if NGE and lane == 0:
                    for xg in range(NGE):
                        mod_ge[U((e * NGE + xg) * H + h)] = ge[U(xg)]
                if two:
                    f = MOD_VALUE(s1, i, j1, e + 1, h, H, mod_v, mod_nd, mod_ns, mod_ef)
                    ds1 = MOD_GRAD(s1, i, j1, e + 1, h, H, mod_v, mod_nd, mod_ns, mod_ef,
                                   math.exp((f - mx) - lgl) * (dp1 - dl), ga, 0, ge)
                    if NGE and lane == 0:
                        for xg in range(NGE):
                            mod_ge[U(((e + 1) * NGE + xg) * H + h)] = ge[U(xg)]
            elif live:
                ds0 = math.exp((s0 - mx) - lgl) * (dp0 - dl)
                if two:
                    ds1 = math.exp((s1 - mx) - lgl) * (dp1 - dl)
            for c in range(DSQ):
                dqa[U(c)] += ds0 * ka[U(c)] + ds1 * kb[U(c)]
            if BIAS and lane == 0:
                dbias[U(e * H + h)] = ds0
                if two:
                    dbias[U((e + 1) * H + h)] = ds1
            e += 2
        if NG and lane == 0:  # the row's (or piece's) modifier gradient sums, one writer each
            for xg in range(NG):
                if slot >= 0:
                    mod_gp[U((slot * NG + xg) * H + h)] = ga[U(xg)]
                else:
                    mod_g[U((i * NG + xg) * H + h)] = ga[U(xg)]
        if slot >= 0:  # partial sum of one piece; make_sum_merge adds the pieces in order
            pb = (slot * H + h) * D
            for c in range(DSQ):
                d = c * G + lane
                if d < D:
                    pdq[U(pb + d)] = dqa[U(c)]
            return
        ob = (i * H + h) * D
        for c in range(DSQ):
            d = c * G + lane
            if d < D:
                dq[U(ob + d)] = IN(dqa[U(c)] * scale)

    spec = ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("dout", "a", IN),
             ("st", "a", ACC), ("dq", "a", IN), ("dbias", "a", ACC), ("indptr", "a", i64),
             ("indices", "a", i32), ("bias", "a", ACC)]
            + _strides("q") + _strides("k") + _strides("v") + _strides("o")
            + [("nrows", "s", i64), ("H", "s", i64), ("grp", "s", i64), ("scale", "s", ACC)]
            + _ITEM_ARGS(ACC) + _mods.kernel_args(ACC))
    cap, opts = register_cap(t, mod)
    return Kernel(f"csr_dq_{t.dtype}_d{D}_dv{DV}_g{G}" + cap + ("_bias" if BIAS else "")
                  + ("_items" if ITEMS else "") + _mods.tag(mod), csr_dq, spec, **opts)


def make_dkdv(t, bias, items=False, mod=None, group=1):
    """`group`: the GQA group size the kernel is compiled for when the modifier has src-field
    gradients (its per-(row, query head) sums live in registers); any group size otherwise."""
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    MOD = mod is not None
    MOD_VALUE = mod.value if MOD else _mods.no_value
    MOD_GRAD, rows_, _ = mod.grad(("src",)) if MOD else (_mods.no_grad, (), ())
    NG = len(rows_)  # per (source row, query head) sums: src fields
    GRP = int(group) if NG else 1
    GA = max(1, GRP * NG)
    AS_IN, AS_ACC, AS_I64, AS_I32 = (array_view(x) for x in (IN, ACC, i64, i32))
    D, DV, G, NT = t.D, t.DV, t.G, t.NT
    DSQ, DSV = t.DSQ, t.DSV
    QS, VS = max(1, DSQ), max(1, DSV)
    BIAS = bool(bias)
    ITEMS = bool(items)
    GM = (1 << G) - 1

    def csr_dkdv(q_p, k_p, v_p, dout_p, st_p, dk_p, dv_p, tptr_p, tind_p,
                 perm_p, bias_p, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2,
                 nsrc, H, grp, scale, items_p, pdk_p, pdv_p, unused_p,
                 mv_p, mnd_p, mns_p, mef_p, mg_p, mgp_p, mge_p):
        mod_v = AS_ACC(mv_p)
        mod_nd = AS_ACC(mnd_p)
        mod_ns = AS_ACC(mns_p)
        mod_ef = AS_ACC(mef_p)
        mod_g = AS_ACC(mg_p)
        mod_gp = AS_ACC(mgp_p)
        q = AS_IN(q_p)
        k = AS_IN(k_p)
        v = AS_IN(v_p)
        dout = AS_IN(dout_p)
        st = AS_ACC(st_p)
        dk = AS_IN(dk_p)
        dv = AS_IN(dv_p)
        tptr = AS_I64(tptr_p)
        tind = AS_I32(tind_p)
        perm = AS_I64(perm_p)
        eb = AS_ACC(bias_p)
        witems = AS_I64(items_p)
        pdk = AS_ACC(pdk_p)
        pdv = AS_ACC(pdv_p)
        tid = cuda.threadIdx.x
        gid = i64(cuda.blockIdx.x) * NT + tid
        gi = gid // G
        lane = gid - gi * G
        Hkv = H // grp
        w = gi // Hkv
        hk = gi - w * Hkv
        if w >= nsrc:
            return
        if ITEMS:  # work item w: entries [tt, t1) of source row j of the transpose
            j = witems[U(4 * w)]
            tt = witems[U(4 * w + 1)]
            t1 = witems[U(4 * w + 2)]
            slot = witems[U(4 * w + 3)]
        else:
            j = w
            tt = tptr[U(j)]
            t1 = tptr[U(j + 1)]
            slot = i64(-1)
        mask = u32(GM << ((tid % 32) - lane))
        kr = cuda.local.array(QS, ACC)
        vr = cuda.local.array(VS, ACC)
        qa = cuda.local.array(QS, ACC)
        qb = cuda.local.array(QS, ACC)
        oa = cuda.local.array(VS, ACC)
        ob_ = cuda.local.array(VS, ACC)
        dka = cuda.local.array(QS, ACC)
        dva = cuda.local.array(VS, ACC)
        ga = cuda.local.array(GA, ACC)
        ge = cuda.local.array(1, ACC)
        for xg in range(GA):
            ga[U(xg)] = ACC(0.0)
        for c in range(DSQ):
            d = c * G + lane
            x = ACC(0.0)
            if d < D:
                x = ACC(k[U(j * ks0 + hk * ks1 + d * ks2)])
            kr[U(c)] = x
            dka[U(c)] = ACC(0.0)
        for c in range(DSV):
            d = c * G + lane
            x = ACC(0.0)
            if d < DV:
                x = ACC(v[U(j * vs0 + hk * vs1 + d * vs2)])
            vr[U(c)] = x
            dva[U(c)] = ACC(0.0)
        while tt < t1:
            two = tt + 1 < t1  # two incoming edges per step: four gathered rows in flight
            i0 = i64(tind[U(tt)])
            e0 = perm[U(tt)]
            i1 = i0
            e1 = e0
            if two:
                i1 = i64(tind[U(tt + 1)])
                e1 = perm[U(tt + 1)]
            for g in range(GRP if NG else grp):  # compiled group size: sums stay in registers
                h = hk * grp + g
                s0 = ACC(0.0)
                s1 = ACC(0.0)
                dp0 = ACC(0.0)
                dp1 = ACC(0.0)
                for c in range(DSQ):
                    d = c * G + lane
                    x0 = ACC(0.0)
                    x1 = ACC(0.0)
                    if d < D:  # scaled q, as in the forward: the same score bits
                        x0 = ACC(q[U(i0 * qs0 + h * qs1 + d * qs2)]) * scale
                        x1 = ACC(q[U(i1 * qs0 + h * qs1 + d * qs2)]) * scale
                    qa[U(c)] = x0
                    qb[U(c)] = x1
                    s0 += kr[U(c)] * x0
                    s1 += kr[U(c)] * x1
                for c in range(DSV):
                    d = c * G + lane
                    x0 = ACC(0.0)
                    x1 = ACC(0.0)
                    if d < DV:
                        x0 = ACC(dout[U(i0 * os0 + h * os1 + d * os2)])
                        x1 = ACC(dout[U(i1 * os0 + h * os1 + d * os2)])
                    oa[U(c)] = x0
                    ob_[U(c)] = x1
                    dp0 += vr[U(c)] * x0
                    dp1 += vr[U(c)] * x1
                r0 = i0 * H + h
                r1 = i1 * H + h
                mx0 = st[U(3 * r0)]
                lgl0 = st[U(3 * r0 + 1)]
                dl0 = st[U(3 * r0 + 2)]
                mx1 = st[U(3 * r1)]
                lgl1 = st[U(3 * r1 + 1)]
                dl1 = st[U(3 * r1 + 2)]
                off = G // 2
                while off > 0:
                    s0 += cuda.shfl_xor_sync(mask, s0, off)
                    s1 += cuda.shfl_xor_sync(mask, s1, off)
                    dp0 += cuda.shfl_xor_sync(mask, dp0, off)
                    dp1 += cuda.shfl_xor_sync(mask, dp1, off)
                    off //= 2
                if BIAS:
                    s0 += eb[U(e0 * H + h)]
                    s1 += eb[U(e1 * H + h)]
                p0 = ACC(0.0)
                p1 = ACC(0.0)
                if MOD:  # f = value(s); ds = p (dp - Delta) * df/ds, src sums per query head
                    ds0 = ACC(0.0)
                    ds1 = ACC(0.0)
                    if mx0 < math.inf:
                        f = MOD_VALUE(s0, i0, j, e0, h, H, mod_v, mod_nd, mod_ns, mod_ef)
                        p0 = math.exp((f - mx0) - lgl0)
                        ds0 = MOD_GRAD(s0, i0, j, e0, h, H, mod_v, mod_nd, mod_ns, mod_ef,
                                       p0 * (dp0 - dl0), ga, g * NG, ge)
                    if two and mx1 < math.inf:
                        f = MOD_VALUE(s1, i1, j, e1, h, H, mod_v, mod_nd, mod_ns, mod_ef)
                        p1 = math.exp((f - mx1) - lgl1)
                        ds1 = MOD_GRAD(s1, i1, j, e1, h, H, mod_v, mod_nd, mod_ns, mod_ef,
                                       p1 * (dp1 - dl1), ga, g * NG, ge)
                else:
                    if mx0 < math.inf:
                        p0 = math.exp((s0 - mx0) - lgl0)
                    if two and mx1 < math.inf:
                        p1 = math.exp((s1 - mx1) - lgl1)
                    ds0 = p0 * (dp0 - dl0)
                    ds1 = p1 * (dp1 - dl1)
                for c in range(DSV):
                    dva[U(c)] += p0 * oa[U(c)] + p1 * ob_[U(c)]
                for c in range(DSQ):
                    dka[U(c)] += ds0 * qa[U(c)] + ds1 * qb[U(c)]
            tt += 2
        if NG and lane == 0:  # the row's (or piece's) src-field sums per query head
            for g in range(GRP):
                h = hk * GRP + g
                for xg in range(NG):
                    if slot >= 0:
                        mod_gp[U((slot * NG + xg) * H + h)] = ga[U(g * NG + xg)]
                    else:
                        mod_g[U((j * NG + xg) * H + h)] = ga[U(g * NG + xg)]
        if slot >= 0:  # partial sums of one piece; make_sum_merge adds the pieces in order
            pb = slot * Hkv + hk
            for c in range(DSQ):
                d = c * G + lane
                if d < D:
                    pdk[U(pb * D + d)] = dka[U(c)]
            for c in range(DSV):
                d = c * G + lane
                if d < DV:
                    pdv[U(pb * DV + d)] = dva[U(c)]
            return
        ob = (j * Hkv + hk) * D
        for c in range(DSQ):
            d = c * G + lane
            if d < D:
                dk[U(ob + d)] = IN(dka[U(c)])  # qa, qb hold scaled q
        ob = (j * Hkv + hk) * DV
        for c in range(DSV):
            d = c * G + lane
            if d < DV:
                dv[U(ob + d)] = IN(dva[U(c)])

    spec = ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("dout", "a", IN),
             ("st", "a", ACC), ("dk", "a", IN), ("dv", "a", IN), ("tptr", "a", i64),
             ("tind", "a", i32), ("perm", "a", i64), ("bias", "a", ACC)]
            + _strides("q") + _strides("k") + _strides("v") + _strides("o")
            + [("nsrc", "s", i64), ("H", "s", i64), ("grp", "s", i64), ("scale", "s", ACC)]
            + _ITEM_ARGS(ACC) + _mods.kernel_args(ACC))
    cap, opts = register_cap(t, mod)
    return Kernel(f"csr_dkdv_{t.dtype}_d{D}_dv{DV}_g{G}" + cap + ("_bias" if BIAS else "")
                  + ("_items" if ITEMS else "") + _mods.tag(mod) + (f"_grp{GRP}" if NG else ""),
                  csr_dkdv, spec, **opts)


# --------------------------------------------------------------------------- split rows
def _ITEM_ARGS(ACC):
    """Trailing arguments of the three kernels: the work-item table (row, e0, e1, slot) and
    up to three partial-state buffers; unused (any 8-byte address) without `items`."""
    return [("items", "a", i64), ("part0", "a", ACC), ("part1", "a", ACC), ("part2", "a", ACC)]


def row_pieces(indptr, piece, longest_first=True):
    """Work items of a CSR pass (host, numpy): every row of degree <= piece is one item
    (row, e0, e1, -1), written directly; a longer row becomes ceil(deg / piece) near-equal
    pieces, each with its own partial-state slot. Returns (items (n, 4) int64, splits (s, 3)
    int64 rows (row, first slot, number of slots), number of slots).

    With `longest_first` the items are ordered by decreasing length (ties in row order): the
    lane groups of a warp then walk rows of about the same length (a warp lasts as long as its
    longest row) and the longest work starts first. Slots stay numbered in row order, so the
    merge order, and the bits, do not depend on the item order."""
    import numpy as np
    indptr = np.asarray(indptr, np.int64)
    deg = np.diff(indptr)
    n = deg.shape[0]
    k = np.where(deg > piece, -(-deg // piece), 1)
    long_ = deg > piece
    first_item = np.concatenate([[0], np.cumsum(k)])
    n_items = int(first_item[-1])
    row = np.repeat(np.arange(n, dtype=np.int64), k)
    p = np.arange(n_items, dtype=np.int64) - first_item[:-1][row]  # piece index in its row
    kk = k[row]
    e0 = indptr[row] + (deg[row] * p) // kk
    e1 = indptr[row] + (deg[row] * (p + 1)) // kk
    slot_base = np.concatenate([[0], np.cumsum(np.where(long_, k, 0))])
    slot = np.where(long_[row], slot_base[:-1][row] + p, -1)
    items = np.stack([row, e0, e1, slot], axis=1).astype(np.int64)
    if longest_first:
        items = items[np.argsort(e0 - e1, kind="stable")]
    srows = np.flatnonzero(long_)
    splits = np.stack([srows, slot_base[:-1][srows], k[srows]], axis=1).astype(np.int64)
    return np.ascontiguousarray(items), np.ascontiguousarray(splits.reshape(-1, 3)), int(slot_base[-1])


def make_softmax_merge(dtype, acc, DV):
    """out, m, l of each split row from its pieces' partial states, in slot order:
    M = max m_s, l = sum l_s e^(m_s - M), out = sum acc_s e^(m_s - M) / l. Launched with
    (pacc, pm, pl, splits table, out, m, l, number of split rows, H); common.make_softmax_merge
    has the kernel (one CTA per (split row, head))."""
    return _softmax_merge(dtype, acc, DV, table=True)


def make_sum_merge(dtype, acc, W):
    """out[row, h, :] = mult * sum of the row's pieces (slot order), for the split rows."""
    IN, ACC = nbtype(dtype), nbtype(acc)
    AS_IN, AS_ACC, AS_I64 = array_view(IN), array_view(ACC), array_view(i64)
    NT = 32 if SIM else 128
    WM = max(W, 1)

    def body(part_p, splits_p, out_p, nsplit, Hh, mult):
        part = AS_ACC(part_p)
        sp = AS_I64(splits_p)
        out = AS_IN(out_p)
        x = i64(cuda.blockIdx.x)
        si = x // Hh
        h = x - si * Hh
        if si >= nsplit:
            return
        i = sp[U(3 * si)]
        s0 = sp[U(3 * si + 1)]
        ns = sp[U(3 * si + 2)]
        for d in range(cuda.threadIdx.x, WM, NT):
            if d < W:
                a = ACC(0.0)
                for s in range(s0, s0 + ns):
                    a += part[U((s * Hh + h) * W + d)]
                out[U((i * Hh + h) * W + d)] = IN(a * mult)

    spec = [("part", "a", ACC), ("splits", "a", i64), ("out", "a", IN), ("nsplit", "s", i64),
            ("Hh", "s", i64), ("mult", "s", ACC)]
    kern = Kernel(f"csr_sum_merge_{dtype}_w{W}", body, spec)
    kern.NT = NT
    return kern
