"""Symbolic stand-ins that `MessagePassing.edge()` is traced with.

`edge()` never sees data. It receives role objects whose attributes are `Field`s, params
that are `ScalarExpr`s, and builds from them a small expression. Every Python/numpy
operation a stand-in does not know raises NotImplementedError naming the construct, so a
program either lowers to a compiled kernel or fails loudly; nothing is evaluated eagerly.

Recognised algebra (everything else refuses):
  * scalars (params, Python/numpy numbers) combine freely with + - * / ** and unary numpy
    ufuncs; they are evaluated once per call, at lowering time;
  * fields multiply elementwise with fields and scale with scalars (`Product`);
  * `Product.sum(axis=-1)` of exactly one src field and one dst field is a dot score;
  * scores scale with scalars and add per-edge fields (`edge.bias`) or other such scores;
  * a traced score network called on fields is a score of its own (not combinable).
"""
from __future__ import annotations

import numbers
import operator

import numpy as np

ROLES = ("src", "dst", "edge")


def _refuse(construct):
    raise NotImplementedError(
        f"edge() uses {construct}, which tiga_numba cannot lower to a compiled kernel. "
        "Recognised: score = (src.a * dst.b).sum(axis=-1) [* or / scalar params] "
        "[+ edge.bias], a per-edge score field edge.score, a tg.nn.trace score network "
        "self.net(fields...), or an elementwise score modifier of these (arithmetic, "
        "comparisons, np.where, np.tanh/exp/log/abs/sqrt/minimum/maximum, tg.leaky_relu; per-head "
        "params, per-node fields, src.index/dst.index); return self.reducer(score, src.value). "
        "See docs/program.md and docs/score_mods.md.")


#: the largest whole exponent `x ** n` takes on a per-edge quantity (written out as n - 1 products)
MAX_POWER = 8


def _written_out_power(n):
    """n as a whole number 1..MAX_POWER, or 0.5, where `x ** n` can be written out; else None."""
    if isinstance(n, (bool, np.bool_)) or not is_number(n):
        return None
    v = float(n)
    if v == 0.5:
        return 0.5
    return int(v) if v.is_integer() and 1 <= v <= MAX_POWER else None


def is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


