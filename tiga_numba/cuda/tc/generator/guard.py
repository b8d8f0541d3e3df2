"""Masked cells of a tile never multiply values: the guard of the B operands of P B products.

A P B product (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q) sums P[i, j] * B[j, n] over the
whole streamed block inside the tensor cores, and a masked cell has P[i, j] = 0: with a
non-finite B[j, n] (inf or NaN in a key / value / query / gradient row outside row i's relation)
0 * inf = NaN would reach row i. No choice of P fixes that, so on the blocks that hold masked
cells (the causal diagonal and the tails: the same CTA-uniform test that masks S there) the B
tiles are checked in shared memory before any product reads them:

  scan     every thread ORs an exponent test over its 16-byte chunks of each tile (any partition
           of the bytes will do: the test is per element) and one barrier-or decides for the CTA;
  rare     only if some element is inf or NaN: each thread zeroes the non-finite elements of its
           own chunks (all three bf16 parts for split tiles), takes the block-local row index of
           each such chunk (the swizzle permutes chunks within a row, never across rows), and the
           CTA reduces those rows to one index `jb` by a bitwise search over barrier-ors: the
           first bad row (`first`: a row's relation is a prefix of the block, forward and dQ) or
           the last (`last`: a suffix, dK/dV, whose B rows are queries);
  poison   after the block's products, the accumulator rows whose relation holds row jb are set
           to NaN (`poison_rows`): a non-finite value inside a row's relation still reaches it.

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


def guard_tiles(e, v, tiles, order):
    """Emit the scan and the rare path for the streamed tiles [(shared base, width), ...] of a block
    with masked cells; leaves `jb` (CTA-uniform, i64): the first / last block row with a non-finite
    element (order "first" / "last"), or the no-row value (BN / -1). The caller has set `jb` to the
    no-row value before its branch (see guard_init) and emits this inside that branch."""
    M, A, H = _EXP[_kind(v)]
    full = 0xFFFFFFFF
    parts = v.parts
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
        e("# rare: zero the non-finite elements (every part), find the block rows that held them")
        none = v.BN if order == "first" else -1
        e(f"lm = i64({none})")
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
                better = "row < lm" if order == "first" else "row > lm"
                e(f"lm = sel((bad != 0) & ({better}), row, lm)")
                # written back by every thread, whatever `go`: a chunk read twice (a pass past the
                # tile's end reads chunk 0) gets the same zeroed words from both writers
                for p in range(parts):
                    addr = f"a32({base}, off)" if p == 0 else f"a32(a32({base}, off), {p * T})"
                    if p:
                        e(f"w0, w1, w2, w3 = lds_u32x4({addr})")
                    e(f"sts_u32x4({addr}, u32(w0 & k0), u32(w1 & k1), u32(w2 & k2), u32(w3 & k3))")
        landed(e, v)   # the zeroed chunks are visible to every warp (and to wgmma's async proxy)
        # the CTA's smallest key (first row: lm; last row: BN - 1 - lm), bit by bit: after the step
        # for bit b, some thread's key lies below jb + 2^b unless jb grew by 2^b
        e(f"key = {'lm' if order == 'first' else f'{v.BN - 1} - lm'}")
        e("jb = i64(0)")
        for b in reversed(range(v.BN.bit_length())):
            e(f"jb = jb + sel(cuda.syncthreads_or(u32(key < jb + {1 << b})) != 0, 0, {1 << b})")
        if order == "last":
            e(f"jb = {v.BN - 1} - jb")


def guard_init(e, v, order):
    """`jb` = no bad row; emitted every block, before the masked-block branch that may set it."""
    e(f"jb = i64({v.BN if order == 'first' else -1})")


def nan_value(e):
    """`nanv`: a float32 NaN made by an asm conversion (fast-math code may fold a NaN constant)."""
    e("_, nanv = unpack2(u32(0x7FC00000))")


def poison_rows(e, v, accs, order, row_sees):
    """after the block's products: accumulator rows (C fragments, names `accs` with their n-tile
    counts) whose relation holds block row jb become NaN. row_sees(m, h) is the expression that is
    true when fragment row (m, h) of this thread sees block row jb."""
    none = v.BN if order == "first" else -1
    e(f"if jb != {none}:")
    with e.indent():
        e("# poison_rows: a non-finite value inside a row's relation reaches it (as NaN)")
        nan_value(e)
        for m in range(v.MT):
            for h in (0, 1):
                e(f"pz = u32({row_sees(m, h)})")
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
