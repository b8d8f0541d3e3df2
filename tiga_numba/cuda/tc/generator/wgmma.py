"""Warpgroup products (wgmma, sm_90a): shared-memory descriptors, the A B^T and P B chains, the
waits, and packing C fragments into register A operands (16-bit, or three bf16 split parts)."""
from __future__ import annotations

from .fragments import a_pairs, a_regs, c_regs, c_to_a, zero_c_tiles
from .shared import sa
from .variant import pb_groups, SPLIT_PARTIALS, SPLIT_PARTS, SPLIT_PASSES


# ----------------------------------------------------------------------------- wgmma (sm_90a)
# A warpgroup (4 consecutive warps) multiplies its 64 rows in one instruction per k-step of 16:
# wgmma.mma_async.m64nNk16, B (and, for A B^T products, A) read by the tensor cores straight from
# shared memory through descriptors, so an operand tile crosses shared memory once per warpgroup
# instead of once per warp through ldmatrix. Warp w % 4 of the group receives rows 16 (w % 4) ..
# + 15 in exactly mma.sync's C layout (c{r} of n-tile j), and register A operands use mma.sync's A
# layout, so softmax, masking, c_to_a and the stores are shared with the mma.sync kernels.
# Shared layout: the canonical 128-byte-swizzled one (chunk c of row r at c ^ (r % 8), 128-byte
# rows, tiles 1024-byte aligned), one (rows x 128 B) sub-tile per 64 columns (load_tile).
#   A B^T (S = Q K^T, dP = dO V^T, ...): A and B K-major; the k-step k16 of a sub-tile starts 32 B
#     further (the hardware applies the swizzle to the final address), the next 8 rows are 1024 B
#     away (SBO); k-steps 4-7 (D = 128) live in the second sub-tile.
#   P B (O += P V, dQ += dS K, ...): A = C fragments packed by c_to_a; B row-major [key][n] is
#     MN-major (imm-trans-b = 1): 8 keys at 128-B pitch, the next 8 at SBO, the next 64 columns at
#     LBO = one sub-tile.
def wg_desc(addr, lbo, sbo=1024):
    """the sm_90 wgmma shared-memory descriptor of a 128-byte-swizzled tile at `addr` (u32):
    start >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45:
    1024, the next 8 rows), swizzle mode 1 = 128 B (62-63). A k-step further is `+ offset >> 4`."""
    const = (lbo >> 4) << 16 | (sbo >> 4) << 32 | 1 << 62
    return f"(i64({addr} >> 4) | {const})"


def _passes(v, swap=False):
    """(A part, B part) index pairs of one product: SPLIT_PASSES, or the operands themselves.
    swap: each pair's roles swapped (the transposed product, products.mma_abt)."""
    if not v.split:
        return [(0, 0)]
    return [(SPLIT_PARTS.index(b), SPLIT_PARTS.index(a)) if swap else (SPLIT_PARTS.index(a), SPLIT_PARTS.index(b))
            for a, b in SPLIT_PASSES]


