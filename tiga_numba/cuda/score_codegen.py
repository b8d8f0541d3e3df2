"""Score modifiers compiled into the CUDA-core kernels (blocks.py, csr.py).

tiga_numba.score_source writes the value and gradient functions of a tree; `CudaTarget` is the
CUDA kernels' calling convention, and the text is compiled with
``numba.cuda.jit(device=True, inline="always")``: numba inlines the function into the kernel
at its IR level, so the kernel still compiles with ``compile_ptx(..., cc=(9, 0))`` on a machine
without a GPU (a device function that is not inlined is compiled for the current device).

    value(s, i, j, e, h, H, mv, mnd, mns, mef) -> f
    grad(s, i, j, e, h, H, mv, mnd, mns, mef, dF, ga, go, ge) -> dF * df/ds

Per-call values, flat arrays in the accumulation dtype (`pack`):
    mv  = scalars, then per-head params: mv[n_sc + k * H + h]
    mnd = dst fields, node-major (Nq, n_dst, H); mns = src fields (Nk, n_src, H);
    mef = edge fields (E, n_edge, H)
(node-major: the fields of one node are read together). `i`, `j` are global node positions,
`e` the edge id (CSR; -1 for block relations).

Gradients: a kernel pass asks for the leaf kinds it owns (`Generated.grad(targets)`). The
leaves owned by a row -- per-head params and dst fields in the destination pass, src fields in
the source pass -- are added into the caller's local array, ``ga[go + pos]`` (`pos`: the leaf's
index in `rows`); the kernel keeps them per (row, head) in registers and writes each row's
sums once, so a row's cell has one writer and no float atomics are needed (per-head params are
then summed over the rows on the host side, in row order). Edge-field gradients are per edge:
``ge[pos] = dF * df/dx``, written out by the kernel for that edge (one writer per edge).
"""
from __future__ import annotations

import hashlib
import math

import numba
import numpy as np
from numba import cuda

from .. import score_source

TARGETS = score_source.TARGETS


class CudaTarget(score_source.Target):
    """Flat per-call arrays indexed with unsigned offsets; row-owned gradients into the
    kernel's local array `ga` at `go`, edge gradients into the local array `ge`."""

    value_args = "s, i, j, e, h, H, mv, mnd, mns, mef"
    grad_args = value_args + ", dF, ga, go, ge"
    tanh = "math.tanh"
    exp = "math.exp"
    # the CUDA-core kernels mask a cell by -inf (NEG_INF): a finite -1e30 would be a real score
    # there, and a row whose every edge the modifier masks would get a uniform softmax
    masked = "_dt(-math.inf)"

    def __init__(self, layout):
        self.n_sc = len(layout.scalars)
        self.n_dst = len(layout.dst)
        self.n_src = len(layout.src)
        self.n_edge = len(layout.edges)

    def leaf(self, x, slot):
        if x.op == "scalar":
            return f"mv[{slot}]"
        if x.op == "head":
            return f"mv[_U({self.n_sc} + {slot} * H + h)]"
        if x.op == "node":
            if x.attr[0] == "dst":
                return f"mnd[_U((i * {self.n_dst} + {slot}) * H + h)]"
            return f"mns[_U((j * {self.n_src} + {slot}) * H + h)]"
        return f"mef[_U((e * {self.n_edge} + {slot}) * H + h)]"

    def accumulate(self, x, slot, pos, value):
        if score_source.kind(x) == "edge":
            return f"ge[{pos}] = {value}"
        return f"ga[_U(go + {pos})] += {value}"


class Generated(score_source.Compiled):
    """The device functions of one (tree, gradient leaves, dtype); `grad(targets)` gives
    (device function, row-owned leaves, edge leaves); `digest` names the kernels compiled with
    them (the cubin cache is keyed by kernel name)."""

    def __init__(self, tree, grad_leaves, dtype_name):
        super().__init__(tree, grad_leaves, dtype_name)
        text = self.sources["value"] + "".join(
            self._src.grad("g", (t,)) for t in TARGETS) + dtype_name
        self.digest = hashlib.sha1(text.encode()).hexdigest()[:12]

    def _grad_entry(self, fn, key):
        rows, edges = self._src.grad_groups(key)
        return (fn, tuple(rows), tuple(edges))

    def _target(self):
        return CudaTarget(self.layout)

    def _globals(self, dt):
        return {"math": math, "_dt": numba.float32 if dt is np.float32 else numba.float64,
                "_U": numba.uint64}

    def _compile(self, fn):
        return cuda.jit(device=True, inline="always")(fn)


@cuda.jit(device=True, inline="always")
def no_value(s, i, j, e, h, H, mv, mnd, mns, mef):
    """Stand-in of `value` in kernels compiled without a modifier (never called)."""
    return s


@cuda.jit(device=True, inline="always")
def no_grad(s, i, j, e, h, H, mv, mnd, mns, mef, dF, ga, go, ge):
    """Stand-in of `grad` in kernels compiled without a modifier (never called)."""
    return dF


