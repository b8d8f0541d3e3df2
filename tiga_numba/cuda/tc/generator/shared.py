"""Shared memory: each thread's place in the tile loads (thread geometry, 32-bit shared addresses),
global -> shared tile copies (cp.async, 16-byte swizzled chunks), the float32 staging and bf16
split of tiles for the wgmma float32 kernels, and the CTA's shared array and barriers."""
from __future__ import annotations

from .source import udiv, umod
from .variant import SPLIT_PARTS, WG_ALIGN


# ----------------------------------------------------------------------------- thread geometry
def sa(*terms):
    """32-bit shared-window address expression: sum of u32 terms, constants folded last (so
    ptxas sees [reg + imm] and no 64-bit address arithmetic keeps registers busy)."""
    const = sum(t for t in terms if isinstance(t, int))
    names = [t for t in terms if not isinstance(t, int)]
    expr = names[0]
    for t in names[1:]:
        expr = f"a32({expr}, {t})"
    return f"a32({expr}, {const})" if const else expr


def load_rows_per_pass(v, rs):
    """rows of a (rows x rs bytes) tile one pass of the CTA's cp.async covers."""
    return v.NT // (rs // 16)


def thread_geometry(e, v):
    """lane decomposition used by every fragment emitter, plus this lane's swizzled shared offsets:
    xa{rs}_{c}: row lrow16, chunk 2c + mhi (A fragments of k-step c; B.trans of n-tile pair c);
    xb{rs}_{c}: row r8, chunk 4c + mi (B fragments of k-steps 2c, 2c+1);
    ls{rs}_{o}: tile-load slot of a pass starting o rows (mod 8) into the tile;
    xv{rs}_{e}_{p} (tf32): key row 2t + e, words 2g, 2g + 1 of n-tile pair p (mod 2) (mma_ab's B)."""
    e("tx = i64(cuda.threadIdx.x)")
    e("wid = tx // 32; lane = tx % 32; g = lane // 4; t = lane % 4")
    # ldmatrix: lanes 8*mi .. 8*mi+7 give the row addresses of 8x8 matrix mi
    e("mi = lane // 8; r8 = lane % 8; mlo = mi % 2; mhi = mi // 2; lrow16 = r8 + 8 * mlo")
    if v.fuse_dq and not v.wgmma and v.BM not in (v.D, v.Dv):   # A fragments of the dS tile (BM keys wide)
        rs = v.EB * v.BM
        for c in range(rs // 32):
            e(f"xa{rs}_{c} = u32(lrow16 * {rs} + (((({2 * c}) + mhi) ^ r8) * 16))")
    if v.wgmma:   # this warpgroup's first row in a resident tile (64 rows of 128 bytes)
        e("wga = u32((wid // 4) * 8192)")
    for width in sorted({v.D, v.Dv}):
        rs = v.row_bytes(width)
        if not v.wgmma:   # ldmatrix offsets (wgmma reads shared memory through descriptors)
            for c in range(rs // 32):
                e(f"xa{rs}_{c} = u32(lrow16 * {rs} + (((({2 * c}) + mhi) ^ r8) * 16))")
            for c in range(rs // 64):
                e(f"xb{rs}_{c} = u32(r8 * {rs} + (((({4 * c}) + mi) ^ r8) * 16))")
        cpr = rs // 16
        step = load_rows_per_pass(v, rs)
        for o in sorted({(i * step) % 8 for i in range(8)}):
            # a pass `o` rows (mod 8) further down swizzles with (row + o) % 8
            row = f"(tx // {cpr})" if o == 0 else f"((tx // {cpr}) + {o})"
            if v.wgmma:   # 128-byte rows of one 64-column group; load_tile adds the group's sub-tile
                e(f"ls{rs}_{o} = u32((tx // {cpr}) * 128 + ((((tx % {cpr}) % 8) ^ ({row} % 8)) * 16))")
            else:
                e(f"ls{rs}_{o} = u32((tx // {cpr}) * {rs} + (((tx % {cpr}) ^ ({row} % 8)) * 16))")
        if v.tf32:
            for ee in (0, 1):
                for p in (0, 1):
                    e(f"xv{rs}_{ee}_{p} = u32((2 * t + {ee}) * {rs} + ((({4 * p} + g // 2) ^ (2 * t + {ee})) * 16)"
                      f" + (g % 2) * 8)")


# ----------------------------------------------------------------------------- global -> shared
def load_tile(e, v, smem, gbase, gstride, nvalid, rows, width, whole=False):
    """cp.async a (rows x width) tile, row r at gbase + r * gstride, into swizzled shared memory.
    Rows >= nvalid are zero-filled (src-size 0) and read nothing: tails never go out of bounds.
    wgmma variants store each 64-column group as its own (rows x 128 B) sub-tile, the canonical
    128-byte-swizzled layout of wgmma's descriptors (for D = 64 the same bytes as the row-major tile).
    whole: a tile whose every row is valid (nvalid >= rows) takes a branch without the per-chunk
    row test and source select (64-bit compares and selects: about a third of a key loop's integer
    instructions otherwise); the tail tile keeps them."""
    if whole:
        e(f"if ({nvalid}) >= {rows}:")
        with e.indent():
            _load_rows(e, v, smem, gbase, gstride, None, rows, width)
        e("else:")
        with e.indent():
            _load_rows(e, v, smem, gbase, gstride, nvalid, rows, width)
        return
    _load_rows(e, v, smem, gbase, gstride, nvalid, rows, width)


def _load_rows(e, v, smem, gbase, gstride, nvalid, rows, width):
    """load_tile's copies; nvalid None: every row is valid."""
    rs = v.row_bytes(width)
    cpr = rs // 16                   # 16-byte chunks per row (wgmma: of the padded row)
    data = width * v.EB // 16        # ... of which hold data: the rest is zero-filled
    step = load_rows_per_pass(v, rs)  # rows covered by one pass of the CTA
    assert v.NT % cpr == 0 and rows % step == 0, (v, rows, width)
    e(f"# load_tile: {rows} x {width} from {gbase} " + ("(every row valid)" if nvalid is None else f"(rows >= {nvalid} zero-filled)")
      + f" -> shared {smem}")
    e(f"lr = tx // {cpr}; lc = tx % {cpr}")
    # the pass stride goes through an opaque move: otherwise every pass's row offset is hoisted
    # out of the key loop and held in a 64-bit register pair for the whole loop (spills)
    e(f"gb = {gbase}; gs = opq({step} * {gstride}); ga = gb + lr * {gstride} + lc * 16")
    group = []
    if v.wgmma and cpr > 8:
        e(f"lgr = u32((lc // 8) * {rows * 128})")
        group = ["lgr"]
    pitch = 128 if v.wgmma else rs
    if nvalid is None and data < cpr:   # padded rows: the chunks past the data are zero-filled
        e(f"okc = u32(lc < {data})")
    for i in range(rows // step):
        if nvalid is None:
            src, size = ("ga", "16") if data == cpr else ("sel(okc != 0, ga, gb)", "okc * 16")
        else:
            e(f"ok = u32(lr + {i * step} < {nvalid})" if data == cpr else f"ok = u32((lr + {i * step} < {nvalid}) & (lc < {data}))")
            src, size = "sel(ok != 0, ga, gb)", "ok * 16"
        e(f"cp_async16({sa(smem, f'ls{rs}_{(i * step) % 8}', *group, i * step * pitch)}, {src}, {size})")
        if i + 1 < rows // step:
            e("ga = ga + gs")


# ----------------------------------------------------------------------------- split (float32 on wgmma)
# A float32 tile reaches its bf16 parts in two steps: stage_tile cp.asyncs it unchanged into the
# staging tile (row-major, 16-byte chunk i * NT + tx per pass i), and convert_tile, once this thread's
# copies landed, reads back exactly the chunks this thread copied and writes their three parts into
# the wgmma layout. Each thread only ever reads its own chunks, so no barrier separates the two and the
# next block can be staged right after the conversion; the layout barrier (`landed`) follows.
def _split_chunk(e, v, i, rows, width):
    """row `fr` and 16-byte chunk `fc` of pass i (chunk i * NT + tx of the rows x width tile), from an
    opaque copy of the thread index so that nothing is hoisted out of the key loop into registers."""
    cpr = width // 4
    e(f"fz = i64(u32(opq(tx)) + {i * v.NT}); fr = {udiv('fz', cpr)}; fc = {umod('fz', cpr)}")


def stage_tile(e, v, stage, gbase, gstride, nvalid, rows, width):
    """split: cp.async a float32 (rows x width) tile into the staging tile (row-major, unswizzled);
    rows >= nvalid are zero-filled and read nothing."""
    e(f"# stage_tile: {rows} x {width} float32 from {gbase} (rows >= {nvalid} zero-filled) -> staging {stage}")
    e(f"gb = {gbase}")
    for i in range(rows * width // 4 // v.NT):
        _split_chunk(e, v, i, rows, width)
        e(f"ok = u32(fr < {nvalid})")
        e(f"cp_async16(a32({stage}, u32(fz * 16)), sel(ok != 0, gb + fr * {gstride} + fc * 16, gb), ok * 16)")


def convert_tile(e, v, stage, dst, rows, width):
    """split: this thread's staged chunks -> bf16 (hi, mid, lo) tiles at dst, dst + T, dst + 2T
    (T = rows x row_bytes): each in load_tile's wgmma layout (64-column sub-tiles of 128-byte rows,
    chunk c of row r at c ^ (r % 8)); 4 floats are half a 16-byte bf16 chunk."""
    T = rows * v.row_bytes(width)
    e(f"# convert_tile: staging {stage} -> bf16 parts {', '.join(SPLIT_PARTS)} of {dst}")
    for i in range(rows * width // 4 // v.NT):
        _split_chunk(e, v, i, rows, width)
        e(f"x0, x1, x2, x3 = lds_f32x4(a32({stage}, u32(fz * 16)))")
        e("h0, m0, q0 = split3x2(x0, x1); h1, m1, q1 = split3x2(x2, x3)")
        # bf16 column 4 fc: sub-tile fc // 16, 16-byte chunk (fc % 16) // 2, half fc % 2
        e(f"so = u32((fc // 16) * {rows * 128} + fr * 128 + ((((fc % 16) // 2) ^ (fr % 8)) * 16) + (fc % 2) * 8)")
        for p, (a, b) in enumerate((("h0", "h1"), ("m0", "m1"), ("q0", "q1"))):
            e(f"sts_u32x2({sa(dst, 'so', p * T)}, {a}, {b})")


def shared_base(e, v):
    """sb: the first byte of the CTA's tiles (wgmma: rounded up to WG_ALIGN, see there)."""
    if v.wgmma:
        e(f"sb = u32((saddr(sm) + {WG_ALIGN - 1}) // {WG_ALIGN} * {WG_ALIGN})")
    else:
        e("sb = saddr(sm)")


def landed(e, v):
    """the barrier after this thread's cp.async copies landed: wgmma reads shared memory through
    the async proxy, so (wgmma only) each thread first fences its generic-proxy writes for it."""
    e("fence_async(); cuda.syncthreads()" if v.wgmma else "cuda.syncthreads()")


def shared_array(e, v):
    if v.dynamic_smem:   # sized at launch (build.kernel passes v.smem_bytes() as dyn_smem)
        e("sm = cuda.shared.array(0, u8)")
    else:
        e(f"sm = cuda.shared.array({v.smem_bytes()}, u8, alignment=128)")
