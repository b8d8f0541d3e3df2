"""CUDA-core kernels for block relations (dense rectangular, triangular, segments).

A BlockRelation is S banded blocks; block b pairs destinations [dst_offsets[b], dst_offsets[b+1])
with sources [src_offsets[b], src_offsets[b+1]) and holds the cell (r, c) (block-local) when
lo[b] <= c - r <= hi[b] (full, square causal, bottom-right-aligned causal, sliding window).
The grid is (S * tiles_per_block, heads): CTA x handles query tile x % tiles_per_block of
block x // tiles_per_block and returns at once when that tile lies past the block's end
(flash-attn's varlen convention: no host-side tile table, so no device->host copy per call).
Only key tiles holding band cells of the CTA's rows are visited (and, in dk/dv, only query
tiles whose band reaches the CTA's keys). In a tile the band cuts, masked cells contribute
nothing: their score is set to -inf (never computed into p), and the products with V, K, Q or
dO of a masked cell are skipped rather than multiplied by 0, so a NaN or inf in a key / value
row outside row i's band never reaches row i (0 * inf would be NaN). Tiles inside the band
take the unguarded loops.

forward: streaming online softmax over BN-key tiles. Phase 1 computes the BM x BN score
tile into shared memory (lane-group dot products, see tiles.py); phase 2 rescales the
running (m, l, acc) once per tile and accumulates p @ V. With `prune`, between the two
phases the CTA reduces the tile's max score and the running max of all its rows and skips
phase 2 (no V use, no softmax update) when max(tile) < m_run_block + ln(rho).

backward (deterministic, no atomics): `dq` walks key tiles per query tile (like the forward);
`dkdv` walks query tiles per key tile, summing the query heads of a GQA group in a fixed order.
Both rebuild p = exp(s - m) / l from the forward's (m, l); Delta comes from common.make_delta.
Every kernel computes a score the same way, (q * scale) . k with the same lane slices and
the same shuffle tree (tiles.py gives the three kernels the same G and VEC), so the backward's
score equals the forward's bit for bit and exp(s - m) of a row's largest score is exactly 1,
at any score magnitude (a last-bit difference would be multiplied by |s|).

Score modifiers (`mod`, cuda/score_codegen.Generated): each in-range score s of cell (i, j) is
replaced by f = value(s, i, j, ...) before masking (global node positions i, j); the backward
kernels rebuild p from f and turn dF = p (dp - Delta) into ds = dF * df/ds with `grad`. The
modifier's gradients are owned by rows: dq sums per-head params and dst fields per (query row,
head) in registers over all its key tiles, dk/dv sums src fields per (key row, query head);
each row writes its sums once (lane 0) into the (rows, n, H) buffer `mg`, so no float atomics.
A kernel compiled without a modifier calls never-used stand-ins (the hooks are compiled out).

Why the three kernels spell out their row loads, tile staging and lane-group dot products
instead of calling shared device functions: numba-cuda (0.30) compiles a device function for
the *current device* (`Dispatcher.compile_device` asks `get_current_device()`), so a kernel that
calls one can no longer be compiled by `compile_ptx(..., cc=(9, 0))` on a machine without a GPU
(CI's sm_90 compile test, `prebuild`); a shared-function version was tried and reverted for this
reason. register_jitable functions go through the same path. The modifier functions are the
exception that works: they are compiled with ``inline="always"``, which numba inlines at its
own IR level, before any device compile.
"""
from __future__ import annotations

import math

import numba
from numba import cuda

from .common import FULL, NEG_INF, array_view, nbtype
from . import launch as _launch
from .launch import SIM, Kernel
from . import score_codegen as _mods

i64 = numba.int64
ALIGN = None if SIM else 16  # 16-byte vector loads from shared memory (the simulator has no alignment)
U = numba.uint64  # index cast: unsigned indices skip numba's negative-index wraparound code


def _strides(prefix):
    return [(f"{prefix}s{n}", "s", i64) for n in range(3)]