# --------------------------------------------------------------------------- base
class Symbolic:
    """Base of every stand-in: anything not explicitly supported refuses by name."""

    __array_priority__ = 1000  # numpy scalars defer to our reflected operators

    def describe(self):  # pragma: no cover - overridden
        return "a symbolic value"

    def __repr__(self):
        return f"<symbolic {self.describe()}>"

    # numpy protocol: arithmetic ufuncs map to our operators, np.sum to .sum, rest refuses
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if getattr(np, ufunc.__name__, None) is not ufunc:
            # another library's ufunc (scipy.special.expit, ...): matched by name it could pass
            # for numpy's own of that name, and its name with "np." would be wrong
            _refuse(f"the ufunc {ufunc.__name__} (not one of numpy's) on {self.describe()}")
        if method == "__call__" and not kwargs:
            mod_op = _MOD_UFUNCS.get(ufunc.__name__)
            if mod_op is not None and len(inputs) == ufunc.nin and any(
                    _is_modifier_operand(x) for x in inputs):
                return modify(mod_op, *inputs, construct=f"np.{ufunc.__name__}")
            op = _UFUNC_OPERATORS.get(ufunc.__name__)
            if op is None and mod_op is not None and len(inputs) == ufunc.nin and any(
                    isinstance(x, ScalarExpr) for x in inputs):
                # np.tanh / np.minimum / np.maximum / comparisons of scalar params: a modifier
                # node over scalar leaves (no cell changes it: the kernels compute it once per call)
                return modify(mod_op, *inputs, construct=f"np.{ufunc.__name__}")
            if op is not None and len(inputs) == ufunc.nin:
                for x in inputs:
                    if not isinstance(x, Symbolic) and not is_number(x):
                        _refuse(f"np.{ufunc.__name__} mixing {self.describe()} with "
                                f"{_describe(x)}")
                # numpy scalars become Python numbers: their own operators would loop back here
                return op(*(x.item() if isinstance(x, np.generic) else x for x in inputs))
        _refuse(f"np.{ufunc.__name__}{'.' + method if method != '__call__' else ''} on "
                f"{self.describe()}")

    def __array_function__(self, func, types, args, kwargs):
        if func is np.sum and args and args[0] is self:
            return self.sum(*args[1:], **kwargs)
        if func is np.where:
            if kwargs or len(args) != 3:
                _refuse("np.where with other than three positional arguments (condition, x, y)")
            return modify("where", *args, construct="np.where")
        _refuse(f"np.{func.__name__} on {self.describe()}")

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol probes (copy, pickle, numpy) must see "absent"
        if name in ("shape", "ndim", "dtype", "size"):
            _refuse(f"{self.describe()}.{name} (sizes and dtypes are not traced; pass derived "
                    "scalars such as scale as params)")
        _refuse(f"{self.describe()}.{name}")

    def __bool__(self):
        _refuse(f"bool() of {self.describe()} (data-dependent control flow)")

    def __float__(self):
        _refuse(f"float() of {self.describe()} (math.* functions or eager evaluation)")

    def __int__(self):
        _refuse(f"int() of {self.describe()}")

    def __index__(self):
        _refuse(f"{self.describe()} as an index")

    def __complex__(self):
        _refuse(f"complex() of {self.describe()}")

    def __len__(self):
        _refuse(f"len() of {self.describe()}")

    def __iter__(self):
        _refuse(f"iteration over {self.describe()}")

    def __getitem__(self, key):
        _refuse(f"indexing or slicing {self.describe()}")

    def __setitem__(self, key, value):
        _refuse(f"item assignment into {self.describe()}")

    def __eq__(self, other):
        _refuse(f"comparison (==) of {self.describe()}")

    def __ne__(self, other):
        _refuse(f"comparison (!=) of {self.describe()}")

    def __lt__(self, other):
        _refuse(f"comparison (<) of {self.describe()}")

    def __le__(self, other):
        _refuse(f"comparison (<=) of {self.describe()}")

    def __gt__(self, other):
        _refuse(f"comparison (>) of {self.describe()}")

    def __ge__(self, other):
        _refuse(f"comparison (>=) of {self.describe()}")

    __hash__ = object.__hash__

    def __abs__(self):
        _refuse(f"abs() of {self.describe()}")

    def __pow__(self, other):
        # x ** n for a whole n from 1 to MAX_POWER is written out as the product x * x * ...,
        # x ** 0.5 as np.sqrt(x): operations every kernel family already compiles, forward and
        # backward. Other exponents would need a power node no kernel has.
        n = _written_out_power(other)
        if n is None:
            _refuse(f"a power (**) of {self.describe()} with exponent {_describe(other)} (whole "
                    f"exponents 1 to {MAX_POWER} and 0.5 are taken; write another with np.exp and np.log)")
        if n == 0.5:
            return np.sqrt(self)
        out = self
        for _ in range(n - 1):
            out = out * self
        return out

    def __rpow__(self, other):
        _refuse(f"a power (**) with exponent {self.describe()}")

    def __round__(self, ndigits=None):
        _refuse(f"round() of {self.describe()}")

    def __invert__(self):
        _refuse(f"a bitwise not (~) of {self.describe()}")

    def __rtruediv__(self, other):
        _refuse(f"a division by {self.describe()}")

    def __pos__(self):
        return self

    def __neg__(self):
        return self * -1

    def __sub__(self, other):
        return self + (-other if isinstance(other, Symbolic) or is_number(other) else _bad(other))

    def __rsub__(self, other):
        return (-self) + other

    def __add__(self, other):
        _refuse(f"adding {_describe(other)} to {self.describe()}")

    def __radd__(self, other):
        return self.__add__(other)

    def __mul__(self, other):
        _refuse(f"multiplying {self.describe()} by {_describe(other)}")

    def __rmul__(self, other):
        return self.__mul__(other)

    def __truediv__(self, other):
        _refuse(f"dividing {self.describe()} by {_describe(other)}")

    def sum(self, *args, **kwargs):
        _refuse(f"a sum over {self.describe()}")


def _refusing(what):
    def method(self, other):
        _refuse(f"{what} of {self.describe()}")
    return method


# binary operators with no score meaning, both operand orders. The bitwise ones: Python's
# `and` / `or` of comparisons would need bool(); np.where combines conditions
for _names, _what in ((("__matmul__", "__rmatmul__"), "a matrix product (@)"),
                      (("__mod__", "__rmod__"), "a modulo (%)"),
                      (("__floordiv__", "__rfloordiv__"), "a floor division (//)"),
                      (("__divmod__", "__rdivmod__"), "divmod()"),
                      (("__and__", "__rand__"), "a bitwise and (&) (combine conditions with np.where)"),
                      (("__or__", "__ror__"), "a bitwise or (|) (combine conditions with np.where)"),
                      (("__xor__", "__rxor__"), "a bitwise xor (^)"),
                      (("__lshift__", "__rlshift__"), "a shift (<<)"),
                      (("__rshift__", "__rrshift__"), "a shift (>>)")):
    for _name in _names:
        setattr(Symbolic, _name, _refusing(_what))


def _bad(other):
    _refuse(f"an operand of type {type(other).__name__}")


