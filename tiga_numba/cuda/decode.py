"""Split-key forward for few-query block relations (decode, short queries over long contexts).

A block with a handful of query rows and a long key range gives the query-tile kernels of
blocks.py one CTA per (query tile, head): a few CTAs for the whole GPU, each walking every key
alone. Here the key range of a block is cut into `splits` chunks (flash-decoding): grid =
(blocks, splits, kv heads x row groups). One CTA takes one chunk of keys and *all* the query
rows of its block times the `grp` query heads that share its kv head ("rows" below, query-row
major: row rl is query row rl // grp, head hk * grp + rl % grp), so every K / V row of the
chunk is read once for all of them (grouped-query heads packed together).

Two kernels share that launch, grid, CTA set-up (make_cta_keys) and end (make_combine):
make_decode on the CUDA cores (any dtype and layout; below) and make_decode_mma on tensor cores
(aligned float16 rows of D 64 / 128; its docstring). The caller picks per call from the K / V
layout (cuda/api.py).

In make_decode's CTA, a lane group of G lanes owns one key at a time (lane s holds dims c * G + s, so
one load instruction reads G consecutive elements of a row); the NW * 32 / G groups walk the
chunk T keys per step, each keeping its own online-softmax state (m, l, acc) for every row.
Per step: T scores per row (dot products meeting through log2(G) xor shuffles), one rescale
per row, T exps, acc += p * V. At the end the groups' states meet in shared memory, summed in
group order. With one split the CTA writes (out, m, l) itself; otherwise it writes its
unnormalised partial (acc, m, l) and `make_merge` combines the splits of each row in split
order:  M = max_c m_c,  l = sum_c l_c e^(m_c - M),  out = sum_c acc_c e^(m_c - M) / l.
Fixed orders everywhere, no atomics: the bits do not depend on scheduling.

Bands (lo <= c - r <= hi) are honoured cell by cell; masked cells get no score and add
nothing (their V row is not multiplied by 0), so a non-finite value outside a row's band never
reaches it. m is the row's largest scaled score and l = sum exp(s - m), as the other CUDA
forwards write them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
from numba import cuda

from .common import FULL, NEG_INF, array_view, make_softmax_merge, nbtype, part_weight
from .launch import SIM, Kernel

i64 = numba.int64
U = numba.uint64
U32 = nbtype("uint32")


@dataclass(frozen=True)
class DecodeTiles:
    dtype: str
    acc: str
    D: int
    DV: int
    G: int = 8  # lanes per key
    T: int = 2  # keys per lane group and step
    NW: int = 4  # warps per CTA
    ROWS: int = 4  # (query row, head) rows per CTA
    threads: int = 0  # 0: 32 * NW (the simulator's tests take fewer)
    vec: bool = False  # 16-bit rows read as 16-byte vectors: lane s holds dims [s DS, s DS + DS)
    mma: bool = False  # tensor-core geometry (make_decode_mma): G = 32, T keys per warp and step
    ctas_per_sm: int = 8  # CTAs an SM holds at once (the split rule fills whole waves of them)

    @property
    def NT(self):
        return self.threads or 32 * self.NW

    @property
    def groups(self):
        return self.NT // self.G

    @property
    def DS(self):
        return max(1, -(-self.D // self.G))

    @property
    def DVS(self):
        return max(1, -(-self.DV // self.G))

    @property
    def step(self):
        """Keys a CTA consumes per step."""
        return self.groups * self.T

    def describe(self):
        if self.mma:
            return (f"tensor cores (mma.sync m16n8k16): {self.T} keys per warp and step, "
                    f"{self.NW} warps, {self.ROWS} rows per CTA as the MMA's M")
        return (f"{self.G} lanes per key, {self.T} keys per lane group and step, "
                f"{self.NT} threads, {self.ROWS} rows per CTA"
                + (", 16-byte K/V loads" if self.vec else ""))


def vector_loads_fit(dtype, D, DV):
    """Whether the 16-byte-load geometry exists for these sizes: 16-bit rows of D == DV
    elements, a multiple of 8, split over a power-of-two number of lanes (the dot products meet
    through xor shuffles). The arrays' alignment is checked per call (vector_loads_aligned)."""
    return dtype == "float16" and D == DV and D % 8 == 0 and D // 8 <= 64 and _pow2(D // 8)


def _pow2(n):
    return n >= 1 and n & (n - 1) == 0