# --------------------------------------------------------------------------- forward
def make_forward(t, prune, mod=None):
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    MOD = mod is not None
    MOD_VALUE = mod.value if MOD else _mods.no_value
    AS_IN, AS_ACC, AS_I64, AS_U8 = (array_view(x) for x in (IN, ACC, i64, numba.uint8))
    D, DV, G, R, NT, BN, VEC = t.D, t.DV, t.G, t.R, t.NT, t.BN, t.VEC
    BM, DSQ, DSV, DP, DVP = t.BM, t.DSQ, t.DSV, t.DP, t.DVP
    BNP = BN + 4  # rows of the score tile start 16-byte aligned, 4 banks apart
    PRUNE = bool(prune)
    # reduce-scatter of G keys' partial scores; only while the G-key loop body (R*G*DSQ FMAs)
    # is small enough for the compiler to unroll it fully (else `part` would go to local memory)
    # (the simulator: only where it offers the shuffles, see launch.simulator_has)
    TRS = (not SIM or _launch.simulator_has("shfl_xor_sync", "syncwarp")) and 1 < G and R * G <= 32 and R * G * DSQ <= 256
    LOGG = G.bit_length() - 1
    PS = R * G if TRS else R
    PVS = R * VEC
    KV = max(VEC, G) if TRS else VEC  # keys are processed in whole groups of KV

    RW = 1 if SIM else 32  # lanes reduced by shuffles in the block-wide prune reduction
    NSLOT = NT // RW
    QS = max(1, R * DSQ)
    VS = max(1, R * DSV)
    SK = max(1, BN * DP)
    SV = max(1, BN * DVP)
    SS = BM * BNP
    SYNC_GROUP = G > 1

    def fwd_body(q_p, k_p, v_p, out_p, mo_p, lo_p, doff_p, soff_p, caus_p, blo_p, bhi_p, cnt_p,
                 qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, tpb, H, grp, scale, log_rho,
                 mv_p, mnd_p, mns_p, mef_p, mg_p, mgp_p, mge_p):
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
        doff = AS_I64(doff_p)
        soff = AS_I64(soff_p)
        cnt = AS_I64(cnt_p)
        caus = AS_U8(caus_p)
        blo_a = AS_I64(blo_p)
        bhi_a = AS_I64(bhi_p)
        sK = cuda.shared.array(SK, ACC, alignment=ALIGN)
        sV = cuda.shared.array(SV, ACC, alignment=ALIGN)
        sS = cuda.shared.array(SS, ACC, alignment=ALIGN)
        sA = cuda.shared.array(NSLOT, ACC)
        sB = cuda.shared.array(NSLOT, ACC)
        sF = cuda.shared.array(1, numba.int32)
        tid = cuda.threadIdx.x
        neg = ACC(NEG_INF)
        bx = i64(cuda.blockIdx.x)
        h = i64(cuda.blockIdx.y)
        b = bx // tpb
        d0 = doff[U(b)]
        d1 = doff[U(b + 1)]
        qoff = (bx - b * tpb) * BM  # first query row of this CTA, block-local
        if d0 + qoff >= d1:
            return
        nd = d1 - d0
        s0 = soff[U(b)]
        ns = soff[U(b + 1)] - s0
        causal = caus[U(b)] != 0
        blo = blo_a[U(b)]
        bhi = bhi_a[U(b)]
        hk = h // grp
        lane = tid % G
        grow = tid // G

        qr = cuda.local.array(QS, ACC)
        acc = cuda.local.array(VS, ACC)
        mrow = cuda.local.array(R, ACC)
        lrow = cuda.local.array(R, ACC)
        tmax = cuda.local.array(R, ACC)
        part = cuda.local.array(PS, ACC)
        pv = cuda.local.array(PVS, ACC)
        for r in range(R):
            il = qoff + grow * R + r
            qb = (d0 + il) * qs0 + h * qs1
            for c in range(DSQ):
                d = ((c // VEC) * G + lane) * VEC + c % VEC
                x = ACC(0.0)
                if il < nd and d < D:
                    x = ACC(q[U(qb + d * qs2)]) * scale
                qr[U(r * DSQ + c)] = x
            for c in range(DSV):
                acc[U(r * DSV + c)] = ACC(0.0)
            mrow[U(r)] = neg
            lrow[U(r)] = ACC(0.0)

        # keys of the band for this tile's rows [qoff, qlast]: [kbeg, kend); key tiles stay
        # aligned to the block, so only tiles holding band cells are visited
        qlast = min(qoff + BM, nd) - 1
        kbeg = max(i64(0), qoff + blo)
        kend = min(ns, qlast + bhi + 1)
        tfirst = kbeg // BN
        ntl = i64(0)
        if kend > kbeg and blo <= bhi:
            ntl = (kend + BN - 1) // BN - tfirst
        npruned = 0
        ntotal = 0
        t0 = i64(0)
        if PRUNE and not causal and ntl > 0:
            # start at the key tile facing this query tile (same relative position), so a
            # local score pattern sets the running max first; then wrap around
            t0 = min(ntl - 1, max(i64(0), ((qoff + BM // 2) * ns // max(nd, 1)) // BN - tfirst))
        for it in range(ntl):
            tix = it
            if PRUNE:
                if causal:
                    tix = ntl - 1 - it  # diagonal tile first, then backwards
                else:
                    tix = t0 + it
                    if tix >= ntl:
                        tix -= ntl
            kt0 = (tfirst + tix) * BN
            nk = min(BN, kend - kt0)
            # a tile the band cuts for some valid row: masked cells there must not multiply V
            cut = kt0 - qlast < blo or kt0 + nk - 1 - qoff > bhi
            nkv = (nk + KV - 1) // KV * KV  # keys padded: whole p vectors (and lane groups)
            kb = s0 + kt0
            cuda.syncthreads()  # the previous tile's readers are done with sK / sV / sS
            for e in range(tid, BN * DP, NT):
                j = e // DP
                d = e - j * DP
                x = ACC(0.0)
                if j < nk and d < D:
                    x = ACC(k[U((kb + j) * ks0 + hk * ks1 + d * ks2)])
                sK[U(e)] = x
            for e in range(tid, BN * DVP, NT):
                j = e // DVP
                d = e - j * DVP
                x = ACC(0.0)
                if j < nk and d < DV:
                    x = ACC(v[U((kb + j) * vs0 + hk * vs1 + d * vs2)])
                sV[U(e)] = x
            cuda.syncthreads()

            # phase 1: scores of this tile -> sS (masked entries -inf), row maxima -> tmax
            for r in range(R):
                tmax[U(r)] = neg
            if TRS:
                # G keys at a time; a reduce-scatter over the group's lanes leaves lane s with
                # the full scores of key j0 + s (G - 1 shuffles per row instead of G log2 G)
                for j0 in range(0, nkv, G):
                    for kk in range(G):
                        for r in range(R):
                            part[U(r * G + kk)] = ACC(0.0)
                        for c in range(DSQ):
                            kv = sK[U((j0 + kk) * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                            for r in range(R):
                                part[U(r * G + kk)] += qr[U(r * DSQ + c)] * kv
                    for lvl in range(LOGG):
                        off = G >> (lvl + 1)
                        hi = (lane & off) != 0
                        for r in range(R):
                            for kk in range(G // 2):  # constant trip count: fully unrolled
                                if kk < off:
                                    a = part[U(r * G + kk)]
                                    b = part[U(r * G + kk + off)]
                                    snd = b
                                    if hi:
                                        snd = a
                                        a = b
                                    part[U(r * G + kk)] = a + cuda.shfl_xor_sync(FULL, snd, off)
                    j = j0 + lane
                    for r in range(R):
                        sc = part[U(r * G)]
                        rl = grow * R + r
                        il = qoff + rl
                        dl = kt0 + j - il
                        if MOD and j < nk and il < nd:
                            sc = MOD_VALUE(sc, d0 + il, s0 + kt0 + j, i64(-1), h, H, mod_v,
                                           mod_nd, mod_ns, mod_ef)
                        if j >= nk or il >= nd or dl < blo or dl > bhi:
                            sc = neg
                        sS[U(rl * BNP + j)] = sc
                        if sc > tmax[U(r)]:
                            tmax[U(r)] = sc
                for r in range(R):
                    x = tmax[U(r)]
                    off = G // 2
                    while off > 0:
                        x = max(x, cuda.shfl_xor_sync(FULL, x, off))
                        off //= 2
                    tmax[U(r)] = x
            else:
                for j in range(nk):
                    for r in range(R):
                        part[U(r)] = ACC(0.0)
                    for c in range(DSQ):
                        kv = sK[U(j * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            part[U(r)] += qr[U(r * DSQ + c)] * kv
                    for r in range(R):
                        sc = part[U(r)]
                        off = G // 2
                        while off > 0:
                            sc += cuda.shfl_xor_sync(FULL, sc, off)
                            off //= 2
                        rl = grow * R + r
                        il = qoff + rl
                        dl = kt0 + j - il
                        if MOD and il < nd:
                            sc = MOD_VALUE(sc, d0 + il, s0 + kt0 + j, i64(-1), h, H, mod_v,
                                           mod_nd, mod_ns, mod_ef)
                        if il >= nd or dl < blo or dl > bhi:
                            sc = neg
                        if lane == 0:
                            sS[U(rl * BNP + j)] = sc
                        if sc > tmax[U(r)]:
                            tmax[U(r)] = sc
                if lane == 0:
                    for j in range(nk, nkv):  # pad to a whole vector of keys: p = 0 there
                        for r in range(R):
                            sS[U((grow * R + r) * BNP + j)] = neg

            if PRUNE:
                # block-wide: max(tile scores) vs the running max of every row of the CTA
                a = neg
                bm = neg
                for r in range(R):
                    a = max(a, tmax[U(r)])
                    bm = max(bm, mrow[U(r)])
                off = RW // 2
                while off > 0:
                    a = max(a, cuda.shfl_xor_sync(FULL, a, off))
                    bm = max(bm, cuda.shfl_xor_sync(FULL, bm, off))
                    off //= 2
                if tid % RW == 0:
                    sA[U(tid // RW)] = a
                    sB[U(tid // RW)] = bm
                cuda.syncthreads()
                if tid == 0:
                    a = sA[U(0)]
                    bm = sB[U(0)]
                    for w in range(1, NSLOT):
                        a = max(a, sA[U(w)])
                        bm = max(bm, sB[U(w)])
                    admit = 1
                    if bm > neg and a < bm + log_rho:
                        admit = 0
                    ntotal += 1
                    npruned += 1 - admit
                    sF[U(0)] = admit
                cuda.syncthreads()
                if sF[U(0)] == 0:
                    continue

            if SYNC_GROUP:
                cuda.syncwarp()  # lane 0 wrote the group's scores; all its lanes read them next
            # phase 2: rescale once per tile, p = exp(s - m_new) in place, acc += p @ V
            for r in range(R):
                rl = grow * R + r
                mo_ = mrow[U(r)]
                mn = max(mo_, tmax[U(r)])
                alpha = ACC(1.0)
                if mn > neg:
                    alpha = math.exp(mo_ - mn)
                mrow[U(r)] = mn
                for c in range(DSV):
                    acc[U(r * DSV + c)] *= alpha
                ps = ACC(0.0)
                for j in range(lane, nkv, G):
                    sv = sS[U(rl * BNP + j)]
                    p = ACC(0.0)
                    if not (sv <= neg):   # a masked cell (neg) adds 0; a NaN score stays NaN, as on the CPU
                        p = math.exp(sv - mn)
                    sS[U(rl * BNP + j)] = p
                    ps += p
                off = G // 2
                while off > 0:
                    ps += cuda.shfl_xor_sync(FULL, ps, off)
                    off //= 2
                lrow[U(r)] = lrow[U(r)] * alpha + ps
            if SYNC_GROUP:
                cuda.syncwarp()
            if cut:
                # masked cells add nothing (not 0 * v: a non-finite v[j] outside row i's band
                # must not reach row i); a compact loop, taken only by tiles the band cuts
                for j in range(nkv):
                    for c in range(DSV):
                        vv = sV[U(j * DVP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            dl = kt0 + j - (qoff + grow * R + r)
                            if dl >= blo and dl <= bhi:
                                acc[U(r * DSV + c)] += sS[U((grow * R + r) * BNP + j)] * vv
                continue
            for j0 in range(0, nkv, VEC):
                for r in range(R):  # VEC consecutive p of a row: one 16-byte load
                    for jj in range(VEC):
                        pv[U(r * VEC + jj)] = sS[U((grow * R + r) * BNP + j0 + jj)]
                for jj in range(VEC):
                    for c in range(DSV):
                        vv = sV[U((j0 + jj) * DVP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            acc[U(r * DSV + c)] += pv[U(r * VEC + jj)] * vv

        for r in range(R):
            il = qoff + grow * R + r
            if il < nd:
                i = d0 + il
                lr = lrow[U(r)]
                inv = ACC(0.0)
                if lr > 0:
                    inv = ACC(1.0) / lr
                ob = (i * H + h) * DV
                for c in range(DSV):
                    d = ((c // VEC) * G + lane) * VEC + c % VEC
                    if d < DV:
                        out[U(ob + d)] = IN(acc[U(r * DSV + c)] * inv)
                if lane == 0:
                    mo[U(i * H + h)] = mrow[U(r)]
                    lo[U(i * H + h)] = lr
        if PRUNE and tid == 0:
            cuda.atomic.add(cnt, 0, npruned)
            cuda.atomic.add(cnt, 1, ntotal)

    spec = ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("out", "a", IN),
             ("mo", "a", ACC), ("lo", "a", ACC), ("doff", "a", i64), ("soff", "a", i64),
             ("caus", "a", numba.uint8), ("blo", "a", i64), ("bhi", "a", i64), ("cnt", "a", i64)]
            + _strides("q") + _strides("k") + _strides("v")
            + [("tpb", "s", i64), ("H", "s", i64), ("grp", "s", i64), ("scale", "s", ACC),
               ("log_rho", "s", ACC)] + _mods.kernel_args(ACC))
    name = (f"blocks_fwd_{t.dtype}_d{D}_dv{DV}_g{G}_r{R}_bn{BN}" + ("_prune" if PRUNE else "")
            + _mods.tag(mod))
    return Kernel(name, fwd_body, spec)


# --------------------------------------------------------------------------- backward: dq
def make_dq(t, mod=None):
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    MOD = mod is not None
    MOD_VALUE = mod.value if MOD else _mods.no_value
    MOD_GRAD, rows_, _ = mod.grad(("head", "dst")) if MOD else (_mods.no_grad, (), ())
    NG = len(rows_)  # row-owned gradient sums per (query row, head): per-head params, dst fields
    AS_IN, AS_ACC, AS_I64, AS_U8 = (array_view(x) for x in (IN, ACC, i64, numba.uint8))
    D, DV, G, R, NT, BN, VEC = t.D, t.DV, t.G, t.R, t.NT, t.BN, t.VEC
    BM, DSQ, DSV, DP, DVP = t.BM, t.DSQ, t.DSV, t.DP, t.DVP
    QS = max(1, R * DSQ)
    VS = max(1, R * DSV)
    SK = max(1, BN * DP)
    SV = max(1, BN * DVP)
    GA = max(1, R * NG)

    def dq_body(q_p, k_p, v_p, dout_p, mo_p, lo_p, delta_p, dq_p, doff_p, soff_p, caus_p,
                blo_p, bhi_p,
                qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2,
                tpb, H, grp, scale, mv_p, mnd_p, mns_p, mef_p, mg_p, mgp_p, mge_p):
        mod_v = AS_ACC(mv_p)
        mod_nd = AS_ACC(mnd_p)
        mod_ns = AS_ACC(mns_p)
        mod_ef = AS_ACC(mef_p)
        mod_g = AS_ACC(mg_p)
        q = AS_IN(q_p)
        k = AS_IN(k_p)
        v = AS_IN(v_p)
        dout = AS_IN(dout_p)
        dq = AS_IN(dq_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        delta = AS_ACC(delta_p)
        doff = AS_I64(doff_p)
        soff = AS_I64(soff_p)
        blo_a = AS_I64(blo_p)
        bhi_a = AS_I64(bhi_p)
        sK = cuda.shared.array(SK, ACC, alignment=ALIGN)
        sV = cuda.shared.array(SV, ACC, alignment=ALIGN)
        tid = cuda.threadIdx.x
        neg = ACC(NEG_INF)
        bx = i64(cuda.blockIdx.x)
        h = i64(cuda.blockIdx.y)
        b = bx // tpb
        d0 = doff[U(b)]
        d1 = doff[U(b + 1)]
        qoff = (bx - b * tpb) * BM
        if d0 + qoff >= d1:
            return
        nd = d1 - d0
        s0 = soff[U(b)]
        ns = soff[U(b + 1)] - s0
        blo = blo_a[U(b)]
        bhi = bhi_a[U(b)]
        hk = h // grp
        lane = tid % G
        grow = tid // G

        qr = cuda.local.array(QS, ACC)
        dqa = cuda.local.array(QS, ACC)
        okr = cuda.local.array(R, numba.boolean)
        dor = cuda.local.array(VS, ACC)
        mm = cuda.local.array(R, ACC)
        il_ = cuda.local.array(R, ACC)
        dl = cuda.local.array(R, ACC)
        ps = cuda.local.array(R, ACC)
        pd = cuda.local.array(R, ACC)
        ga = cuda.local.array(GA, ACC)
        ge = cuda.local.array(1, ACC)
        for xg in range(GA):
            ga[U(xg)] = ACC(0.0)
        for r in range(R):
            il = qoff + grow * R + r
            i = d0 + il
            for c in range(DSQ):
                d = ((c // VEC) * G + lane) * VEC + c % VEC
                x = ACC(0.0)
                if il < nd and d < D:
                    x = ACC(q[U(i * qs0 + h * qs1 + d * qs2)]) * scale
                qr[U(r * DSQ + c)] = x
                dqa[U(r * DSQ + c)] = ACC(0.0)
            for c in range(DSV):
                d = ((c // VEC) * G + lane) * VEC + c % VEC
                x = ACC(0.0)
                if il < nd and d < DV:
                    x = ACC(dout[U(i * os0 + h * os1 + d * os2)])
                dor[U(r * DSV + c)] = x
            mm[U(r)] = neg
            il_[U(r)] = ACC(0.0)
            dl[U(r)] = ACC(0.0)
            if il < nd:
                lv = lo[U(i * H + h)]
                # l = 0: an empty row (p = 0); a NaN l (a NaN or inf score in the row) makes the
                # row's probabilities, and so its gradient shares, NaN as on the CPU
                if lv > 0 or lv != lv:
                    mm[U(r)] = mo[U(i * H + h)]
                    il_[U(r)] = ACC(1.0) / lv
                    dl[U(r)] = delta[U(i * H + h)]

        qlast = min(qoff + BM, nd) - 1
        kbeg = max(i64(0), qoff + blo)
        kend = min(ns, qlast + bhi + 1)
        if blo > bhi:  # empty block
            kend = kbeg
        for kt0 in range(kbeg // BN * BN, kend, BN):
            nk = min(BN, kend - kt0)
            kb = s0 + kt0
            cut = kt0 - qlast < blo or kt0 + nk - 1 - qoff > bhi
            cuda.syncthreads()
            for e in range(tid, BN * DP, NT):
                j = e // DP
                d = e - j * DP
                x = ACC(0.0)
                if j < nk and d < D:
                    x = ACC(k[U((kb + j) * ks0 + hk * ks1 + d * ks2)])
                sK[U(e)] = x
            for e in range(tid, BN * DVP, NT):
                j = e // DVP
                d = e - j * DVP
                x = ACC(0.0)
                if j < nk and d < DV:
                    x = ACC(v[U((kb + j) * vs0 + hk * vs1 + d * vs2)])
                sV[U(e)] = x
            cuda.syncthreads()
            for j in range(nk):
                for r in range(R):
                    ps[U(r)] = ACC(0.0)
                    pd[U(r)] = ACC(0.0)
                for c in range(DSQ):
                    kv = sK[U(j * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                    for r in range(R):
                        ps[U(r)] += qr[U(r * DSQ + c)] * kv
                for c in range(DSV):
                    vv = sV[U(j * DVP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                    for r in range(R):
                        pd[U(r)] += dor[U(r * DSV + c)] * vv
                for r in range(R):
                    s = ps[U(r)]
                    dp = pd[U(r)]
                    off = G // 2
                    while off > 0:
                        s += cuda.shfl_xor_sync(FULL, s, off)
                        dp += cuda.shfl_xor_sync(FULL, dp, off)
                        off //= 2
                    il = qoff + grow * R + r
                    dlt = kt0 + j - il
                    inb = dlt >= blo and dlt <= bhi
                    okr[U(r)] = inb
                    g_ = ACC(0.0)  # masked cells: 0, not 0 * (dp - Delta) (dp may be non-finite)
                    if il_[U(r)] != 0 and inb:
                        if MOD:  # f = value(s); dF = p (dp - Delta); ds = dF * df/ds
                            i = d0 + il
                            jg = s0 + kt0 + j
                            f = MOD_VALUE(s, i, jg, i64(-1), h, H, mod_v, mod_nd, mod_ns, mod_ef)
                            g_ = MOD_GRAD(s, i, jg, i64(-1), h, H, mod_v, mod_nd, mod_ns, mod_ef,
                                          math.exp(f - mm[U(r)]) * il_[U(r)] * (dp - dl[U(r)]),
                                          ga, r * NG, ge)
                        else:
                            g_ = math.exp(s - mm[U(r)]) * il_[U(r)] * (dp - dl[U(r)])
                    ps[U(r)] = g_
                if cut:  # masked cells add nothing (k[j] outside the band may be non-finite)
                    for c in range(DSQ):
                        kv = sK[U(j * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            if okr[U(r)]:
                                dqa[U(r * DSQ + c)] += ps[U(r)] * kv
                else:
                    for c in range(DSQ):
                        kv = sK[U(j * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            dqa[U(r * DSQ + c)] += ps[U(r)] * kv

        for r in range(R):
            il = qoff + grow * R + r
            if il < nd:
                ob = ((d0 + il) * H + h) * D
                for c in range(DSQ):
                    d = ((c // VEC) * G + lane) * VEC + c % VEC
                    if d < D:
                        dq[U(ob + d)] = IN(dqa[U(r * DSQ + c)] * scale)
                if NG and lane == 0:  # this row's modifier gradient sums: one writer per cell
                    for xg in range(NG):
                        mod_g[U(((d0 + il) * NG + xg) * H + h)] = ga[U(r * NG + xg)]

    spec = ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("dout", "a", IN),
             ("mo", "a", ACC), ("lo", "a", ACC), ("delta", "a", ACC), ("dq", "a", IN),
             ("doff", "a", i64), ("soff", "a", i64), ("caus", "a", numba.uint8),
             ("blo", "a", i64), ("bhi", "a", i64)]
            + _strides("q") + _strides("k") + _strides("v") + _strides("o")
            + [("tpb", "s", i64), ("H", "s", i64), ("grp", "s", i64), ("scale", "s", ACC)]
            + _mods.kernel_args(ACC))
    return Kernel(f"blocks_dq_{t.dtype}_d{D}_dv{DV}_g{G}_r{R}_bn{BN}" + _mods.tag(mod), dq_body,
                  spec)


# --------------------------------------------------------------------------- backward: dk, dv
def make_dkdv(t, mod=None):
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    MOD = mod is not None
    MOD_VALUE = mod.value if MOD else _mods.no_value
    MOD_GRAD, rows_, _ = mod.grad(("src",)) if MOD else (_mods.no_grad, (), ())
    NG = len(rows_)  # row-owned gradient sums per (key row, query head): src fields
    AS_IN, AS_ACC, AS_I64, AS_U8 = (array_view(x) for x in (IN, ACC, i64, numba.uint8))
    D, DV, G, R, NT, BN, VEC = t.D, t.DV, t.G, t.R, t.NT, t.BN, t.VEC
    BM, DSQ, DSV, DP, DVP = t.BM, t.DSQ, t.DSV, t.DP, t.DVP
    QS = max(1, R * DSQ)
    VS = max(1, R * DSV)
    SQ = max(1, BN * DP)
    SO = max(1, BN * DVP)
    GA = max(1, R * NG)

    def dkdv_body(q_p, k_p, v_p, dout_p, mo_p, lo_p, delta_p, dk_p, dv_p, doff_p, soff_p, caus_p,
                  blo_p, bhi_p,
                  qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2,
                  tpb, H, grp, scale, mv_p, mnd_p, mns_p, mef_p, mg_p, mgp_p, mge_p):
        mod_v = AS_ACC(mv_p)
        mod_nd = AS_ACC(mnd_p)
        mod_ns = AS_ACC(mns_p)
        mod_ef = AS_ACC(mef_p)
        mod_g = AS_ACC(mg_p)
        q = AS_IN(q_p)
        k = AS_IN(k_p)
        v = AS_IN(v_p)
        dout = AS_IN(dout_p)
        dk = AS_IN(dk_p)
        dv = AS_IN(dv_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        delta = AS_ACC(delta_p)
        doff = AS_I64(doff_p)
        soff = AS_I64(soff_p)
        blo_a = AS_I64(blo_p)
        bhi_a = AS_I64(bhi_p)
        sQ = cuda.shared.array(SQ, ACC, alignment=ALIGN)
        sO = cuda.shared.array(SO, ACC, alignment=ALIGN)
        sM = cuda.shared.array(BN, ACC)
        sL = cuda.shared.array(BN, ACC)
        sD = cuda.shared.array(BN, ACC)
        tid = cuda.threadIdx.x
        neg = ACC(NEG_INF)
        bx = i64(cuda.blockIdx.x)
        hk = i64(cuda.blockIdx.y)
        Hkv = H // grp
        b = bx // tpb
        s0 = soff[U(b)]
        s1 = soff[U(b + 1)]
        koff = (bx - b * tpb) * BM
        if s0 + koff >= s1:
            return
        ns = s1 - s0
        d0 = doff[U(b)]
        nd = doff[U(b + 1)] - d0
        blo = blo_a[U(b)]
        bhi = bhi_a[U(b)]
        lane = tid % G
        grow = tid // G

        kr = cuda.local.array(QS, ACC)
        dka = cuda.local.array(QS, ACC)
        vr = cuda.local.array(VS, ACC)
        dva = cuda.local.array(VS, ACC)
        ps = cuda.local.array(R, ACC)
        pd = cuda.local.array(R, ACC)
        okr = cuda.local.array(R, numba.boolean)
        ga = cuda.local.array(GA, ACC)
        ge = cuda.local.array(1, ACC)
        for r in range(R):
            kl = koff + grow * R + r
            j = s0 + kl
            for c in range(DSQ):
                d = ((c // VEC) * G + lane) * VEC + c % VEC
                x = ACC(0.0)
                if kl < ns and d < D:
                    x = ACC(k[U(j * ks0 + hk * ks1 + d * ks2)])
                kr[U(r * DSQ + c)] = x
                dka[U(r * DSQ + c)] = ACC(0.0)
            for c in range(DSV):
                d = ((c // VEC) * G + lane) * VEC + c % VEC
                x = ACC(0.0)
                if kl < ns and d < DV:
                    x = ACC(v[U(j * vs0 + hk * vs1 + d * vs2)])
                vr[U(r * DSV + c)] = x
                dva[U(r * DSV + c)] = ACC(0.0)

        # query rows whose band reaches this tile's keys [koff, klast]: [qbeg, qend)
        klast = min(koff + BM, ns) - 1
        qbeg = max(i64(0), koff - bhi)
        qend = min(nd, klast - blo + 1)
        if blo > bhi:  # empty block
            qend = qbeg
        for g in range(grp):
            h = hk * grp + g
            for xg in range(GA):
                ga[U(xg)] = ACC(0.0)
            for qt0 in range(qbeg, qend, BN):
                nq = min(BN, qend - qt0)
                qb = d0 + qt0
                cut = koff - (qt0 + nq - 1) < blo or klast - qt0 > bhi
                cuda.syncthreads()
                for e in range(tid, BN * DP, NT):
                    jq = e // DP
                    d = e - jq * DP
                    x = ACC(0.0)
                    if jq < nq and d < D:
                        # scaled q, as the forward scales it: the same products, summed in
                        # the same order, give the forward's score bit for bit
                        x = ACC(q[U((qb + jq) * qs0 + h * qs1 + d * qs2)]) * scale
                    sQ[U(e)] = x
                for e in range(tid, BN * DVP, NT):
                    jq = e // DVP
                    d = e - jq * DVP
                    x = ACC(0.0)
                    if jq < nq and d < DV:
                        x = ACC(dout[U((qb + jq) * os0 + h * os1 + d * os2)])
                    sO[U(e)] = x
                for e in range(tid, BN, NT):
                    mv = neg
                    lv = ACC(0.0)
                    dv_ = ACC(0.0)
                    if e < nq:
                        row = (qb + e) * H + h
                        l_ = lo[U(row)]
                        if l_ > 0 or l_ != l_:   # as in the dq kernel: NaN l gives NaN shares
                            mv = mo[U(row)]
                            lv = ACC(1.0) / l_
                            dv_ = delta[U(row)]
                    sM[U(e)] = mv
                    sL[U(e)] = lv
                    sD[U(e)] = dv_
                cuda.syncthreads()
                for jq in range(nq):
                    for r in range(R):
                        ps[U(r)] = ACC(0.0)
                        pd[U(r)] = ACC(0.0)
                    for c in range(DSQ):
                        qv = sQ[U(jq * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            ps[U(r)] += kr[U(r * DSQ + c)] * qv
                    for c in range(DSV):
                        ov = sO[U(jq * DVP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                        for r in range(R):
                            pd[U(r)] += vr[U(r * DSV + c)] * ov
                    lv = sL[U(jq)]
                    mv = sM[U(jq)]
                    dlt = sD[U(jq)]
                    for r in range(R):
                        s = ps[U(r)]
                        dp = pd[U(r)]
                        off = G // 2
                        while off > 0:
                            s += cuda.shfl_xor_sync(FULL, s, off)
                            dp += cuda.shfl_xor_sync(FULL, dp, off)
                            off //= 2
                        kl = koff + grow * R + r
                        dq_ = kl - (qt0 + jq)
                        inb = kl < ns and dq_ >= blo and dq_ <= bhi
                        okr[U(r)] = inb
                        p = ACC(0.0)
                        g_ = ACC(0.0)  # masked cells: 0, not 0 * (dp - Delta)
                        if lv != 0 and inb:
                            if MOD:  # f = value(s); ds = p (dp - Delta) * df/ds
                                i = qb + jq
                                jg = s0 + kl
                                f = MOD_VALUE(s, i, jg, i64(-1), h, H, mod_v, mod_nd, mod_ns,
                                              mod_ef)
                                p = math.exp(f - mv) * lv
                                g_ = MOD_GRAD(s, i, jg, i64(-1), h, H, mod_v, mod_nd, mod_ns,
                                              mod_ef, p * (dp - dlt), ga, r * NG, ge)
                            else:
                                p = math.exp(s - mv) * lv
                                g_ = p * (dp - dlt)
                        ps[U(r)] = p
                        pd[U(r)] = g_
                    if cut:  # masked cells add nothing (q / dout outside the band may be non-finite)
                        for c in range(DSV):
                            ov = sO[U(jq * DVP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                            for r in range(R):
                                if okr[U(r)]:
                                    dva[U(r * DSV + c)] += ps[U(r)] * ov
                        for c in range(DSQ):
                            qv = sQ[U(jq * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                            for r in range(R):
                                if okr[U(r)]:
                                    dka[U(r * DSQ + c)] += pd[U(r)] * qv
                    else:
                        for c in range(DSV):
                            ov = sO[U(jq * DVP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                            for r in range(R):
                                dva[U(r * DSV + c)] += ps[U(r)] * ov
                        for c in range(DSQ):
                            qv = sQ[U(jq * DP + ((c // VEC) * G + lane) * VEC + c % VEC)]
                            for r in range(R):
                                dka[U(r * DSQ + c)] += pd[U(r)] * qv
            if NG and lane == 0:  # this query head's src-field sums of each key row
                for r in range(R):
                    kl = koff + grow * R + r
                    if kl < ns:
                        for xg in range(NG):
                            mod_g[U(((s0 + kl) * NG + xg) * H + h)] = ga[U(r * NG + xg)]

        for r in range(R):
            kl = koff + grow * R + r
            if kl < ns:
                j = s0 + kl
                ob = (j * Hkv + hk) * D
                for c in range(DSQ):
                    d = ((c // VEC) * G + lane) * VEC + c % VEC
                    if d < D:
                        dk[U(ob + d)] = IN(dka[U(r * DSQ + c)])  # sQ holds scaled q
                ob = (j * Hkv + hk) * DV
                for c in range(DSV):
                    d = ((c // VEC) * G + lane) * VEC + c % VEC
                    if d < DV:
                        dv[U(ob + d)] = IN(dva[U(r * DSV + c)])

    spec = ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("dout", "a", IN),
             ("mo", "a", ACC), ("lo", "a", ACC), ("delta", "a", ACC), ("dk", "a", IN),
             ("dv", "a", IN), ("doff", "a", i64), ("soff", "a", i64), ("caus", "a", numba.uint8),
             ("blo", "a", i64), ("bhi", "a", i64)]
            + _strides("q") + _strides("k") + _strides("v") + _strides("o")
            + [("tpb", "s", i64), ("H", "s", i64), ("grp", "s", i64), ("scale", "s", ACC)]
            + _mods.kernel_args(ACC))
    return Kernel(f"blocks_dkdv_{t.dtype}_d{D}_dv{DV}_g{G}_r{R}_bn{BN}" + _mods.tag(mod),
                  dkdv_body, spec)