def _describe(x):
    if x is None:
        return "None"
    if isinstance(x, Symbolic):
        return x.describe()
    if is_number(x):
        return f"the constant {x!r}"
    return f"a {type(x).__name__} object (arrays or other data inside edge() are not traced)"


def _ufunc_unary(name):
    def apply(x):
        if isinstance(x, ScalarExpr):
            return ScalarExpr("ufunc", name, (x,))
        _refuse(f"np.{name} on {_describe(x)}")
    return apply


# numpy ufuncs that build score-modifier nodes when an operand is a per-edge quantity
_MOD_UFUNCS = {"tanh": "tanh", "exp": "exp", "log": "log", "sqrt": "sqrt", "absolute": "abs",
               "minimum": "minimum", "maximum": "maximum", "greater": "gt", "greater_equal": "ge",
               "less": "lt", "less_equal": "le", "equal": "eq", "not_equal": "ne"}

_UFUNC_OPERATORS = {
    "multiply": operator.mul, "true_divide": operator.truediv, "divide": operator.truediv,
    "add": operator.add, "subtract": operator.sub, "negative": operator.neg,
    "positive": operator.pos, "power": operator.pow,
    "square": lambda x: x ** 2,   # written out as x * x, per-edge quantity or scalar alike
}
# Unary ufuncs are fine on scalars (params): evaluated once per call when lowering.
for _name in ("sqrt", "exp", "log", "log2", "exp2", "reciprocal", "abs", "absolute"):
    _UFUNC_OPERATORS[_name] = _ufunc_unary(_name)


# --------------------------------------------------------------------------- scalars
class ScalarExpr(Symbolic):
    """A scalar built from params and constants; evaluated per call (never traced twice)."""

    __slots__ = ("op", "arg", "children")

    def __init__(self, op, arg=None, children=()):
        object.__setattr__(self, "op", op)  # "param" | "const" | "bin" | "ufunc"
        object.__setattr__(self, "arg", arg)
        object.__setattr__(self, "children", tuple(children))

    @staticmethod
    def const(value):
        return ScalarExpr("const", value)

    @staticmethod
    def lift(x):
        if isinstance(x, ScalarExpr):
            return x
        if is_number(x):
            return ScalarExpr.const(x)
        return None

    def describe(self):
        if self.op == "param":
            return f"the param {self.arg!r}"
        return f"the scalar {self}"

    def __str__(self):
        if self.op == "param":
            return self.arg
        if self.op == "const":
            return repr(float(self.arg)) if not isinstance(self.arg, int) else str(self.arg)
        if self.op == "ufunc":
            return f"{self.arg}({self.children[0]})"
        a, b = self.children
        return f"({a} {self.arg} {b})"

    def params(self):
        if self.op == "param":
            return {self.arg}
        out = set()
        for c in self.children:
            out |= c.params()
        return out

    def is_one(self):
        return self.op == "const" and self.arg == 1

    def evaluate(self, values):
        if self.op == "param":
            return values[self.arg]
        if self.op == "const":
            return float(self.arg)
        if self.op == "ufunc":
            return float(getattr(np, self.arg)(np.float64(self.children[0].evaluate(values))))
        a, b = (c.evaluate(values) for c in self.children)
        return float(_BINOPS[self.arg](np.float64(a), np.float64(b)))

    def derivatives(self, values):
        """{param: d self / d param} at `values` for every param the expression reads (float64,
        forward mode). |x| has derivative 0 at 0, as the score modifiers' abs."""
        return self._forward(values)[1]

    def _forward(self, values):
        if self.op == "param":
            return float(values[self.arg]), {self.arg: 1.0}
        if self.op == "const":
            return float(self.arg), {}
        if self.op == "ufunc":
            a, da = self.children[0]._forward(values)
            with np.errstate(all="ignore"):
                x = np.float64(a)
                slope = {"sqrt": lambda: 0.5 / np.sqrt(x), "exp": lambda: np.exp(x),
                         "log": lambda: 1.0 / x, "log2": lambda: 1.0 / (x * np.log(2.0)),
                         "exp2": lambda: np.exp2(x) * np.log(2.0), "reciprocal": lambda: -1.0 / (x * x),
                         "abs": lambda: np.sign(x), "absolute": lambda: np.sign(x)}[self.arg]()
            return self.evaluate(values), {p: float(slope) * d for p, d in da.items()}
        (a, da), (b, db) = (c._forward(values) for c in self.children)
        with np.errstate(all="ignore"):
            x, y = np.float64(a), np.float64(b)
            if self.arg == "+":
                sa, sb = 1.0, 1.0
            elif self.arg == "-":
                sa, sb = 1.0, -1.0
            elif self.arg == "*":
                sa, sb = y, x
            elif self.arg == "/":
                sa, sb = 1.0 / y, -x / (y * y)
            else:   # x ** y: the y-derivative x^y ln x only where y varies
                sa = y * x ** (y - 1.0)
                sb = x ** y * np.log(x) if db else 0.0
            value = float(_BINOPS[self.arg](x, y))
        out = {p: float(sa) * d for p, d in da.items()}
        for p, d in db.items():
            out[p] = out.get(p, 0.0) + float(sb) * d
        return value, out

    def _bin(self, sym, other, swap=False):
        o = ScalarExpr.lift(other)
        if o is None:
            return NotImplemented
        a, b = (o, self) if swap else (self, o)
        if sym == "*" and a.is_one():
            return b
        if sym in ("*", "/") and b.is_one():
            return a
        return _fold(ScalarExpr("bin", sym, (a, b)))

    def __add__(self, other):
        return self._bin("+", other)

    def __radd__(self, other):
        return self._bin("+", other, swap=True)

    def __sub__(self, other):
        return self._bin("-", other)

    def __rsub__(self, other):
        return self._bin("-", other, swap=True)

    def __mul__(self, other):
        return self._bin("*", other)

    def __rmul__(self, other):
        return self._bin("*", other, swap=True)

    def __truediv__(self, other):
        return self._bin("/", other)

    def __rtruediv__(self, other):
        return self._bin("/", other, swap=True)

    def __pow__(self, other):
        return self._bin("**", other)

    def __rpow__(self, other):
        return self._bin("**", other, swap=True)

    def __neg__(self):
        return self._bin("*", -1, swap=True)

    def _compare(self, other, sym):
        if _is_modifier_operand(other):
            return NotImplemented  # the score side builds the modifier node (reflected)
        _refuse(f"comparison ({sym}) of {self.describe()} (scalar params are not traced as "
                "conditions)")

    def __lt__(self, other):
        return self._compare(other, "<")

    def __le__(self, other):
        return self._compare(other, "<=")

    def __gt__(self, other):
        return self._compare(other, ">")

    def __ge__(self, other):
        return self._compare(other, ">=")

    __hash__ = object.__hash__


