"""mma.sync register fragments: zeroing C tiles, A operands from shared memory (ldmatrix) or from C
fragments (c_to_a), the tf32 big/small split, and one mma.sync instruction per fragment triple."""
from __future__ import annotations

from .shared import sa
from .variant import TF32_PASSES


# ----------------------------------------------------------------------------- fragments
def zero_c(e, name, MT, ntiles):
    for m in range(MT):
        for j in range(ntiles):
            e("; ".join(f"{name}{m}_{j}_{r} = zero" for r in range(4)))


def zero_c_tiles(e, name, MT, tiles):
    for m in range(MT):
        for j in tiles:
            e("; ".join(f"{name}{m}_{j}_{r} = zero" for r in range(4)))


def a_regs(v, A, m, ks):
    """register names of one A fragment: 4 packed x2 words, or (tf32) 4 big + 4 small halves."""
    return [f"{A}{m}_{ks}_{r}" for r in range(8 if v.tf32 else 4)]


def split_tf32(e, v, regs):
    """tf32: in-place split of raw fp32 words r -> (r big, r + 's' small); 16-bit: nothing."""
    if v.tf32:
        for x in regs:
            e(f"{x}, {x}s = tf32x2({x})")


def ldsm_a(e, v, A, m, ks, addr):
    """one A fragment from shared memory (ldmatrix; tf32: split into halves 0-3 big, 4-7 small)."""
    regs = a_regs(v, A, m, ks)
    e(f"{', '.join(regs[:4])} = ldsm_x4({addr})")
    if v.tf32:
        e("; ".join(f"{regs[r]}, {regs[r + 4]} = tf32x2({regs[r]})" for r in range(4)))


def mma(e, v, C, a, b, swap=False):
    """C += A B for one m16 x n8 tile: a = a_regs(), b = [b0, b1] (tf32: their halves are b0, b0s, ...).
    swap (tf32): the TF32_PASSES with the (A, B) halves' roles swapped (products.mma_abt)."""
    c = ", ".join(C)
    if not v.tf32:
        e(f"{c} = mma16816({', '.join(a)}, {', '.join(b)}, {c})")
        return
    half_a = dict(big=a[:4], small=a[4:])
    half_b = dict(big=b, small=[x + "s" for x in b])
    for ha, hb in TF32_PASSES:
        if swap:
            ha, hb = hb, ha
        e(f"{c} = mma1688({', '.join(half_a[ha])}, {', '.join(half_b[hb])}, {c})")


def c_regs(C, m, j):
    return [f"{C}{m}_{j}_{r}" for r in range(4)]


def load_a(e, v, name, smem, row0, MT, ksteps, rs):
    """A fragments (16 rows x one k-step) of m-tiles starting at local row `row0` + 16 m."""
    for m in range(MT):
        for ks in range(ksteps):
            ldsm_a(e, v, name, m, ks, sa(smem, f"u32({row0} * {rs})", f"xa{rs}_{ks}", 16 * m * rs))


def a_pairs(C, m, ks):
    """FA2 register reuse: C fragments of n-tiles 2k, 2k+1 are exactly the A fragment of k-step k;
    A register r of k-step ks packs this pair of C values (low half first)."""
    return [(f"{C}{m}_{j}_{c}", f"{C}{m}_{j}_{c + 1}") for j in (2 * ks, 2 * ks + 1) for c in (0, 2)]


def c_to_a(e, A, C, MT, ksteps, after=None):
    """C fragments -> packed 16-bit A fragments (a_pairs), two registers a line; after(ks) (MT = 1)
    is emitted once k-step ks is packed: C tiles 2 ks, 2 ks + 1 may be overwritten from there on."""
    e(f"# c_to_a: {C} (f32 C fragments) -> {A} (packed A fragments)")
    for m in range(MT):
        for ks in range(ksteps):
            packed = [f"{A}{m}_{ks}_{r} = pack2({lo}, {hi})" for r, (lo, hi) in enumerate(a_pairs(C, m, ks))]
            e("; ".join(packed[:2]))
            e("; ".join(packed[2:]))
            if after is not None:
                after(ks)


def c_to_a_tf32(e, A, C, m, j):
    """tf32 register reuse: C tile j is the A fragment of k-step j with keys permuted
    (a0..a3 = c0, c2, c1, c3: key 2t is k t, key 2t + 1 is k t + 4), split into halves."""
    for r, src in enumerate((0, 2, 1, 3)):
        e(f"{A}{m}_{j}_{r}, {A}{m}_{j}_{r + 4} = tf32x2({C}{m}_{j}_{src})")
