"""Score modifiers: one immutable expression tree per traced score, its derivatives, and the
per-call values the kernels read.

A modified score is an elementwise function ``f(s, i, j, e, h)`` of the dot score ``s`` (already
multiplied by its scale), the destination ``i``, the source ``j``, the edge ``e`` (CSR relations)
and the head ``h``. Its tree is built from these leaves:

    score            the dot score (0 when the program has no dot product)
    const  value     a Python number, compiled into the kernel
    scalar text      a scalar param expression (``c``, ``1 / c``); its value is read per call
    head   name      a per-head param of shape (H,), read at h
    node   (role, n) a per-node field of shape (N,) or (N, H) read at i (dst) or j (src)
    edge   name      a per-edge field of shape (E,) or (E, H) (CSR relations), read at e
    index  role      the node position i (dst) or j (src), an integer

and the operators ``add sub mul div neg`` / comparisons ``lt le gt ge eq ne`` / ``where`` /
``tanh exp log abs sqrt minimum maximum leaky_relu``. Trees compare and hash structurally: a
kernel compiled for a tree is cached under the tree itself, so two different expressions never
share a kernel and the same expression (whatever the values of its params) compiles once.
``diff(tree, leaf)`` differentiates symbolically; the backends generate code from the trees.
"""
from __future__ import annotations

import math

import numpy as np

LEAVES = ("score", "const", "scalar", "head", "node", "edge", "index", "dot")
UNARY = ("neg", "tanh", "exp", "log", "abs", "sqrt")
BINARY = ("add", "sub", "mul", "div", "minimum", "maximum", "leaky_relu")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
TERNARY = ("where",)
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">",
           "ge": ">=", "eq": "==", "ne": "!="}
_PREC = {"add": 1, "sub": 1, "mul": 2, "div": 2, "neg": 3}


class Expr:
    """One node of a score-modifier tree (immutable, structural equality and hash)."""

    __slots__ = ("op", "args", "attr", "_hash")

    def __init__(self, op, args=(), attr=None):
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "attr", attr)
        object.__setattr__(self, "_hash", hash((op, self.args, attr)))

    def __setattr__(self, name, value):
        raise AttributeError("Expr is immutable")

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (isinstance(other, Expr) and self._hash == other._hash and self.op == other.op
                and self.attr == other.attr and self.args == other.args)

    def __ne__(self, other):
        return not self == other

    def __reduce__(self):
        return (Expr, (self.op, self.args, self.attr))

    @property
    def is_leaf(self):
        return self.op in LEAVES

    @property
    def is_bool(self):
        return self.op in COMPARE

    def __repr__(self):
        return f"Expr({self})"

    def __str__(self):
        return _format(self, 0)


def _format(e, prec):
    op = e.op
    if op == "score":
        return "s"
    if op == "const":
        v = e.attr
        return repr(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))
    if op == "scalar":
        return e.attr
    if op == "head":
        return f"{e.attr}[h]"
    if op == "node":
        role, name = e.attr
        return f"{role}.{name}"
    if op == "edge":
        return f"edge.{e.attr}"
    if op == "index":
        return f"{e.attr}.index"
    if op == "dot":  # while tracing: the dot score scaled by the factor `attr`
        return f"({e.attr}) * <dot>"
    if op == "neg":
        text = "-" + _format(e.args[0], 3)
        return f"({text})" if prec > 3 else text
    if op in ("add", "sub", "mul", "div"):
        p = _PREC[op]
        a = _format(e.args[0], p)
        b = _format(e.args[1], p + 1)  # left-associative: a - (b - c) keeps its brackets
        text = f"{a} {_SYMBOL[op]} {b}"
        return f"({text})" if prec > p else text
    if op in COMPARE:
        text = f"{_format(e.args[0], 1)} {_SYMBOL[op]} {_format(e.args[1], 1)}"
        return f"({text})" if prec > 0 else text
    return f"{op}({', '.join(_format(a, 0) for a in e.args)})"


# --------------------------------------------------------------------------- constructors
SCORE = Expr("score")


def const(v):
    return Expr("const", (), float(v))


ZERO = const(0.0)
ONE = const(1.0)


