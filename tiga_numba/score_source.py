"""Source text of a score modifier's value and gradient functions, for any backend.

One generator turns a tree (tiga_numba.score_mod) into Python source; a backend supplies a
`Target` that says how its kernels pass the per-call values and gradient buffers (where a leaf
is read, where a leaf's gradient goes, the argument lists, the tanh / exp it calls) and
compiles the text with its own decorator (cpu/score_codegen.py: numba.njit; cuda/score_codegen.py:
numba.cuda.jit(device=True)). The generated functions are

    value(<value args>) -> f                   (at most 1e30; NaN or <= -1e30: the target's masked value)
    grad(<grad args>)   -> dF * df/ds, and for each wanted leaf x: dF * df/dx into its cell

Every node is computed once (common subexpressions shared); constants become typed globals
named `_k0, _k1, ...` (the backend binds them in the accumulation dtype).
"""
from __future__ import annotations

import threading

import numpy as np

from . import score_mod as sm

NEG = -1e30  # the kernels' finite masked value: a value below it (or NaN) is clamped to it
BIG = 1e30
TARGETS = ("head", "dst", "src", "edge")


def kind(leaf):
    """The gradient target kind of a differentiable leaf: head, dst, src or edge."""
    return leaf.attr[0] if leaf.op == "node" else leaf.op


class Target:
    """What differs between backends. Subclasses fill in the argument lists and the texts."""

    value_args = ""
    grad_args = ""
    tanh = "_tanh"
    exp = "_exp"
    exp2 = "_exp2"
    score = "s"      # the name of the score in the generated text
    temp = "t"       # the prefix of the generated temporaries
    # what a masked cell's value is (NaN, or at most NEG: the edge is masked): the kernels' own
    # masked value, so that a row whose every edge is masked is an empty row (output 0, l = 0)
    masked = "_NEG"

    def select(self, cond, a, b):
        """Expression choosing `a` where `cond` holds, else `b` (branch-free targets override)."""
        return f"{a} if {cond} else {b}"

    def leaf(self, x, slot):
        """Expression reading the per-call value of leaf `x` (packed slot `slot`)."""
        raise NotImplementedError

    def index(self, role):
        return "_dt(i)" if role == "dst" else "_dt(j)"

    def accumulate(self, x, slot, pos, value):
        """Statement adding `value` (dF * df/dx) into the gradient cell of leaf `x`; `pos` is
        the leaf's position among the wanted leaves of its group (see Source.grad_groups)."""
        raise NotImplementedError