generated = score_source.memoised(Generated)


#: read-only arrays of host numbers, made once per (library, device, dtype, values): the packed
#: scalars of a modifier whose values are all host numbers (a soft-cap) and the one-element
#: stand-ins of empty groups. A call that repeats them copies nothing to the device: a copy from
#: pageable host memory waits for the stream, so the host would stall on every call and could not
#: queue the next one while the GPU runs. Kernels never write these arrays.
_CONSTANTS = {}
_CONSTANTS_MAX = 64


def _constant(xp, acc, values):
    device = xp.cuda.Device().id if xp.__name__ == "cupy" else None
    key = (xp.__name__, device, np.dtype(acc).str, tuple(values))
    hit = _CONSTANTS.get(key)
    if hit is None:
        if len(_CONSTANTS) >= _CONSTANTS_MAX:
            _CONSTANTS.clear()
        hit = _CONSTANTS[key] = xp.asarray(np.array(values, acc))
    return hit


def pack(bound, xp, acc, H, Nq, Nk, E):
    """(mv, mnd, mns, mef): a BoundModifier's values in the layout above, dtype `acc`, as
    arrays of library `xp` (numpy under the simulator, cupy on the GPU). Empty groups are
    one-element arrays (a kernel reads none of them; a device pointer must still exist). What
    is already on the device is packed by device operations; the scalars (Python floats:
    BoundModifier.check) come from `_constant` or are written as kernel arguments (`mv[k] = x`),
    never copied per call."""
    lay = bound.layout
    scalars = [bound.values[x] for x in lay.scalars]
    if not lay.heads:
        mv = _constant(xp, acc, scalars or [0.0])
    else:
        mv = xp.zeros(max(1, len(lay.scalars) + len(lay.heads) * H), acc)
        for k, value in enumerate(scalars):
            mv[k] = value
    for k, x in enumerate(lay.heads):
        off = len(lay.scalars) + k * H
        mv[off:off + H] = xp.asarray(bound.values[x]).astype(acc)

    def stack(group, n):
        if not group or n == 0:
            return _constant(xp, acc, [0.0])
        out = xp.empty((n, len(group), H), acc)
        for k, x in enumerate(group):
            a = xp.asarray(bound.values[x])
            out[:, k, :] = xp.broadcast_to(a.reshape(n, -1), (n, H)).astype(acc)
        return out.reshape(-1)

    return mv, stack(lay.dst, Nq), stack(lay.src, Nk), stack(lay.edges, E)


def unpack(bound, gen, xp, acc, H, Nq, Nk, E, dst_rows=None, src_rows=None, edges=None):
    """{leaf: gradient in the leaf's own shape and dtype} from the kernels' buffers:
    `dst_rows` (Nq, n_rows_dst, H) of the destination pass, `src_rows` (Nk, n_rows_src, H) of
    the source pass, `edges` (E, n_edge, H). Per-head params are summed over the rows here."""
    lay = bound.layout
    ghp = xp.zeros((len(lay.heads), H), acc)
    gnd = xp.zeros((len(lay.dst), Nq, H), acc)
    gns = xp.zeros((len(lay.src), Nk, H), acc)
    gef = xp.zeros((len(lay.edges), E, H), acc)
    _, rows_dst, edge_leaves = gen.grad(("head", "dst", "edge"))
    _, rows_src, _ = gen.grad(("src",))
    for buf, rows in ((dst_rows, rows_dst), (src_rows, rows_src)):
        for pos, x in enumerate(rows if buf is not None else ()):
            k = lay.slot[x]
            if x.op == "head":
                ghp[k] = buf[:, pos, :].sum(axis=0)
            elif x.attr[0] == "dst":
                gnd[k] = buf[:, pos, :]
            else:
                gns[k] = buf[:, pos, :]
    for pos, x in enumerate(edge_leaves if edges is not None else ()):
        gef[lay.slot[x]] = edges[:, pos, :]
    return bound.grads_to_user((ghp, gnd, gns, gef))


def kernel_args(ACC):
    """The trailing arguments every CUDA-core block / CSR kernel takes: the per-call values
    (mv, mnd, mns, mef), the row-owned gradient sums (rows, n, H), their per-piece partials
    for split CSR rows (slots, n, H) and the edge-field gradients (E, n_edge, H). Kernels
    compiled without a modifier never read them (any 8-byte-aligned address will do)."""
    return [("mv", "a", ACC), ("mnd", "a", ACC), ("mns", "a", ACC), ("mef", "a", ACC),
            ("mg", "a", ACC), ("mgp", "a", ACC), ("mge", "a", ACC)]


def tag(mod):
    """Kernel-name suffix of a modifier: its digest (the cubin cache is keyed by name)."""
    return "" if mod is None else f"_m{mod.digest}"
