"""The forward kernel text: O = softmax(scale Q K^T) V per work row, writing O, m, l."""
from __future__ import annotations

from .fragments import a_regs, zero_c
from .guard import guard_init, guard_tiles, poison_rows
from .pipeline import key_range, prune_gate, read_work, span, store_c_rows, stream_key_blocks
from .products import mma_abt, mma_pb, resident
from .shared import landed, load_tile, sa, shared_array, shared_base, thread_geometry
from .softmax import mask_rows, online_softmax, rescale, row_limits, row_offset
from .source import Source, udiv
from .modifier import ARGS as MOD_ARGS, cell_col, cell_row
from .variant import LOG2E, MASKED, WG_ALIGN
from .wgmma import wg_pack, wg_pb, wg_wait


def gen_forward(v):
    """O = softmax(scale Q K^T) V over one block of the relation per work row; writes O, m, l.
    Pipeline: Q tile resident (registers or shared); K/V blocks double-buffered through cp.async."""
    v.check()
    e = Source()
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    rsv = v.GB * Dv   # bytes of one head's output row
    e("def kernel(qp, kp, vp, op, mp, lp, mkp, work, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, o_rs, group, "
      + ("cntp, sc, minf, lg2rho):" if v.prune else "sc, minf" + (f", {MOD_ARGS}):" if v.mod else "):")))
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
        e(f"wrow = wid * {16 * MT}")   # this warp's first row inside the CTA tile
        key_range(e, v)
        e("qg = qp + row0 * q_rs + hh * q_hs")
        e("kg = kp + col0 * k_rs + hk * k_hs")
        e("vg = vp + col0 * v_rs + hk * v_hs")
        if v.pingpong_loop:
            e.uses_barriers()
            ring_init(e, v)
        # stage 1: the Q tile, resident for the whole loop (registers, or shared with a_smem)
        where, _, off = resident(e, v, [("qa", "qg", "q_rs", D)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")   # first byte of the streamed buffers
        zero_c(e, "o", MT, Dv // 8)
        for m in range(MT):
            e(f"m{m}0 = masked; m{m}1 = masked; l{m}0 = zero; l{m}1 = zero")
        # stage 2: stream key blocks; S = Q K^T of each, then softmax and O += P V
        def modify():   # S -> f(scale S) log2(e), before the mask (sc = 1), unclamped: guarded_softmax
            for m in range(MT):
                for j in range(BN // 8):
                    for r in range(4):
                        x = f"s{m}_{j}_{r}"
                        v.mod.cell(e, x, cell_row(m, r), cell_col(f"kb * {BN}", j, r), x, clamp=False)
            if v.mod.split is not None:   # S holds f + R: the rows' offsets for online_softmax
                for m in range(MT):
                    for h in (0, 1):
                        v.mod.row_offset(e, cell_row(m, 2 * h), row_offset(m, h), f"col0 + kb * {BN}")

        def block(kbuf, vbuf):
            if not v.prune:
                online_softmax(e, v, "s", "o", Dv // 8)
                mma_pb(e, v, "o", "pa", "s", vbuf, Dv // 8, BN, Dv)
                return
            rowmax = prune_gate(e, v)   # a pruned tile skips the softmax and the value product
            e("if adm != 0:")
            with e.indent():
                online_softmax(e, v, "s", "o", Dv // 8, rowmax)
                mma_pb(e, v, "o", "pa", "s", vbuf, Dv // 8, BN, Dv)
            e("npr = npr + sel(adm != 0, 0, 1)")
        if v.prune:
            e(f"prs = a32(sb, {v.smem_bytes() - v.prune_bytes() - (WG_ALIGN if v.wgmma else 0)}); npr = i64(0); rcta = masked")
        if v.fwd_pipelined:
            pipelined_key_blocks(e, v, where["qa"], modify if v.mod else None)
        else:
            stream_key_blocks(e, v, where["qa"], block, "v", [("o", Dv // 8)], modify=modify if v.mod else None)
        # stage 3: finish the quad's row sums, normalise, store O, m (natural log), l, and (mkp
        # not 0) m in the kernel's base-2 units exactly as the softmax used it: the backward
        # reads that one, since m log2(e) rounded back from the natural-log m is off by an ulp
        # of m, which the exponent turns into a factor of 2^ulp on P at large scores
        for m in range(MT):
            for h in (0, 1):
                e(f"l{m}{h} = l{m}{h} + shfl_xor(l{m}{h}, 1)")
                e(f"l{m}{h} = l{m}{h} + shfl_xor(l{m}{h}, 2)")
                e(f"iv{m}{h} = sel(l{m}{h} > zero, f32(1.0) / l{m}{h}, zero)")
        store_c_rows(e, v, "o", Dv // 8, f"op + row0 * o_rs + hh * {rsv}", "o_rs", "wrow", "rows",
                     lambda m, h: f"iv{m}{h}")
        e("H = o_rs // %d" % rsv)
        for m in range(MT):
            for h in (0, 1):
                e(f"rl = wrow + {16 * m + 8 * h} + g")
                e("ok = u32((rl < rows) & (t == 0)); gi = (row0 + sel(ok != 0, rl, 0)) * H + hh")
                e(f"stg_f32_if(ok, mp + gi * 4, sel(l{m}{h} > zero, m{m}{h} * f32({1 / LOG2E!r}), minf))")
                e(f"stg_f32_if(ok, lp + gi * 4, l{m}{h})")
                e(f"stg_f32_if(ok & u32(mkp != 0), mkp + gi * 4, sel(l{m}{h} > zero, m{m}{h}, minf))")
        if v.prune:   # this CTA's (pruned, visited) tile counts, one slot per CTA: summed on the host
            e("ok = u32(tx == 0); slot = cntp + (i64(cuda.blockIdx.x) * H + hh) * 8")
            e("stg_u32_if(ok, slot, u32(npr)); stg_u32_if(ok, slot + 4, u32(nkb))")
    return e.text()


def pipelined_key_blocks(e, v, qa_where, modify=None):
    """The forward's key loop as a software pipeline on the warpgroup's tensor cores (wgmma,
    16-bit; Variant.fwd_pipelined). Iteration kb issues S = Q K^T of block kb and, right behind
    it, O += P V of block kb - 1 (P packed at the end of the previous iteration), waits for S
    only, and runs the softmax of block kb on the CUDA cores while the tensor cores multiply P V;
    then it waits for P V, rescales O by the new running max and packs P of block kb. The last
    block's P V follows the loop. The arithmetic is that of the serial loop: O gets the same
    products in the same order, only the waits moved (online softmax: O holds blocks < kb scaled
    to the max before block kb until the rescale).

    Shared memory holds K blocks in two slots and V blocks in two (pingpong: Variant.v_slots) slots,
    V one block behind K: the copies issued in iteration kb bring K of block kb + 1 and V of block
    kb, so at the top of iteration kb, once they have landed, K of kb and V of kb - 1 are there.
    The guard of the V tile (guard.py) and the poisoning of O's rows therefore happen for block
    kb - 1 in iteration kb, around its P V. Expects key_range's names, ss, kg, vg and cols.

    How the warps agree that a slot is full or free (the `ring`):
    - CTA barrier (default): one barrier per block (as in the serial loop, StreamedPair.advance),
      after each thread waited for its own copies, both publishes the landed copies and closes the
      previous iteration, after which its slots are free: the copies are issued right behind S's
      chain and have the whole iteration to land.
    - pingpong (two warpgroups): no CTA barrier in the loop. Every thread's copies of an
      iteration arrive on the mbarrier `full` of their stage when they land
      (cp.async.mbarrier.arrive.noinc), and a thread reads a stage after waiting on it; a
      thread releases a K slot on `emptyK` once its S chain completed and a V slot on `emptyV` once
      its P V chain completed, and copies into a slot only after its last readers released it.
      The warpgroups then need not run in step, and two named barriers make them take turns on the
      tensor cores: a warpgroup issues its two chains when the other one has issued its own, and
      runs its softmax while the other one's chains run (FlashAttention-3's ping-pong schedule).
      V takes three slots where they fit, so that the slot V of block kb is copied into (last read
      by P V of block kb - 3) was released an iteration before any warpgroup gets there (with two,
      by P V of kb - 2). A block with masked cells has its V tile guarded at the top of the
      iteration, before the turn is taken: the guard's CTA-wide barrier-ors then cannot wait on a
      warpgroup that waits for its turn. Whole blocks are copied without per-chunk row tests."""
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    pp = v.pingpong_loop
    A, B = BN * v.row_bytes(D), BN * v.row_bytes(Dv)   # one K slot, one V slot
    kslot = lambda i: f"a32(ss, u32(({i}) * {A}))"  # noqa: E731
    vbase = v.k_slots * A
    vslot = lambda i: f"a32(ss, u32({vbase} + ({i}) * {B}))"  # noqa: E731
    # the V slot of block b (b = -1: the zero-filled one), written with the names the loop keeps:
    # b % 2 (-1: slot 1), pingpong (b + 1) % v_slots (vsr: V of kb - 1, vsw: V of kb)
    vslot_of = {"kb": "cur", "kb - 1": "prv", "-1": "1", "nkb - 1": "(nkb - 1) % 2"}
    S = v.v_slots
    vring_of = {"kb": "vsw", "kb - 1": "vsr", "-1": "u32(0)", "nkb - 1": f"u32(nkb) % u32({S})"}
    vblock = lambda b: vslot(vring_of[b] if pp else vslot_of[b])  # noqa: E731
    edge = lambda b: f"(({b}) >= nfull) | (({b}) < nlow)"  # noqa: E731   the block holds masked cells
    # pingpong ring: mbarrier i at rb + 8 i: full 0-1, emptyK 2-3, emptyV from 4; indices and phases
    # in u32 arithmetic on non-negative values (no signed floor-division fix-ups in the loop)
    full = lambda i: f"a32(rb, u32({i}) * u32(8))"  # noqa: E731
    empty_k = lambda i: f"a32(rb, u32(16) + u32({i}) * u32(8))"  # noqa: E731
    empty_v = lambda i: f"a32(rb, u32(32) + u32({i}) * u32(8))"  # noqa: E731

    def wait(bar, use):
        """wait for the phase of barrier `bar` numbered `use` (a u32 expression) to complete."""
        return f"mbar_wait({bar}, ({use}) & u32(1))"

    def load(name, slot, c, width):
        base, stride = ("kg", "k_rs") if name == "k" else ("vg", "v_rs")
        # pingpong: whole blocks skip the per-chunk row tests (load_tile's `whole`)
        load_tile(e, v, slot, f"{base} + {c} * {stride}", stride, f"cols - {c}", BN, width, whole=pp)

    def ring_copies():
        """pingpong: iteration kb's copies. K kb + 1 goes where S of kb - 1 read, V kb where P V of
        kb - S read: each waits for the release of its slot first."""
        e("if kb + 1 < nkb:")
        with e.indent():
            e("if kb >= 1:")
            with e.indent():
                e(wait(empty_k("prv"), "(ku - u32(1)) >> u32(1)"))
            e(f"c1 = (kb + 1) * {BN}")
            load("k", kslot("prv"), "c1", D)
        e(f"if kb >= {S - 1}:")
        with e.indent():
            e(wait(empty_v("vsw"), f"(ku - u32({S - 1})) // u32({S})"))
        e(f"cv = kb * {BN}")
        load("v", vblock("kb"), "cv", Dv)
        e(f"mbar_cp_arrive({full('prv')})")

    def guard(b, vbuf, real="True"):
        """guard V of block b if it is `real` and holds masked cells (before any P V reads it)."""
        guard_init(e, v)
        e(f"if ({real}) & ({edge(b)}):")
        with e.indent():
            guard_tiles(e, v, [(vbuf, Dv)])

    def poison(b):
        poison_rows(e, v, [("o", Dv // 8)], lambda m, h: span(f"wrow + {16 * m + 8 * h} + g", f"({b}) * {BN}"))

    def stage_landed(kb):
        """wait until the copies that iteration kb reads (K of kb, V of kb - 1) have landed."""
        if pp:
            e(f"{wait(full(f'u32({kb}) & u32(1)'), f'u32({kb}) >> u32(1)')}; fence_async()")
        else:
            e("cp_wait0()")
            landed(e, v)

    # Every iteration issues both chains, the first one a P V of "block -1": P = 0 and a
    # zero-filled V slot (0 * 0 adds exact zeros to O = 0). ptxas keeps wgmma chains asynchronous
    # only in straight-line code: a chain issued on one branch and waited for after the join makes
    # it serialise them (warning C7513).
    e("# pipelined key loop: S of block kb and P V of block kb - 1 in flight together"
      + (" (two warpgroups in ping-pong, mbarrier ring)" if pp else ""))
    if pp:   # the ring was initialised before the resident tile's barrier (ring_init)
        e(f"rb = {sa('sb', v.ring_offset())}; wgi = u32(wid // 4)")
        e("own = u32(1) + wgi; other = u32(2) - wgi")   # named barriers 1, 2: warpgroup 0's, 1's turn
    for ks in range(BN // 16):
        e("; ".join(f"{x} = u32(0)" for x in a_regs(v, "pa", 0, ks)))
    e("if nkb > 0:")
    with e.indent():
        load("k", "ss", "0", D)
        load_tile(e, v, vblock("-1"), "vg", "v_rs", "0", BN, Dv)   # no valid rows: zero-filled
        e(f"mbar_cp_arrive({full(0)})" if pp else "cp_commit()")
    if pp:   # warpgroup 0 takes the first turn
        e(f"bar_arrive_if(u32(wgi == 1), 1, {v.NT})")
    e("for kb in range(nkb):")
    with e.indent():
        e("cur = kb % 2; prv = 1 - cur")
        if pp:
            e(f"ku = u32(kb); vsr = ku % u32({S}); vsw = (ku + u32(1)) % u32({S})")
        e(f"kbuf_cur = {kslot('cur')}; vbuf_prv = {vblock('kb - 1')}")
        # past this point, every thread's copies of K kb and V kb - 1 landed; with the CTA barrier
        # every warp has also left iteration kb - 1, so the slots it read are free at once
        stage_landed("kb")
        if pp:
            guard("kb - 1", "vbuf_prv", real="kb > 0")
            e(f"bar_sync_n(own, {v.NT})")   # my turn on the tensor cores
        zero_c(e, "s", MT, BN // 8)
        mma_abt(e, v, "s", "qa", "kbuf_cur", BN // 8, D, qa_where, wait=False)
        if not pp:
            e("if kb + 1 < nkb:")
            with e.indent():
                e(f"c1 = (kb + 1) * {BN}")
                load("k", kslot("prv"), "c1", D)
            e(f"cv = kb * {BN}")
            load("v", vblock("kb"), "cv", Dv)
            e("cp_commit()")
            guard("kb - 1", "vbuf_prv", real="kb > 0")
        wg_pb(e, v, "o", "pa", "s", "vbuf_prv", Dv // 8, BN, wait=False, packed=True)
        if pp:
            # the other warpgroup's turn; this one's copies go out while its S chain runs (after its
            # S completed instead they landed late: results/hopper-h200-2026-12-04b.txt)
            e(f"bar_arrive_n(other, {v.NT})")
            ring_copies()
        wg_wait(e, 1, "s", BN // 8)   # S completes first; P V stays in flight
        if pp:
            e(f"mbar_arrive({empty_k('cur')})")   # S of kb read its K slot: free for K kb + 2
        if modify is not None:
            modify()
        e(f"if {edge('kb')}:")
        with e.indent():
            row_limits(e, v, "lim", "wrow")
            mask_rows(e, "s", MT, BN // 8, f"kb * {BN}", "lim")
        factors = lambda m, h: f"alf{m}{h}"  # noqa: E731   kept until P V has completed
        online_softmax(e, v, "s", "o", Dv // 8, factors=factors)
        wg_wait(e, 0, "o", Dv // 8)
        if pp:
            e(f"mbar_arrive({empty_v('vsr')})")   # P V of kb - 1 read its V slot: free
        poison("kb - 1")   # block -1 marked no row (guard_init)
        rescale(e, v, "o", Dv // 8, factors)
        wg_pack(e, v, "pa", "s", BN // 16)
    e("if nkb > 0:")   # the last block's P V
    with e.indent():
        stage_landed("nkb")
        e(f"vbuf_prv = {vblock('nkb - 1')}")
        guard("nkb - 1", "vbuf_prv")
        wg_pb(e, v, "o", "pa", "s", "vbuf_prv", Dv // 8, BN, wait=True, packed=True)
        poison("nkb - 1")
    if pp:   # warpgroup 0 takes the turn warpgroup 1 handed it last, so no arrival is left pending
        e(f"bar_sync_if(u32(wgi == 0), 1, {v.NT})")


def ring_init(e, v):
    """pingpong: thread 0 initialises the ring's mbarriers (pipelined_key_blocks): every thread
    arrives once per phase on each. Emitted before the resident tile's CTA barrier, which
    publishes the initialisation."""
    e(f"rb = {sa('sb', v.ring_offset())}; first = u32(tx == 0)")
    for i in range(v.ring_barriers):
        e(f"mbar_init_if(first, a32(rb, u32({8 * i})), u32({v.NT}))")
    e("mbar_init_fence()")