_SYMBOL_OF = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_BINOPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "**": operator.pow}
ONE = ScalarExpr.const(1)


def param(name):
    return ScalarExpr("param", name)


def _fold(e):
    """Constant-fold a binary node of two constants (so forms print as -0.5, not (0.5 * -1))."""
    a, b = e.children
    if a.op == "const" and b.op == "const":
        try:
            v = _BINOPS[e.arg](a.arg, b.arg)
        except (ArithmeticError, ValueError):
            return e  # e.g. 1 / 0: left for evaluation, which reports it per call
        if is_number(v):
            return ScalarExpr.const(v)
    return e


def _times(a, b):
    """Product of two factors, dropping the constant 1 so forms print cleanly."""
    if a.is_one():
        return b
    if b.is_one():
        return a
    return _fold(ScalarExpr("bin", "*", (a, b)))


# --------------------------------------------------------------------------- fields
class Product(Symbolic):
    """factor * f1 * f2 * ... elementwise over per-edge views of node/edge fields."""

    __slots__ = ("fields", "factor")

    def __init__(self, fields, factor=ONE):
        object.__setattr__(self, "fields", tuple(fields))
        object.__setattr__(self, "factor", factor)

    def describe(self):
        body = " * ".join(f.ref for f in self.fields)
        if not self.factor.is_one():
            body = f"{self.factor} * {body}"
        return body if len(self.fields) == 1 and self.factor.is_one() else f"({body})"

    def is_edge_field(self):
        return len(self.fields) == 1 and self.fields[0].role == "edge"

    def __mul__(self, other):
        if isinstance(other, Product):
            return Product(self.fields + other.fields, _times(self.factor, other.factor))
        s = ScalarExpr.lift(other)
        if s is not None:
            return Product(self.fields, _times(self.factor, s))
        if isinstance(other, Symbolic):
            return NotImplemented if isinstance(other, (Score,)) else other.__rmul__(self)
        _bad(other)

    def __rmul__(self, other):
        return self.__mul__(other)

    def __truediv__(self, other):
        s = ScalarExpr.lift(other)
        if s is None:
            return modify("div", self, other, construct="a division")
        return Product(self.fields, _fold(ScalarExpr("bin", "/", (self.factor, s))))

    def __rtruediv__(self, other):
        return modify("div", other, self, construct="a division")

    def __sub__(self, other):
        if self.is_edge_field() and _linear_term(other):
            return self + (-other)
        return modify("sub", self, other, construct="a subtraction")

    def __rsub__(self, other):
        if self.is_edge_field() and _linear_term(other):
            return (-self) + other
        return modify("sub", other, self, construct="a subtraction")

    def __add__(self, other):
        if self.is_edge_field() and isinstance(other, (Score, Product)) and (
                not isinstance(other, Product) or other.is_edge_field()):
            return as_score(self, "an addition") + other
        return modify("add", self, other, construct="an addition")

    def sum(self, axis=None, dtype=None, out=None, keepdims=False, *, dim=None, **extra):
        if extra:
            _refuse(f"sum(...) with {', '.join(sorted(extra))}= on {self.describe()}")
        if dim is not None:
            if axis is not None:
                raise TypeError("sum() got both axis= and dim=; give one")
            axis = dim
        if dtype is not None or out is not None or keepdims:
            _refuse(f"sum(dtype=/out=/keepdims=) on {self.describe()}")
        fields = self.fields
        if len(fields) != 2:
            _refuse(f"a sum over the product of {len(fields)} field(s) {self.describe()} "
                    "(a dot score multiplies exactly one src field by one dst field)")
        roles = sorted(f.role for f in fields)
        if roles != ["dst", "src"]:
            _refuse(f"a sum over {self.describe()} (a dot score pairs one src field with one "
                    "dst field)")
        src_f = fields[0] if fields[0].role == "src" else fields[1]
        dst_f = fields[1] if src_f is fields[0] else fields[0]
        if src_f.ndim != dst_f.ndim:
            raise ValueError(f"{src_f.ref} has {src_f.ndim} dims but {dst_f.ref} has {dst_f.ndim}; "
                             "a dot score needs two fields of the same rank")
        last = src_f.ndim - 1
        if axis is None:
            _refuse(f"a sum over all axes of {self.describe()} (use axis=-1 / dim=-1)")
        if isinstance(axis, tuple) or not isinstance(axis, numbers.Integral) or axis not in (-1, last):
            _refuse(f"a sum over axis={axis!r} of {self.describe()} (only the feature axis, "
                    "-1, forms a dot score)")
        return Score(dot=(src_f, dst_f), dot_factor=self.factor)


