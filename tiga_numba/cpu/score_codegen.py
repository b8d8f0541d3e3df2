"""Generate numba functions from a score-modifier tree (tiga_numba.score_mod).

For a tree ``f`` and a dtype this module has tiga_numba.score_source write small Python functions
as source text (the generator the CUDA backend shares; `CpuTarget` is the CPU's calling
convention), compiles them with ``numba.njit`` and memoises them per (tree, gradient leaves, dtype) for the life of
the process. The functions themselves are exec'd (not disk-cached), but a kernel that calls them
is: `jit_kernel` names it after a digest of their texts, constants and dtype (see there):

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

import hashlib
import math

import numpy as np
from numba import njit

from .. import score_source
from .fastexp import FASTMATH, exp2f

NEG = score_source.NEG  # blocks.NEG (not imported: blocks imports this module)
LOG2E = 1.0 / math.log(2.0)
TARGETS = score_source.TARGETS



#: tanh(x) = x P(x^2) / Q(x^2) on |x| <= 9 (beyond, float32's tanh is 1): a rational function fitted
#: for relative error, numerator and denominator of degree 4 in x^2 (benchmarks/tuning/fit_tanh.py
#: prints these coefficients and the float32 error). Evaluated in float32 its error against float64
#: is below 4e-7 relative everywhere (tests/test_score_mods.py), tiny x included (P(0) / Q(0) =
#: 1 - 6e-9), and it has no exp, no branch and no cancellation: the exp2-based (1 - t) / (1 + t)
#: form it replaces needed a series below 1/16 and cost ~1.7x as much per cell
#: (benchmarks/tuning/cpu_span_and_tanh.py; results/mods-cpu-xeon-2core-2026-12-03.txt).
_TANH_P = (0.9999999941833351, 0.1338546741659332, 0.003500717745181587, 2.0687585868296497e-05,
           1.345232746614613e-08)
_TANH_Q = (1.0, 0.467187892716961, 0.025896875837976594, 0.0003293769182830583, 7.818879391572369e-07)
_P0, _P1, _P2, _P3, _P4 = (np.float32(c) for c in _TANH_P)
_Q0, _Q1, _Q2, _Q3, _Q4 = (np.float32(c) for c in _TANH_Q)


@njit(inline="always", fastmath=True, cache=True)
def tanh_f32(x):
    """tanh with float32 relative accuracy everywhere (see _TANH_P); NaN stays NaN."""
    xc = min(max(x, np.float32(-9.0)), np.float32(9.0))
    z = xc * xc
    p = (((_P4 * z + _P3) * z + _P2) * z + _P1) * z + _P0
    q = (((_Q4 * z + _Q3) * z + _Q2) * z + _Q1) * z + _Q0
    r = min(max(xc * p / q, np.float32(-1.0)), np.float32(1.0))
    return r if x == x else x


@njit(inline="always", fastmath=True, cache=True)
def exp_f32(x):
    return exp2f(x * np.float32(LOG2E))


@njit(inline="always", cache=True)
def tanh_f64(x):
    return math.tanh(x)


@njit(inline="always", cache=True)
def exp_f64(x):
    return math.exp(x)


class CpuTarget(score_source.Target):
    """The CPU kernels' calling convention: the packed (n, N, H) arrays of score_mod.Layout
    indexed directly; gradients added into ``ghp[k, h]``, ``gnd[k, gi, h]``, ``gns[k, gj, h]``,
    ``gef[k, e, h]`` (``gi`` / ``gj``: the buffer rows the kernel owns)."""

    value_args = "s, i, j, e, h, sc, hp, nd, ns, ef"
    grad_args = "s, i, j, e, h, sc, hp, nd, ns, ef, dF, ghp, gnd, gi, gns, gj, gef"

    def leaf(self, x, slot):
        if x.op == "scalar":
            return f"sc[{slot}]"
        if x.op == "head":
            return f"hp[{slot}, h]"
        if x.op == "node":
            return f"nd[{slot}, i, h]" if x.attr[0] == "dst" else f"ns[{slot}, j, h]"
        return f"ef[{slot}, e, h]"

    def accumulate(self, x, slot, pos, value):
        cell = {"head": f"ghp[{slot}, h]", "dst": f"gnd[{slot}, gi, h]",
                "src": f"gns[{slot}, gj, h]", "edge": f"gef[{slot}, e, h]"}[score_source.kind(x)]
        return f"{cell} += {value}"


class Generated(score_source.Compiled):
    """The compiled functions of one (tree, gradient leaves, dtype): numba.njit."""

    def _target(self):
        return CpuTarget()

    def _globals(self, dt):
        f32 = dt is np.float32
        return {"math": math, "_dt": dt, "_tanh": tanh_f32 if f32 else tanh_f64,
                "_exp": exp_f32 if f32 else exp_f64}

    def _compile(self, fn):
        return njit(nogil=True, error_model="numpy")(fn)


@njit(inline="always", cache=True)
def no_value(s, i, j, e, h, sc, hp, nd, ns, ef):
    """Stand-in of `value` in kernels compiled without a modifier (never called)."""
    return s


@njit(inline="always", cache=True)
def no_slope(s, i, j, e, h, sc, hp, nd, ns, ef):
    """Stand-in of `slope` in kernels compiled without a modifier (never called)."""
    return s, s


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


def _math_source():
    """the source of the math functions the generated functions call (tanh, exp, exp2): numba's
    cache checks the kernel's own file only, so a changed math function must change the digest."""
    import inspect
    try:
        return "".join(inspect.getsource(f.py_func) for f in (tanh_f32, exp_f32, tanh_f64, exp_f64, exp2f)) \
            + repr((_TANH_P, _TANH_Q))   # the coefficients are globals: their values, not names
    except (OSError, TypeError):   # no source (frozen install): the package version stands in
        from importlib.metadata import version
        return version("tiga-numba")


