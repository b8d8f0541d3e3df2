"""Generate numba functions from a score-modifier tree (tiga_numba.score_mod).

For a tree ``f`` and a dtype this module writes small Python functions as source text, compiles
them with ``numba.njit`` and memoises them per (tree, gradient leaves, dtype) for the life of
the process (exec'd code cannot use numba's on-disk cache):

    value(s, i, j, e, h, sc, hp, nd, ns, ef) -> f                    (natural units)
    grad_<targets>(s, i, j, e, h, sc, hp, nd, ns, ef, dF, ghp, gnd, gi, gns, gj, gef)
        -> dF * df/ds

``grad`` also adds ``dF * df/dx`` for each differentiable leaf x of the requested target kinds
into its gradient buffer (``ghp[k, h]``, ``gnd[k, gi, h]``, ``gns[k, gj, h]``, ``gef[k, e, h]``;
``gi`` / ``gj`` are the rows of the buffers, which a kernel may keep per row or per piece):
a kernel asks only for the kinds it owns (the CSR destination pass owns dst fields, edge fields
and head params, the source pass owns src fields), so no two threads ever add to one cell.

The packed per-call arrays (``Layout`` in score_mod): ``sc (n,)``, ``hp (n, H)``,
``nd (n, Nq, H)``, ``ns (n, Nk, H)``, ``ef (n, E, H)``, all in the kernel's accumulation dtype.
float32 code uses a vectorisable tanh/exp built on ``fastexp.exp2f``; float64 code uses libm.
The value is clamped to the kernels' finite range (NaN -> the masked value), because the
kernels run with fast-math and never form infinities.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from numba import njit

from .. import score_mod as sm
from .fastexp import exp2f

NEG = -1e30  # blocks.NEG (not imported: blocks imports this module)
BIG = 1e30
LOG2E = 1.0 / math.log(2.0)
TARGETS = ("head", "dst", "src", "edge")

_MEMO = {}
_LOCK = threading.Lock()


@njit(inline="always", fastmath=True, cache=True)
def tanh_f32(x):
    t = exp2f(np.float32(-2.0 * LOG2E) * abs(x))  # exp(-2|x|) in (0, 1]
    r = (np.float32(1.0) - t) / (np.float32(1.0) + t)
    return r if x >= 0 else -r


@njit(inline="always", fastmath=True, cache=True)
def exp_f32(x):
    return exp2f(x * np.float32(LOG2E))


@njit(inline="always", cache=True)
def tanh_f64(x):
    return math.tanh(x)


@njit(inline="always", cache=True)
def exp_f64(x):
    return math.exp(x)


class Generated:
    """The compiled functions of one (tree, gradient leaves, dtype)."""

    def __init__(self, tree, grad_leaves, dtype_name):
        self.tree = tree
        self.layout = sm.Layout(tree)
        self.grad_leaves = tuple(grad_leaves)
        self.dtype_name = dtype_name
        self.sources = {}
        self.value = self._build("value", self._value_source())
        self._grads = {}

    def grad(self, targets):
        """The gradient function that accumulates the leaves of kinds `targets`."""
        key = tuple(t for t in TARGETS if t in targets)
        fn = self._grads.get(key)
        if fn is None:
            name = "grad_" + ("_".join(key) or "score")
            fn = self._grads[key] = self._build(name, self._grad_source(name, key))
        return fn

    # ------------------------------------------------------------------ source text
    def _globals(self):
        f32 = self.dtype_name == "float32"
        return {"math": math, "_dt": np.float32 if f32 else np.float64,
                "_tanh": tanh_f32 if f32 else tanh_f64, "_exp": exp_f32 if f32 else exp_f64}

    def _emit(self, roots):
        """Assignments computing every node of `roots` once (common subexpressions shared);
        returns (lines, {node: expression text}), constants as typed globals."""
        lay = self.layout
        text = {}
        lines = []
        self._consts = getattr(self, "_consts", {})
        is_bool = {}
        seen = set()
        order = []
        for r in roots:
            for x in sm.walk(r):
                if x not in seen:
                    seen.add(x)
                    order.append(x)

        def num(x):
            return f"(_dt(1.0) if {text[x]} else _dt(0.0))" if is_bool[x] else text[x]

        n = 0
        for x in order:
            op = x.op
            is_bool[x] = op in sm.COMPARE
            if op == "score":
                text[x] = "s"
                continue
            if op == "const":
                name = self._consts.setdefault(x.attr, f"_k{len(self._consts)}")
                text[x] = name
                continue
            if op == "scalar":
                text[x] = f"sc[{lay.slot[x]}]"
                continue
            if op == "head":
                text[x] = f"hp[{lay.slot[x]}, h]"
                continue
            if op == "node":
                text[x] = (f"nd[{lay.slot[x]}, i, h]" if x.attr[0] == "dst"
                           else f"ns[{lay.slot[x]}, j, h]")
                continue
            if op == "edge":
                text[x] = f"ef[{lay.slot[x]}, e, h]"
                continue
            if op == "index":
                text[x] = "_dt(i)" if x.attr == "dst" else "_dt(j)"
                continue
            a = x.args
            if op in ("add", "sub", "mul", "div"):
                rhs = f"{num(a[0])} {sm._SYMBOL[op]} {num(a[1])}"
            elif op in sm.COMPARE:
                rhs = f"{num(a[0])} {sm._SYMBOL[op]} {num(a[1])}"
            elif op == "neg":
                rhs = f"-{num(a[0])}"
            elif op == "where":
                cond = text[a[0]] if is_bool[a[0]] else f"{text[a[0]]} != 0"
                rhs = f"{num(a[1])} if {cond} else {num(a[2])}"
            elif op == "tanh":
                rhs = f"_tanh({num(a[0])})"
            elif op == "exp":
                rhs = f"_exp({num(a[0])})"
            elif op in ("log", "sqrt"):
                rhs = f"_dt(math.{op}({num(a[0])}))"
            elif op == "abs":
                rhs = f"abs({num(a[0])})"
            elif op == "sign":
                v = num(a[0])
                rhs = f"_dt(1.0) if {v} > 0 else (_dt(-1.0) if {v} < 0 else _dt(0.0))"
            elif op == "minimum":
                rhs = f"{num(a[0])} if {num(a[0])} <= {num(a[1])} else {num(a[1])}"
            elif op == "maximum":
                rhs = f"{num(a[0])} if {num(a[0])} >= {num(a[1])} else {num(a[1])}"
            elif op == "leaky_relu":
                v = num(a[0])
                rhs = f"{v} if {v} > 0 else {num(a[1])} * {v}"
            else:  # pragma: no cover - the tracer builds only the ops above
                raise NotImplementedError(f"score modifier op {op!r} has no code generator")
            name = f"t{n}"
            n += 1
            lines.append(f"    {name} = {rhs}")
            text[x] = name
        return lines, text, num

    def _value_source(self):
        lines, text, num = self._emit([self.tree])
        body = "\n".join(lines)
        return (f"def value(s, i, j, e, h, sc, hp, nd, ns, ef):\n{body}\n"
                f"    v = {num(self.tree)}\n"
                f"    if v > _BIG:\n        return _BIG\n"
                f"    if v > _NEG:\n        return v\n"
                f"    return _NEG\n")

    def _grad_source(self, name, targets):
        lay = self.layout
        wanted = [x for x in self.grad_leaves if _kind(x) in targets]
        derivs = [sm.diff(self.tree, sm.SCORE)] + [sm.diff(self.tree, x) for x in wanted]
        lines, text, num = self._emit(derivs)
        out = [f"def {name}(s, i, j, e, h, sc, hp, nd, ns, ef, dF, ghp, gnd, gi, gns, gj, gef):"]
        out += lines
        for x, dx in zip(wanted, derivs[1:]):
            if dx == sm.ZERO:
                continue
            k = lay.slot[x]
            cell = {"head": f"ghp[{k}, h]", "dst": f"gnd[{k}, gi, h]", "src": f"gns[{k}, gj, h]",
                    "edge": f"gef[{k}, e, h]"}[_kind(x)]
            out.append(f"    {cell} += dF * {num(dx)}")
        out.append(f"    return dF * {num(derivs[0])}")
        return "\n".join(out) + "\n"

    def _build(self, name, source):
        self.sources[name] = source
        g = self._globals()
        dt = g["_dt"]
        g.update({v: dt(k) for k, v in self._consts.items()})
        g["_NEG"], g["_BIG"] = dt(NEG), dt(BIG)
        code = compile(source, f"<score modifier {name}: {self.tree}>", "exec")
        exec(code, g)
        return njit(nogil=True, error_model="numpy")(g[name])


@njit(inline="always", cache=True)
def no_value(s, i, j, e, h, sc, hp, nd, ns, ef):
    """Stand-in of `value` in kernels compiled without a modifier (never called)."""
    return s


@njit(inline="always", cache=True)
def no_grad(s, i, j, e, h, sc, hp, nd, ns, ef, dF, ghp, gnd, gi, gns, gj, gef):
    """Stand-in of `grad` in kernels compiled without a modifier (never called)."""
    return dF


_EMPTY = {}


def empty_context(dt):
    """(sc, hp, nd, ns, ef) of a kernel without a modifier: empty arrays of the right ranks
    (made once per dtype; the kernels never write them)."""
    ctx = _EMPTY.get(dt)
    if ctx is None:
        ctx = _EMPTY[dt] = (np.zeros(0, dt), np.zeros((0, 1), dt), np.zeros((0, 1, 1), dt),
                            np.zeros((0, 1, 1), dt), np.zeros((0, 1, 1), dt))
    return ctx


def jit_kernel(py_func, mod, **hooks):
    """numba.njit(parallel, fastmath) of a kernel whose modifier calls go through the global
    names in `hooks`. Without a modifier the kernel is compiled as written (its globals are the
    module's never-called stand-ins, so numba's on-disk cache works as for any kernel); with one,
    the same code is compiled with `hooks` bound to the generated functions (exec'd code: not
    disk-cacheable, memoised per tree in-process by the kernel cache)."""
    import types
    from .fastexp import FASTMATH
    opts = dict(parallel=True, fastmath=FASTMATH, nogil=True)
    if mod is None:
        return njit(cache=True, **opts)(py_func)
    g = dict(py_func.__globals__)
    g.update(hooks)
    fn = types.FunctionType(py_func.__code__, g, py_func.__name__, py_func.__defaults__,
                            py_func.__closure__)
    fn.__qualname__ = py_func.__qualname__
    return njit(cache=False, **opts)(fn)


def _kind(leaf):
    return leaf.attr[0] if leaf.op == "node" else leaf.op


def generated(tree, grad_leaves, dtype_name):
    """The memoised Generated functions for (tree, grad_leaves, dtype)."""
    key = (tree, tuple(grad_leaves), dtype_name)
    with _LOCK:
        g = _MEMO.get(key)
        if g is None:
            g = _MEMO[key] = Generated(tree, grad_leaves, dtype_name)
    return g