def _is_const(e, v=None):
    return e.op == "const" and (v is None or e.attr == v)


def make(op, *args):
    """A node with constant folding and the identities that keep derivatives small."""
    if op in ("add", "sub", "mul", "div") and all(_is_const(a) for a in args):
        a, b = args[0].attr, args[1].attr
        if op != "div" or b != 0:
            return const({"add": a + b, "sub": a - b, "mul": a * b, "div": a / b if b else 0}[op])
    if op == "add":
        a, b = args
        if _is_const(a, 0.0):
            return b
        if _is_const(b, 0.0):
            return a
    elif op == "sub":
        a, b = args
        if _is_const(b, 0.0):
            return a
        if _is_const(a, 0.0):
            return make("neg", b)
    elif op == "mul":
        a, b = args
        if _is_const(a, 0.0) or _is_const(b, 0.0):
            return ZERO
        if _is_const(a, 1.0):
            return b
        if _is_const(b, 1.0):
            return a
        if _is_const(a, -1.0):
            return make("neg", b)
        if _is_const(b, -1.0):
            return make("neg", a)
    elif op == "div":
        a, b = args
        if _is_const(a, 0.0):
            return ZERO
        if _is_const(b, 1.0):
            return a
    elif op == "neg":
        (a,) = args
        if _is_const(a):
            return const(-a.attr)
        if a.op == "neg":
            return a.args[0]
    elif op == "where":
        c, a, b = args
        if a == b:
            return a
    return Expr(op, args)


# --------------------------------------------------------------------------- inspection
def walk(e):
    """Every node once, children before parents (the order code is generated in)."""
    seen = set()
    out = []

    def visit(x):
        if x in seen:
            return
        for a in x.args:
            visit(a)
        seen.add(x)
        out.append(x)

    visit(e)
    return out


def leaves(e, op=None):
    """Leaves of the tree in first-use order (optionally only those of kind `op`)."""
    return [x for x in walk(e) if x.is_leaf and (op is None or x.op == op)]


def substitute(e, mapping):
    """The tree with the leaves in `mapping` replaced (constant folding re-applied)."""
    memo = {}
    for x in walk(e):
        if x in mapping:
            memo[x] = mapping[x]
        elif x.is_leaf:
            memo[x] = x
        else:
            args = [memo[a] for a in x.args]
            memo[x] = make(x.op, *args) if x.op in _FOLDED else Expr(x.op, args)
    return memo[e]


_FOLDED = ("add", "sub", "mul", "div", "neg", "where")


def uses_score(e):
    return SCORE in walk(e)


class Layout:
    """Where each leaf's per-call value lives in the packed arrays the kernels read:
    ``sc[k]`` (scalars), ``hp[k, h]`` (per-head params), ``nd[k, i, h]`` / ``ns[k, j, h]``
    (dst / src node fields), ``ef[k, e, h]`` (edge fields). Slots are numbered in first-use
    order, so the layout is a function of the tree alone."""

    def __init__(self, tree):
        self.scalars = leaves(tree, "scalar")
        self.heads = leaves(tree, "head")
        nodes = leaves(tree, "node")
        self.dst = [x for x in nodes if x.attr[0] == "dst"]
        self.src = [x for x in nodes if x.attr[0] == "src"]
        self.edges = leaves(tree, "edge")
        self.slot = {}
        for group in (self.scalars, self.heads, self.dst, self.src, self.edges):
            for k, x in enumerate(group):
                self.slot[x] = k

    def differentiable(self):
        """Leaves a gradient can be asked for (scalars are per-call constants)."""
        return self.heads + self.dst + self.src + self.edges


