"""Masking of the diagonal / tail tiles and the online softmax (running row max and sum, rescaling
of the output accumulator) on C fragments."""
from __future__ import annotations

from .modifier import CEIL
from .source import _tree


# ----------------------------------------------------------------------------- masking
def row_span(r):
    """(first, end) expressions of the block columns tile row r sees: lo + r <= c <= hi + r (the
    work row's band; schedule.py), below `cols`."""
    return f"lo + {r}", f"imin(cols, hi + {r} + 1)"


def row_limits(e, v, lim, row_base):
    """Per fragment row: its admitted columns [low{lim}, {lim}) of the block (row_span)."""
    first, end = row_span("rl")
    for m in range(v.MT):
        for h in (0, 1):
            e(f"rl = {row_base} + {16 * m + 8 * h} + g")
            e(f"{lim}{m}{h} = {end}; low{lim}{m}{h} = {first}")


def mask_rows(e, C, MT, ntiles, col0, lim):
    """C[m][j][r] = MASKED where column col0 + 8 j + 2 t + r % 2 lies outside the row's
    [low{lim}, {lim}) (rows of the C tile)."""
    e(f"# mask_rows: {C} columns outside [low{lim}, {lim}) (tail / band edges)")
    for m in range(MT):
        for j in range(ntiles):
            for r in range(4):
                x = f"{C}{m}_{j}_{r}"
                e(f"cc = {col0} + {8 * j + r % 2} + 2 * t")
                e(f"{x} = sel((cc < {lim}{m}{r // 2}) & (cc >= low{lim}{m}{r // 2}), {x}, masked)")


# ----------------------------------------------------------------------------- online softmax
def online_softmax(e, v, S, O, nt_o, rowmax=None, factors=None):
    """Running (max, sum) update in the exp2 domain; S becomes P (unnormalised); O rescaled.
    A row whose max is still MASKED has met only masked cells; its l stays 0 and its P is 0.
    rowmax: names of the rows' raw maxima already reduced over the quad (prune_gate's), by (m, h).
    Pruning's admission rule still wants a real key of every row in the first tile it visits
    (it compares against the running max). factors(m, h): O is left alone and row (m, h)'s
    rescaling factor is kept under that name for rescale() (O may be an in-flight product's
    accumulator); by default O is rescaled per m16 tile, its factors named al0 / al1. With a
    score modifier (v.mod) S holds its values unclamped: guarded_softmax."""
    if v.mod is not None:
        return guarded_softmax(e, v, S, O, nt_o, factors)
    defer = factors is not None
    factors = factors or (lambda m, h: f"al{h}")
    stem = factors(0, 0)[:-2]   # the kept factors' name without its (m, h) digits, for the comment
    e(f"# online_softmax: running max/sum of {S}, {S} -> P" + (f", factors {stem}" if defer else f", rescale {O}"))
    ad = lambda a, b: f"({a} + {b})"
    for m in range(v.MT):
        for h in (0, 1):
            cells = row_cells(v, S, m, h)
            if rowmax is None:
                row_max(e, "x", cells, "fmaxf")
            else:
                e(f"x = {rowmax[m, h]}")
            exponentiate(e, m, h, "x", cells, factors(m, h), "fmaxf")
            e(f"l{m}{h} = l{m}{h} * {factors(m, h)} + " + _tree(ad, cells))
        if not defer:
            rescale(e, v, O, nt_o, factors, [m])


