"""Masking of the diagonal / tail tiles and the online softmax (running row max and sum, rescaling
of the output accumulator) on C fragments."""
from __future__ import annotations

from .source import _tree


# ----------------------------------------------------------------------------- masking
def row_limits(e, v, lim, row_base):
    """Per fragment row: number of admitted columns. Non-causal: all `cols` of the block;
    causal: columns j_local <= i_local, i.e. < diag + row + 1 (diag = local index of row 0)."""
    for m in range(v.MT):
        for h in (0, 1):
            e(f"rl = {row_base} + {16 * m + 8 * h} + g")
            e(f"{lim}{m}{h} = sel(causal != 0, imin(cols, diag + rl + 1), cols)")


def mask_rows(e, C, MT, ntiles, col0, lim):
    """C[m][j][r] = MASKED where column col0 + 8 j + 2 t + r % 2 >= the row's limit (rows of the C tile)."""
    e(f"# mask_rows: {C} columns >= {lim} (tail / causal diagonal)")
    for m in range(MT):
        for j in range(ntiles):
            for r in range(4):
                x = f"{C}{m}_{j}_{r}"
                e(f"{x} = sel({col0} + {8 * j + r % 2} + 2 * t < {lim}{m}{r // 2}, {x}, masked)")


# ----------------------------------------------------------------------------- online softmax
def online_softmax(e, v, S, O, nt_o, rowmax=None):
    """Running (max, sum) update in the exp2 domain; S becomes P (unnormalised); O rescaled.
    A row whose max is still MASKED only meets masked tiles; its l stays 0 and nothing is read.
    rowmax: names of the rows' raw maxima already reduced over the quad (prune_gate's), by (m, h).
    Every visiting order must give each row a real key in its first tile: on an all-masked first
    tile the running max would become MASKED * sc and, with FMA contraction, exp2 of the rounding
    error of MASKED * sc could overflow."""
    e(f"# online_softmax: running max/sum of {S}, {S} -> P, rescale {O}")
    mx = lambda a, b: f"fmaxf({a}, {b})"
    ad = lambda a, b: f"({a} + {b})"
    nt = v.BN // 8
    for m in range(v.MT):
        for h in (0, 1):
            rs = (0, 1) if h == 0 else (2, 3)
            if rowmax is None:
                e("x = " + _tree(mx, [f"{S}{m}_{j}_{r}" for j in range(nt) for r in rs]))
                e("x = fmaxf(x, shfl_xor(x, 1))")   # the 4 lanes of a quad share a row
                e("x = fmaxf(x, shfl_xor(x, 2))")
            else:
                e(f"x = {rowmax[m, h]}")
            e(f"mn = fmaxf(m{m}{h}, x * sc)")
            e(f"al{h} = ex2(m{m}{h} - mn)")
            e(f"m{m}{h} = mn")
            for j in range(nt):
                for r in rs:
                    e(f"{S}{m}_{j}_{r} = ex2({S}{m}_{j}_{r} * sc - mn)")
            e(f"l{m}{h} = l{m}{h} * al{h} + " + _tree(ad, [f"{S}{m}_{j}_{r}" for j in range(nt) for r in rs]))
        for j in range(nt_o):
            e(f"{O}{m}_{j}_0 = {O}{m}_{j}_0 * al0; {O}{m}_{j}_1 = {O}{m}_{j}_1 * al0; "
              f"{O}{m}_{j}_2 = {O}{m}_{j}_2 * al1; {O}{m}_{j}_3 = {O}{m}_{j}_3 * al1")