class Field(Product):
    """`role.name`: a node field read per edge (src -> source node, dst -> destination)."""

    __slots__ = ("role", "name", "ndim")

    def __init__(self, role, name, ndim):
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "ndim", ndim)
        Product.__init__(self, (self,), ONE)

    @property
    def ref(self):
        return f"{self.role}.{self.name}"

    def describe(self):
        return f"the field {self.ref}"

    @property
    def key(self):
        return (self.role, self.name)


# --------------------------------------------------------------------------- scores
class Score(Symbolic):
    """dot_factor * <src.a, dst.b>  +  sum_i c_i * edge.f_i,  or  net(fields...)."""

    __slots__ = ("dot", "dot_factor", "biases", "net")

    def __init__(self, dot=None, dot_factor=ONE, biases=(), net=None):
        object.__setattr__(self, "dot", dot)
        object.__setattr__(self, "dot_factor", dot_factor)
        object.__setattr__(self, "biases", tuple(biases))
        object.__setattr__(self, "net", net)

    def describe(self):
        return f"the score [{self.formula()}]"

    def formula(self):
        if self.net is not None:
            return self.net.formula()
        parts = []
        if self.dot is not None:
            s, d = self.dot
            term = f"<{s.ref}, {d.ref}>"
            parts.append(term if self.dot_factor.is_one() else f"{self.dot_factor} * {term}")
        for f, c in self.biases:
            parts.append(f.ref if c.is_one() else f"{c} * {f.ref}")
        return " + ".join(parts)

    def fields(self):
        if self.net is not None:
            return list(self.net.args)
        out = list(self.dot) if self.dot is not None else []
        return out + [f for f, _ in self.biases]

    def _scaled(self, s):
        if self.net is not None:
            _refuse(f"scaling the output of the score network {self.net.attr} (fold the factor "
                    "into the network's last layer)")
        return Score(self.dot, _times(self.dot_factor, s), [(f, _times(c, s)) for f, c in self.biases])

    def __mul__(self, other):
        s = ScalarExpr.lift(other)
        if s is None:
            if not isinstance(other, Symbolic):
                _bad(other)
            if self.net is not None:
                _refuse(f"multiplying the output of the score network {self.net.attr} by "
                        f"{other.describe()} (a network score must be the whole score)")
            return modify("mul", self, other, construct="a product")
        return self._scaled(s)

    def __truediv__(self, other):
        s = ScalarExpr.lift(other)
        if s is None:
            if not isinstance(other, Symbolic):
                _bad(other)
            return modify("div", self, other, construct="a division")
        return self._scaled(_fold(ScalarExpr("bin", "/", (ONE, s))))

    def __rtruediv__(self, other):
        return modify("div", other, self, construct="a division")

    def __add__(self, other):
        if self.net is not None or (isinstance(other, Score) and other.net is not None):
            _refuse("adding to the output of a score network (a network score must be the whole "
                    "score)")
        if isinstance(other, Product) and other.is_edge_field():
            other = as_score(other, "an addition")
        if not isinstance(other, Score) or (self.dot is not None and other.dot is not None):
            if not (isinstance(other, Symbolic) or is_number(other)):
                _bad(other)
            return modify("add", self, other, construct="an addition")
        dot, factor = (self.dot, self.dot_factor) if self.dot is not None else (other.dot, other.dot_factor)
        return Score(dot, factor, self.biases + other.biases)

    def __sub__(self, other):
        if _linear_term(other):
            return self + (-other)
        return modify("sub", self, other, construct="a subtraction")

    def __rsub__(self, other):
        if _linear_term(other):
            return (-self) + other
        return modify("sub", other, self, construct="a subtraction")