def wg_abt(e, v, C, btile, ntiles, width, atile, wait=True, swap=False):
    """C (this warp's 16 rows x 8 ntiles) += A B^T over k = width: A = this warpgroup's 64 rows of
    the resident tile `atile` (BM rows), B = `btile` (8 ntiles rows), both K-major. split: one chain
    over SPLIT_PASSES x k-steps, part p of a tile p x (its rows x row bytes) further."""
    nk, N = width // 16, 8 * ntiles
    e(f"# wgmma: {C} += A . B^T, A = shared {atile} (this warpgroup's rows), B = shared {btile}")
    e(f"da = {wg_desc(sa(atile, 'wga'), 16)}; db = {wg_desc(btile, 16)}")
    step = lambda ks, rows: ((ks // 4) * rows * 128 + (ks % 4) * 32) >> 4  # noqa: E731
    part = lambda p, rows: (p * rows * v.row_bytes(width)) >> 4  # noqa: E731
    steps = [(part(pa, v.BM) + step(ks, v.BM), part(pb, N) + step(ks, N)) for pa, pb in _passes(v, swap) for ks in range(nk)]
    regs = [x for j in range(ntiles) for x in c_regs(C, 0, j)]
    e(f"{', '.join(regs)} = {e.chain('ss', N, steps, wait)}({', '.join(['da', 'db'] + regs)})")


def wg_wait(e, n, C, ntiles):
    """wgmma: wait until at most n issued chains are in flight; the one that completed is the one
    into C (ntiles n-tiles): its registers are handed back through ptx.wgmma_wait."""
    regs = [x for j in range(ntiles) for x in c_regs(C, 0, j)]
    e(f"{', '.join(regs)} = {e.wait(n, len(regs))}({', '.join(regs)})")


def c_to_a_split(e, A, C, nk, after=None):
    """split: C fragments -> the A fragments of the three bf16 parts ({A}h, {A}m, {A}l), one
    split3x2 per packed pair (a_pairs); after(ks) as in c_to_a."""
    e(f"# c_to_a_split: {C} -> {A}h / {A}m / {A}l (bf16 parts of the packed A fragments)")
    for ks in range(nk):
        for r, (lo, hi) in enumerate(a_pairs(C, 0, ks)):
            outs = ", ".join(f"{A}{p[0]}0_{ks}_{r}" for p in SPLIT_PARTS)
            e(f"{outs} = split3x2({lo}, {hi})")
        if after is not None:
            after(ks)


def wg_pack(e, v, A, C, nk, after=None):
    """wgmma: C fragments over nk k-steps -> the register A operands of a P B product (16-bit:
    packed pairs; split: three bf16 parts), after(ks) as in c_to_a."""
    if v.split:
        c_to_a_split(e, A, C, nk, after)
    else:
        c_to_a(e, A, C, 1, nk, after)


def wg_pb(e, v, O, A, P, btile, ntiles, nkeys, wait=True, packed=False):
    """O (16 rows x 8 ntiles) += P B: P = C fragments over `nkeys` keys (c_to_a), B = `btile`
    [key][n] (nkeys rows), MN-major. split: per pb_groups column group, a chain over SPLIT_PASSES x
    k-steps into fresh partials, then added. wait=False (not split: one chain): issued, O is read
    after wg_wait; P may change meanwhile (the chain reads the packed copy A). packed: A already
    holds P's operands (wg_pack)."""
    assert wait or not v.split, "split P B products add their partials after the chain"
    nk, width = nkeys // 16, 8 * ntiles
    if not packed:
        wg_pack(e, v, A, P, nk)
    e(f"# wgmma: {O} += {A} . B, B = shared {btile} (MN-major)")
    e(f"db = {wg_desc(btile, nkeys * 128)}")
    # register A groups: k-step ks of the i-th part the passes use is group i * nk + ks
    used = sorted({pa for pa, _ in _passes(v)})
    names = [f"{A}{SPLIT_PARTS[p][0]}" if v.split else A for p in used]
    aregs = [x for a in names for ks in range(nk) for x in a_regs(v, a, 0, ks)]
    j0 = 0
    for n in pb_groups(v, width):
        # group columns 8 j0 .. : sub-tile j0 // 8 of B (nkeys rows of 128 bytes each), 16 bytes
        # further per 8 columns inside it (the swizzle is applied to the final address)
        col = (j0 // 8) * nkeys * 128 + (j0 % 8) * 16
        steps = [(used.index(pa) * nk + ks, (pb * nkeys * v.row_bytes(width) + col + ks * 16 * 128) >> 4)
                 for pa, pb in _passes(v) for ks in range(nk)]
        tiles = range(j0, j0 + n // 8)
        partials = v.split and SPLIT_PARTIALS
        acc = f"{O}_t" if partials else O
        if partials:
            zero_c_tiles(e, acc, 1, tiles)
        regs = [x for j in tiles for x in c_regs(acc, 0, j)]
        e(f"{', '.join(regs)} = {e.chain('rs', n, steps, wait)}({', '.join(aregs + ['db'] + regs)})")
        if partials:
            for j in tiles:
                e("; ".join(f"{x} = {x} + {y}" for x, y in zip(c_regs(O, 0, j), c_regs(acc, 0, j))))
        j0 += n // 8