# --------------------------------------------------------------------------- derivatives
def diff(e, var):
    """d e / d var, symbolically (var a leaf). Comparisons and integer positions have zero
    derivative; where/minimum/maximum/abs/leaky_relu take the derivative of the branch they
    select (at a tie: minimum/maximum the first argument, abs 0, leaky_relu the slope)."""
    memo = {}

    def d(x):
        r = memo.get(x)
        if r is not None:
            return r
        r = _d(x)
        memo[x] = r
        return r

    def _d(x):
        op = x.op
        if x.is_leaf:
            return ONE if x == var else ZERO
        if op in COMPARE:
            return ZERO
        a = x.args
        if op == "add":
            return make("add", d(a[0]), d(a[1]))
        if op == "sub":
            return make("sub", d(a[0]), d(a[1]))
        if op == "neg":
            return make("neg", d(a[0]))
        if op == "mul":
            return make("add", make("mul", d(a[0]), a[1]), make("mul", a[0], d(a[1])))
        if op == "div":
            da, db = d(a[0]), d(a[1])
            t = make("div", da, a[1])
            if _is_const(db, 0.0):
                return t
            return make("sub", t, make("div", make("mul", x, db), a[1]))
        if op == "where":
            return make("where", a[0], d(a[1]), d(a[2]))
        if op == "minimum":
            return make("where", make("le", a[0], a[1]), d(a[0]), d(a[1]))
        if op == "maximum":
            return make("where", make("ge", a[0], a[1]), d(a[0]), d(a[1]))
        if op == "leaky_relu":
            xv, slope = a
            dx = d(xv)
            pos = Expr("gt", (xv, ZERO))
            g = make("where", pos, dx, make("mul", slope, dx))
            ds = d(slope)
            if _is_const(ds, 0.0):
                return g
            return make("add", g, make("where", pos, ZERO, make("mul", xv, ds)))
        da = d(a[0])
        if _is_const(da, 0.0):
            return ZERO
        if op == "tanh":
            return make("mul", da, make("sub", ONE, make("mul", x, x)))
        if op == "exp":
            return make("mul", da, x)
        if op == "log":
            return make("div", da, a[0])
        if op == "sqrt":
            return make("div", da, make("mul", const(2.0), x))
        if op == "abs":
            return make("mul", da, Expr("sign", (a[0],)))
        raise NotImplementedError(f"no derivative for {op}")

    return d(e)


# --------------------------------------------------------------------------- evaluation
def evaluate(e, env):
    """The tree on numpy arrays (float64 oracle, tests): env maps each leaf to an array
    broadcastable to the edge/head shape; a "sign" node (derivative of abs) is np.sign."""
    cache = {}
    for x in walk(e):
        if x.is_leaf:
            cache[x] = np.float64(x.attr) if x.op == "const" else env[x]
            continue
        v = [cache[a] for a in x.args]
        op = x.op
        if op in _SYMBOL:
            cache[x] = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                        "lt": np.less, "le": np.less_equal, "gt": np.greater,
                        "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal}[op](*v)
        elif op == "neg":
            cache[x] = -v[0]
        elif op == "where":
            cache[x] = np.where(v[0] != 0, v[1], v[2])
        elif op == "leaky_relu":
            cache[x] = np.where(v[0] > 0, v[0], v[1] * v[0])
        elif op == "sign":
            cache[x] = np.sign(v[0])
        else:
            cache[x] = getattr(np, op)(*v)
    return cache[e]


