"""The streamed skeleton shared by the kernels: the work-table prologue (one row per CTA), the
double-buffered key/value block loop (cp.async, `StreamedPair`, `stream_key_blocks`), the
tile-pruning gate, and the stores of C fragments to global memory."""
from __future__ import annotations

from .fragments import zero_c
from .guard import guard_init, guard_tiles, poison_rows
from .products import mma_abt
from .shared import convert_tile, landed, load_tile, sa, stage_tile
from .softmax import mask_rows, row_limits, row_span
from .source import _tree, udiv
from .variant import WORK_FIELDS


# ----------------------------------------------------------------------------- stores
def store_c_rows(e, v, C, ntiles, gbase, gstride, row_base, nvalid, scale_of):
    """Store mma_pb's C fragments to rows gbase + row * gstride, rows < nvalid: 16-bit as x2 pairs
    (4-byte stores); tf32 (columns permuted in n-tile pairs, see mma_pb) as 4 consecutive floats
    (16-byte stores). scale_of(m, h) is the expression multiplying the row (1/l, the softmax scale, ...)."""
    for m in range(v.MT):
        for h in (0, 1):
            e(f"rl = {row_base} + {16 * m + 8 * h} + g")
            e(f"ok = u32(rl < {nvalid}); ga = {gbase} + sel(ok != 0, rl, 0) * {gstride} + t * {16 if v.tf32 else 8 if v.split else 4}")
            f = scale_of(m, h)
            r0, r1 = 2 * h, 2 * h + 1
            if v.tf32:
                for jp in range(ntiles // 2):
                    a, b = 2 * jp, 2 * jp + 1
                    vals = [f"{C}{m}_{a}_{r0}", f"{C}{m}_{b}_{r0}", f"{C}{m}_{a}_{r1}", f"{C}{m}_{b}_{r1}"]
                    e(f"stg_v4_if(ok, ga + {64 * jp}, {', '.join(x + ' * ' + f for x in vals)})")
                continue
            if v.split:   # float32 outputs in the natural column order: 8 bytes per n-tile
                for j in range(ntiles):
                    e(f"stg_v2_if(ok, ga + {32 * j}, {C}{m}_{j}_{r0} * {f}, {C}{m}_{j}_{r1} * {f})")
                continue
            for j in range(ntiles):
                e(f"stg_u32_if(ok, ga + {16 * j}, pack2({C}{m}_{j}_{r0} * {f}, {C}{m}_{j}_{r1} * {f}))")


# ----------------------------------------------------------------------------- work-table prologue
def read_work(e, v, index="i64(cuda.blockIdx.x)"):
    """This CTA's row of the work table (schedule.py): which rows it owns and which block they face.
    `rows` is capped at the tile; `rows_left` keeps the block's rows from row0 on."""
    e(f"wa = work + {index} * {4 * len(WORK_FIELDS)}")
    for i, f in enumerate(WORK_FIELDS):
        e(f"{f} = i64(ldg_i32(wa + {4 * i}))")
    if v.fuse_dq:
        e("rows_left = rows")
    e(f"rows = imin(rows, {v.BM})")


class StreamedPair:
    """The two tiles a loop streams per block (K and V for the forward and dQ kernels, Q and dO for
    dK/dV), named `{a}buf_*` / `{b}buf_*`, `widths` = their head dims, from shared byte `ss` on.
    16-bit and 3xTF32: a cp.async double buffer, block i + 1 lands in the other half while block i
    computes. split: one block buffer of bf16 parts, the next block lands in the float32 staging
    tile and is converted at the top of its iteration (stage_tile / convert_tile)."""

    def __init__(self, e, v, names, widths):
        self.e, self.v, self.names, self.widths = e, v, names, widths
        BN = v.BN
        self.sizes = [BN * v.row_bytes(w) for w in widths]   # one buffer of one part
        a, b = names
        e(f"{a}buf_0 = ss; {b}buf_0 = a32(ss, {v.stream_buffers * v.parts * self.sizes[0]})")
        if v.split:
            e(f"st{a} = {sa('sb', v.staging_offset())}; st{b} = a32(st{a}, {4 * BN * widths[0]})")

    def load(self, slot, sources):
        """copy the block whose rows start at sources = [(global base, row stride, valid rows)] per
        tile into buffer `slot` ("0" or "nxt"), or (split) the staging tile."""
        e, v = self.e, self.v
        for name, w, (gbase, gstride, nvalid) in zip(self.names, self.widths, sources):
            if v.split:
                stage_tile(e, v, f"st{name}", gbase, gstride, nvalid, v.BN, w)
            else:
                load_tile(e, v, f"{name}buf_{slot}", gbase, gstride, nvalid, v.BN, w)

    def advance(self, it, n, upcoming):
        """Top of iteration `it` of `n`: make this block's tiles {a}buf_cur / {b}buf_cur visible to
        every thread, then start the copy of the next one, inside `if it + 1 < n:` (upcoming()
        emits the names that block needs and returns its sources).
        16-bit and 3xTF32: ONE CTA barrier per block. This block's copies are the only group in
        flight; once each thread has waited for its own and passed the barrier, every warp has also
        left the previous iteration, so the slot that iteration read is refilled at once and the
        copy has the whole iteration to land. The loop needs no barrier at its end (end_barrier).
        split: the staging tile is waited for and converted into the one block buffer, the next
        block staged, then the barrier; the block buffer is rewritten at the next top, so the loop
        ends with a barrier."""
        e, v, (a, b), (A, B) = self.e, self.v, self.names, self.sizes
        if v.split:
            e(f"{a}buf_cur = {a}buf_0; {b}buf_cur = {b}buf_0")
            e("cp_wait0()")
            for name, w in zip(self.names, self.widths):
                convert_tile(e, v, f"st{name}", f"{name}buf_cur", v.BN, w)
        else:
            e(f"cur = {it} % 2")
            e(f"{a}buf_cur = a32(ss, u32(cur * {A})); {b}buf_cur = a32(ss, u32({2 * A} + cur * {B}))")
            e("cp_wait0()")
            landed(e, v)
        e(f"if {it} + 1 < {n}:")
        with e.indent():
            sources = upcoming()
            if not v.split:
                e(f"nxt = 1 - cur; {a}buf_nxt = a32(ss, u32(nxt * {A})); {b}buf_nxt = a32(ss, u32({2 * A} + nxt * {B}))")
            self.load("nxt", sources)
            e("cp_commit()")
        if v.split:
            landed(e, v)

    @property
    def end_barrier(self):
        """whether the loop body must end with a CTA barrier for the streamed tiles (split only)."""
        return self.v.split


def key_range(e, v):
    """The key blocks a query tile visits (forward, dQ) from its work row's band: 0 .. nkb - 1
    (the work row starts at its first row's lower limit, schedule.py) up to the block holding the
    last row's upper limit; blocks below nlow cross some row's lower limit, blocks from nfull on
    its upper limit or the tail: only those are masked."""
    BN = v.BN
    e(f"nkb = (imin(cols, hi + rows) + {BN - 1}) // {BN}")
    e(f"nfull = imin(cols // {BN}, (hi + 1) // {BN})")
    e(f"nlow = imax(lo + rows + {BN - 2}, 0) // {BN}")


def stream_key_blocks(e, v, qa_where, block, guarded, accs, issue=None, modify=None):
    """The key loop of the forward and dQ kernels over the blocks key_range() chose: the block's
    K/V tiles stream through StreamedPair (block kb+1 is copied while kb computes; one CTA
    barrier per block, at its top); per block
    S = Q K^T, masked only where the block crosses a band edge or the tail (kb < nlow or kb >= nfull), then
    block(kbuf, vbuf) emits the kernel's own use of S with the current buffers; issue(kbuf, vbuf),
    if given, right after S (a wgmma product issued there runs while S is masked and
    exponentiated). On those masked blocks the tile `guarded` ("k" or "v": the B operand of the
    kernel's P B product) is guarded before any product reads it and the accumulators `accs`
    [(name, n-tiles)] are poisoned after (guard.py). modify(), if given, rewrites S before the
    mask (a score modifier: masking then needs no test of its own). Expects ss, kg, vg, cols and
    key_range's names."""
    D, Dv, BN, MT = v.D, v.Dv, v.BN, v.MT
    # the key blocks in key order, or (pruning) the near ones first so that the running max is set early: from the block holding key
    # `diag` (the one facing the query tile; causal: its first row's diagonal), wrapping around.
    # That block holds a real key of every row of the tile (online_softmax needs one in each
    # row's first tile).
    it = "it" if v.prune else "kb"
    if v.prune:
        e(f"kstart = imin({udiv('diag', BN)}, nkb - 1)")
        order = lambda i: f"sel({i} + kstart >= nkb, {i} + kstart - nkb, {i} + kstart)"  # noqa: E731
    kv = StreamedPair(e, v, ("k", "v"), (D, Dv))
    block_at = lambda c: [(f"kg + {c} * k_rs", "k_rs", f"cols - {c}"), (f"vg + {c} * v_rs", "v_rs", f"cols - {c}")]  # noqa: E731
    e("if nkb > 0:")
    with e.indent():
        e(f"c0 = {order('0') if v.prune else '0'} * {BN}")
        kv.load("0", block_at("c0"))
        e("cp_commit()")
    e(f"for {it} in range(nkb):")
    with e.indent():
        if v.prune:
            e(f"kb = {order('it')}")
        def upcoming():
            e(f"c1 = {order('it + 1') if v.prune else '(kb + 1)'} * {BN}")
            return block_at("c1")
        kv.advance(it, "nkb", upcoming)
        # the block holds masked cells (CTA-uniform); tested where used, nothing held across S
        edge = "(kb >= nfull) | (kb < nlow)"
        guard_init(e, v)
        e(f"if {edge}:")
        with e.indent():
            guard_tiles(e, v, [(f"{guarded}buf_cur", D if guarded == "k" else Dv)])
        zero_c(e, "s", MT, BN // 8)
        mma_abt(e, v, "s", "qa", "kbuf_cur", BN // 8, D, qa_where)
        if issue is not None:
            issue("kbuf_cur", "vbuf_cur")
        if modify is not None:
            modify()
        e(f"if {edge}:")
        with e.indent():
            row_limits(e, v, "lim", "wrow")   # computed here only: no registers held in the loop
            mask_rows(e, "s", MT, BN // 8, f"kb * {BN}", "lim")
        block("kbuf_cur", "vbuf_cur")
        # row rl sees the block rows from lo + rl to its limit (row_limits), less the block's start
        poison_rows(e, v, accs, lambda m, h: span(f"wrow + {16 * m + 8 * h} + g", f"kb * {BN}"))
        if kv.end_barrier:
            e("cuda.syncthreads()")   # the block buffer is rewritten at the next top


def span(r, c0):
    """(first, end) expressions: the columns tile row r sees (row_span), counted from column c0."""
    return tuple(f"{x} - {c0}" for x in row_span(r))


# ============================================================================= forward
def prune_gate(e, v):
    """Tile-pruning admission (docs/design.md): admit iff the running max R over the whole query tile is
    still unset or max(tile scores) T >= R + ln(rho), both over this CTA's real rows (tail rows
    hold zero-filled queries), in the exp2 domain (ln(rho) arrives as lg2rho = log2(rho)).
    T >= R + c holds iff some thread's own rows reach R + c, so one barrier-or decides for the
    CTA; R is kept uniform in every thread: an admitted tile raises it to max(R, T), T read from
    the per-warp maxima each warp left in shared memory before the barrier (the next tile's
    writes come after the barrier at the top of its iteration, StreamedPair.advance).
    Returns the rows' quad-reduced raw maxima for online_softmax."""
    mx = lambda a, b: f"fmaxf({a}, {b})"  # noqa: E731
    e("# prune_gate: admit this tile? (T >= R + ln rho, R = the query tile's running max)")
    e("tl = masked")
    rowmax = {}
    for m in range(v.MT):
        for h in (0, 1):
            rs = (0, 1) if h == 0 else (2, 3)
            x = rowmax[m, h] = f"xr{m}{h}"
            e(f"{x} = " + _tree(mx, [f"s{m}_{j}_{r}" for j in range(v.BN // 8) for r in rs]))
            e(f"{x} = fmaxf({x}, shfl_xor({x}, 1)); {x} = fmaxf({x}, shfl_xor({x}, 2))")
            e(f"tl = fmaxf(tl, sel(wrow + {16 * m + 8 * h} + g < rows, {x} * sc, masked))")
    e("tl = fmaxf(tl, shfl_xor(tl, 4)); tl = fmaxf(tl, shfl_xor(tl, 8)); tl = fmaxf(tl, shfl_xor(tl, 16))")
    e("sts_f32(a32(prs, u32(wid * 4)), tl)")
    e("adm = u32(cuda.syncthreads_or(u32((rcta <= masked) | (tl >= rcta + lg2rho))))")
    e("if adm != 0:")
    with e.indent():
        for c in range(-(-v.NW // 4)):   # 16-byte loads: four warps' maxima each
            e(f"y0, y1, y2, y3 = lds_f32x4(a32(prs, {16 * c}))")
            e("rcta = fmaxf(rcta, fmaxf(fmaxf(y0, y1), fmaxf(y2, y3)))")
    return rowmax
