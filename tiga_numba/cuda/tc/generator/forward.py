"""The forward kernel text: O = softmax(scale Q K^T) V per work row, writing O, m, l."""
from __future__ import annotations

from .fragments import zero_c
from .pipeline import key_range, prune_gate, read_work, store_c_rows, stream_key_blocks
from .products import mma_pb, resident
from .shared import sa, shared_array, shared_base, thread_geometry
from .softmax import online_softmax
from .source import Source, udiv
from .modifier import ARGS as MOD_ARGS, cell_col, cell_row
from .variant import LOG2E, MASKED, WG_ALIGN


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
        # stage 1: the Q tile, resident for the whole loop (registers, or shared with a_smem)
        where, _, off = resident(e, v, [("qa", "qg", "q_rs", D)], "wrow")
        e(f"ss = {sa('sb', off) if off else 'sb'}")   # first byte of the streamed buffers
        zero_c(e, "o", MT, Dv // 8)
        for m in range(MT):
            e(f"m{m}0 = masked; m{m}1 = masked; l{m}0 = zero; l{m}1 = zero")
        # stage 2: stream key blocks; S = Q K^T of each, then softmax and O += P V
        def modify():   # S -> f(scale S) log2(e), before the mask (the kernel runs with sc = 1)
            for m in range(MT):
                for j in range(BN // 8):
                    for r in range(4):
                        x = f"s{m}_{j}_{r}"
                        v.mod.cell(e, x, cell_row(m, r), cell_col(f"kb * {BN}", j, r), x, masked=False)

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