_MATH_DIGEST = hashlib.sha1(_math_source().encode()).hexdigest()[:16]


def hooks_digest(mod, hooks):
    """A digest of everything the generated functions bound in `hooks` compile from: their
    source texts, the values of their constants, the dtype and the math functions' source."""
    parts = [mod.dtype_name, _MATH_DIGEST]
    for name in sorted(hooks):
        fn_name = hooks[name].py_func.__name__
        parts += [name, fn_name, mod.sources[fn_name]]
    consts = mod._src.constants(float)
    parts += [f"{k}={float(v).hex()}" for k, v in sorted(consts.items())]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def jit_kernel(py_func, mod, parallel=True, exact=False, **hooks):
    """numba.njit(fastmath; parallel unless told) of a kernel whose modifier calls go through the
    global names in `hooks`. Without a modifier the kernel is compiled as written (its globals are
    the module's never-called stand-ins). With one, the same code is compiled with `hooks` bound to
    the generated functions. Either way under a qualified name that ends in a digest of its
    closure values (_closure_digest) and, with a modifier, its `hooks_digest`: numba's on-disk
    cache keys a kernel on its file, qualified name, bytecode and closure values, which would not
    tell two modifiers apart, and numba's symbol names come from the qualified name, which would
    not tell two tile shapes apart once both are loaded from the cache. The names give every
    variant its own cache entries and symbols, and let other processes (test workers, later runs)
    load the compiled kernel instead of compiling it again (30 s and more per kernel).

    `exact`: compiled without fast-math, for the merges of split rows and key ranges, whose
    order of additions is what makes their bits fixed: with fast-math LLVM may reassociate or
    contract them, and its choice may change with the code around them. The merges are small
    next to the items they merge."""
    opts = dict(parallel=parallel, fastmath=False if exact else FASTMATH, nogil=True)
    tag = "_of_" + _closure_digest(py_func) + ("_exact" if exact else "")
    if mod is not None:
        tag += f"_mod_{hooks_digest(mod, hooks)}"
    return njit(cache=True, **opts)(_rebound(py_func, hooks if mod is not None else {}, tag))


def _stable_repr(x):
    """repr of a closure value that is the same in every process (a function or class by its
    qualified name, not its address)."""
    name = getattr(x, "__qualname__", None)
    if callable(x) and name is not None:
        return f"{getattr(x, '__module__', '')}.{name}"
    return repr(x)