def _linear_term(x):
    """x joins a score linearly (an edge field or a bias-only score): kept as an edge bias."""
    return (isinstance(x, Product) and x.is_edge_field()) or (
        isinstance(x, Score) and x.dot is None and x.net is None)


def as_score(x, where):
    """The score argument of the reducer: a Score, or one edge field (precomputed score)."""
    if isinstance(x, ScoreExpr):
        return finalize(x)
    if isinstance(x, Score):
        return x
    if isinstance(x, Product) and x.is_edge_field():
        return Score(biases=[(x.fields[0], x.factor)])
    if isinstance(x, Product) and all(f.ndim is not None and f.ndim <= 2 for f in x.fields):
        # a product of (N,) / (N, H) node fields and (E,) / (E, H) edge fields (src.a * dst.a,
        # c * src.a) is a per-edge score of its own: an elementwise expression of fields, as any
        # modifier; the lowering checks that each field is (N,) or (N, H)
        tree, dot, scalars = _to_mod(x, "the score")
        return finalize(ScoreExpr(tree, dot, scalars))
    if isinstance(x, Product):
        _refuse(f"{x.describe()} as a score in {where} (an unsummed product or a node field is "
                "not a per-edge score; did you forget .sum(axis=-1)?)")
    if isinstance(x, Symbolic):
        _refuse(f"{x.describe()} as a score in {where}")
    _refuse(f"{_describe(x)} as a score in {where}")


class NetCall:
    """A traced score network called on fields: records what lowering needs."""

    def __init__(self, attr, net, args):
        self.attr = attr
        self.net = net
        self.args = tuple(args)

    def formula(self):
        return f"{self.attr}({', '.join(a.ref for a in self.args)})"


class NetStandIn:
    """What `self.<attr>` is during tracing when the attribute is a traced score network."""

    def __init__(self, attr, net):
        self._attr = attr
        self._net = net

    def __call__(self, *args, **kwargs):
        if kwargs:
            _refuse(f"keyword arguments ({', '.join(kwargs)}) to the score network {self._attr}")
        if not args:
            _refuse(f"calling the score network {self._attr} without fields")
        for i, a in enumerate(args):
            if not isinstance(a, Field):
                _refuse(f"{_describe(a)} as argument {i} of the score network {self._attr} "
                        "(its arguments must be plain fields such as edge.displacement, src.x)")
        return Score(net=NetCall(self._attr, self._net, args))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._net, name)


# --------------------------------------------------------------------------- roles
class Role:
    """`src`, `dst` or `edge` inside edge(): attribute access reads a field by name."""

    def __init__(self, role, fields, recorder):
        object.__setattr__(self, "_role", role)
        object.__setattr__(self, "_fields", dict(fields))  # name -> ndim
        object.__setattr__(self, "_recorder", recorder)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        fields = object.__getattribute__(self, "_fields")
        role = object.__getattribute__(self, "_role")
        if name == "index" and name not in fields and role != "edge":
            from . import score_mod as sm
            return ScoreExpr(sm.Expr("index", (), role))
        if name not in fields:
            given = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"edge() reads {role}.{name} but the call gives no {role} field "
                             f"{name!r} (given {role} fields: {given})")
        object.__getattribute__(self, "_recorder").add((role, name))
        return Field(role, name, fields[name])

    __getitem__ = __getattr__

    def __setattr__(self, name, value):
        raise NotImplementedError(f"assigning {object.__getattribute__(self, '_role')}.{name} "
                                  "inside edge() (fields are read-only)")

    def __repr__(self):
        return f"<role {object.__getattribute__(self, '_role')}>"


