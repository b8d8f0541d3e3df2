"""The backward kernel texts: the Delta pre-pass, dQ by query tiles, dK/dV by key tiles and the
fused dK/dV/dQ kernel (ordered accumulator or float atomics), on mma.sync or wgmma."""
from __future__ import annotations

from .fragments import a_regs, c_regs, ldsm_a, mma, split_tf32, zero_c
from .guard import guard_init, guard_tiles, poison_rows, zero_masked
from .pipeline import key_range, read_work, store_c_rows, stream_key_blocks, StreamedPair
from .softmax import row_limits
from .products import mma_abt, mma_pb, resident
from .shared import landed, sa, shared_array, shared_base, thread_geometry
from .source import Source, udiv, umod
from .modifier import ARGS as MOD_ARGS, cell_col, cell_row
from .variant import MASKED
from .wgmma import wg_desc, wg_pack, wg_wait


# ============================================================================= backward: dQ
def gen_dq(v):
    """dQ = scale * sum_j dS_ij K_j over the key blocks of each query tile (deterministic: one CTA
    owns its rows). P = exp2(s * sc - m2 - log2 l) from the forward's (m, l); dS = P (dP - Delta).
    s * sc - m2 is written as the forward writes it, so the compiler contracts both into the same
    fma and the row's largest score gets exactly the exponent it had in the forward (gen_delta)."""
    v.check()
    e = Source()
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    rsk = v.GB * D
    e("def kernel(qp, kp, vp, dop, lsep, dltp, dqp, work, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, do_rs, do_hs,"
      " dq_rs, group, sc, scale" + (f", {MOD_ARGS}):" if v.mod else "):"))
    with e.indent():
        thread_geometry(e, v)
        e(f"hh = i64(cuda.blockIdx.y); hk = {udiv('hh', 'group')}")
        read_work(e, v)
        if v.mod:
            v.mod.prelude(e)
            v.mod.params(e, "hh")
        shared_array(e, v)
        shared_base(e, v)
        e("zero = f32(0.0); masked = f32(%r)" % MASKED)
        e(f"wrow = wid * {16 * MT}")
        key_range(e, v)
        e("kg = kp + col0 * k_rs + hk * k_hs")
        e("vg = vp + col0 * v_rs + hk * v_hs")
        # resident operands: this tile's Q and dO rows
        where, _, off = resident(e, v, [("qa", "qp + row0 * q_rs + hh * q_hs", "q_rs", D),
                                     ("da", "dop + row0 * do_rs + hh * do_hs", "do_rs", Dv)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")
        e("H = dq_rs // %d" % rsk)
        for m in range(MT):
            for h in (0, 1):
                e(f"rl = wrow + {16 * m + 8 * h} + g")
                e("ok = u32(rl < rows); gi = (row0 + sel(ok != 0, rl, 0)) * H + hh")
                e(f"ls{m}{h} = ldg_f32_if(ok, lsep + gi * 8); lg{m}{h} = ldg_f32_if(ok, lsep + gi * 8 + 4)")
                e(f"dl{m}{h} = ldg_f32_if(ok, dltp + gi * 4)")
        zero_c(e, "acc", MT, D // 8)

        def issue(kbuf, vbuf):   # wgmma: dP = dO V^T runs while S is masked and exponentiated
            zero_c(e, "dp", MT, BN // 8)
            mma_abt(e, v, "dp", "da", vbuf, BN // 8, Dv, where["da"], wait=False)

        def block(kbuf, vbuf):   # dP = dO V^T, dS = P (dP - Delta), dQ += dS K
            if v.wg_async:
                for j in range(BN // 8):
                    for r in range(4):
                        e(f"s0_{j}_{r} = ex2(s0_{j}_{r} * sc - ls0{r // 2} - lg0{r // 2})")
                wg_wait(e, 0, "dp", BN // 8)
                for j in range(BN // 8):
                    for r in range(4):
                        e(f"s0_{j}_{r} = s0_{j}_{r} * (dp0_{j}_{r} - dl0{r // 2})")
            else:
                zero_c(e, "dp", MT, BN // 8)
                mma_abt(e, v, "dp", "da", vbuf, BN // 8, Dv, where["da"])
                for m in range(MT):
                    for j in range(BN // 8):
                        for r in range(4):
                            s, dp = f"s{m}_{j}_{r}", f"dp{m}_{j}_{r}"
                            if v.mod:   # dS_z = P (dP - Delta) f'(z), P from y = f(z) (modifier.py)
                                v.mod.cell(e, s, cell_row(m, r), cell_col(f"kb * {BN}", j, r), "my", "md")
                                e(f"{s} = ex2(my * sc - ls{m}{r // 2} - lg{m}{r // 2}) * ({dp} - dl{m}{r // 2}) * md")
                            else:
                                e(f"{s} = ex2({s} * sc - ls{m}{r // 2} - lg{m}{r // 2}) * ({dp} - dl{m}{r // 2})")
            # masked cells: dS = 0 exactly (0 * (dP - Delta) is NaN where V outside the row is)
            e("if (kb >= nfull) | (kb < nlow):")
            with e.indent():
                row_limits(e, v, "lim", "wrow")
                zero_masked(e, "s", MT, BN // 8, lambda m, j, r: f"(kb * {BN} + {8 * j + r % 2} + 2 * t < lim{m}{r // 2})"
                                                                 f" & (kb * {BN} + {8 * j + r % 2} + 2 * t >= lowlim{m}{r // 2})")
            mma_pb(e, v, "acc", "sa", "s", kbuf, D // 8, BN, D)
        stream_key_blocks(e, v, where["qa"], block, "k", [("acc", D // 8)], issue if v.wg_async else None)
        store_c_rows(e, v, "acc", D // 8, f"dqp + row0 * dq_rs + hh * {rsk}", "dq_rs", "wrow", "rows",
                     lambda m, h: "scale")
    return e.text()


def col_stats(e, tiles, names, ptr):
    """per-column float32 statistics of the query block at cq, for this lane's columns of the
    n-tiles `tiles`: names ("cd",) reads Delta (one float per (row, head)), ("cl", "cg") the
    (m2, log2 l) pair the Delta pre-pass writes (two floats per (row, head))."""
    width = 4 * len(names)
    for j in tiles:
        for c in (0, 1):
            e(f"ci = cq + {8 * j + c} + 2 * t; ok = u32(ci < cols)")
            e(f"ca = {ptr} + ((col0 + sel(ok != 0, ci, 0)) * H + hq) * {width}")
            for i, name in enumerate(names):
                e(f"{name}{j}{c} = ldg_f32_if(ok, ca{f' + {4 * i}' if i else ''})")


def copy_stats(e, v, slot, c1, h):
    """copy the statistics of the query block starting at block-local query c1, head h, into the
    shared slot `slot` (Variant.stats_in_smem): BN (m2, log2 l) pairs (8-byte copies) then BN Delta
    values (4-byte copies), one copy per thread and pass; queries from cols on are zero-filled.
    Issued before the commit of the block's tiles, so one wait covers both."""
    BN, NT = v.BN, v.NT
    for i in range(-(-2 * BN // NT)):
        e(f"sx = tx + {i * NT}; sl = u32(sx < {BN}); sd = u32((sx >= {BN}) & (sx < {2 * BN})); "
          f"sr = sel(sl != 0, sx, sx - {BN})")
        e(f"ci = {c1} + sr; ok = u32(ci < cols); cr = (col0 + sel(ok != 0, ci, 0)) * H + {h}")
        e(f"cp_async8_if(sl, a32({slot}, u32(sr * 8)), lsep + cr * 8, ok * 8)")
        e(f"cp_async4_if(sd, a32({slot}, u32({8 * BN} + sr * 4)), dltp + cr * 4, ok * 4)")


def smem_stats(e, v, tiles, names, slot):
    """col_stats' values from the block's shared slot (copy_stats): this lane's columns 2t, 2t + 1
    of n-tile j are slot rows 8 j + 2 t, + 1, whose (m2, log2 l) pairs are 16 contiguous bytes and
    whose Delta values are 8."""
    for j in tiles:
        if names == ("cl", "cg"):
            e(f"cl{j}0, cg{j}0, cl{j}1, cg{j}1 = lds_f32x4(a32({slot}, u32({64 * j} + t * 16)))")
        else:
            e(f"w0, w1 = lds64(a32({slot}, u32({8 * v.BN + 32 * j} + t * 8))); "
              f"{names[0]}{j}0 = bits_f32(w0); {names[0]}{j}1 = bits_f32(w1)")


# ============================================================================= fused dQ (dkdv, fuse_dq)
# The dK/dV kernel already holds dS^T = (P (dP - Delta))^T for its key tile and one query block, so
# dQ_block += dS K costs one more product instead of the dQ kernel's three (S, dP, dQ): 5 products
# in all. Each key tile's contribution is added to a float32 accumulator in a fixed order (its rank
# among the key tiles that visit the query block), so the bits do not depend on timing: a turn
# counter per (query block, head), acquire/release at GPU scope. A CTA only ever waits for a lower
# rank, i.e. a CTA launched earlier (work rows keep the key tiles of a block in increasing order and
# the grid is flat, key tile-major), which is what makes the wait deadlock-free; heads are
# interleaved in the grid so that no wave holds many ranks of one head (a staircase of waits).
# The add runs one step behind (stage_dq, then fetch_acc / flush_dq during the next block), so the
# turn has usually arrived and the running sum's L2 trip overlaps four products. dq_atomic instead
# adds with red.global (FA2's scheme, not deterministic). Measured on the H200, neither beat the
# two-kernel backward at 16-bit; the atomic one did in float32 (docs/tensor_cores.md), which is why
# api ships the two-kernel backward by default and offers the atomic one as an opt-in.
def dq_geometry(e, v, part):
    """per-lane offsets of the fused dQ, emitted where they are used, from an opaque copy of the
    thread index: computed once at kernel start they were ~20 loop-long registers, and the kernel
    spills at 255. part: "store" (kv{m}{h} key-row guards, dso{m}{h}{q} transposed dS store offsets:
    key half h of m-tile m, query parity q), "mma" (this warp's dQ rows qrow / columns qcol and their
    byte offsets), "stage" (sqo: stage_dq's fragment rows), "move" (fr, fc, fo: 16-byte row chunks)."""
    rsA, RS = v.EB * v.BM, v.dq_stage_row()
    e("tz = opq(tx); wz = tz // 32; gz = (tz % 32) // 4; tz4 = tz % 4")
    if part in ("mma", "stage"):
        WR, WC, MQ, NQ = v.dq_warps()
        e(f"qrow = (wz // {WC}) * {16 * MQ}; qcol = (wz % {WC}) * {v.D // WC}")
    if part == "mma":
        e(f"qrowoff = u32(qrow * {rsA}); qcolb = u32(qcol * {v.EB})")
    elif part == "stage":
        e(f"sqo = u32((qrow + gz) * {RS} + qcol * 4 + tz4 * {16 if v.tf32 else 8})")
    elif part == "move":
        e(f"fr = tz // {v.D // 4}; fc = tz % {v.D // 4}; fo = u32(fr * {RS} + fc * 16)")
    elif part == "store":
        for m in range(v.MT):
            for h in (0, 1):
                e(f"kv{m}{h} = u32(wz * {16 * v.MT} + {16 * m + 8 * h} + gz < rows)")
                key8 = f"(wz * {2 * v.MT} + {2 * m + h})"   # the key's 16-byte-chunk group (8 keys)
                # tf32: key 8c + 2i + e sits at word i + 4e of its group (mma_pb's key order)
                chunk, within = (f"(2 * {key8} + gz % 2)", "(gz // 2) * 4") if v.tf32 else (key8, "2 * gz")
                for q in (0, 1):
                    e(f"dso{m}{h}{q} = u32((2 * tz4 + {q}) * {rsA} + (({chunk} ^ (2 * tz4 + {q})) * 16) + {within})")


def store_ds(e, v, dsb):
    """dS^T (C fragments: this warp's key rows x the block's queries) -> the query-major dS tile in
    shared memory. Key rows past the tile are stored as 0: their K rows are zero-filled, so their
    "probabilities" are not bounded and could overflow (0 * inf). 16-bit: the halves of the packed A
    registers c_to_a made for dK; tf32: the f32 values."""
    rsA = v.EB * v.BM
    e(f"# store_ds: dS^T fragments -> shared dS (query-major, {v.BN} x {v.BM})")
    dq_geometry(e, v, "store")
    for m in range(v.MT):
        if v.tf32:
            for j in range(v.BN // 8):
                for r in range(4):
                    h, q = r // 2, r % 2
                    e(f"sts_f32({sa(dsb, f'dso{m}{h}{q}', 8 * j * rsA)}, sel(kv{m}{h} != 0, s{m}_{j}_{r}, zero))")
            continue
        for ks in range(v.BN // 16):
            for r in range(4):   # a{r}: key half r % 2, queries 16 ks + 8 (r // 2) + 2t, +1
                h, off = r % 2, (16 * ks + 8 * (r // 2)) * rsA
                e(f"sts_halves({sa(dsb, f'dso{m}{h}0', off)}, {sa(dsb, f'dso{m}{h}1', off)}, "
                  f"sel(kv{m}{h} != 0, sa{m}_{ks}_{r}, u32(0)))")


def mma_dq(e, v, C, A, dsb, ktile):
    """C = dS . K for this warp's share of the block (MQ m16 query tiles x NQ column pairs, k = the
    BM keys): A = dS rows from shared (ldmatrix), B = K rows in shared (16-bit: ldmatrix.trans;
    tf32: lds64 at mma_pb's permuted keys and columns, matching store_ds's key order)."""
    WR, WC, MQ, NQ = v.dq_warps()
    rsA, rsk = v.EB * v.BM, v.EB * v.D
    e(f"# mma_dq: {C} = dS . K (dS rows from qrow, K columns from qcol)")
    dq_geometry(e, v, "mma")
    zero_c(e, C, MQ, 2 * NQ)
    for ks in range(v.ksteps(v.BM)):
        for mq in range(MQ):
            ldsm_a(e, v, A, mq, ks, sa(dsb, "qrowoff", f"xa{rsA}_{ks}", 16 * mq * rsA))
        for jp in range(NQ):
            if v.tf32:
                for x, ee in (("u", 0), ("w", 1)):
                    e(f"{x}0, {x}1 = lds64({sa(ktile, 'qcolb', f'xv{rsk}_{ee}_{jp % 2}', ks * 8 * rsk + 128 * (jp // 2))})")
                split_tf32(e, v, ["u0", "u1", "w0", "w1"])
                tiles = ((2 * jp, ["u0", "w0"]), (2 * jp + 1, ["u1", "w1"]))
            else:
                e(f"b0, b1, b2, b3 = ldsm_x4_t({sa(ktile, 'qcolb', f'xa{rsk}_{jp}', ks * 16 * rsk)})")
                tiles = ((2 * jp, ["b0", "b1"]), (2 * jp + 1, ["b2", "b3"]))
            for j, b in tiles:
                for mq in range(MQ):
                    mma(e, v, c_regs(C, mq, j), a_regs(v, A, mq, ks), b)


def dq_row_vectors(v, C):
    """this warp's dQ block (C fragments of mma_dq) as row pieces in natural column order:
    (m-tile, half, byte offset in the row, values) with offset from the lane's first column. tf32
    (mma_pb's pair layout): n-tile pair jp holds columns 16 jp + 4t .. + 3, four floats; 16-bit:
    n-tile j holds 8 j + 2t, + 1, two floats."""
    WR, WC, MQ, NQ = v.dq_warps()
    for mq in range(MQ):
        for h in (0, 1):
            r0, r1 = 2 * h, 2 * h + 1
            if v.tf32:
                for jp in range(NQ):
                    a, b = c_regs(C, mq, 2 * jp), c_regs(C, mq, 2 * jp + 1)
                    yield mq, h, 64 * jp, (a[r0], b[r0], a[r1], b[r1])
            else:
                for j in range(2 * NQ):
                    c = c_regs(C, mq, j)
                    yield mq, h, 32 * j, (c[r0], c[r1])


def stage_dq(e, v, C):
    """this block's dQ (C fragments) -> the float32 staging tile `sq` (natural column order); it is
    added to the running sum one step later (flush_dq), when the turn has long arrived."""
    RS = v.dq_stage_row()
    e(f"# stage_dq: {C} -> shared sq (float32, {v.BN} x {v.D})")
    dq_geometry(e, v, "stage")
    for mq, h, off, vals in dq_row_vectors(v, C):
        e(f"sts_v{len(vals)}({sa('sq', 'sqo', (16 * mq + 8 * h) * RS + off)}, {', '.join(vals)})")


def atomic_dq(e, v, C):
    """dq_atomic: add this warp's dQ fragments to the float32 accumulator with red.global.add
    (FA2's scheme: fast, but the summation order, hence the bits, depend on timing)."""
    e(f"# atomic_dq: {C} -> accumulator (red.global.add, unordered)")
    for mq, h, off, vals in dq_row_vectors(v, C):
        if off == 0:   # a new fragment row: its global address
            e(f"rl = cq + qrow + {16 * mq + 8 * h} + g")
            e(f"ok = u32(rl < cols); ab = accp + ((col0 + sel(ok != 0, rl, 0)) * H + hq) * {4 * v.D} + qcol * 4")
        e(f"red_v{len(vals)}_if(ok, ab + {off} + t * {4 * len(vals)}, {', '.join(vals)})")


def dq_passes(v):
    """(passes, rows per pass) of a CTA moving a float32 BN x D block in 16-byte chunks."""
    cpr = v.D // 4
    return v.BN * cpr // v.NT, v.NT // cpr


def fetch_acc(e, v):
    """Wait for this tile's turn at the pending block and start copying its running sum into `sacc`
    (cp.async through L2; zero-filled for the first visitor, who reads nothing, and for tail rows)."""
    RS = v.dq_stage_row()
    n, step = dq_passes(v)
    e("# fetch_acc: the pending block's running dQ sum -> shared sacc (after our turn came)")
    dq_geometry(e, v, "move")
    e("turn = cntp + ((col0 + p_cq) * H + p_hq) * 4")
    # one thread spins (an acquire per thread would cost every warp a fence), the barrier hands
    # the acquire on to the CTA (causality order), then every thread's cp.async reads the sum
    e("wait_eq_if(u32(tx == 0), turn, rank)")
    e("cuda.syncthreads()")
    e("rd = u32(rank > 0)")
    for k in range(n):
        e(f"rr = fr + {k * step}; ok = u32(p_cq + rr < cols) & rd")
        e(f"ga = accp + ((col0 + p_cq + sel(ok != 0, rr, 0)) * H + p_hq) * {4 * v.D} + fc * 16")
        e(f"cp_async16({sa('sacc', 'fo', k * step * RS)}, sel(ok != 0, ga, accp), ok * 16)")
    e("cp_commit()")


def pass_turn(e):
    """after the barrier that ends flush_dq's reads of sq and its stores: thread 0 hands the pending
    block's turn to the next rank (st.release at GPU scope publishes every thread's stores)."""
    e("cuda.syncthreads()")
    e("stg_release_if(u32((tx == 0) & (p_on != 0)), turn, rank + 1)")


def flush_dq(e, v):
    """pending block: running sum + staged dQ -> the float32 accumulator, or (last visitor) dQ =
    scale * total in q's dtype. Coalesced 16-byte rows; tail rows are not written."""
    RS = v.dq_stage_row()
    n, step = dq_passes(v)
    e("# flush_dq: add the staged block to the running sum and store it (or the finished dQ)")
    dq_geometry(e, v, "move")
    e("mid = u32(p_last == 0)")
    if v.tf32:
        e("f = sel(p_last != 0, scale, one)")
    for k in range(n):
        e(f"rr = fr + {k * step}; ok = u32(p_cq + rr < cols); gr = col0 + p_cq + sel(ok != 0, rr, 0)")
        e(f"x0, x1, x2, x3 = lds_f32x4({sa('sq', 'fo', k * step * RS)})")
        e(f"y0, y1, y2, y3 = lds_f32x4({sa('sacc', 'fo', k * step * RS)})")
        e("x0 = x0 + y0; x1 = x1 + y1; x2 = x2 + y2; x3 = x3 + y3")
        e(f"ab = accp + (gr * H + p_hq) * {4 * v.D} + fc * 16; ob = dqp + gr * dq_rs + p_hq * {v.EB * v.D} + fc * {4 * v.EB}")
        if v.tf32:   # dQ is float32: the same 16-byte store, to one buffer or the other
            e("stg_v4_if(ok, sel(p_last != 0, ob, ab), x0 * f, x1 * f, x2 * f, x3 * f)")
            continue
        e("stg_v4_if(ok & mid, ab, x0, x1, x2, x3)")
        e("stg_u32_if(ok & p_last, ob, pack2(x0 * scale, x1 * scale))")
        e("stg_u32_if(ok & p_last, ob + 4, pack2(x2 * scale, x3 * scale))")


# ----------------------------------------------------------------------------- fused dQ on wgmma
# The same scheme with warpgroup products: dS^T leaves the registers (the packed A operands of the
# dK product) as a query-major tile in the wgmma layout (64-key sub-tiles of 128-byte rows), and
# each unit of 64 queries x N columns of dQ is one "st" chain: A = dS rows (K-major), B = the
# resident K tile read MN-major, exactly as O += P V reads V.
def wg_store_ds(e, v, dsb):
    """dS^T (this warp's 16 key rows: key 16 wid + 8 h + g, packed pairs of queries 2t, 2t + 1 in
    sa0_{ks}_{r}) -> the query-major dS tile: query row i, key c at sub-tile c // 64, chunk
    ((c % 64) // 8) ^ (i % 8). A warp's keys sit in one sub-tile (16 wid // 64 = its warpgroup).
    Key rows past the tile are stored as 0 (see store_ds)."""
    e(f"# wg_store_ds: dS^T fragments -> shared dS ({v.BN} queries x {v.BM} keys, wgmma layout)")
    for h in (0, 1):
        e(f"kv{h} = u32(wid * 16 + {8 * h} + g < rows)")
        for q in (0, 1):
            e(f"dso{h}{q} = u32((wid // 4) * {v.BN * 128} + (2 * t + {q}) * 128"
              f" + (((2 * (wid % 4) + {h}) ^ (2 * t + {q})) * 16) + 2 * g)")
    for ks in range(v.BN // 16):
        for r in range(4):   # sa0_{ks}_{r}: key half r % 2, queries 16 ks + 8 (r // 2) + 2t, +1
            h, off = r % 2, (16 * ks + 8 * (r // 2)) * 128
            e(f"sts_halves({sa(dsb, f'dso{h}0', off)}, {sa(dsb, f'dso{h}1', off)}, sel(kv{h} != 0, sa0_{ks}_{r}, u32(0)))")


def wg_dq(e, v, dsb, ktile):
    """dQ of this block, unit by unit (Variant.wg_dq_units): one st chain into dqc, then added with
    red.global (dq_atomic) or staged into the float32 tile sq in natural column order (the ordered
    accumulation's flush_dq adds it one block later)."""
    RG, CG, N, per = v.wg_dq_units()
    nwg, RS = v.NW // 4, v.dq_stage_row()
    # k-step ks: 32 bytes into the dS row's sub-tile ks // 4 (A, K-major); 16 key rows further in K (B)
    steps = [(((ks // 4) * v.BN * 128 + (ks % 4) * 32) >> 4, (ks * 16 * 128) >> 4) for ks in range(v.BM // 16)]
    chain = e.chain("st", N, steps)
    regs = [x for j in range(N // 8) for x in c_regs("dqc", 0, j)]
    e(f"# wg_dq: dQ units of 64 queries x {N} columns = dS . K ({'red.global' if v.dq_atomic else 'staged in sq'})")
    for i in range(per):
        e(f"un = wid // 4 + {nwg * i}; urg = un // {CG}; ucg = un % {CG}")
        e(f"da = {wg_desc(f'a32({dsb}, u32(urg * {64 * 128}))', 16)}")
        e(f"db = {wg_desc(f'a32({ktile}, u32((ucg * {N} // 64) * {v.BM * 128} + (ucg * {N} % 64) * 2))', v.BM * 128)}")
        zero_c(e, "dqc", 1, N // 8)
        e(f"{', '.join(regs)} = {chain}(da, db, {', '.join(regs)})")
        e(f"ur = urg * 64 + (wid % 4) * 16 + g; uc = ucg * {N} + 2 * t")   # this lane's row (h = 0), column
        for h in (0, 1):
            r0, r1 = 2 * h, 2 * h + 1
            if v.dq_atomic:
                e(f"rl = cq + ur + {8 * h}; ok = u32(rl < cols)")
                e(f"ab = accp + ((col0 + sel(ok != 0, rl, 0)) * H + hq) * {4 * v.D} + uc * 4")
                for j in range(N // 8):
                    e(f"red_v2_if(ok, ab + {32 * j}, dqc0_{j}_{r0}, dqc0_{j}_{r1})")
            else:
                e(f"so = u32((ur + {8 * h}) * {RS} + uc * 4)")
                for j in range(N // 8):
                    e(f"sts_v2({sa('sq', 'so', 32 * j)}, dqc0_{j}_{r0}, dqc0_{j}_{r1})")


# ============================================================================= backward: dK, dV
def gen_dkdv(v):
    """dV = sum_i P_ij dO_i, dK = scale * sum_i dS_ij Q_i for one key tile per CTA, all query heads
    of its kv group in order (GQA without atomics). Works on the transposed tile S^T = K Q^T so
    the accumulators are rows of dK/dV; per-column (query) (m2, log2 l) and Delta come from global
    memory, or (v.stats_in_smem) from a shared slot filled with each block's tiles (copy_stats).
    With v.col_parts = P > 1 the CTA at grid z = part keeps columns [part D / P, (part + 1) D / P)
    of dK and of dV (the B operands of its P B products start that many sub-tiles into the streamed
    Q / dO tiles) and computes S^T and dP^T over the whole head dim, as every part does."""
    v.check()
    e = Source()
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    rsk, rsv = v.GB * D, v.GB * Dv
    DP, DVP = D // v.col_parts, Dv // v.col_parts   # the dK / dV columns this CTA keeps
    QT, OT = BN * v.row_bytes(D), BN * v.row_bytes(Dv)   # one part of a streamed Q / dO tile
    nt = BN // 8
    fq = v.fuse_dq
    e("def kernel(qp, kp, vp, dop, lsep, dltp, dkp, dvp, " + ("dqp, accp, cntp, " if fq else "")
      + "work, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, do_rs, do_hs, dk_rs, dv_rs, " + ("dq_rs, " if fq else "")
      + "group, H, sc, scale" + (f", {MOD_ARGS}):" if v.mod else "):"))
    with e.indent():
        thread_geometry(e, v)
        if v.mod:
            v.mod.prelude(e)
        # work row: rows = this tile's keys, cols = the block's queries, diag = local index of key row 0
        if fq:   # flat grid, heads interleaved (see the fused-dQ notes above)
            e(f"bid = i64(cuda.blockIdx.x); nkvh = {udiv('H', 'group')}; hk = {umod('bid', 'nkvh')}")
            read_work(e, v, udiv("bid", "nkvh"))
            e(f"rank = diag // {v.BM}; ntk = (diag + rows_left + {v.BM - 1}) // {v.BM}")
        else:
            e("hk = i64(cuda.blockIdx.y)")
            read_work(e, v)
        shared_array(e, v)
        shared_base(e, v)
        e("zero = f32(0.0); masked = f32(%r)" % MASKED)
        e(f"wrow = wid * {16 * MT}")
        # key row r sees the queries lo + r .. hi + r (causal: from its own position on): the query
        # blocks from the one holding the first row's lower limit to the last row's upper limit;
        # blocks below qfull cross some row's lower limit, blocks from qlast on its upper one or
        # the tail: only those hold masked cells
        e(f"qb0 = imax(lo, 0) // {BN}")
        e(f"nqb = (imin(cols, hi + rows) + {BN - 1}) // {BN}")
        e(f"qfull = imax(lo + rows + {BN - 2}, 0) // {BN}")
        e(f"qlast = imin(cols // {BN}, (hi + 1) // {BN})")
        where, kept, off = resident(e, v, [("ka", "kp + row0 * k_rs + hk * k_hs", "k_rs", D),
                                           ("va", "vp + row0 * v_rs + hk * v_hs", "v_rs", Dv)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")
        if fq:
            e(f"dsb = a32(ss, {2 * (QT + OT)}); sq = a32(dsb, {v.ds_tile_bytes()}); "
              f"sacc = a32(sq, {v.BN * v.dq_stage_row()})")
            # the block whose dQ is staged in sq and not yet added (one step behind)
            e("p_on = 0; p_hq = i64(0); p_cq = i64(0); p_last = u32(0); turn = cntp")
        # this thread's key rows see the query columns kl .. kl + bw (the band; causal: kl = own
        # position), below cols; one register per row, the width shared
        e("bw = hi - lo")
        for m in range(MT):
            for h in (0, 1):
                e(f"kl{m}{h} = lo + wrow + {16 * m + 8 * h} + g")
        zero_c(e, "dk", MT, DP // 8)
        zero_c(e, "dv", MT, DVP // 8)
        if v.col_parts > 1:   # this part's first column, as bytes into a streamed tile (whole sub-tiles)
            e("part = i64(cuda.blockIdx.z)")
            e(f"pq = u32(part * {(DP * v.EB // 128) * BN * 128}); po = u32(part * {(DVP * v.EB // 128) * BN * 128})")
        qbuf = lambda b: f"qbuf_{b}"  # noqa: E731
        obuf = lambda b: f"obuf_{b}"  # noqa: E731
        # the B operands of dK += dS^T Q and dV += P^T dO: this part's columns of the streamed tiles
        qcols = (lambda b: f"a32({qbuf(b)}, pq)") if v.col_parts > 1 else qbuf  # noqa: E731
        ocols = (lambda b: f"a32({obuf(b)}, po)") if v.col_parts > 1 else obuf  # noqa: E731
        qo = StreamedPair(e, v, ("q", "o"), (D, Dv))
        block_at = lambda c, h: [(f"qp + (col0 + {c}) * q_rs + {h} * q_hs", "q_rs", f"cols - {c}"),  # noqa: E731
                                 (f"dop + (col0 + {c}) * do_rs + {h} * do_hs", "do_rs", f"cols - {c}")]
        if v.stats_in_smem:   # two slots of block statistics after the streamed tiles
            e.uses_copies()
            e(f"sst = a32(ss, u32({v.stream_bytes()}))")
        e("nit = (nqb - qb0) * group")   # flattened (head, query block) loop: one pipeline across heads
        e("if nit > 0:")
        with e.indent():
            e("hq = hk * group")
            e(f"c1 = qb0 * {BN}")
            qo.load("0", block_at("c1", "hq"))
            if v.stats_in_smem:
                copy_stats(e, v, "sst", "c1", "hq")
            e("cp_commit()")
        e("for it in range(nit):")
        with e.indent():
            e(f"nqc = nqb - qb0; hq = hk * group + {udiv('it', 'nqc')}; qb = qb0 + {umod('it', 'nqc')}")

            def upcoming():
                e(f"hn = hk * group + {udiv('(it + 1)', 'nqc')}; c1 = (qb0 + {umod('(it + 1)', 'nqc')}) * {BN}")
                if v.stats_in_smem:   # into the other slot, in the tiles' commit group
                    copy_stats(e, v, f"a32(sst, u32((1 - cur) * {v.stats_slot_bytes()}))", "c1", "hn")
                return block_at("c1", "hn")
            qo.advance("it", "nit", upcoming)
            e(f"cq = qb * {BN}")
            if v.stats_in_smem:
                e(f"ssc = a32(sst, u32(cur * {v.stats_slot_bytes()}))")

            def stats(tiles, names):   # this lane's columns' statistics, where they are used
                if v.stats_in_smem:
                    smem_stats(e, v, tiles, names, "ssc")
                else:
                    col_stats(e, tiles, names, "lsep" if names[0] == "cl" else "dltp")
            if v.mod:
                v.mod.params(e, "hq")
            if not fq:   # masked cells never multiply Q / dO rows (guard.py); the fused kernel: not yet
                guard_init(e, v)
                e("if (qb < qfull) | (qb >= qlast):")
                with e.indent():
                    guard_tiles(e, v, [(qbuf("cur"), D), (obuf("cur"), Dv)])
            if fq and not v.dq_atomic:   # the previous block's turn: fetch its running sum while this block computes
                e("if p_on != 0:")
                with e.indent():
                    fetch_acc(e, v)
            zero_c(e, "s", MT, nt)
            mma_abt(e, v, "s", "ka", qbuf("cur"), nt, D, where["ka"], swap=True)   # S^T: the forward's S bits
            if v.wg_async:   # dP^T = V dO^T runs while S^T is masked and exponentiated
                zero_c(e, "dp", MT, nt)
                mma_abt(e, v, "dp", "va", obuf("cur"), nt, Dv, where["va"], wait=False)
            e("if (qb < qfull) | (qb >= qlast):")
            with e.indent():
                for m in range(MT):
                    for j in range(nt):
                        for r in range(4):
                            x = f"s{m}_{j}_{r}"
                            e(f"ci = cq + {8 * j + r % 2} + 2 * t")
                            e(f"{x} = sel((ci < cols) & (ci >= kl{m}{r // 2}) & (ci - kl{m}{r // 2} <= bw), {x}, masked)")
            # per-column (query) statistics, loaded where used (short live ranges; masked
            # columns read nothing): (m2, log2 l) for P, then Delta for dS
            # (overlapped with dP: tile by tile, so that few are live next to the in-flight dP)
            for tiles in ([] if v.mod else [[j] for j in range(nt)] if v.wg_async else [range(nt)]):
                stats(tiles, ("cl", "cg"))
                for m in range(MT):
                    for j in tiles:
                        for r in range(4):
                            x = f"s{m}_{j}_{r}"
                            # masked cells: P = 0 exactly, selected as P is made (the (m2, log2 l)
                            # of a masked query may be non-finite); no second pass re-derives the mask
                            e(f"{x} = sel({x} != masked, ex2({x} * sc - cl{j}{r % 2} - cg{j}{r % 2}), zero)")
            if not fq:   # blocks with masked cells (CTA-uniform): their dS keeps masked cells at 0
                e("mb = u32((qb < qfull) | (qb >= qlast))")
            def to_ds(m, tiles):   # dS = P (dP - Delta), in place
                for j in tiles:
                    for r in range(4):
                        x = f"s{m}_{j}_{r}"
                        ds = f"{x} * (dp{m}_{j}_{r} - cd{j}{r % 2})"
                        if fq:
                            e(f"{x} = {ds}")
                        else:   # masked cells: dS = 0 exactly (dP and Delta of a masked query may be
                            # non-finite); P == 0 marks them (a real cell whose P underflowed gives 0 too)
                            e(f"{x} = sel(({x} != zero) | (mb == 0), {ds}, zero)")
            if v.mod:
                # dP first, then per cell z -> (f(z), f'(z)), P and dS_z = P (dP - Delta) f'(z) into
                # the dP registers: P and dS both stay (dV reads P, dK reads dS), f'(z) never does
                zero_c(e, "dp", MT, nt)
                mma_abt(e, v, "dp", "va", obuf("cur"), nt, Dv, where["va"])
                stats(range(nt), ("cl", "cg"))
                stats(range(nt), ("cd",))
                for m in range(MT):
                    for j in range(nt):
                        for r in range(4):
                            x, dp = f"s{m}_{j}_{r}", f"dp{m}_{j}_{r}"
                            # the fragment's rows are keys, its columns queries
                            v.mod.cell(e, x, cell_col("cq", j, r), cell_row(m, r), "my", "md")
                            e(f"{x} = sel({x} != masked, ex2(my * sc - cl{j}{r % 2} - cg{j}{r % 2}), zero)")
                            e(f"{dp} = sel(({x} != zero) | (mb == 0), {x} * ({dp} - cd{j}{r % 2}) * md, zero)")
                mma_pb(e, v, "dv", "pa", "s", ocols("cur"), DVP // 8, BN, Dv)
            elif v.wg_async:
                # P's A operands are packed k-step by k-step and each k-step's P turns into dS right
                # after (dP dies as P is packed: no more registers live than before); then dV += P^T dO
                # (16-bit: issued, it runs while dS is packed for dK; split: its per-block partials
                # need the result at once) and dK += dS^T Q
                wg_wait(e, 0, "dp", nt)
                stats(range(nt), ("cd",))
                wg_pack(e, v, "pa", "s", BN // 16, lambda ks: to_ds(0, (2 * ks, 2 * ks + 1)))
                mma_pb(e, v, "dv", "pa", "s", ocols("cur"), DVP // 8, BN, Dv, wait=v.split, packed=True)
            else:
                mma_pb(e, v, "dv", "pa", "s", ocols("cur"), DVP // 8, BN, Dv)
                zero_c(e, "dp", MT, nt)
                mma_abt(e, v, "dp", "va", obuf("cur"), nt, Dv, where["va"])
                stats(range(nt), ("cd",))
                for m in range(MT):
                    to_ds(m, range(nt))
            mma_pb(e, v, "dk", "sa", "dp" if v.mod else "s", qcols("cur"), DP // 8, BN, D)
            if v.wg_async and not v.split:   # dV: completed by the dK chain's wait, handed back here
                wg_wait(e, 0, "dv", DVP // 8)
            if not fq:   # key row (m, h) sees the queries kl .. kl + bw below cols, from cq on
                poison_rows(e, v, [("dk", DP // 8), ("dv", DVP // 8)],
                            lambda m, h: (f"kl{m}{h} - cq", f"imin(cols, kl{m}{h} + bw + 1) - cq"))
            if fq and v.wgmma:
                wg_store_ds(e, v, "dsb")
                if not v.dq_atomic:
                    e("if p_on != 0:")
                    with e.indent():
                        e("cp_wait0()")
                landed(e, v)   # dS (for the async proxy) and the fetched running sum are visible
                if not v.dq_atomic:   # add the previous block, pass its turn on, then this block's dQ into sq
                    e("if p_on != 0:")
                    with e.indent():
                        flush_dq(e, v)
                    pass_turn(e)
                wg_dq(e, v, "dsb", kept["ka"])
            elif fq:
                store_ds(e, v, "dsb")
                if not v.dq_atomic:
                    e("if p_on != 0:")
                    with e.indent():
                        e("cp_wait0()")
                e("cuda.syncthreads()")   # dS and the fetched running sum are visible to every warp
                if not v.dq_atomic:
                    e("if p_on != 0:")
                    with e.indent():
                        flush_dq(e, v)
                mma_dq(e, v, "dqc", "qs", "dsb", kept["ka"])
                if v.dq_atomic:
                    atomic_dq(e, v, "dqc")
            if fq and not v.dq_atomic:
                if not v.wgmma:
                    pass_turn(e)
                    stage_dq(e, v, "dqc")
                e(f"nvis = sel(causal != 0, imin(ntk, ((qb + 1) * {BN} - 1) // {v.BM} + 1), ntk)")
                e("p_on = 1; p_hq = hq; p_cq = cq; p_last = u32(rank + 1 == nvis)")
            if fq or qo.end_barrier:   # fused dQ: the dS tile and the staged sum are rewritten next block
                e("cuda.syncthreads()")
        if fq and not v.dq_atomic:   # the last block's dQ is still staged
            e("if p_on != 0:")
            with e.indent():
                fetch_acc(e, v)
                e("cp_wait0(); cuda.syncthreads()")
                flush_dq(e, v)
                e("cuda.syncthreads()")
                e("stg_release_if(u32(tx == 0), turn, rank + 1)")
        pk = f" + part * {DP * v.GB}" if v.col_parts > 1 else ""
        pv = f" + part * {DVP * v.GB}" if v.col_parts > 1 else ""
        store_c_rows(e, v, "dk", DP // 8, f"dkp + row0 * dk_rs + hk * {rsk}{pk}", "dk_rs", "wrow", "rows",
                     lambda m, h: "scale")
        store_c_rows(e, v, "dv", DVP // 8, f"dvp + row0 * dv_rs + hk * {rsv}{pv}", "dv_rs", "wrow", "rows",
                     lambda m, h: "one")
    return e.text().replace("    zero = f32(0.0); masked", "    one = f32(1.0); zero = f32(0.0); masked", 1)


# ============================================================================= backward: Delta pre-pass
#: threads per CTA of the Delta pre-pass
DELTA_THREADS = 128


def delta_lanes(dtype, Dv):
    """(lanes per (row, head), 16-byte chunks per lane, 16-byte chunks per row) of the Delta
    pre-pass: a row of O or dO is Dv * itemsize / 16 chunks of 16 bytes, spread over the fewest
    power-of-two lanes (at most a warp) that cover it, so that a warp reads whole 16-byte vectors
    from 32 / lanes rows at once."""
    row_bytes = Dv * (4 if dtype == "float32" else 2)
    assert row_bytes % 16 == 0, "rows are whole 16-byte chunks"
    chunks = row_bytes // 16
    lanes = 1
    while lanes < min(chunks, 32):
        lanes *= 2
    return lanes, -(-chunks // lanes), chunks


def delta_grid(dtype, Dv, rows):
    """(CTAs, threads per CTA) of the Delta pre-pass over `rows` (row, head) pairs."""
    per_cta = DELTA_THREADS // delta_lanes(dtype, Dv)[0]
    return -(-rows // per_cta), DELTA_THREADS


def gen_delta(dtype, Dv):
    """Delta_i = sum_d dO_id O_id and the pair (m2_i, log2 l_i) ((0, 0) for empty rows): the
    per-row inputs of both backward kernels (NaN l stays NaN). Each (row, head) is read by a group of lanes
    (delta_lanes) with 16-byte vector loads, every load of a lane issued before its first product
    (the pass is a pure read of O and dO: loads in flight, not arithmetic, set its speed; rows
    are 16-byte aligned, tensor-core operands always are: api._operand). m2 (at mp) is the row
    max in the kernels' base-2 units as the forward found it (api.backward converts natural-log
    stats that lack it), so no rounded unit conversion enters the exponent.

    The pair is not added into one lse2: the forward's exponent for the row's largest score,
    fma(s, sc, -m2), is the rounding error of m2 = s * sc (up to ulp(m2) / 2, 2^-8 at m2 ~ 7e4),
    and l carries it as log2 l; m2 + log2 l in float32 would round it away again and leave P off by
    2^(ulp(m2) / 2) in the backward at large scores. Two floats keep it: exp2((s sc - m2) - log2 l)."""
    lanes, per_lane, chunks = delta_lanes(dtype, Dv)
    e = Source()
    e("def kernel(op, dop, mp, lp, dltp, lsep, n, H, o_rs, o_hs, do_rs, do_hs):")
    with e.indent():
        e("tx = i64(cuda.threadIdx.x); lane = tx % 32")
        e(f"c0 = lane % {lanes}")
        e(f"rh = (i64(cuda.blockIdx.x) * (i64(cuda.blockDim.x) // 32) + tx // 32) * {32 // lanes} + lane // {lanes}")
        # predicated rather than branched: every lane takes part in the shuffles
        e("live = u32(rh < n * H); rh = sel(live != 0, rh, 0)")
        e("row = rh // H; hh = rh % H")
        e("oa = op + row * o_rs + hh * o_hs; da = dop + row * do_rs + hh * do_hs")
        for j in range(per_lane):   # every load first
            e(f"d{j} = c0 + {j * lanes}; ok{j} = live & u32(d{j} < {chunks})")
            e(f"x{j} = ldg_v4_if(ok{j}, oa + d{j} * 16)")
            e(f"y{j} = ldg_v4_if(ok{j}, da + d{j} * 16)")
        e("acc = f32(0.0)")
        for j in range(per_lane):
            for w in range(4):
                if dtype == "float32":
                    e(f"acc = acc + bits_f32(x{j}[{w}]) * bits_f32(y{j}[{w}])")
                else:
                    e(f"xa, xb = unpack2(x{j}[{w}]); ya, yb = unpack2(y{j}[{w}])")
                    e("acc = acc + xa * ya + xb * yb")
        s = lanes // 2
        while s:   # butterflies inside each aligned group of `lanes` lanes
            e(f"acc = acc + shfl_xor(acc, {s})")
            s //= 2
        e("ll = ldg_f32_if(live, lp + rh * 4); mm = ldg_f32_if(live, mp + rh * 4)")
        # l = 0: an empty row, (0, 0); a NaN l (a NaN or inf score in the row) passes through, so
        # the row's probabilities and gradient shares are NaN as on the CPU, not dropped
        e("nz = (ll > f32(0.0)) | (ll != ll)")
        e("ms = sel(nz, mm, f32(0.0)); lg = sel(nz, log2f(sel(nz, ll, f32(1.0))), f32(0.0))")
        e("ok = live & u32(c0 == 0)")
        e("stg_f32_if(ok, dltp + rh * 4, acc)")
        e("stg_f32_if(ok, lsep + rh * 8, ms)")
        e("stg_f32_if(ok, lsep + rh * 8 + 4, lg)")
    return e.text()