def _closure_digest(py_func):
    """Digest of a factory-made function's qualified name and closure values (the tile shape,
    dtype and options it was made with). It goes into the compiled function's qualified name,
    which numba's symbol names are made from: two variants of one item function compiled in
    different processes would otherwise get the same symbol (same name, same argument types,
    the same per-process counter), and a process that loads both drivers from numba's disk
    cache would link one variant's calls to the other's code."""
    key = [f"{py_func.__module__}.{py_func.__qualname__}",
           repr([_stable_repr(c.cell_contents) for c in py_func.__closure__ or ()])]
    return hashlib.sha1("\n".join(key).encode()).hexdigest()[:16]


def jit_driver(py_func, mod, hooks, **items):
    """numba.njit(parallel) of a driver whose prange loops each make one call per work item to
    the functions bound to the global names in `items` (jit_kernel(..., parallel=False)). numba's
    parallel passes then see only the small driver, not the item's body: a kernel variant (a
    score modifier, a tile shape) compiles in about half the time, and the body runs the same
    code. The qualified name carries a digest of the items' names and closure values (the tile
    shape, dtype and options they were made with) and, with a modifier, ends in its
    hooks_digest as jit_kernel's, so numba's disk cache keeps every variant apart."""
    key = [f"driver={_closure_digest(py_func)}"]
    key += [f"{name}={_closure_digest(items[name].py_func)}" for name in sorted(items)]
    tag = "_of_" + hashlib.sha1("\n".join(key).encode()).hexdigest()[:16]
    if mod is not None:
        tag += f"_mod_{hooks_digest(mod, hooks)}"
    opts = dict(parallel=True, fastmath=FASTMATH, nogil=True)
    driver = njit(cache=True, **opts)(_rebound(py_func, items, tag))
    _load_items_first(driver, items)
    return driver


def _item_arguments(driver_func, items):
    """[(item, positions)]: for each work item, the positions in the driver's arguments of the
    arguments it takes after its work index. Every item takes its index first and then driver
    arguments by their names, as the driver passes them on unchanged, so its compiled signature
    is (int64, the driver's types at those positions)."""
    code = driver_func.__code__
    where = {name: i for i, name in enumerate(code.co_varnames[:code.co_argcount])}
    out = []
    for glob, item in sorted(items.items()):
        icode = item.py_func.__code__
        names = icode.co_varnames[1:icode.co_argcount]
        missing = [n for n in names if n not in where]
        if missing:
            raise TypeError(f"work item {glob} takes {missing}, which its driver "
                            f"{driver_func.__name__} does not: an item takes its index, then "
                            "driver arguments by name")
        out.append((item, tuple(where[n] for n in names)))
    return out


def _load_items_first(driver, items):
    """Make every process run one code for each work item: the item's own compiled function.

    numba links a copy of each item's code into the driver's module (optimised again there) and
    marks it weak, so the code a driver calls depends on what was loaded first: the process that
    compiles the driver has the item's own function loaded already (typing the driver compiled
    it) and calls that, while a process that loads the driver from the disk cache, with no item
    loaded, calls the driver's copy. Both compute the same values, but with fast-math the copy
    may be vectorised differently and round differently in the last bits (the block kernels'
    outputs differed by an ulp between the compiling process and the loading ones). Here, before
    the driver is compiled or loaded for new argument types, each item is compiled or loaded for
    the types the driver will call it with, so every process calls the item's own function."""
    from numba import types
    from numba.core import sigutils
    picks = _item_arguments(driver.py_func, items)
    compile_driver = driver.compile

    def compile(sig):
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) not in driver.overloads:
            for item, at in picks:
                item.compile((types.int64,) + tuple(args[i] for i in at))
        return compile_driver(sig)

    driver.compile = compile
    # kernel_cache counts and announces a driver's compiles with its items': the items now
    # compile first, and a first-compile notice waiting for the driver would come late
    driver.work_items = tuple(item for item, _ in picks)


def _rebound(py_func, names, suffix):
    """py_func with `names` bound in its globals and `suffix` appended to its qualified name."""
    import types
    g = dict(py_func.__globals__)
    g.update(names)
    fn = types.FunctionType(py_func.__code__, g, py_func.__name__, py_func.__defaults__,
                            py_func.__closure__)
    fn.__qualname__ = f"{py_func.__qualname__}{suffix}"
    return fn


generated = score_source.memoised(Generated)