class Source:
    """The source texts of one (tree, gradient leaves) for one target."""

    def __init__(self, tree, grad_leaves, target):
        self.tree = tree
        self.layout = sm.Layout(tree)
        self.grad_leaves = tuple(grad_leaves)
        self.target = target
        self.consts = {}  # value -> global name

    def wanted(self, targets):
        """The gradient leaves of kinds `targets`, in gradient-leaf order."""
        return [x for x in self.grad_leaves if kind(x) in targets]

    def grad_groups(self, targets):
        """(leaves owned by a row: head/dst/src, leaves owned by an edge) of `targets`; a
        leaf's `pos` in accumulate() is its index in its list."""
        w = self.wanted(targets)
        return [x for x in w if kind(x) != "edge"], [x for x in w if kind(x) == "edge"]

    def _emit(self, roots):
        """Assignments computing every node of `roots` once; returns (lines, num) where num(x)
        is the numeric expression text of node x (comparisons as 1.0 / 0.0)."""
        lay = self.layout
        tg = self.target
        text = {}
        is_bool = {}
        lines = []
        seen = set()
        order = []
        for r in roots:
            for x in sm.walk(r):
                if x not in seen:
                    seen.add(x)
                    order.append(x)

        def num(x):
            return f"({tg.select(text[x], '_dt(1.0)', '_dt(0.0)')})" if is_bool[x] else text[x]

        n = 0
        for x in order:
            op = x.op
            is_bool[x] = op in sm.COMPARE
            if op == "score":
                text[x] = tg.score
                continue
            if op == "const":
                text[x] = self.consts.setdefault(x.attr, f"_k{len(self.consts)}")
                continue
            if op in ("scalar", "head", "node", "edge"):
                # a lowering's own leaves ("__" names, generator/modifier.py) have no packed slot
                own = x.op == "scalar" and x.attr.startswith("__")
                text[x] = tg.leaf(x, None if own else lay.slot[x])
                continue
            if op == "index":
                text[x] = tg.index(x.attr)
                continue
            a = x.args
            if op in ("add", "sub", "mul", "div") or op in sm.COMPARE:
                rhs = f"{num(a[0])} {sm._SYMBOL[op]} {num(a[1])}"
            elif op == "neg":
                rhs = f"-{num(a[0])}"
            elif op == "where":
                cond = text[a[0]] if is_bool[a[0]] else f"{text[a[0]]} != 0"
                rhs = tg.select(cond, num(a[1]), num(a[2]))
            elif op == "tanh":
                rhs = f"{tg.tanh}({num(a[0])})"
            elif op == "exp":
                rhs = f"{tg.exp}({num(a[0])})"
            elif op == "exp2":   # lowering-only ops (a target that rewrites tanh / exp)
                rhs = f"{tg.exp2}({num(a[0])})"
            elif op == "recip":
                rhs = f"_dt(1.0) / {num(a[0])}"
            elif op in ("log", "sqrt"):
                rhs = f"_dt(math.{op}({num(a[0])}))"
            elif op == "abs":
                rhs = f"abs({num(a[0])})"
            elif op == "sign":
                v = num(a[0])
                rhs = tg.select(f"{v} > 0", "_dt(1.0)", f"({tg.select(f'{v} < 0', '_dt(-1.0)', '_dt(0.0)')})")
            elif op == "minimum":
                rhs = tg.select(f"{num(a[0])} <= {num(a[1])}", num(a[0]), num(a[1]))
            elif op == "maximum":
                rhs = tg.select(f"{num(a[0])} >= {num(a[1])}", num(a[0]), num(a[1]))
            elif op == "leaky_relu":
                v = num(a[0])
                rhs = tg.select(f"{v} > 0", v, f"{num(a[1])} * {v}")
            else:  # pragma: no cover - the tracer builds only the ops above
                raise NotImplementedError(f"score modifier op {op!r} has no code generator")
            name = f"{tg.temp}{n}"
            n += 1
            lines.append(f"    {name} = {rhs}")
            text[x] = name
        return lines, num

    def value(self, name="value"):
        lines, num = self._emit([self.tree])
        body = "\n".join(lines)
        return (f"def {name}({self.target.value_args}):\n{body}\n"
                f"    v = {num(self.tree)}\n"
                f"    if v > _BIG:\n        return _BIG\n"
                f"    if v > _NEG:\n        return v\n"
                f"    return {self.target.masked}\n")

    def slope(self, name="slope"):
        """value and df/ds together, their common subexpressions computed once: what a backward
        needs per cell when no leaf wants a gradient (soft-cap: one tanh where value and grad
        made two). Returns (the clamped value as `value`'s, df/ds)."""
        d = sm.diff(self.tree, sm.SCORE)
        lines, num = self._emit([self.tree, d])
        body = "\n".join(lines)
        return (f"def {name}({self.target.value_args}):\n{body}\n"
                f"    v = {num(self.tree)}\n"
                f"    g = {num(d)}\n"
                # where the clamp holds f constant (NaN or -inf masks the edge; +inf is capped),
                # df/ds is 0: the masked cell's p = 0 times a NaN f' would be NaN
                f"    if v > _BIG:\n        return _BIG, _dt(0.0)\n"
                f"    if v > _NEG:\n        return v, g\n"
                f"    return {self.target.masked}, _dt(0.0)\n")

    def grad(self, name, targets):
        rows, edges = self.grad_groups(targets)
        wanted = rows + edges
        derivs = [sm.diff(self.tree, sm.SCORE)] + [sm.diff(self.tree, x) for x in wanted]
        lines, num = self._emit([self.tree] + derivs)
        out = [f"def {name}({self.target.grad_args}):"] + lines
        # a cell whose value the clamp holds constant (NaN / -inf: the edge is masked; above the
        # cap) has no gradient: nothing is accumulated, and its p = 0 never meets a NaN f'
        out.append(f"    v = {num(self.tree)}")
        out.append("    if not (v > _NEG and v <= _BIG):\n        return dF * _dt(0.0)")
        for x, dx in zip(wanted, derivs[1:]):
            if dx == sm.ZERO:
                continue
            pos = (rows if kind(x) != "edge" else edges).index(x)
            out.append("    " + self.target.accumulate(x, self.layout.slot[x], pos, f"dF * {num(dx)}"))
        out.append(f"    return dF * {num(derivs[0])}")
        return "\n".join(out) + "\n"

    def constants(self, dt):
        """{global name: value in dtype dt} of the constants and the clamp bounds."""
        g = {name: dt(v) for v, name in self.consts.items()}
        g["_NEG"], g["_BIG"] = dt(NEG), dt(BIG)
        return g