class ReducerOutput(Symbolic):
    """The result of the reducer call: edge() must return it unchanged."""

    __slots__ = ("call",)

    def __init__(self, call):
        object.__setattr__(self, "call", call)

    def describe(self):
        return "the reducer output (post-processing after the reduction)"


# --------------------------------------------------------------------------- score modifiers
class HeadParam(Symbolic):
    """A param given as an array of shape (H,): one value per head (ALiBi slopes)."""

    __slots__ = ("name",)

    def __init__(self, name):
        object.__setattr__(self, "name", name)

    def describe(self):
        return f"the per-head param {self.name!r}"


class ScoreExpr(Symbolic):
    """An elementwise expression of the score (a score modifier), lowered to one tree of
    tiga_numba.score_mod. `dot` is (src field, dst field, factor) of the one dot score the
    tree's "score" leaf stands for (None: no dot product); `scalars` maps the text of each
    scalar-param leaf to its ScalarExpr (evaluated per call)."""

    __slots__ = ("expr", "dot", "scalars")

    def __init__(self, expr, dot=None, scalars=None):
        object.__setattr__(self, "expr", expr)
        object.__setattr__(self, "dot", dot)
        object.__setattr__(self, "scalars", dict(scalars or {}))

    def describe(self):
        return f"the score expression [{self.expr}]"

    def formula(self):
        text = str(self.expr)
        if self.dot is not None:
            s, d, factor = self.dot
            dot = f"<{s.ref}, {d.ref}>"
            text += f"  with s = {dot}" if factor.is_one() else f"  with s = {factor} * {dot}"
        return text

    def fields(self):
        from . import score_mod as sm
        out = list(self.dot[:2]) if self.dot is not None else []
        for leaf in sm.leaves(self.expr):
            if leaf.op == "node":
                role, name = leaf.attr
                out.append(Field(role, name, 0))
            elif leaf.op == "edge":
                out.append(Field("edge", leaf.attr, 0))
        return out

    def __bool__(self):
        _refuse(f"bool() of {self.describe()} (data-dependent control flow; use np.where)")

    def __abs__(self):
        return modify("abs", self, construct="abs()")


def _is_modifier_operand(x):
    return isinstance(x, Symbolic) and not isinstance(x, (ScalarExpr, ReducerOutput))


def _to_mod(x, construct):
    """Operand -> (tree, dot, scalars) for a score-modifier node."""
    from . import score_mod as sm
    if isinstance(x, ScoreExpr):
        return x.expr, x.dot, x.scalars
    if isinstance(x, bool) or isinstance(x, np.bool_):
        _refuse(f"the boolean constant {x!r} in {construct}")
    if is_number(x):
        return sm.const(x), None, {}
    if isinstance(x, np.generic) and is_number(x.item()):
        return sm.const(x.item()), None, {}
    if isinstance(x, ScalarExpr):
        if x.op == "const":
            return sm.const(x.arg), None, {}
        text = str(x)
        return sm.Expr("scalar", (), text), None, {text: x}
    if isinstance(x, HeadParam):
        return sm.Expr("head", (), x.name), None, {}
    if isinstance(x, Score):
        if x.net is not None:
            _refuse(f"{construct} on the output of the score network {x.net.attr} (a network "
                    "score must be the whole score)")
        tree, scalars = sm.ZERO, {}
        dot = None
        if x.dot is not None:
            # the dot score scaled by its factor; resolved to the "score" leaf by finalize()
            text = str(x.dot_factor)
            tree = sm.Expr("dot", (), text)
            scalars[text] = x.dot_factor
            dot = (x.dot[0], x.dot[1], None)
        for f, c in x.biases:
            term, _, sc = _to_mod(f, construct)
            ct, _, sc2 = _to_mod(c, construct)
            scalars.update(sc)
            scalars.update(sc2)
            tree = sm.make("add", tree, sm.make("mul", ct, term))
        return tree, dot, scalars
    if isinstance(x, Field):
        if x.role == "edge":
            return sm.Expr("edge", (), x.name), None, {}
        return sm.Expr("node", (), (x.role, x.name)), None, {}
    if isinstance(x, Product):
        tree, _, scalars = _to_mod(x.factor, construct)
        for f in x.fields:
            tree = sm.make("mul", tree, _to_mod(f, construct)[0])
        return tree, None, scalars
    if isinstance(x, Symbolic):
        _refuse(f"{construct} with {x.describe()}")
    _refuse(f"{construct} with {_describe(x)}")


def _dot_key(dot):
    s, d, _ = dot
    return (s.key, d.key)