def vector_loads_aligned(ptrs, strides):
    """16-byte loads need every K / V row start 16-byte aligned and unit stride along D."""
    return (all(p % 16 == 0 for p in ptrs)
            and all(s0 % 8 == 0 and s1 % 8 == 0 and s2 == 1 for s0, s1, s2 in strides))


# vector geometry: 16-byte loads per lane and K / V row, keys per lane group and step (chosen
# on the H200 with benchmarks/gpu/decode_probe.py)
VEC_LOADS = 2
VEC_KEYS = 4


def decode_tiles(dtype, D, DV, rows, vec=False):
    """Geometry for `rows` (query row, head) pairs per block: about 16 elements of a K / V row
    per lane; up to 8 rows per CTA for D <= 64, 4 above (q and acc stay in registers).

    With `vec` (vector_loads_fit), a lane holds 8 * VEC_LOADS consecutive elements of a row and
    reads them with VEC_LOADS 16-byte loads, VEC_KEYS keys per lane group and step, so each lane
    has 2 * VEC_LOADS * VEC_KEYS loads of 16 bytes in flight per step (the scalar geometry
    issues one 2-byte load per element)."""
    R = 1
    while R < rows and R < (8 if max(D, DV) <= 64 else 4):
        R *= 2
    if vec:
        G = max(1, min(32, D // 8 // VEC_LOADS))  # lanes per key; each holds D / G elements
        return DecodeTiles(dtype, "float32", D, DV, G=G, T=VEC_KEYS, NW=4, ROWS=R, vec=True)
    G = 1
    while G < 32 and G * 16 < max(D, DV):
        G *= 2
    acc = "float64" if dtype == "float64" else "float32"
    return DecodeTiles(dtype, acc, D, DV, G=G, T=2, NW=4, ROWS=R)


def make_decode(t):
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    AS_IN, AS_ACC, AS_I64 = (array_view(x) for x in (IN, ACC, i64))
    D, DV, G, T, ROWS = t.D, t.DV, t.G, t.T, t.ROWS
    DS, DVS, NGT = t.DS, t.DVS, t.groups
    VEC = t.vec
    if VEC:  # 16-byte loads (ld.global.nc.v4) and half2 -> float2 unpacking, inline PTX
        from .tc.ptx import intrinsics
        _ptx = intrinsics(t.dtype)
        ldg16, unpack2 = _ptx["ldg_v4_if"], _ptx["unpack2"]
        assert DS == DVS and DS % 8 == 0
    else:
        ldg16 = unpack2 = None
    NV = DS // 8  # with VEC: 16-byte loads per lane and K / V row
    LOGG = G.bit_length() - 1
    SM = NGT * ROWS
    SA = NGT * ROWS * DV if DV else 1
    QS = ROWS * DS
    AS = ROWS * DVS
    SCN = ROWS * T
    KS = DS * T
    VSB = DVS * T

    combine = make_combine(t)
    cta_keys = make_cta_keys(ROWS)

    def body(q_p, k_p, v_p, out_p, mo_p, lo_p, pacc_p, pm_p, pl_p, doff_p, soff_p, blo_p, bhi_p,
             qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, H, grp, nrg, splits, chunk, scale):
        q = AS_IN(q_p)
        k = AS_IN(k_p)
        v = AS_IN(v_p)
        out = AS_IN(out_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        pacc = AS_ACC(pacc_p)
        pm = AS_ACC(pm_p)
        pl = AS_ACC(pl_p)
        doff = AS_I64(doff_p)
        soff = AS_I64(soff_p)
        blo_a = AS_I64(blo_p)
        bhi_a = AS_I64(bhi_p)
        sM = cuda.shared.array(SM, ACC)
        sL = cuda.shared.array(SM, ACC)
        sA = cuda.shared.array(SA, ACC)
        neg = ACC(NEG_INF)
        tid = cuda.threadIdx.x
        c, hk, d0, s0, nrows, r0, blo, bhi, cb, ce, qa, qz = cta_keys(doff, soff, blo_a, bhi_a,
                                                                       nrg, grp, chunk)
        if r0 >= nrows:
            return
        cut = cb - qz < blo or ce - 1 - qa > bhi  # the band cuts this chunk for some row

        lane = tid % G
        gid = tid // G
        qr = cuda.local.array(QS, ACC)
        acc = cuda.local.array(AS, ACC)
        mrow = cuda.local.array(ROWS, ACC)
        lrow = cuda.local.array(ROWS, ACC)
        sc = cuda.local.array(SCN, ACC)
        ok = cuda.local.array(SCN, numba.boolean)
        kv = cuda.local.array(KS, ACC)
        vv = cuda.local.array(VSB, ACC)
        for r in range(ROWS):
            rl = r0 + r
            il = rl // grp
            h = hk * grp + (rl - il * grp)
            for cc in range(DS):
                d = lane * DS + cc if VEC else cc * G + lane
                x = ACC(0.0)
                if rl < nrows and d < D:
                    x = ACC(q[U((d0 + il) * qs0 + h * qs1 + d * qs2)]) * scale
                qr[U(r * DS + cc)] = x
            for cc in range(DVS):
                acc[U(r * DVS + cc)] = ACC(0.0)
            mrow[U(r)] = neg
            lrow[U(r)] = ACC(0.0)

        # every thread runs the same number of steps (the shuffles need whole warps); group gid
        # takes keys [j0 + gid * T, j0 + gid * T + T) of each step
        for js in range(cb, ce, NGT * T):
            j0 = js + gid * T
            # this group's T keys: K and V rows loaded together (2 T rows in flight per
            # group), then the scores of every row
            for tt in range(T):
                j = j0 + tt
                if VEC:
                    # NV 16-byte loads of K and of V per lane (8 halves each); keys past the
                    # chunk are not read (the predicated load returns zeros)
                    inr = numba.uint32(1 if j < ce else 0)
                    jj = min(j, ce - 1)
                    for w in range(NV):
                        ka = k_p + 2 * ((s0 + jj) * ks0 + hk * ks1 + lane * DS + 8 * w)
                        va = v_p + 2 * ((s0 + jj) * vs0 + hk * vs1 + lane * DS + 8 * w)
                        kw = ldg16(inr, ka)
                        vw = ldg16(inr, va)
                        e8 = tt * DS + 8 * w
                        for p in range(4):  # each u32 holds two halves
                            kv[U(e8 + 2 * p)], kv[U(e8 + 2 * p + 1)] = unpack2(kw[p])
                            vv[U(e8 + 2 * p)], vv[U(e8 + 2 * p + 1)] = unpack2(vw[p])
                else:
                    for cc in range(DS):
                        d = cc * G + lane
                        x = ACC(0.0)
                        if j < ce and d < D:
                            x = ACC(k[U((s0 + j) * ks0 + hk * ks1 + d * ks2)])
                        kv[U(tt * DS + cc)] = x
                    for cc in range(DVS):
                        d = cc * G + lane
                        x = ACC(0.0)
                        if j < ce and d < DV:
                            x = ACC(v[U((s0 + j) * vs0 + hk * vs1 + d * vs2)])
                        vv[U(tt * DVS + cc)] = x
            for tt in range(T):
                for r in range(ROWS):
                    x = ACC(0.0)
                    for cc in range(DS):
                        x += qr[U(r * DS + cc)] * kv[U(tt * DS + cc)]
                    for lvl in range(LOGG):
                        x += cuda.shfl_xor_sync(FULL, x, 1 << lvl)
                    sc[U(r * T + tt)] = x
            for r in range(ROWS):
                rl = r0 + r
                il = rl // grp
                tmax = neg
                for tt in range(T):
                    j = j0 + tt
                    dl = j - il
                    inb = j < ce and rl < nrows and dl >= blo and dl <= bhi
                    ok[U(r * T + tt)] = inb
                    x = sc[U(r * T + tt)]
                    if not inb:
                        x = neg
                    sc[U(r * T + tt)] = x
                    tmax = max(tmax, x)
                mo_ = mrow[U(r)]
                mn = max(mo_, tmax)
                alpha = ACC(1.0)
                if mn > neg:
                    alpha = math.exp(mo_ - mn)
                mrow[U(r)] = mn
                ps = ACC(0.0)
                for tt in range(T):
                    x = sc[U(r * T + tt)]
                    p = ACC(0.0)
                    # masked (neg): 0; a NaN score stays NaN (NaN row, as on the CPU), also
                    # before the row's first finite score
                    if not (x <= neg):
                        p = math.exp(x - mn)
                    sc[U(r * T + tt)] = p
                    ps += p
                lrow[U(r)] = lrow[U(r)] * alpha + ps
                for cc in range(DVS):
                    acc[U(r * DVS + cc)] *= alpha
            for tt in range(T):
                if cut:
                    for r in range(ROWS):
                        if ok[U(r * T + tt)]:  # masked cells add nothing, not 0 * v
                            p = sc[U(r * T + tt)]
                            for cc in range(DVS):
                                acc[U(r * DVS + cc)] += p * vv[U(tt * DVS + cc)]
                else:  # every cell of the chunk is in the band (keys past ce have v = 0)
                    for r in range(ROWS):
                        p = sc[U(r * T + tt)]
                        for cc in range(DVS):
                            acc[U(r * DVS + cc)] += p * vv[U(tt * DVS + cc)]

        # the groups' states meet in shared memory; combined in group order
        for r in range(ROWS):
            if lane == 0:
                sM[U(gid * ROWS + r)] = mrow[U(r)]
                sL[U(gid * ROWS + r)] = lrow[U(r)]
            for cc in range(DVS):
                d = lane * DVS + cc if VEC else cc * G + lane
                if d < DV:
                    sA[U((gid * ROWS + r) * DV + d)] = acc[U(r * DVS + cc)]
        cuda.syncthreads()
        combine(sM, sL, sA, out, mo, lo, pacc, pm, pl, tid, r0, nrows, grp, hk, d0, H, splits, c)

    name = f"decode_{t.dtype}_d{D}_dv{DV}_g{G}_t{T}_nw{t.NW}_r{ROWS}"
    return Kernel(name, body, _spec(IN, ACC))


def _spec(IN, ACC):
    """the parameters of both split-key kernels"""
    return ([("q", "a", IN), ("k", "a", IN), ("v", "a", IN), ("out", "a", IN),
             ("mo", "a", ACC), ("lo", "a", ACC), ("pacc", "a", ACC), ("pm", "a", ACC),
             ("pl", "a", ACC), ("doff", "a", i64), ("soff", "a", i64), ("blo", "a", i64),
             ("bhi", "a", i64)]
            + [(f"{p}s{n}", "s", i64) for p in "qkv" for n in range(3)]
            + [("H", "s", i64), ("grp", "s", i64), ("nrg", "s", i64), ("splits", "s", i64),
               ("chunk", "s", i64), ("scale", "s", ACC)])


def make_cta_keys(ROWS):
    """Device function: this CTA's split c, kv head hk, block (query rows from d0, keys from
    s0), its rows [r0, r0 + ROWS) of the block's nrows = query rows x grp (query rows qa..qz),
    the block's band [blo, bhi] and the CTA's chunk [cb, ce) of the keys any row's band holds."""
    @cuda.jit(device=True, inline="always")
    def cta_keys(doff, soff, blo_a, bhi_a, nrg, grp, chunk):
        b = i64(cuda.blockIdx.x)  # blocks on x: up to 2^31 - 1 of them (y and z stop at 65535)
        c = i64(cuda.blockIdx.y)
        z = i64(cuda.blockIdx.z)
        hk = z // nrg
        r0 = (z - hk * nrg) * ROWS
        d0 = doff[U(b)]
        nrows = (doff[U(b + 1)] - d0) * grp
        s0 = soff[U(b)]
        ns = soff[U(b + 1)] - s0
        blo = blo_a[U(b)]
        bhi = bhi_a[U(b)]
        kbeg = max(i64(0), blo)
        kend = min(ns, nrows // grp - 1 + bhi + 1)
        if blo > bhi:
            kend = kbeg
        cb = kbeg + c * chunk
        ce = min(kend, cb + chunk)
        return (c, hk, d0, s0, nrows, r0, blo, bhi, cb, ce, r0 // grp,
                (min(r0 + ROWS, nrows) - 1) // grp)
    return cta_keys


def make_combine(t):
    """Device function: the CTA's `groups` partial states of its ROWS rows (sM, sL: m and l per
    group and row; sA: acc per group, row and value dim, all in shared memory) combined in group
    order, then written as the row's (out, m, l) with one split, or as split c's partial."""
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    ROWS, NGT, NT, DV = t.ROWS, t.groups, t.NT, t.DV
    DVM = max(DV, 1)

    @cuda.jit(device=True, inline="always")
    def combine(sM, sL, sA, out, mo, lo, pacc, pm, pl, tid, r0, nrows, grp, hk, d0, H, splits, c):
        neg = ACC(NEG_INF)
        for e in range(tid, ROWS * DVM, NT):
            r = e // DVM
            d = e - r * DVM
            rl = r0 + r
            if rl < nrows:
                M = neg
                for g in range(NGT):
                    M = max(M, sM[U(g * ROWS + r)])
                L = ACC(0.0)
                A = ACC(0.0)
                for g in range(NGT):
                    lg = sL[U(g * ROWS + r)]
                    w = part_weight(sM[U(g * ROWS + r)], lg, M)
                    if w != 0:
                        L += lg * w
                        if DV:
                            A += sA[U((g * ROWS + r) * DV + d)] * w
                il = rl // grp
                h = hk * grp + (rl - il * grp)
                i = d0 + il
                if splits == 1:
                    if DV:
                        inv = ACC(0.0)
                        if L > 0 or L != L:
                            inv = ACC(1.0) / L
                        out[U((i * H + h) * DV + d)] = IN(A * inv)
                    if d == 0:
                        mo[U(i * H + h)] = M
                        lo[U(i * H + h)] = L
                else:
                    # partial row (split c of row i, head h)
                    pr = (i * H + h) * splits + c
                    if DV:
                        pacc[U(pr * DV + d)] = A
                    if d == 0:
                        pm[U(pr)] = M
                        pl[U(pr)] = L
    return combine


def mma_fits(dtype, D, DV):
    """Whether the tensor-core geometry exists: float16 rows of D == DV elements, D 64 or 128
    (the accumulators of 16 rows x D stay in registers). Alignment as for vector loads."""
    return dtype == "float16" and D == DV and D in (64, 128)


# tensor-core geometry, chosen on the H200 with benchmarks/gpu/decode_probe.py: warps per CTA,
# and the CTAs an SM holds at once (4 warps x 4 shared tiles of 32 keys x 272 bytes at D = 128:
# 139 KB, one CTA per SM)
MMA_WARPS = 4
MMA_CTAS_PER_SM = 1
MMA_KEYS = 32  # keys per warp and step (16 or 32: one or two k16 steps of the P V product)


def mma_tiles(dtype, D, DV, rows):
    """Tensor-core geometry: up to 8 rows per CTA (rows 0-7 of the MMA's M = 16; more rows take
    more row groups), MMA_KEYS keys per warp and step."""
    R = 1
    while R < rows and R < 8:
        R *= 2
    return DecodeTiles(dtype, "float32", D, DV, G=32, T=MMA_KEYS, NW=MMA_WARPS, ROWS=R, mma=True,
                       ctas_per_sm=MMA_CTAS_PER_SM)


def make_decode_mma(t):
    """Split-key forward on tensor cores (mma.sync m16n8k16, float16 operands, float32
    accumulation), same launch, grid and outputs as make_decode.

    The CTA's ROWS <= 8 (query row, head) pairs are rows 0-7 of the MMA's M dimension (lane
    (gq, tq) = (lane / 4, lane % 4) holds row gq; rows 8-15 are zeros, their results unused).
    Each warp walks its own steps of T (16 or 32) keys of the chunk. cp.async copies the K and V rows of
    the warp's next step into its other pair of shared tiles while this step computes: S = Q K^T
    over n-blocks of 8 keys (K's B fragments by ldmatrix), online softmax on the C
    fragments (a row's 16 scores sit in the 4 lanes of its group), then O += P V with P's A
    fragments taken from S's C fragments as they are and V's B fragments by ldmatrix.trans.
    A step that the band cuts for some row adds its P V on the CUDA cores, cell by cell, so
    that a non-finite V row outside a row's band never reaches it (the MMA would multiply it
    by 0). The warps' states meet in shared memory and are combined in warp order
    (make_combine)."""
    from .tc.ptx import intrinsics
    from .tc.generator.variant import LOG2E
    IN, ACC = nbtype(t.dtype), nbtype(t.acc)
    AS_IN, AS_ACC, AS_I64 = (array_view(x) for x in (IN, ACC, i64))
    D, DV, NW, ROWS, KEYS = t.D, t.DV, t.NW, t.ROWS, t.T
    NB = KEYS // 8  # n-blocks of 8 keys per step
    assert KEYS in (16, 32)
    ptx = intrinsics(t.dtype)
    mma, ldsm, ldsm_t, unpack2, pack2, ex2 = (ptx[n] for n in ("mma16816", "ldsm_x4", "ldsm_x4_t",
                                                                "unpack2", "pack2", "ex2"))
    cp_async16, cp_commit, cp_wait1, cp_wait0, saddr = (
        ptx[n] for n in ("cp_async16", "cp_commit", "cp_wait1", "cp_wait0", "saddr"))
    assert ROWS <= 8
    NS = D // 16  # k16 steps of Q K^T
    NO = DV // 8  # n-blocks of O
    ROWP = 2 * DV + 16  # bytes per K / V row in a shared tile (+16: ldmatrix rows fall in other banks)
    TILE = KEYS * ROWP  # a warp's tiles: K, V of buffer 0, then K, V of buffer 1
    CPR = DV // 8  # 16-byte copies per row
    NCP = KEYS * CPR // 32  # copies per lane and tile
    SM = NW * ROWS
    QF, OFN, SCN = NS * 2, NO * 4, 2 * NB  # fragment registers: Q, O; S / P values per lane
    combine = make_combine(t)
    cta_keys = make_cta_keys(ROWS)

    RPC = 32 // CPR  # K / V rows one warp-wide copy covers: lane l copies 16 bytes of row l // CPR

    @cuda.jit(device=True, inline="always")
    def issue_tiles(ta, kl, vl, krs, vrs, k_p, v_p, s0, hk, ks0, ks1, vs0, vs1, js, ce, lane):
        """cp.async the K and V rows of keys [js, js + KEYS) into the shared tiles at ta and
        ta + TILE; one commit group per call, empty or not, so that the wait counts stay
        aligned. A whole step (every step but a chunk's last) copies from the lane's own
        addresses with no per-copy arithmetic beyond one add: kl, vl are the global addresses
        of its 16 bytes of key 0, krs, vrs the bytes from one key to the next. A step that ends
        the chunk clamps keys past ce (zero-filled, nothing read there)."""
        if js + KEYS <= ce:
            ka = kl + js * krs
            va = vl + js * vrs
            kst = RPC * krs
            vst = RPC * vrs
            sa = ta + numba.uint32((lane // CPR) * ROWP + 16 * (lane % CPR))
            for i in range(NCP):
                cp_async16(sa + numba.uint32(i * RPC * ROWP), ka, numba.uint32(16))
                cp_async16(sa + numba.uint32(TILE + i * RPC * ROWP), va, numba.uint32(16))
                ka += kst
                va += vst
        elif js < ce:
            for i in range(NCP):
                cid = lane + 32 * i
                kk = cid // CPR
                pp = cid - kk * CPR
                j = js + kk
                jj = min(j, ce - 1)
                nb = numba.uint32(16 if j < ce else 0)
                cp_async16(numba.uint32(ta + kk * ROWP + 16 * pp),
                           k_p + 2 * ((s0 + jj) * ks0 + hk * ks1 + 8 * pp), nb)
                cp_async16(numba.uint32(ta + TILE + kk * ROWP + 16 * pp),
                           v_p + 2 * ((s0 + jj) * vs0 + hk * vs1 + 8 * pp), nb)
        cp_commit()

    def body(q_p, k_p, v_p, out_p, mo_p, lo_p, pacc_p, pm_p, pl_p, doff_p, soff_p, blo_p, bhi_p,
             qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, H, grp, nrg, splits, chunk, scale):
        q = AS_IN(q_p)
        out = AS_IN(out_p)
        mo = AS_ACC(mo_p)
        lo = AS_ACC(lo_p)
        pacc = AS_ACC(pacc_p)
        pm = AS_ACC(pm_p)
        pl = AS_ACC(pl_p)
        doff = AS_I64(doff_p)
        soff = AS_I64(soff_p)
        blo_a = AS_I64(blo_p)
        bhi_a = AS_I64(bhi_p)
        sM = cuda.shared.array(SM, ACC)
        sL = cuda.shared.array(SM, ACC)
        # dynamic shared memory: two K and two V tiles per warp, then (aliased) the warps'
        # accumulators
        sA = cuda.shared.array(0, ACC)
        sv = cuda.shared.array(0, U32)
        neg = ACC(NEG_INF)
        zero = ACC(0.0)
        tid = cuda.threadIdx.x
        c, hk, d0, s0, nrows, r0, blo, bhi, cb, ce, qa, qz = cta_keys(doff, soff, blo_a, bhi_a,
                                                                       nrg, grp, chunk)
        if r0 >= nrows:
            return

        lane = tid % 32
        warp = tid // 32
        gq = lane // 4
        tq = lane % 4
        # the lane's row gq: query row il, head h
        rl = r0 + gq
        live = gq < ROWS and rl < nrows
        il = rl // grp
        h = hk * grp + (rl - il * grp)
        qb = (d0 + il) * qs0 + h * qs1
        mrow = neg
        lrow = zero
        # Q as A fragments: step s, registers a0a1 and a4a5 (row gq; a2a3, a6a7: rows 8-15,
        # zeros), dims 16 s + 2 tq + {0, 1} and + 8
        qf = cuda.local.array(QF, U32)
        for s in range(NS):
            for w in range(2):
                x = numba.uint32(0)
                if live:
                    dq = 16 * s + 2 * tq + 8 * w
                    x = pack2(ACC(q[U(qb + dq * qs2)]), ACC(q[U(qb + (dq + 1) * qs2)]))
                qf[s * 2 + w] = x
        of = cuda.local.array(OFN, ACC)
        for e in range(OFN):
            of[e] = zero
        sc = cuda.local.array(SCN, ACC)  # row gq's S (then P) of the step's n-blocks
        z32 = numba.uint32(0)
        wbase = saddr(sv) + numba.uint32(warp * 4 * TILE)
        first = cb + warp * KEYS
        stride = NW * KEYS
        # the lane's copy addresses at key 0 of the block (issue_tiles)
        kl = k_p + 2 * ((s0 + lane // CPR) * ks0 + hk * ks1 + 8 * (lane % CPR))
        vl = v_p + 2 * ((s0 + lane // CPR) * vs0 + hk * vs1 + 8 * (lane % CPR))
        krs = 2 * ks0
        vrs = 2 * vs0
        issue_tiles(wbase, kl, vl, krs, vrs, k_p, v_p, s0, hk, ks0, ks1, vs0, vs1, first, ce,
                    lane)  # the first step
        buf = 0
        # lane l addresses row l % 8 of ldmatrix matrix l // 8
        ka = (lane % 8) * ROWP + 16 * (lane // 8)  # K: keys 8 nb + l % 8, dims + 8 (l // 8)
        va = ((lane % 8) + 8 * ((lane // 8) % 2)) * ROWP + 16 * (lane // 16)  # V: keys, dims
        for js in range(first, ce, stride):
            # the next step's tiles, into the other buffer (every lane finished reading it)
            issue_tiles(wbase + (1 - buf) * 2 * TILE, kl, vl, krs, vrs, k_p, v_p, s0, hk, ks0,
                        ks1, vs0, vs1, js + stride, ce, lane)
            cp_wait1()  # this lane's copies of the current step landed,
            cuda.syncwarp()  # and every lane's
            tk = wbase + buf * 2 * TILE
            tv = tk + TILE
            # S = Q K^T, n-blocks of 8 keys
            for nb in range(NB):
                c0 = zero
                c1 = zero
                c2 = zero
                c3 = zero
                for s2 in range(NS // 2):  # two k16 steps per ldmatrix.x4
                    b0, b1, b2, b3 = ldsm(numba.uint32(tk + ka + 8 * nb * ROWP + 64 * s2))
                    c0, c1, c2, c3 = mma(qf[4 * s2], z32, qf[4 * s2 + 1], z32, b0, b1, c0, c1, c2, c3)
                    c0, c1, c2, c3 = mma(qf[4 * s2 + 2], z32, qf[4 * s2 + 3], z32, b2, b3, c0, c1, c2, c3)
                sc[nb * 2] = c0 * scale  # row gq, keys js + 8 nb + 2 tq + {0, 1}
                sc[nb * 2 + 1] = c1 * scale
            # does the band cut this step for some row? (then P V goes cell by cell below)
            je = min(js + KEYS, ce) - 1
            cut = js - qz < blo or je - qa > bhi
            # online softmax of row gq: sc[2 nb + e] is key js + 8 nb + 2 tq + e. A whole step
            # that the band does not cut needs no mask (a row that is not live has Q = 0 and
            # finite scores, and its state is never written)
            tmax = neg
            if cut or js + KEYS > ce:
                for nb in range(NB):
                    for e in range(2):
                        j = js + 8 * nb + 2 * tq + e
                        dl = j - il
                        x = sc[2 * nb + e]
                        if not (live and j < ce and dl >= blo and dl <= bhi):
                            x = neg
                        sc[2 * nb + e] = x
                        tmax = max(tmax, x)
            else:
                for e4 in range(SCN):
                    tmax = max(tmax, sc[e4])
            tmax = max(tmax, cuda.shfl_xor_sync(FULL, tmax, 1))
            tmax = max(tmax, cuda.shfl_xor_sync(FULL, tmax, 2))
            mn = max(mrow, tmax)
            # e^x as 2^(x log2 e) on the SFU (ex2.approx, as the tensor-core forwards): one
            # instruction where expf takes a dozen; -inf gives 0 with no branch (mb = 0 while
            # the row has no score, so that -inf - mb stays -inf, never NaN)
            alpha = ACC(1.0)
            mb = zero
            if mn > neg:
                alpha = ex2((mrow - mn) * LOG2E)
                mrow = mn
                mb = mn
            ps = zero
            for e4 in range(SCN):
                p = ex2((sc[e4] - mb) * LOG2E)
                sc[e4] = p
                ps += p
            lrow = lrow * alpha + ps
            for o in range(NO):
                of[o * 4] *= alpha
                of[o * 4 + 1] *= alpha
            if not cut:
                # P as A fragments (keys js + 2 tq + {0, 1} and + 8), V by ldmatrix.trans
                for kb in range(NB // 2):  # k16 steps over keys 16 kb ..
                    pa0 = pack2(sc[4 * kb], sc[4 * kb + 1])
                    pa2 = pack2(sc[4 * kb + 2], sc[4 * kb + 3])
                    for o2 in range(NO // 2):  # V: keys 16 kb + (l % 8) + 8 ((l // 8) % 2), n-blocks 2 o2, 2 o2 + 1
                        b0, b1, b2, b3 = ldsm_t(numba.uint32(tv + va + 16 * kb * ROWP + 32 * o2))
                        o = 2 * o2
                        of[o * 4], of[o * 4 + 1], of[o * 4 + 2], of[o * 4 + 3] = mma(
                            pa0, z32, pa2, z32, b0, b1, of[o * 4], of[o * 4 + 1], of[o * 4 + 2], of[o * 4 + 3])
                        o = 2 * o2 + 1
                        of[o * 4], of[o * 4 + 1], of[o * 4 + 2], of[o * 4 + 3] = mma(
                            pa0, z32, pa2, z32, b2, b3, of[o * 4], of[o * 4 + 1], of[o * 4 + 2], of[o * 4 + 3])
            else:
                # cell by cell: row gq and the lane's O columns 8 o + 2 tq + {0, 1}; row gq's P
                # of key kk = 8 nb + 2 i + e sits in lane 4 gq + i, as its sc[2 nb + e]
                for nb in range(NB):
                    for e in range(2):
                        pv = sc[2 * nb + e]
                        for i in range(4):
                            kk = 8 * nb + 2 * i + e
                            p = cuda.shfl_sync(FULL, pv, 4 * gq + i)
                            j = js + kk
                            dl = j - il
                            if live and j < ce and dl >= blo and dl <= bhi:
                                wrow = (warp * 4 * TILE + (2 * buf + 1) * TILE + kk * ROWP) // 4 + tq
                                for o in range(NO):
                                    va_, vb_ = unpack2(sv[U(wrow + 4 * o)])
                                    of[o * 4] += p * va_
                                    of[o * 4 + 1] += p * vb_
            cuda.syncwarp()  # every lane done with this tile before the next step refills it
            buf = 1 - buf

        # the warps' states meet in shared memory (sA aliases the V tiles: all warps done)
        cp_wait0()
        cuda.syncthreads()
        lr = lrow
        lr += cuda.shfl_xor_sync(FULL, lr, 1)
        lr += cuda.shfl_xor_sync(FULL, lr, 2)
        if gq < ROWS:
            if tq == 0:
                sM[U(warp * ROWS + gq)] = mrow
                sL[U(warp * ROWS + gq)] = lr
            for o in range(NO):
                d = 8 * o + 2 * tq
                sA[U((warp * ROWS + gq) * DV + d)] = of[o * 4]
                sA[U((warp * ROWS + gq) * DV + d + 1)] = of[o * 4 + 1]
        cuda.syncthreads()
        combine(sM, sL, sA, out, mo, lo, pacc, pm, pl, tid, r0, nrows, grp, hk, d0, H, splits, c)

    name = f"decode_mma_{t.dtype}_d{D}_dv{DV}_nw{NW}_r{ROWS}_k{KEYS}"
    kern = Kernel(name, body, _spec(IN, ACC))
    kern.dyn_smem = max(NW * 4 * TILE, NW * ROWS * DV * 4)
    return kern


def make_merge(dtype, acc, DV):
    """out, m, l of each (row, head) from its `splits` partials, in split order. Launched with
    (pacc, pm, pl, unused int64 array, out, m, l, rows, splits); common.make_softmax_merge has
    the kernel (one CTA per row)."""
    return make_softmax_merge(dtype, acc, DV, table=False)
