"""Score modifiers in the tensor-core kernels: f(z) and df/dz of every score cell, inline.

A modifier (tiga_numba.score_mod tree) is written into the kernel text once per C-fragment cell
of S, from the same source generator as the CPU and CUDA-core kernels (score_source), with a
branch-free target: `sel` for every choice, per-call values read through raw pointers.

Units. The unmodified kernels exponentiate `s * sc` with sc = scale log2(e). A modified kernel
takes the natural score z = s * msc (msc = scale), replaces the cell by y = f(z) log2(e) (base-2
units) and is launched with sc = 1, so the softmax, the stats (m is the row max of f) and the
backward's `y * sc - m2` are the unmodified text, and `y * 1 - m2` is exact: the fma that the
compiler makes of it cannot turn the rounding of a huge y * sc into a huge exponent. The
backward also takes df/dz: dS_z = P (dP - Delta) f'(z), and dQ / dK keep their `scale` factor
(dz/dq = scale k).

Masked cells keep MASKED. A real cell's y is clamped to [-1e29, 1e30] (NaN -> -1e29): above
MASKED, so a row whose every real score is "-inf" (clamped) gets the same uniform softmax the
float64 oracle gives on its clamped values, and masked cells stay at weight 0.

Per-call values (cuda/score_codegen.pack): mvp -> scalars then per-head params (k * H + h),
mndp -> dst fields (Nq, n_dst, H), mnsp -> src fields (Nk, n_src, H), float32. Scalars and the
head's params are loaded once per kernel (per head in the dK/dV kernel's head loop); node fields
per cell, at row / column indices clamped into the block (tail cells are masked anyway).

Not here (the registry sends these to the CUDA-core kernels): gradients of the modifier's fields
and params, per-edge fields (CSR only), tile pruning, the fused dK/dV/dQ kernel.
"""
from __future__ import annotations

import hashlib

from .... import score_source
from .... import score_mod as sm
from .variant import LOG2E

#: floor of a real cell's modified score (above the masked value, see the module text)
FLOOR = -1.0e29
CEIL = 1.0e30


class _Target(score_source.Target):
    score = "mz"
    temp = "mt"
    tanh = "math.tanh"
    exp = "math.exp"

    def __init__(self, layout):
        self.n_sc = len(layout.scalars)
        self.n_dst = len(layout.dst)
        self.n_src = len(layout.src)

    def select(self, cond, a, b):
        return f"sel({cond}, {a}, {b})"

    def leaf(self, x, slot):
        if x.op == "scalar":
            return f"mks{slot}"
        if x.op == "head":
            return f"mkh{slot}"
        if x.op == "node":
            if x.attr[0] == "dst":
                return f"ldg_f32_if(u32(1), mndp + ((mi * {self.n_dst} + {slot}) * mh + mhd) * 4)"
            return f"ldg_f32_if(u32(1), mnsp + ((mj * {self.n_src} + {slot}) * mh + mhd) * 4)"
        raise NotImplementedError("per-edge fields need a CSR relation (CUDA-core kernels)")

    def index(self, role):
        return "f32(mi)" if role == "dst" else "f32(mj)"


class Modifier:
    """One tree's inline text for the tensor-core kernels. Equal trees are equal modifiers (the
    Variant, and so the kernel name and its cubin, is keyed on `digest`)."""

    def __init__(self, tree):
        self.tree = tree
        self.layout = sm.Layout(tree)
        if self.layout.edges:
            raise NotImplementedError("per-edge fields need a CSR relation (CUDA-core kernels)")
        self.dtree = sm.diff(tree, sm.SCORE)
        self._src = score_source.Source(tree, (), _Target(self.layout))
        self._lines, num = self._src._emit([tree, self.dtree])
        self._value, self._deriv = num(tree), num(self.dtree)
        text = "\n".join(self._lines) + self._value + self._deriv + repr(sorted(self._src.consts.items()))
        self.digest = hashlib.sha1(text.encode()).hexdigest()[:12]

    def __eq__(self, other):
        return isinstance(other, Modifier) and other.tree == self.tree

    def __hash__(self):
        return hash(("tc-modifier", self.tree))

    def __repr__(self):
        return f"Modifier({self.tree})"

    # ------------------------------------------------------------------ emitters
    def prelude(self, e):
        """module-level constants of the text (typed float32 globals: compile-time constants)."""
        if "_dt = f32" not in e.prelude:
            e.prelude.append("_dt = f32")
            for value, name in self._src.consts.items():
                e.prelude.append(f"{name} = f32({_finite(value)!r})")

    def params(self, e, head):
        """load the scalars and the per-head params of query head `head` (a name)."""
        e(f"mhd = {head}")
        for k in range(len(self.layout.scalars)):
            e(f"mks{k} = ldg_f32_if(u32(1), mvp + {4 * k})")
        n_sc = len(self.layout.scalars)
        for k in range(len(self.layout.heads)):
            e(f"mkh{k} = ldg_f32_if(u32(1), mvp + ({n_sc} + {k} * mh + mhd) * 4)")

    def cell(self, e, x, i, j, y, d=None, masked=True):
        """y = f(z) log2(e) (clamped; with `masked`, MASKED where x is MASKED) and, with d,
        d = f'(z), for the raw score x (a name) of the cell at global destination i / source j
        (expressions). math.tanh is libdevice's: a hand-written exp2 / division tanh for the
        16-bit kernels made the soft-cap forward slower on the H200 (5.3 ms against 3.8 ms,
        benchmarks/results/gpu-h200-2026-12-02d.txt), so there is one flavour."""
        # positions as 32-bit integers (the dispatcher keeps them below 2^31): the float
        # conversion of an index is then one cvt.f32.u32, not the slow 64-bit one
        e(f"mi = u32({i}); mj = u32({j}); mz = {x} * msc")
        for line in self._lines:
            e(line.strip())
        e(f"mf = ({self._value}) * f32({LOG2E!r})")
        e(f"mf = sel(mf > f32({FLOOR!r}), mf, f32({FLOOR!r}))")
        clamped = f"sel(mf < f32({CEIL!r}), mf, f32({CEIL!r}))"
        e(f"{y} = sel({x} != masked, {clamped}, masked)" if masked else f"{y} = {clamped}")
        if d is not None:
            e(f"{d} = {self._deriv}")


def _finite(value):
    """a constant as the fast-math kernels can hold it: +-inf -> +-3e38 and NaN -> -3e38 (both
    clamp like the infinity: a real cell's f ends in [FLOOR, CEIL])."""
    value = float(value)
    if value != value:
        return -3.0e38
    return max(-3.0e38, min(3.0e38, value))


def cell_row(m, r):
    """global position of C-fragment cell (m, ., r)'s row (fragment rows are the tile's rows:
    queries in the forward / dQ kernels, keys in dK/dV), clamped into the block."""
    return f"row0 + imin(wrow + {16 * m + 8 * (r // 2)} + g, rows - 1)"


def cell_col(base, j, r):
    """global position of C-fragment cell (., j, r)'s column in the streamed block starting at
    block-local `base`, clamped into the block."""
    return f"col0 + imin({base} + {8 * j + r % 2} + 2 * t, cols - 1)"


def tag(mod):
    return "" if mod is None else f"_m{mod.digest}"


#: the extra kernel arguments of a modified kernel
ARGS = "msc, mh, mvp, mndp, mnsp"