def row_cells(v, S, m, h):
    """the names of this thread's cells of C-fragment row (m, h) of S."""
    return [f"{S}{m}_{j}_{r}" for j in range(v.BN // 8) for r in ((0, 1) if h == 0 else (2, 3))]


def row_max(e, x, cells, mx):
    """x = the row's max over its cells and the 4 lanes of its quad, by the binary max `mx`."""
    e(f"{x} = " + _tree(lambda a, b: f"{mx}({a}, {b})", cells))
    e(f"{x} = {mx}({x}, shfl_xor({x}, 1))")   # the 4 lanes of a quad share a row
    e(f"{x} = {mx}({x}, shfl_xor({x}, 2))")


def exponentiate(e, m, h, x, cells, factor, mx, offset=None):
    """row (m, h)'s running max from its block max `x`, its rescaling factor named `factor`, and
    its cells -> 2^(S sc - m). A row whose cells are all masked here (x == masked: a band's row
    before its first key, a tile's padding row) keeps its max; while the max is still unset
    (masked) P is exp2(masked sc) = 0 against an exponent base of 0, never exp2 of a rounding
    error. offset: the name of the row's offset R where S holds its values plus R (a score
    modifier's Split): the max and the exponent take R off, 2^(S sc - (m + R))."""
    off = "" if offset is None else f" - {offset}"
    e(f"mn = {mx}(m{m}{h}, sel({x} != masked, {x} * sc{off}, masked))")
    e(f"{factor} = ex2(m{m}{h} - mn)")
    e(f"m{m}{h} = mn")
    e("mu = sel(mn != masked, mn, zero)" + ("" if offset is None else f" + {offset}"))
    for c in cells:
        e(f"{c} = ex2({c} * sc - mu)")


def row_offset(m, h):
    """the name of row (m, h)'s Split offset (forward.modify computes it, guarded_softmax reads it)."""
    return f"ro{m}{h}"


def rescale(e, v, O, nt_o, factors, tiles=None):
    """O's rows times their factors: row (m, h) by the value named factors(m, h) (online_softmax's),
    m over `tiles` (all m16 tiles)."""
    for m in range(v.MT) if tiles is None else tiles:
        a0, a1 = factors(m, 0), factors(m, 1)
        for j in range(nt_o):
            e(f"{O}{m}_{j}_0 = {O}{m}_{j}_0 * {a0}; {O}{m}_{j}_1 = {O}{m}_{j}_1 * {a0}; "
              f"{O}{m}_{j}_2 = {O}{m}_{j}_2 * {a1}; {O}{m}_{j}_3 = {O}{m}_{j}_3 * {a1}")


def guarded_softmax(e, v, S, O, nt_o, factors):
    """online_softmax for a score modifier's values left unclamped by the cells: the clamp to
    [MASKED, CEIL] (only the floor with a Fold: its value is bounded above) is taken on the rare
    blocks that need it, not on every cell. max.f32 passes over a NaN, so the rows' maxima are
    those of the real values; a warp whose maxima exceed the ceiling (an infinite or huge value)
    clamps its cells and takes the maxima again, and a warp one of whose weights is NaN (a NaN
    value: 2^NaN) makes those weights 0 (a masked edge). A value below MASKED needs nothing: its
    weight is 0 against any real row max, and a row whose every value is at most MASKED keeps the
    running max at MASKED (its weights 2^(value - 0) are 0), as if it were clamped. m, l and P are
    then those of the clamped values, and the cells lose the max and min of the clamp (the max
    with a Fold). The maxima are taken with clamps.atleast (max.f32 by inline PTX), not fmaxf,
    whose NaN handling is the compiler's choice. The warp-level votes keep both branches uniform
    within a warp. With a Split, S holds the values plus the rows' offsets (row_offset)."""
    e.uses_clamps()
    defer = factors is not None
    factors = factors or (lambda m, h: f"al{m}{h}")   # every row's, kept to the end (rescale)
    e(f"# guarded online_softmax: {S} unclamped -> P")
    ad = lambda a, b: f"({a} + {b})"  # noqa: E731
    ceiling = CEIL if v.mod.fold is None else None
    rows = [(m, h) for m in range(v.MT) for h in (0, 1)]

    def maxima():   # atleast: max.f32, the other operand of a NaN
        for m, h in rows:
            row_max(e, f"x{m}{h}", row_cells(v, S, m, h), "atleast")

    def any_of(conds):
        return f"cuda.any_sync(0xFFFFFFFF, u32({' | '.join(conds)})) != 0"

    maxima()
    if ceiling is not None:
        e("if " + any_of(f"(x{m}{h} > f32({ceiling!r}))" for m, h in rows) + ":")
        with e.indent():   # an infinite or huge value in this warp: the clamp, then the maxima again
            for m, h in rows:
                for c in row_cells(v, S, m, h):
                    e(f"{c} = clampf({c}, masked, f32({ceiling!r}))")
            maxima()
    for m, h in rows:
        cells = row_cells(v, S, m, h)
        # x is NaN where every value of the row is: atleast keeps the running max
        exponentiate(e, m, h, f"x{m}{h}", cells, factors(m, h), "atleast",
                     row_offset(m, h) if v.mod.split is not None else None)
        e(f"ps{m}{h} = " + _tree(ad, cells))
    e("if " + any_of(f"(ps{m}{h} != ps{m}{h})" for m, h in rows) + ":")
    with e.indent():   # a NaN value in this warp: its weight (NaN) becomes 0
        for m, h in rows:
            cells = row_cells(v, S, m, h)
            for c in cells:
                e(f"{c} = sel({c} == {c}, {c}, zero)")
            e(f"ps{m}{h} = " + _tree(ad, cells))
    for m, h in rows:
        e(f"l{m}{h} = l{m}{h} * {factors(m, h)} + ps{m}{h}")
    if not defer:
        rescale(e, v, O, nt_o, factors)
