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
(dz/dq = scale k). Where y = K g with K cell-invariant and g bounded (a soft-cap), the kernel
computes g and sets sc = K instead (Fold): the softmax's fma does the multiply, as for raw scores
in the unmodified kernels, and a bounded g needs only the clamp's floor.

Lowering. The tree is rewritten before any text is written (`lower`): the score leaf becomes the
raw product times `msc`, the value is multiplied by log2(e), and every chain of products and
quotients is regrouped as (one factor that no cell changes) x (the cell's own factors), a
quotient by such a factor turned into a product with its reciprocal; a factor over a sum, a
`where`, a minimum / maximum or a leaky_relu is pushed into its terms. The cell-invariant
subtrees (constants, scalars, the head's params and what is built from them only) are then
computed once per kernel (per head in the dK/dV loop), so a soft-cap cell is one multiply, the
tanh and one multiply (it was three multiplies, a division and the tanh; how tanh itself is
taken: TANH) and an ALiBi cell one multiply and one fma around the distance. What depends on
one position only (a node field, an index and what is built from them: ALiBi's
dst.index + shift) is computed by the first
cell of its fragment row or column and named for the others (`staged`; a kernel text emits its
cells in one straight-line region per loop body, which is what makes the first cell's name
visible to the rest): a node field is then loaded once per row, not once per cell.

Masked cells keep MASKED: the relation's mask is applied after the modifier (forward) or to P
and dS after the cell (backward), so a cell never tests for it. A real cell's y is clamped to
[MASKED, 1e30] (with a Fold its bounded g has only the floor): a value that is NaN, -inf or at
most MASKED (max.f32 gives the bound for a NaN) becomes MASKED, so the edge is masked as on the CPU
and the CUDA cores, and a row whose every edge the modifier masks is an empty row (the online
softmax keeps l = 0 for a row that has met only masked cells: output 0, m = -inf). The forward's
cells leave y unclamped (cell(clamp=False)) and its softmax takes the same clamp where a block
needs it (softmax.guarded_softmax: warp votes on a row max above the ceiling and on a NaN
weight). Where the clamp
holds y constant f' is 0 (a two-sided test of y); with a Fold whose f' has a static bound B (the
soft-cap's 1 - tanh^2) a held cell is a NaN cell whose P is 0 anyway, and one max.f32 taking f' to
at least -B keeps its dS 0 (a NaN f' would make P f' NaN).

Per-call values (cuda/score_codegen.pack): mvp -> scalars then per-head params (k * H + h),
mndp -> dst fields (Nq, n_dst, H), mnsp -> src fields (Nk, n_src, H), float32. Scalars and the
head's params are loaded once per kernel (per head in the dK/dV kernel's head loop); node fields
once per fragment row / column (`staged`), at positions clamped into the block (tail cells are
masked anyway).

Not here (the registry sends these to the CUDA-core kernels): gradients of the modifier's fields
and params, per-edge fields (CSR only), tile pruning, the fused dK/dV/dQ kernel.
"""
from __future__ import annotations

import hashlib

from .... import score_source
from .... import score_mod as sm
from .variant import LOG2E, MASKED

#: the ceiling of a cell's modified score (its floor is MASKED: a value below masks the edge)
CEIL = 1.0e30


class _Target(score_source.Target):
    score = "mz"
    temp = "mt"
    tanh = "math.tanh"
    exp = "math.exp"
    exp2 = "ex2"

    def __init__(self, layout, temp="mt"):
        self.layout = layout
        self.temp = temp
        self.n_sc = len(layout.scalars)
        self.n_dst = len(layout.dst)
        self.n_src = len(layout.src)

    def select(self, cond, a, b):
        return f"sel({cond}, {a}, {b})"

    def leaf(self, x, slot):
        if x.op == "scalar" and x.attr.startswith("__"):   # the lowering's own leaves
            return x.attr[2:]   # a name, or an @role k@ placeholder that cell() fills in
        slot = self.layout.slot[x]   # the packed layout is the original tree's
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
        return "mif" if role == "dst" else "mjf"


class Modifier:
    """One tree's inline text for the tensor-core kernels. Equal trees lowered alike are equal
    modifiers (the Variant, and so the kernel name and its cubin, is keyed on `digest`)."""

    def __init__(self, tree, tanh="exp2", fold=True, ordered=False):
        if tanh not in ("exp2", "hardware"):
            raise ValueError(f"tanh must be 'exp2' or 'hardware', got {tanh!r}")
        self.tree = tree
        self.tanh = tanh
        self.layout = sm.Layout(tree)
        if self.layout.edges:
            raise NotImplementedError("per-edge fields need a CSR relation (CUDA-core kernels)")
        self.dtree = sm.diff(tree, sm.SCORE)
        #: the distances P - src.index the tree takes |.| of (ALiBi's); with `ordered` (the
        #: caller checked P >= src.index on every edge: api.ordered) they are taken signed
        #: (ordered_tree) and split (Split)
        self.distances = distances(tree)

        def lowered(t):   # (y, f', hoisted, Fold or None) of tree t
            (y, dy), hoist = lower(t, self.dtree, tanh)
            return y, dy, hoist, (Fold.of(y, hoist) if fold else None)
        #: Fold (or None): the value's positive factor taken by the exponent scale (see Fold);
        #: Split (or None): the value's distance terms taken apart into a column term in the
        #: cells and a row offset per key block (the forward only; see Split)
        self.split = None
        if ordered and self.distances:
            value, deriv, hoisted, self.fold = lowered(ordered_tree(tree))
            self.split = Split.of(value) if self.fold is None else None
        if self.split is None:   # not ordered, or nothing to split: the tree as written
            value, deriv, hoisted, self.fold = lowered(tree)
        value = self.split.cell if self.split else self.fold.rest if self.fold else value
        # the cell-invariant subtrees (params()), then the cell's text (cell()); one constant table
        self._src = score_source.Source(tree, (), _Target(self.layout))
        hsrc = score_source.Source(tree, (), _Target(self.layout, temp="mq"))
        hsrc.consts = self._src.consts
        self._hoisted, hnum = hsrc._emit(list(hoisted))
        self._hoisted += [f"{leaf.attr[2:]} = {hnum(x)}" for x, leaf in hoisted.items()]
        (value, deriv), stages = staged([value, deriv])
        self._stages = {}   # role -> (lines, [placeholder, expression text]) per position
        for role, group in stages.items():
            ssrc = score_source.Source(tree, (), _Target(self.layout, temp="mpX"))
            ssrc.consts = self._src.consts
            lines, snum = ssrc._emit(list(group))
            self._stages[role] = (lines, [(f"@{leaf.attr[3:]}", snum(x)) for x, leaf in group.items()])
        self._lines, num = self._src._emit([value, deriv])
        self._value, self._deriv = num(value), num(deriv)
        self._row = self._coef = ([], "")   # Split's row offset and column coefficient: lines, value
        if self.split is not None:
            for attr, x, temp in (("_row", self.split.row, "mr"), ("_coef", self.split.coef, "mc")):
                xsrc = score_source.Source(tree, (), _Target(self.layout, temp=temp))
                xsrc.consts = self._src.consts
                lines, xnum = xsrc._emit([x])
                setattr(self, attr, (lines, xnum(x)))
        #: with a Fold, a static bound B on f'(z) (None: none): cell() then takes NaN to -B by one
        #: max.f32 instead of testing the value (only a NaN value reaches a folded value's floor)
        self.deriv_bound = _bound(deriv) if self.fold is not None else None
        #: f'(z) is a constant (ALiBi's 1): never NaN, so only the ceiling needs a test (cell())
        self.deriv_const = deriv.op == "const"
        text = ("\n".join(self._hoisted + self._lines) + self._value + self._deriv + repr(self._stages)
                + repr(sorted(self._src.consts.items())) + (self.fold.text if self.fold else "")
                + (repr((self._row, self._coef)) if self.split else ""))
        self.digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        #: explain()'s words for the tanh this text takes ("" when the tree has none)
        self.tanh_words = TANH_WORDS[tanh] if any(x.op == "tanh" for x in sm.walk(tree)) else ""
        #: explain()'s words for the fold ("" without one)
        self.fold_words = (f"; folded: f log2(e) = K g with K = {self.fold.factor} taken as the exponent scale "
                           f"(|g| <= {self.fold.bound:g}: one max.f32 clamp)" if self.fold else "")
        #: explain()'s words for the split ("" without one)
        self.split_words = ("; the relation keeps every source at or before its destination's position, so "
                            + ", ".join(f"|{d}|" for d in self.distances) + " is taken as the signed distance, "
                            "a column term per key and a row offset per key block (forward kernel)"
                            if self.split else "")

    def __eq__(self, other):   # the digest: the same tree lowered with another TANH differs
        return isinstance(other, Modifier) and other.tree == self.tree and other.digest == self.digest

    def __hash__(self):
        return hash(("tc-modifier", self.tree, self.digest))

    def __repr__(self):
        return f"Modifier({self.tree})"

    # ------------------------------------------------------------------ emitters
    def prelude(self, e):
        """module-level constants of the text (typed float32 globals: compile-time constants)."""
        if self.fold is not None:
            e.uses_clamps()
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
        for line in self._hoisted:   # the cell-invariant subtrees (lower())
            e(line.strip())
        if self.fold is not None:   # the kernel's exponent scale becomes the value's factor
            e(f"sc = {self.fold.text}")
        if self.split is not None:   # the column term's coefficient, and the thread's part of it
            lines, value = self._coef
            for line in lines:
                e(line.strip())
            e(f"mcc = {value}; mct = mcc * {cell_col('kb', 0, 0).rel[0]}")

    def cell(self, e, x, i, j, y, d=None, clamp=True):
        """y = f(z) log2(e) (clamped) and, with d, d = f'(z), for the raw score x (a name) of the
        cell at global destination i / source j (Positions). The text is lower()'s: invariant
        factors were computed by params(). Masked cells are the caller's: the forward masks the
        modified block (a masked cell's y is then MASKED whatever f made of it), the backward makes
        their P and dS 0 after the cell (so y and d of a masked cell are never read). clamp=False
        (the forward): y is left unclamped, for softmax.guarded_softmax to clamp where needed."""
        # positions as 32-bit integers (the dispatcher keeps them below 2^31): the float
        # conversion of an index is then one cvt.f32.u32, not the slow 64-bit one
        e(f"mi = u32({i.index}); mj = u32({j.index}); mif = {i.value}; mjf = {j.value}; mz = {x}")
        names = {}
        memo = e.named
        for role, pos in (("dst", i), ("src", j)):
            lines, outs = self._stages[role]
            if not outs:
                continue
            got = memo.get((role, pos.index))
            if got is None:   # the first cell at this position computes its values
                n = len(memo)
                for line in lines:
                    e(line.strip().replace("mpX", f"mp{n}_"))
                got = memo[role, pos.index] = {ph: text.replace("mpX", f"mp{n}_") for ph, text in outs}
            names.update(got)
        if self.split is not None:   # the column term K (j - j0) = K (2 t) + K c: one fma a column
            key = ("column term", j.index)
            got = memo.get(key)
            if got is None:
                got = memo[key] = f"mc{len(memo)}_"
                e(f"{got} = mcc * {j.rel[1]} + mct")
            names["@col@"] = got

        def fill(text):
            for ph, name in names.items():
                text = text.replace(ph, name)
            return text
        for line in self._lines:
            e(fill(line.strip()))
        e(f"mf = {fill(self._value)}")
        if self.fold is None:
            clamped = f"clampf(mf, f32({MASKED!r}), f32({CEIL!r}))"
            inside = f"(mf > f32({MASKED!r})) & (mf < f32({CEIL!r}))"
        else:   # a bounded value: only a NaN reaches the floor (Fold)
            clamped = f"atleast(mf, f32({MASKED!r}))"
            inside = f"mf > f32({MASKED!r})"
        e(f"{y} = {clamped}" if clamp else f"{y} = mf")
        if d is None:
            return
        if self.deriv_const:
            # a finite f' times the P = 0 of a cell held at the floor is 0: only the ceiling, where
            # P is not 0, needs f' = 0 (a Fold has no ceiling)
            e(f"{d} = sel(mf < f32({CEIL!r}), {fill(self._deriv)}, f32(0.0))" if self.fold is None
              else f"{d} = {fill(self._deriv)}")
            return
        if self.deriv_bound is not None:
            # folded (no ceiling) and |f'| <= B: a cell the floor holds is a NaN cell, whose P is 0;
            # its f' (NaN too) only has to be finite for P (dP - Delta) f' to be 0, and max.f32
            # makes it -B (any finite f' is left as it is)
            e(f"{d} = atleast({fill(self._deriv)}, f32({-self.deriv_bound!r}))")
            return
        # where the clamp holds y constant (a NaN or -inf value: the cell is masked; beyond the
        # ceiling) f' is 0: P = 0 times a NaN f' (sqrt of a negative score) would make dS NaN
        e(f"{d} = sel({inside}, {fill(self._deriv)}, f32(0.0))")


    def row_offset(self, e, i, name, first):
        """`name` = the Split's row offset R of the destination at position i (a Position) for the
        key block whose first global column is `first` (an integer expression): the cells of
        that block hold y + R (Split)."""
        e(f"mi = u32({i.index}); mif = {i.value}; mj0 = f32(u32({first}))")
        lines, value = self._row
        for line in lines:
            e(line.strip())
        e(f"{name} = {value}")


class Fold:
    """A value y = K g whose factor K is cell-invariant and whose rest g is bounded, |g| <= B on
    every input (a soft-cap: K = c log2(e), g = tanh(z / c), B = 1). The kernel then computes g
    per cell and takes K as its exponent scale (`sc = K`, set by Modifier.params): the softmax's
    own fma, 2^(g sc - m), does the multiply that y = K g took per cell, as the unmodified kernels
    scale raw scores, and the row max, the stats and the backward's P are the same text in the
    same (y) units. A bounded g needs no ceiling: the clamp is one max.f32 (clamps.atleast), which
    still maps a NaN to MASKED (the cell is masked, as without the fold).

    It holds for a call (`holds`) where 2^-20 <= K and K B <= FOLD_LIMIT: K > 0 keeps the row max
    of g the row max of y, K >= 2^-20 keeps a masked cell's K MASKED below -1e23 (its P is 0),
    and K B <= 2^16 keeps the fma's rounding of the largest y (up to ulp(K B) / 2 = 2^-8 in the
    exponent) at the size of y's own float32 rounding. K is evaluated on the host from the call's
    scalars and the score scale, so a K made from per-head params is not folded (nor, by the
    caller, tc/api._modifier_for, one whose scalars are device arrays). A call outside the range
    takes the kernel without the fold (Modifier(..., fold=False))."""

    def __init__(self, factor, rest, bound, text):
        self.factor = factor   # K as a tree of constants, scalars and MSC
        self.rest = rest       # g, the value the kernel computes per cell
        self.bound = bound     # B
        self.text = text       # K in the kernel text: a hoisted name or a constant
        #: the call's scalars K is made of (the score scale MSC aside), in first-use order
        self.scalars = tuple(x for x in sm.leaves(factor, "scalar") if x != MSC)

    @classmethod
    def of(cls, value, hoisted):
        """the Fold of a lowered value (lower()'s y and hoisted map), or None."""
        if value.op != "mul":
            return None
        names = {leaf: x for x, leaf in hoisted.items()}
        for k, g in (value.args, value.args[::-1]):
            if k not in names and k.op != "const":
                continue   # a cell's own factor
            factor = names.get(k, k)
            if not all(x.op in ("const", "scalar") for x in sm.leaves(factor)):
                continue   # a per-head param in K (no host value to check)
            bound = _bound(g)
            if bound is None:
                continue
            text = k.attr[2:] if k in names else f"f32({_finite(k.attr)!r})"
            return cls(factor, g, bound, text)
        return None

    def holds(self, values, scale):
        """whether K = factor(values, scale) lies in [2^-20, FOLD_LIMIT / B]; `values` maps each of
        `scalars` to a host number."""
        env = {x: values[x] for x in self.scalars}
        env[MSC] = float(scale)
        K = float(sm.evaluate(self.factor, env))
        return 2.0 ** -20 <= K and K * self.bound <= FOLD_LIMIT


#: the largest K B a fold takes (Fold)
FOLD_LIMIT = 2.0 ** 16


#: Split's column term in a cell's value (a lowering leaf: the name cell() gives its column's)
COLUMN_TERM = sm.Expr("scalar", (), "__@col@")
#: the key block's first column (Split's row offset; a lowering leaf, named mj0 in the text)
FIRST_COL = sm.Expr("scalar", (), "__mj0")
_SRC = sm.Expr("index", (), "src")


def distances(tree):
    """the distances P - src.index that `tree` takes the absolute value of, P a function of the
    destination's position and the package's bottom-right shift only (ALiBi's dst.index +
    dst._alibi_shift - src.index: SHIFT), in first-use order."""
    out = []
    for x in sm.walk(tree):
        if x.op == "abs" and _is_distance(x.args[0]) and x.args[0] not in out:
            out.append(x.args[0])
    return tuple(out)


#: the one node field a distance's P may hold: the bottom-right shift the package derives from the
#: relation (functional._alibi_shift, cached per graph), never a user's array, which the host
#: would have to read on every call and which could change in place between calls
SHIFT = sm.Expr("node", (), ("dst", "_alibi_shift"))


def _is_distance(d):
    return (d.op == "sub" and d.args[1] == _SRC
            and all(x.op == "const" or x == SHIFT or (x.op == "index" and x.attr == "dst")
                    for x in sm.leaves(d.args[0])))


def ordered_tree(tree):
    """`tree` with |P - src.index| written as P - src.index for each of its distances(): equal to
    it on every edge of a relation where P >= src.index (api.ordered checks the call's)."""
    return sm.substitute(tree, {sm.Expr("abs", (d,)): d for d in distances(tree)})


class Split:
    """A lowered value y = rest + sum_t c_t (P_t - j) whose distance terms (c_t cell-invariant,
    P_t a destination position such as ALiBi's i + shift, j the source's position) are split at
    the key block's first column j0: c (P - j) = c (P - j0) - c (j - j0). The cells compute
    y + R = rest + K (j - j0) with K = -sum c_t (`coef`; |.| needs the relation's order:
    ordered_tree): the column term is one fma per column position and key block (j - j0 is the
    thread's 2 t plus the cell's constant: K (2 t) is computed once per kernel), and an ALiBi
    cell is one fma on the score where it took a subtraction, a multiply and an fma around
    |i - j|. The row offset R = -sum c_t (P_t - j0) (`row`) is computed once per row and key
    block: the online softmax takes the row max of y + R less R and exponentiates
    (y + R) - (m + R), so the running max, the stats and P are those of y. j - j0 and P - j0 are
    exact integers in float32 and both terms stay near the size of the block (not of the
    sequence) where the weights are large, so y loses nothing to the split while positions stay
    below 2^24 (api.ordered checks it: float32 holds them exactly); the clamp of y + R to
    [MASKED, CEIL] is that of y (R is far below either bound's rounding). The backward kernels
    compute y as it is written (Modifier without `ordered`): the stored m, (x + R) - R, may differ
    from their row max by an ulp of m (P at the max 2^(+-ulp)), as any recomputation may."""

    def __init__(self, cell, coef, row):
        self.cell = cell   # y + R: the rest plus COLUMN_TERM
        self.coef = coef   # K, cell-invariant: the column term is K (j - j0)
        self.row = row     # R, a tree of the destination's position and FIRST_COL

    @classmethod
    def of(cls, value):
        """the Split of a lowered value, or None where it has no distance term or nothing else."""
        terms = []
        _signed_terms(value, 1, terms)
        rest, parts = [], []
        for sign, t in terms:
            got = _distance_term(t)
            if got is None:
                rest.append((sign, t))
            else:
                parts.append((sign,) + got)
        if not parts or not any(sm.SCORE in sm.walk(t) for _, t in rest):
            return None   # nothing to split, or no cell term (a gather: the CUDA cores' anyway)
        cell = _signed_sum(rest + [(1, COLUMN_TERM)])
        coef = _signed_sum([(-sign, c) for sign, c, P in parts])
        row = _signed_sum([(-sign, sm.make("mul", c, sm.make("sub", P, FIRST_COL))) for sign, c, P in parts])
        return cls(cell, coef, row)


def _signed_terms(x, sign, out):
    """x as a sum of (sign, term) through add / sub / neg."""
    if x.op in ("add", "sub"):
        _signed_terms(x.args[0], sign, out)
        _signed_terms(x.args[1], sign if x.op == "add" else -sign, out)
    elif x.op == "neg":
        _signed_terms(x.args[0], -sign, out)
    else:
        out.append((sign, x))


def _signed_sum(terms):
    out = None
    for sign, t in terms:
        if out is None:
            out = t if sign > 0 else sm.make("neg", t)
        else:
            out = sm.make("add" if sign > 0 else "sub", out, t)
    return out


def _distance_term(t):
    """(c, P) where the lowered term t is c (P - src.index) with c cell-invariant, else None."""
    if _is_distance(t):
        return sm.ONE, t.args[0]
    if t.op == "mul":
        for c, d in (t.args, t.args[::-1]):
            if c.is_leaf and c.op in _INVARIANT_LEAVES and _is_distance(d):
                return c, d.args[0]
    return None


def _bound(x):
    """a bound on |x| for every input of a lowered tree, or None where there is none: constants,
    tanh (|tanh| <= 1, tanh.approx.f32 included) and the sums, products, negations, selections,
    minima and maxima of bounded terms."""
    if x.op == "const":
        v = abs(float(x.attr))
        return v if v < float("inf") else None
    if x.op == "tanh":
        return 1.0
    if x.op in ("add", "sub", "mul", "neg", "minimum", "maximum", "where"):
        args = x.args[1:] if x.op == "where" else x.args
        bounds = [_bound(a) for a in args]
        if any(b is None for b in bounds):
            return None
        if x.op == "mul":
            return bounds[0] * bounds[1]
        if x.op in ("add", "sub"):
            return bounds[0] + bounds[1]
        return max(bounds)
    return None


#: how the kernels take tanh, per dtype: "hardware" is tanh.approx.f32 (one SFU op; what
#: libdevice's tanhf becomes under fast-math; flash-attn's soft-cap): the PTX manual bounds it
#: at ~2^-11 relative, measured on the H200 at 8e-6 absolute (benchmarks/gpu/tanh_error.py);
#: "exp2" is _tanh below (ex2 and rcp: two SFU ops, 2.3e-7 absolute), which keeps float32
#: kernels fp32-class. On the H200 (fp16, N = 16384, H = 16, D = 128, causal, soft-cap 30;
#: benchmarks/gpu/mods_probe.py) the 16-bit soft-cap forward took 4.04 ms with the hardware
#: tanh and 4.73 ms with "exp2" (plain causal 2.94 ms).
TANH = {"float16": "hardware", "bfloat16": "hardware", "float32": "exp2"}
TANH_WORDS = {
    "hardware": " (tanh: the hardware tanh.approx.f32, as flash-attn's soft-cap: ~1e-5 relative on the H200)",
    "exp2": " (tanh: 1 - 2 / (2^(2x log2 e) + 1) on ex2 / rcp, absolute error ~2e-7)"}

#: the lowering's leaves: the kernel's score scale (an argument of every modified kernel)
MSC = sm.Expr("scalar", (), "__msc")
_INVARIANT_LEAVES = ("const", "scalar", "head")
#: ops a positive constant factor distributes over (c f(a, b) = f(c a, c b) for c > 0)
_DISTRIBUTES = ("add", "sub", "neg", "where", "minimum", "maximum", "leaky_relu")


def lower(tree, dtree, tanh="exp2"):
    """((y, d), hoisted): y = f(z) log2(e) and d = f'(z) as trees of the raw score (sm.SCORE is
    the raw product here; z = raw * MSC; tanh as `tanh` says, see TANH), every product / quotient
    chain regrouped as
    (cell-invariant factor) x (cell factors) / (cell factors), log2(e) pushed through sums and
    selections into the terms' invariant factors; `hoisted` maps each largest cell-invariant
    subtree that is not a leaf to the leaf naming it (computed once per kernel by params())."""
    invariant = {}

    def inv(x):
        r = invariant.get(x)
        if r is None:
            r = invariant[x] = (x.op in _INVARIANT_LEAVES if x.is_leaf
                                else x.op != "where" and all(inv(a) for a in x.args))
        return r

    def factors(x, num, den):   # flatten a product / quotient chain
        if x.op == "mul":
            factors(x.args[0], num, den)
            factors(x.args[1], num, den)
        elif x.op == "div":
            factors(x.args[0], num, den)
            factors(x.args[1], den, num)
        elif x.op == "neg":
            num.append(sm.const(-1.0))
            factors(x.args[0], num, den)
        else:
            num.append(x)

    def product(xs):
        out = sm.ONE
        for x in xs:
            out = sm.make("mul", out, x)
        return out

    def regroup(x):   # x's children already regrouped
        if x.op not in ("mul", "div", "neg"):
            return x
        num, den = [], []
        factors(x, num, den)
        cancelled = False
        for f in list(den):   # c / c: the soft-cap's derivative is c (1 / c) (1 - t^2)
            if inv(f) and f in num:
                num.remove(f)
                den.remove(f)
                cancelled = True
        if inv(x):   # an invariant product is kept as written unless a factor cancelled
            return x if not cancelled else sm.make("div", product(num), product(den))
        k = sm.make("div", product(f for f in num if inv(f)), product(f for f in den if inv(f)))
        cells = [f for f in num if not inv(f)]
        under = [f for f in den if not inv(f)]
        if (not under and len(cells) == 1 and cells[0].op in ("add", "sub") and k != sm.ONE
                and any(inv(a) for a in cells[0].args)):
            # k (a + b c) with a invariant -> (k a) + (k b) c: an fma (the soft-cap's c (1 - 2 r))
            a, b = cells[0].args
            return sm.make(cells[0].op, regroup(sm.make("mul", k, a)), regroup(sm.make("mul", k, b)))
        out = sm.make("mul", k, product(cells)) if k != sm.ONE else product(cells)
        return sm.make("div", out, product(under)) if under else out

    def rebuild(root):
        memo = {}
        for x in sm.walk(root):
            if x.is_leaf:
                memo[x] = x
                continue
            args = [memo[a] for a in x.args]
            if x.op == "exp":   # e^u = 2^(u log2 e): the constant joins u's invariant factor
                y = sm.Expr("exp2", (regroup(sm.make("mul", sm.const(LOG2E), args[0])),))
            elif x.op == "tanh" and not inv(x) and tanh == "exp2":
                y = _tanh(args[0], regroup)
            else:
                y = sm.make(x.op, *args) if x.op in sm._FOLDED else sm.Expr(x.op, args)
            memo[x] = regroup(y)
        return memo[root]

    def scaled(x, k):   # k x, k a positive constant, pushed into the terms
        if x.op in _DISTRIBUTES and not inv(x):
            keep = 1 if x.op == "where" else 0   # a where's condition is not scaled
            args = [a if n < keep or (x.op == "leaky_relu" and n == 1) else scaled(a, k)
                    for n, a in enumerate(x.args)]
            return sm.make(x.op, *args) if x.op in sm._FOLDED else sm.Expr(x.op, args)
        return sm.make("mul", sm.const(k), x)

    raw = {sm.SCORE: sm.make("mul", sm.SCORE, MSC)}
    y = rebuild(scaled(sm.substitute(tree, raw), LOG2E))
    d = rebuild(sm.substitute(dtree, raw))
    hoisted = {}

    def visit(x):
        if x.is_leaf:
            return
        if inv(x):
            hoisted.setdefault(x, sm.Expr("scalar", (), f"__mk{len(hoisted)}"))
            return
        for a in x.args:
            visit(a)

    visit(y)
    visit(d)
    lowered = [sm.substitute(r, hoisted) for r in (y, d)]
    return lowered, hoisted


def _role(x):
    """the position a leaf depends on: "dst" / "src" (a node field or index), "cell" (the score)
    or None (cell-invariant)."""
    if x.op == "score":
        return "cell"
    if x.op == "node":
        return x.attr[0]
    if x.op == "index":
        return x.attr
    return None


def staged(roots):
    """(roots, {role: {subtree: leaf}}): the largest subtrees of `roots` that depend on one
    position only (a destination or a source: a node field, an index and what is built from them
    and invariants), bare positions excepted, replaced by leaves; Modifier.cell computes each
    once per fragment row / column position instead of once per cell."""
    roles = {}

    def role(x):
        r = roles.get(x, 0)
        if r == 0:
            if x.is_leaf:
                r = _role(x)
            else:
                got = {role(a) for a in x.args} - {None}
                r = got.pop() if len(got) == 1 and x.op != "where" else ("cell" if got else None)
            roles[x] = r
        return r

    out = {"dst": {}, "src": {}}

    def visit(x):
        r = role(x)
        if r in out and not (x.is_leaf and x.op == "index"):
            group = out[r]
            group.setdefault(x, sm.Expr("scalar", (), f"__@{r}{len(group)}@"))
            return
        for a in x.args:
            visit(a)

    for root in roots:
        visit(root)
    mapping = {x: leaf for group in out.values() for x, leaf in group.items()}
    return [sm.substitute(r, mapping) for r in roots], out


def _tanh(u, regroup):
    """tanh(u) = 1 - 2 / (2^(2 log2(e) u) + 1): ex2.approx and rcp.approx (two SFU ops, the
    2 log2(e) folded into u's invariant factor) and an fma. Its absolute error stays near
    float32 rounding (2.3e-7 measured on the H200) on the whole line, so `c * tanh(s / c)` is off
    by ~c 2e-7, where the hardware tanh.approx.f32 (what libdevice's tanhf becomes under
    fast-math) measured 8e-6 (its PTX bound: ~2^-11 relative). Large |u| saturate exactly:
    2^big = inf -> 1, 2^-big = 0 -> -1."""
    e = sm.Expr("exp2", (regroup(sm.make("mul", sm.const(2.0 * LOG2E), u)),))
    r = sm.Expr("recip", (sm.make("add", e, sm.ONE),))
    return sm.make("sub", sm.ONE, sm.make("mul", sm.const(2.0), r))


def _finite(value):
    """a constant as the fast-math kernels can hold it: +-inf -> +-3e38 and NaN -> -3e38 (both
    clamp like the infinity: a cell's f ends in [MASKED, CEIL])."""
    value = float(value)
    if value != value:
        return -3.0e38
    return max(-3.0e38, min(3.0e38, value))


class Position:
    """A C-fragment cell's global row or column. `index` addresses node fields and is clamped
    into the block (a tail cell reads the last real row of a field, never past its end);
    `value` is the position as float32 (what dst.index / src.index read), written as the
    thread's first position in the tile plus the cell's constant offset: one conversion per tile
    and a float add per cell position (a conversion per cell position kept 32 column integers
    alive across the key loop: more spills in the D = 128 ALiBi forwards). With `clamp` the value
    is clamped into the block too (a float min more): the CTA's own fragment rows need it, since
    its tail rows take part in every streamed block unmasked (a tail row then computes the last
    real row's values, which stay finite); the streamed columns do not, since a block holding
    tail columns is always masked (stream_key_blocks' edge blocks)."""

    def __init__(self, first, offset, limit, clamp, block=None):
        self.index = f"{first} + imin({offset}, {limit} - 1)"
        base, _, const = offset.rpartition(" + ")
        pos = f"(f32(u32({first} + {base})) + f32({float(const)!r}))"
        #: a column's position less its key block's first (`block`: that part of the offset) as
        #: (the thread's part, the cell's constant part), float32 texts (Split's column term)
        self.rel = None if block is None else \
            (f"f32(u32({base.replace(block + ' + ', '', 1)}))", f"f32({float(const)!r})")
        last = f"f32(u32({first} + {limit} - 1))"
        self.value = f"sel({pos} < {last}, {pos}, {last})" if clamp else pos


def cell_row(m, r):
    """the position of C-fragment cell (m, ., r)'s row (fragment rows are the tile's rows:
    queries in the forward / dQ kernels, keys in dK/dV)."""
    return Position("row0", f"wrow + g + {16 * m + 8 * (r // 2)}", "rows", clamp=True)


def cell_col(base, j, r):
    """the position of C-fragment cell (., j, r)'s column in the streamed block starting at
    block-local `base`."""
    return Position("col0", f"{base} + 2 * t + {8 * j + r % 2}", "cols", clamp=False, block=base)


#: the extra kernel arguments of a modified kernel
ARGS = "msc, mh, mvp, mndp, mnsp"
