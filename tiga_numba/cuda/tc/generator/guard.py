"""Masked cells of a tile never multiply values: the guard of the B operands of P B products.

A P B product (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q) sums P[i, j] * B[j, n] over the
whole streamed block inside the tensor cores, and a masked cell has P[i, j] = 0: with a
non-finite B[j, n] (inf or NaN in a key / value / query / gradient row outside row i's relation)
0 * inf = NaN would reach row i. No choice of P fixes that, so on the blocks that hold masked
cells (those crossing a band edge, e.g. the causal diagonal, and the tails: the same CTA-uniform
test that masks S there) the B tiles are checked in shared memory before any product reads them:

  scan     every thread ORs an exponent test over its 16-byte chunks of each tile (any partition
           of the bytes will do: the test is per element) and one barrier-or decides for the CTA;
  rare     only if some element is inf or NaN: each thread zeroes the non-finite elements of its
           own chunks (all three bf16 parts for split tiles), marks the block-local row of each
           such chunk in its own bit mask of the block's rows (the swizzle permutes chunks within
           a row, never across rows), and the CTA ORs the masks bit by bit over barrier-ors into
           `jm0`, `jm1`, ... (32 block rows per word): every bad row, since a row's relation
           inside a block is any interval of it (a band), not only a prefix or a suffix;
  poison   after the block's products, the accumulator rows whose interval of block rows holds a
           marked row are set to NaN (`poison_rows`): a non-finite value inside a row's relation
           still reaches it.

What stays exact: every row whose relation holds no non-finite value of the block. A row whose
relation does hold one gets NaN in every column of that product (IEEE arithmetic would give inf or
NaN in the affected columns only). The A operands (P, dS) are kept clean by selection where they
are made (their masked cells are exactly 0); scores read non-finite K / Q rows unguarded, the
masking of S selects them away. Blocks without masked cells pay nothing but a branch.
"""
from __future__ import annotations

from .shared import landed, sa

#: per element kind: (exponent mask of the 32-bit word, the add that carries an all-ones exponent
#: into the element's top bit, those top bits). 16-bit words hold two elements; the sums do not
#: carry from the low half into the high one (0x7c00 + 0x0400 = 0x8000).
_EXP = {"float16": (0x7C007C00, 0x04000400, 0x80008000),
        "bfloat16": (0x7F807F80, 0x00800080, 0x80008000),
        "float32": (0x7F800000, 0x00800000, 0x80000000)}


def _kind(v):
    """the element kind of the shared operand tiles: split tiles hold bf16 parts."""
    return "bfloat16" if v.split else v.dtype