def leaky_relu(x, negative_slope=0.01):
    """max(x, 0) + negative_slope * min(x, 0): eager on arrays and numbers; inside edge() it
    builds a score-modifier node (compiled into the kernels)."""
    from .symbolic import Symbolic, leaky_relu_symbolic
    if isinstance(x, Symbolic) or isinstance(negative_slope, Symbolic):
        return leaky_relu_symbolic(x, negative_slope)
    if hasattr(x, "__cuda_array_interface__"):
        import cupy
        return cupy.where(x > 0, x, negative_slope * x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x if x > 0 else negative_slope * x
    x = np.asarray(x)
    # the slope in x's float dtype (float32 stays float32); an integer x becomes float64, as
    # torch's and numpy's own mixed int * float arithmetic gives (0.2 cast to int would be 0)
    dt = x.dtype if x.dtype.kind in "fc" else np.result_type(x.dtype, np.float64)
    x = x.astype(dt, copy=False)
    return np.where(x > 0, x, np.asarray(negative_slope, dtype=dt) * x)


# --------------------------------------------------------------------------- functional forms
#: the per-call scalar leaf of flash-attn's soft-cap in flash_tree (one compiled kernel for every cap)
SOFTCAP = Expr("scalar", (), "softcap")


def softcap_tree(tree):
    """flash-attn's soft-cap, ``softcap * tanh(s / softcap)``, over `tree` (the cap: SOFTCAP)."""
    return make("mul", SOFTCAP, Expr("tanh", (make("div", tree, SOFTCAP),)))


#: the per-head leaf of flash-attn's ALiBi slopes in flash_tree (its gradient, where one is asked
#: for, is keyed by it)
ALIBI_SLOPES = Expr("head", (), "alibi_slopes")


#: flash-attn's per-sequence slopes ((batch, H) alibi_slopes): the slopes of each query row's
#: sequence, a per-row (N, H) field gathered from them per call (bind_flash)
ALIBI_ROW_SLOPES = Expr("node", (), ("dst", "_alibi_slopes"))


def alibi_tree(tree, aligned, per_sequence=False):
    """flash-attn's ALiBi, ``s - slopes[h] * |i - j|``; with `aligned`, the destination
    position is shifted by the per-row integer field dst._alibi_shift (bottom-right alignment
    of rectangular blocks: |i + Lk - Lq - j| in block-local positions); `per_sequence`: the
    slope is the row's own (ALIBI_ROW_SLOPES, one set of slopes per sequence) instead of the
    head's (ALIBI_SLOPES)."""
    i = Expr("index", (), "dst")
    if aligned:
        i = make("add", i, Expr("node", (), ("dst", "_alibi_shift")))
    dist = Expr("abs", (make("sub", i, Expr("index", (), "src")),))
    return make("sub", tree, make("mul", ALIBI_ROW_SLOPES if per_sequence else ALIBI_SLOPES, dist))


def flash_tree(softcap, alibi, aligned, per_sequence=False):
    """The tree of flash-attn's `softcap=` / `alibi_slopes=` (functional.flash_modifier): the
    soft-cap, then ALiBi (bottom-right `aligned` through dst._alibi_shift; `per_sequence`: the
    slopes of each row's sequence), over the score."""
    tree = softcap_tree(SCORE) if softcap else SCORE
    return alibi_tree(tree, aligned, per_sequence) if alibi else tree


def bind_flash(softcap, slopes, shift, grad_slopes=False, row_sequence=None):
    """flash_tree bound to one call's values: `softcap` (a float or None), `slopes` ((H,) array
    or None) and `shift` (the per-row int array of the bottom-right alignment, dst._alibi_shift,
    or None where there is nothing to align); `grad_slopes`: the backward also gives the slopes'
    gradient (keyed by ALIBI_SLOPES). With `row_sequence` (int array (N,): the sequence of each
    query row, increasing), `slopes` is (batch, H), one set per sequence: the kernels read the
    (N, H) gather slopes[row_sequence] as the field ALIBI_ROW_SLOPES, and the slopes' gradient
    is that field's, summed per sequence (BoundModifier.gathers). Checked by the caller."""
    values = {}
    gathers = {}
    if softcap is not None:
        values[SOFTCAP] = softcap
    if slopes is not None:
        if row_sequence is None:
            values[ALIBI_SLOPES] = slopes
        else:
            values[ALIBI_ROW_SLOPES] = slopes[row_sequence]
            gathers[ALIBI_ROW_SLOPES] = (ALIBI_SLOPES, row_sequence, slopes)
        if shift is not None:
            values[Expr("node", (), ("dst", "_alibi_shift"))] = shift
    aligned = slopes is not None and shift is not None
    leaf = ALIBI_SLOPES if row_sequence is None else ALIBI_ROW_SLOPES
    return BoundModifier(flash_tree(softcap is not None, slopes is not None, aligned,
                                    row_sequence is not None), values,
                         want_grad=(leaf,) if grad_slopes and slopes is not None else (),
                         gathers=gathers)


#: the trees `python -m tiga_numba.cuda.tc.prebuild --modifiers` names: flash_tree's arguments
#: ("-rows": flash-attn's per-sequence (batch, H) slopes)
FLASH_TREES = {"softcap": (True, False, False), "alibi": (False, True, False),
               "alibi-aligned": (False, True, True), "softcap+alibi": (True, True, False),
               "softcap+alibi-aligned": (True, True, True),
               "alibi-rows": (False, True, False, True), "alibi-rows-aligned": (False, True, True, True),
               "softcap+alibi-rows": (True, True, False, True),
               "softcap+alibi-rows-aligned": (True, True, True, True)}


# --------------------------------------------------------------------------- per-call values
_LEAF_NAME = {"head": lambda x: f"param {x.attr!r}", "node": lambda x: f"{x.attr[0]}.{x.attr[1]}",
              "edge": lambda x: f"edge.{x.attr}", "scalar": lambda x: f"scalar {x.attr}"}


def leaf_name(x):
    return _LEAF_NAME[x.op](x)


class BoundModifier:
    """A tree with one call's values: `values` maps every scalar/head/node/edge leaf to a
    float (scalars) or an array; `want_grad` lists the leaves whose gradient the caller wants
    (float arrays only). `check(shape, graph)` validates the shapes against the call."""

    def __init__(self, tree, values, want_grad=(), gathers=None):
        self.tree = tree
        self.layout = Layout(tree)
        self.values = dict(values)
        #: {leaf: (user leaf, index, user array)}: the leaf's value is user_array[index] (a
        #: gather along the first axis, index increasing); grads_to_user gives its gradient as
        #: the user array's, summed over each run of equal indices, keyed by the user leaf
        self.gathers = dict(gathers or {})
        for x in self.layout.scalars + self.layout.differentiable():
            if x not in self.values:
                raise ValueError(f"the score modifier reads {leaf_name(x)}, which has no value")
        self.grad_leaves = tuple(x for x in self.layout.differentiable() if x in set(want_grad)
                                 and np.issubdtype(np.dtype(self.values[x].dtype), np.floating))

    def __str__(self):
        return str(self.tree)

    @property
    def uses_score(self):
        return uses_score(self.tree)

    def check(self, heads, num_dst, num_src, num_edges, implicit):
        lay = self.layout
        if lay.edges and implicit:
            raise NotImplementedError(
                f"the score modifier [{self.tree}] reads per-edge fields "
                f"({', '.join(leaf_name(x) for x in lay.edges)}), which need a CSR relation; "
                "use Graph.from_scipy(graph.to_scipy()) to make the relation explicit")
        for x in lay.scalars:
            v = self.values[x]
            if not (isinstance(v, float) and math.isfinite(v)):
                raise ValueError(f"{leaf_name(x)} in the score modifier must be a finite real "
                                 f"number, got {v!r}")
        sizes = {"dst": ("graph.num_dst", num_dst), "src": ("graph.num_src", num_src),
                 "edge": ("graph.num_edges", num_edges)}
        for x in lay.differentiable():
            a = self.values[x]
            name = leaf_name(x)
            kind = np.dtype(a.dtype).kind
            if kind not in "fiub" and str(a.dtype) != "bfloat16":
                raise TypeError(f"{name} in the score modifier must be a real (float or int) "
                                f"array, got dtype {a.dtype}")
            if x.op == "head":
                if a.shape != (heads,):
                    raise ValueError(f"{name} is a per-head param and must have shape "
                                     f"({heads},) (one value per query head), got {tuple(a.shape)}")
                continue
            label, n = sizes[x.attr[0] if x.op == "node" else "edge"]
            if a.ndim not in (1, 2) or a.shape[0] != n or (a.ndim == 2 and a.shape[1] not in (1, heads)):
                hint = ("; a feature vector per node: did you forget .sum(axis=-1) of a product?"
                        if a.ndim >= 2 and a.shape[-1] not in (1, heads) else "")
                raise ValueError(f"{name} in the score modifier must have shape ({n},) or "
                                 f"({n}, {heads}) ({label} = {n}, {heads} heads), got "
                                 f"{tuple(a.shape)}{hint}")

    def pack(self, xp, acc, heads, num_dst, num_src, num_edges):
        """(sc, hp, nd, ns, ef) in dtype `acc` (score_codegen's layout)."""
        lay = self.layout
        sc = xp.asarray(np.array([self.values[x] for x in lay.scalars], dtype=acc))

        def stack(group, n):
            out = xp.empty((len(group), n, heads), dtype=acc)
            for k, x in enumerate(group):
                a = self.values[x]
                out[k] = xp.broadcast_to(a.reshape(n, -1), (n, heads))
            return out

        hp = xp.empty((len(lay.heads), heads), dtype=acc)
        for k, x in enumerate(lay.heads):
            hp[k] = self.values[x]
        return (sc, hp, stack(lay.dst, num_dst), stack(lay.src, num_src),
                stack(lay.edges, num_edges if lay.edges else 0))

    def zero_grads(self, xp):
        """What grads_to_user gives for a call with nothing to reduce (no rows, edges or heads):
        zeros in each leaf's shape and dtype (a gathered leaf's: its user array's, under the
        user leaf), as arrays of library `xp`."""
        out = {}
        for x in self.grad_leaves:
            user, _, a = self.gathers.get(x, (x, None, self.values[x]))
            out[user] = xp.zeros(a.shape, dtype=a.dtype)
        return out

    def grads_to_user(self, packed):
        """{leaf: gradient in the leaf's own shape and dtype} from the kernels' (n, H) /
        (n, N, H) accumulation buffers (ghp, gnd, gns, gef)."""
        lay = self.layout
        ghp, gnd, gns, gef = packed
        out = {}
        for x in self.grad_leaves:
            a = self.values[x]
            k = lay.slot[x]
            if x.op == "head":
                g = ghp[k]
            else:
                buf = {"dst": gnd, "src": gns}.get(x.attr[0]) if x.op == "node" else gef
                g = buf[k]
                if a.ndim == 1:
                    g = g.sum(axis=1)
                elif a.shape[1] == 1 and g.shape[1] != 1:
                    g = g.sum(axis=1, keepdims=True)
            if x in self.gathers:
                user, index, arr = self.gathers[x]
                out[user] = _sum_runs(g, index, arr.shape[0]).astype(arr.dtype, copy=False)
            else:
                out[x] = g.astype(a.dtype, copy=False)
        return out


def _sum_runs(g, index, n):
    """(n,) + g.shape[1:] float64, in g's library: row b sums the rows r of g with index[r] == b
    (index increasing), each run in float64 from its first row onward (cpu/segments.py says why
    that order); a b no row has gives 0. A cupy g runs the same sums on the device, one thread
    per output element: the same bits as a numpy call, with no copy to the host."""
    on_host = isinstance(g, np.ndarray)
    if on_host:
        xp = np
    else:
        import cupy as xp
    ih = xp.asarray(index)
    b = xp.arange(n, dtype=ih.dtype)
    starts = xp.searchsorted(ih, b).astype(np.int64, copy=False)
    ends = xp.searchsorted(ih, b, side="right").astype(np.int64, copy=False)
    if on_host:
        from .cpu.segments import sum_runs
        return sum_runs(g, starts, ends)
    return _sum_runs_device(g, starts, ends)


#: the device form of cpu/segments.py's sums: output element (b, c) of an (n, width) result
#: adds rows starts[b] .. ends[b] - 1 of column c in order, starting from the first (an empty
#: run gives 0), in double
_SUM_RUNS_SOURCE = """
long long b = i / width, c = i - b * width;
long long s = starts[b], e = ends[b];
double acc = 0.0;
if (s < e) {
    acc = (double)g[s * width + c];
    for (long long r = s + 1; r < e; ++r) acc += (double)g[r * width + c];
}
y = acc;
"""


def _sum_runs_device(g, starts, ends):
    """cpu/segments.sum_runs for cupy arrays."""
    import cupy
    from .kernel_cache import KERNELS
    kernel = KERNELS.derived(None, "score_mod.sum_runs", lambda: cupy.ElementwiseKernel(
        "raw T g, raw int64 starts, raw int64 ends, int64 width", "float64 y", _SUM_RUNS_SOURCE,
        "tiga_sum_runs"))
    n, trailing = starts.shape[0], g.shape[1:]
    width = int(np.prod(trailing, dtype=np.int64))
    out = cupy.empty((n,) + trailing, np.float64)
    if out.size:
        flat = cupy.ascontiguousarray(g).reshape(g.shape[0], width)
        kernel(flat, starts, ends, np.int64(width), out.reshape(n, width))
    return out