def finalize(se):
    """The modifier as the kernels see it: its dot leaves become the one "score" leaf. When
    every use of the dot product has the same factor (``c * tanh(s / c)`` folds 1 / c into it),
    the factor scales q once; otherwise the leaf is the unscaled dot product and each use
    multiplies by its own factor."""
    from . import score_mod as sm
    dots = sm.leaves(se.expr, "dot")
    used = {x.attr for x in sm.leaves(se.expr, "scalar")}
    scalars = {t: v for t, v in se.scalars.items() if t in used}
    if not dots:
        return ScoreExpr(se.expr, None, scalars)
    if len({d.attr for d in dots}) == 1:
        factor = se.scalars[dots[0].attr]
        tree = sm.substitute(se.expr, {dots[0]: sm.SCORE})
    else:
        factor = ONE
        mapping = {}
        for d in dots:
            f = se.scalars[d.attr]
            if f.op == "const":
                fx = sm.const(f.arg)
            else:
                fx = sm.Expr("scalar", (), d.attr)
                scalars[d.attr] = f
            mapping[d] = sm.make("mul", fx, sm.SCORE)
        tree = sm.substitute(se.expr, mapping)
    return ScoreExpr(tree, (se.dot[0], se.dot[1], factor), scalars)


def modify(op, *operands, construct=None):
    """A score-modifier node `op` over the operands (scores, fields, params, numbers)."""
    from . import score_mod as sm
    construct = construct or op
    trees, dot, scalars = [], None, {}
    for x in operands:
        t, d, sc = _to_mod(x, construct)
        if d is not None:
            if dot is not None and _dot_key(dot) != _dot_key(d):
                _refuse(f"{construct} combining two different dot scores "
                        f"<{dot[0].ref}, {dot[1].ref}> and <{d[0].ref}, {d[1].ref}>: a score has "
                        "one dot product, not two dot scores")
            dot = dot or d
        scalars.update(sc)
        trees.append(t)
    if op == "where":
        trees[0] = trees[0] if trees[0].is_bool else sm.Expr("ne", (trees[0], sm.ZERO))
    if op in sm.COMPARE or op == "where" or op == "leaky_relu":
        expr = sm.make(op, *trees) if op == "where" else sm.Expr(op, trees)
    else:
        expr = sm.make(op, *trees)
    return ScoreExpr(expr, dot, scalars)


def leaky_relu_symbolic(x, negative_slope):
    if not (is_number(negative_slope) or isinstance(negative_slope, ScalarExpr)):
        _refuse(f"tg.leaky_relu with negative_slope {_describe(negative_slope)} (a number or a "
                "scalar param)")
    return modify("leaky_relu", x, negative_slope, construct="tg.leaky_relu")


def _binary(op, swap=False, construct=None):
    def method(self, other):
        if not (_is_modifier_operand(other) or isinstance(other, ScalarExpr) or is_number(other)
                or (isinstance(other, np.generic) and is_number(other.item()))):
            _refuse(f"{construct or op} of {self.describe()} with {_describe(other)}")
        return modify(op, other, self, construct=construct) if swap else modify(
            op, self, other, construct=construct)
    return method


_ARITH = {"__add__": ("add", False, "an addition"), "__radd__": ("add", True, "an addition"),
          "__sub__": ("sub", False, "a subtraction"), "__rsub__": ("sub", True, "a subtraction"),
          "__mul__": ("mul", False, "a product"), "__rmul__": ("mul", True, "a product"),
          "__truediv__": ("div", False, "a division"),
          "__rtruediv__": ("div", True, "a division")}
_COMPARISONS = {"__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__eq__": "eq",
                "__ne__": "ne"}

for _cls in (ScoreExpr, HeadParam):
    for _m, (_op, _swap, _what) in _ARITH.items():
        setattr(_cls, _m, _binary(_op, _swap, _what))
    _cls.__neg__ = lambda self: modify("neg", self, construct="a negation")
    _cls.__abs__ = lambda self: modify("abs", self, construct="abs()")
for _cls in (ScoreExpr, HeadParam, Score, Product):
    for _m, _op in _COMPARISONS.items():
        setattr(_cls, _m, _binary(_op, construct=f"a comparison ({_SYMBOL_OF[_op]})"))
    _cls.__hash__ = object.__hash__
Score.__abs__ = lambda self: modify("abs", self, construct="abs()")
# comparisons of scalar params are score-modifier conditions (np.where(c > 1, s, -s)); abs() of
# one is evaluated per call like np.abs
for _m, _op in _COMPARISONS.items():
    setattr(ScalarExpr, _m, _binary(_op, construct=f"a comparison ({_SYMBOL_OF[_op]})"))
ScalarExpr.__hash__ = object.__hash__
ScalarExpr.__abs__ = _ufunc_unary("absolute")
Product.__abs__ = lambda self: modify("abs", self, construct="abs()")