def _chunks(v, width):
    """(passes, per-pass expressions) of a thread's 16-byte chunks of one (BN x width) tile part:
    chunk i * NT + tx of the part's bytes, its block-local row and whether it holds data (the
    wgmma tiles' padded sub-tile rows are never written by the split conversion)."""
    rs = v.row_bytes(width)
    nbytes = v.BN * rs
    assert nbytes % 16 == 0
    passes = -(-nbytes // 16 // v.NT)
    return passes, rs, nbytes


def _pass(e, v, i, rs, nbytes, width):
    """emit: go (this chunk exists), off (its byte offset in the part), row (its block row), data."""
    e(f"gc = {i * v.NT} + tx; go = u32(gc < {nbytes // 16}); off = u32(sel(go != 0, gc, 0) * 16)")
    if v.wgmma:   # 64-column sub-tiles of BN rows x 128 bytes; chunk c of row r at c ^ (r % 8)
        e(f"row = (i64(off) // 128) % {v.BN}")
        if rs != width * v.EB:
            e(f"cb = (i64(off) // {v.BN * 128}) * 128 + (((i64(off) % 128) // 16) ^ (row % 8)) * 16")
            e(f"go = go & u32(cb < {width * v.EB})")
    else:
        e(f"row = i64(off) // {rs}")


def _words(v):
    """the 32-bit words of a block-row mask (BN rows)."""
    return -(-v.BN // 32)


def guard_tiles(e, v, tiles):
    """Emit the scan and the rare path for the streamed tiles [(shared base, width), ...] of a block
    with masked cells; leaves `jm0`, `jm1`, ... (CTA-uniform u32 words): bit r % 32 of word r // 32
    is set when block row r holds a non-finite element. The caller has cleared the words before its
    branch (see guard_init) and emits this inside that branch."""
    M, A, H = _EXP[_kind(v)]
    full = 0xFFFFFFFF
    parts = v.parts
    nw = _words(v)
    e("# guard_tiles: inf / NaN in the B tiles of this block's P B products? (masked cells must not multiply them)")
    e("nf = u32(0)")
    for base, width in tiles:
        passes, rs, nbytes = _chunks(v, width)
        for i in range(passes):
            _pass(e, v, i, rs, nbytes, width)
            e(f"w0, w1, w2, w3 = lds_u32x4(a32({base}, off))")
            e(f"nf = nf | (go * u32(u32(((w0 & u32({M})) + u32({A})) | ((w1 & u32({M})) + u32({A}))"
              f" | ((w2 & u32({M})) + u32({A})) | ((w3 & u32({M})) + u32({A}))) & u32({H})))")
    e("if cuda.syncthreads_or(u32(nf != 0)) != 0:")
    with e.indent():
        e("# rare: zero the non-finite elements (every part), mark the block rows that held them")
        for k in range(nw):
            e(f"tm{k} = u32(0)")
        for base, width in tiles:
            passes, rs, nbytes = _chunks(v, width)
            T = v.BN * rs   # bytes of one part
            for i in range(passes):
                _pass(e, v, i, rs, nbytes, width)
                e(f"w0, w1, w2, w3 = lds_u32x4(a32({base}, off))")
                for w in range(4):
                    e(f"t{w} = (w{w} & u32({M})) + u32({A})")
                    if _kind(v) == "float32":
                        e(f"k{w} = sel((t{w} & u32(0x80000000)) != 0, u32(0), u32({full}))")
                    else:
                        e(f"k{w} = sel((t{w} & u32(0x8000)) != 0, u32(0xFFFF0000), u32({full}))"
                          f" & sel((t{w} & u32(0x80000000)) != 0, u32(0xFFFF), u32({full}))")
                e(f"bad = go & u32((k0 & k1 & k2 & k3) != u32({full}))")
                for k in range(nw):
                    e(f"tm{k} = tm{k} | sel((bad != 0) & (row >= {32 * k}) & (row < {32 * k + 32}), "
                      f"u32(1) << u32((row - {32 * k}) & 31), u32(0))")
                # written back by every thread, whatever `go`: a chunk read twice (a pass past the
                # tile's end reads chunk 0) gets the same zeroed words from both writers
                for p in range(parts):
                    addr = f"a32({base}, off)" if p == 0 else f"a32(a32({base}, off), {p * T})"
                    if p:
                        e(f"w0, w1, w2, w3 = lds_u32x4({addr})")
                    e(f"sts_u32x4({addr}, u32(w0 & k0), u32(w1 & k1), u32(w2 & k2), u32(w3 & k3))")
        landed(e, v)   # the zeroed chunks are visible to every warp (and to wgmma's async proxy)
        # the CTA's OR of the threads' masks, bit by bit (the rare path: barriers are cheap here)
        for k in range(nw):
            for b in range(min(32, v.BN - 32 * k)):
                e(f"jm{k} = jm{k} | sel(cuda.syncthreads_or(u32((tm{k} >> u32({b})) & u32(1))) != 0, "
                  f"u32({1 << b}), u32(0))")


def guard_init(e, v):
    """the block-row mask words `jm0`, ... = no bad row; emitted every block, before the
    masked-block branch that may set them."""
    e("; ".join(f"jm{k} = u32(0)" for k in range(_words(v))))


def nan_value(e):
    """`nanv`: a float32 NaN made by an asm conversion (fast-math code may fold a NaN constant)."""
    e("_, nanv = unpack2(u32(0x7FC00000))")


def poison_rows(e, v, accs, row_span):
    """after the block's products: accumulator rows (C fragments, names `accs` with their n-tile
    counts) whose relation holds a marked block row become NaN. row_span(m, h) is the pair of
    expressions (first, end): fragment row (m, h) of this thread sees block rows first .. end - 1
    (any values; clamped to the block here)."""
    nw = _words(v)
    e(f"if ({' | '.join(f'jm{k}' for k in range(nw))}) != u32(0):")
    with e.indent():
        e("# poison_rows: a non-finite value inside a row's relation reaches it (as NaN)")
        nan_value(e)
        for m in range(v.MT):
            for h in (0, 1):
                first, end = row_span(m, h)
                e(f"ps = {first}; pe = {end}; pz = u32(0)")
                for k in range(nw):
                    # the row's span inside word k as a bit range [bs, be) of 0..32 (64-bit shifts)
                    e(f"bs = imin(imax(ps - {32 * k}, 0), 32); be = imin(imax(pe - {32 * k}, 0), 32)")
                    e(f"pz = pz | u32((jm{k} & u32(((i64(1) << be) - 1) & ~((i64(1) << bs) - 1))) != u32(0))")
                for name, nt in accs:
                    for j in range(nt):
                        e("; ".join(f"{name}{m}_{j}_{r} = sel(pz != 0, nanv, {name}{m}_{j}_{r})" for r in (2 * h, 2 * h + 1)))


def zero_masked(e, C, MT, ntiles, keep):
    """C[m][j][r] = 0 where keep(m, j, r) (an expression) is false: the masked cells of a P-like
    operand (P, dS) are exactly 0, whatever the column statistics or dP held there."""
    e(f"# zero_masked: masked cells of {C} -> 0")
    for m in range(MT):
        for j in range(ntiles):
            for r in range(4):
                x = f"{C}{m}_{j}_{r}"
                e(f"{x} = sel({keep(m, j, r)}, {x}, zero)")


__all__ = ["guard_tiles", "guard_init", "poison_rows", "zero_masked", "nan_value", "sa"]