class Compiled:
    """The compiled value / gradient functions of one (tree, gradient leaves, dtype) on one
    backend. A backend subclass gives its Target (`_target`), the globals its texts read
    (`_globals`: `_dt`, tanh / exp) and the decorator that compiles a text (`_compile`);
    `_grad_entry` may wrap what `grad` returns."""

    def __init__(self, tree, grad_leaves, dtype_name):
        self.tree = tree
        self.layout = sm.Layout(tree)
        self.grad_leaves = tuple(grad_leaves)
        self.dtype_name = dtype_name
        self.sources = {}
        self._src = Source(tree, grad_leaves, self._target())
        self.value = self._build("value", self._src.value())
        self._grads = {}

    @property
    def key(self):
        """What a kernel compiled with these functions is cached under."""
        return (self.tree, self.grad_leaves)

    def grad(self, targets):
        """The gradient function that accumulates the leaves of kinds `targets` (memoised)."""
        key = tuple(t for t in TARGETS if t in targets)
        got = self._grads.get(key)
        if got is None:
            name = "grad_" + ("_".join(key) or "score")
            fn = self._build(name, self._src.grad(name, key))
            got = self._grads[key] = self._grad_entry(fn, key)
        return got

    def slope(self):
        """The function returning (value, df/ds) of a cell (Source.slope), memoised."""
        got = self._grads.get("slope")
        if got is None:
            got = self._grads["slope"] = self._build("slope", self._src.slope())
        return got

    def _build(self, name, source):
        self.sources[name] = source
        dt = np.float32 if self.dtype_name == "float32" else np.float64
        g = self._globals(dt)
        g.update(self._src.constants(dt))
        exec(compile(source, f"<score modifier {name}: {self.tree}>", "exec"), g)
        return self._compile(g[name])

    def _grad_entry(self, fn, key):
        return fn

    def _target(self):
        raise NotImplementedError

    def _globals(self, dt):
        raise NotImplementedError

    def _compile(self, fn):
        raise NotImplementedError


def memoised(cls):
    """generated(tree, grad_leaves, dtype_name): one `cls` instance per key for the life of the
    process (exec'd functions compile once), safe across threads."""
    memo = {}
    lock = threading.Lock()

    def generated(tree, grad_leaves, dtype_name):
        key = (tree, tuple(grad_leaves), dtype_name)
        with lock:
            g = memo.get(key)
            if g is None:
                g = memo[key] = cls(tree, grad_leaves, dtype_name)
        return g

    generated.__doc__ = f"The memoised {cls.__module__}.{cls.__name__} of (tree, grad_leaves, dtype)."
    return generated
