"""Fused GAT-MLP edge attention on the CPU (numba parallel), forward and backward.

Model (see tiga_numba.edge_mlp): per edge e = (j -> i)
    h0_e = As[j] + Ad[i] + We @ ef_e          (first Linear, split per node + edge part)
    s_e  = rest-of-MLP(h0_e)                  (activations, Linears, ..., width 1)
    out_i = sum_e softmax_i(s)_e * V[j]

The per-edge part of the network is emitted as Python source specialised on the layer
stack, the edge features and the value width (compile-time constants: loops have fixed
trip counts, offsets are literals; the unrolled emitters are tiga_numba.score_net_source, shared
with the CUDA kernels), written to the cache folder (tiga_numba.disk_cache) and imported,
so numba's on-disk cache (cache=True) works for generated code too.

Work split, all deterministic:
  forward     one pass over destination rows (fixed chunks); online softmax in locals.
  backward A  destination rows: recomputes s, p, ds and backpropagates the MLP per edge;
              writes the dst-side node grads per row and parameter grads into one partial
              row per chunk (reduced in chunk order afterwards).
  backward B  source rows over the transposed relation: src-side node grads per row.
Only per-row (m, l, Delta) and per-node (N, hidden) products persist; no (E, .) buffer.
"""
from __future__ import annotations

import numba

from .. import disk_cache
from ..kernel_cache import KERNELS
from ..kernel_cache import source as kernel_source
from ..score_net_source import (indented, layer_widths, route_edge_grad, u_backward, u_edge_grad,
                               u_features, u_hoist, u_score, u_weights, unrollable)

__all__ = ["get_kernels", "NUM_CHUNKS"]

# Fixed chunk count (not thread-count dependent): the parameter-gradient partial sums, and
# so their rounding, are the same on every machine and every run.
NUM_CHUNKS = 1024


# --------------------------------------------------------------------------- code generation


def _offsets(widths):
    off, acc = [], 0
    for w in widths:
        off.append(acc)
        acc += w
    return off, acc


def _emit_edge_features(spec, ind):
    """Lines that fill ef[...] for edge e = (j -> i); d0.. and dist stay in locals because
    the backward needs them to route gradients to the positions."""
    L = []
    geo = any(it[0] in ("disp", "dist") for it in spec.edge_items)
    if geo:
        for d in range(spec.pd):
            L.append(f"d{d} = pos[j, {d}] - pos[i, {d}]")
        if any(it[0] == "dist" for it in spec.edge_items):
            L.append("dist = math.sqrt(" + " + ".join(f"d{d} * d{d}" for d in range(spec.pd)) + ")")
    for it in spec.edge_items:
        if it[0] == "disp":
            for d in range(spec.pd):
                L.append(f"ef[{it[1] + d}] = d{d}")
        elif it[0] == "dist":
            L.append(f"ef[{it[1]}] = dist")
        else:
            _, off, width, xcol = it
            L.append(f"for c in range({width}):")
            L.append(f"    ef[{off} + c] = EX[e, {xcol} + c]")
    return [ind + s for s in L]


def _emit_score(spec, ind):
    """h0 = As[j] + Ad[i] + We @ ef, then the remaining layers; leaves s in a local.
    Loops run along contiguous memory (WeT is (fe, h1)) so LLVM can vectorise them."""
    widths = layer_widths(spec)
    off, _ = _offsets(widths)
    L = [f"for r in range({spec.h1}):",
         "    A[r] = As[j, r] + Ad[i, r]"]
    if spec.fe:
        L += [f"for c in range({spec.fe}):",
              "    v = ef[c]",
              f"    for r in range({spec.h1}):",
              "        A[r] += WeT[c, r] * v"]
    for k, layer in enumerate(spec.layers, 1):
        src, dst, w = off[k - 1], off[k], widths[k]
        kind = layer[0]
        if kind == "linear":
            _, n_in, n_out, w_off, b_off = layer
            L += [f"for r in range({n_out}):",
                  f"    acc = P[{b_off} + r]",
                  f"    for c in range({n_in}):",
                  f"        acc += P[{w_off} + r * {n_in} + c] * A[{src} + c]",
                  f"    A[{dst} + r] = acc"]
        elif kind == "leaky_relu":
            L += [f"for c in range({w}):",
                  f"    x = A[{src} + c]",
                  f"    A[{dst} + c] = x if x > ZERO else x * T({layer[1]!r})"]
        elif kind == "relu":
            L += [f"for c in range({w}):",
                  f"    x = A[{src} + c]",
                  f"    A[{dst} + c] = x if x > ZERO else ZERO"]
        else:
            L += [f"for c in range({w}):",
                  f"    A[{dst} + c] = math.tanh(A[{src} + c])"]
    L.append(f"s = A[{off[-1]}]")
    return [ind + s for s in L]


def _emit_mlp_backward(spec, ind, param_grads):
    """From ds (a local) back to gh0 = G0[0:h1]; with param_grads, accumulates the
    parameter gradients of layers >= 1 into PG[ch, ...] (this chunk's partial row)."""
    widths = layer_widths(spec)
    off, _ = _offsets(widths)
    L = ["G1[0] = ds"]
    cur, other = "G1", "G0"
    for k in range(len(spec.layers), 0, -1):
        layer = spec.layers[k - 1]
        src, dst = off[k - 1], off[k]
        kind = layer[0]
        if kind == "linear":
            _, n_in, n_out, w_off, b_off = layer
            L += [f"for c in range({n_in}):",
                  f"    {other}[c] = ZERO"]
            L += [f"for r in range({n_out}):",
                  f"    g = {cur}[r]"]
            if param_grads:
                L += [f"    PG[ch, {b_off} + r] += g"]
            L += [f"    for c in range({n_in}):",
                  f"        {other}[c] += P[{w_off} + r * {n_in} + c] * g"]
            if param_grads:
                L += [f"        PG[ch, {w_off} + r * {n_in} + c] += g * A[{src} + c]"]
        else:
            w = widths[k]
            L += [f"for c in range({w}):"]
            if kind == "leaky_relu":
                L += [f"    {other}[c] = {cur}[c] if A[{src} + c] > ZERO else {cur}[c] * T({layer[1]!r})"]
            elif kind == "relu":
                L += [f"    {other}[c] = {cur}[c] if A[{src} + c] > ZERO else ZERO"]
            else:
                L += [f"    tt = A[{dst} + c]",
                      f"    {other}[c] = {cur}[c] * (ONE - tt * tt)"]
        cur, other = other, cur
    if cur != "G0":
        L += [f"for c in range({spec.h1}):",
              f"    G0[c] = {cur}[c]"]
    return [ind + s for s in L]


def _emit_edge_grad(spec, ind, side):
    """gef = We^T gh0 into the scratch GE, then routed (looped generator)."""
    if not spec.fe:
        return []
    L = [f"for c in range({spec.fe}):",
         "    acc = ZERO",
         f"    for r in range({spec.h1}):",
         "        acc += WeT[c, r] * G0[r]",
         "    GE[c] = acc"]
    L += route_edge_grad(spec, side, lambda i: f"GE[{i}]",
                          lambda off, width, xcol: [f"for c in range({width}):",
                                                    f"    dEX[e, {xcol} + c] = GE[{off} + c]"])
    return [ind + s for s in L]


def _read_perm(spec):
    """The transposed pass needs the original edge id only for explicit edge fields (EX);
    without them `perm` is never read (callers may then pass an empty array)."""
    if any(it[0] == "x" for it in spec.edge_items):
        return " " * 16 + "e = perm[t]"
    return ""


_FM = "{'reassoc', 'contract'}"  # reductions may vectorise; no nnan/ninf (m can be -inf)


SMALL_VALUE = 16  # value widths up to this keep the value accumulators in scalar locals


def _value_code(fv, small):
    """Snippets for the value-side loops: scalar locals (`small`) or loops over arrays."""
    F = range(fv)
    if small:
        return dict(
            f_alloc=[],
            f_init=[f"acc{f} = ZERO" for f in F],
            f_rescale=[f"acc{f} = acc{f} * corr + V[j, {f}]" for f in F],
            f_add=[f"acc{f} += p * V[j, {f}]" for f in F],
            f_store=[f"out[i, {f}] = acc{f} * inv" for f in F],
            r_hoist=[f"do{f} = dout[i, {f}]" for f in F],
            r_delta=["delta = " + " + ".join(f"do{f} * out[i, {f}]" for f in F)],
            r_dp=["dp = " + " + ".join(f"do{f} * V[j, {f}]" for f in F)],
            c_alloc=[],
            c_init=[f"gv{f} = ZERO" for f in F] + [f"vj{f} = V[j, {f}]" for f in F],
            c_dp=[f"di{f} = dout[i, {f}]" for f in F]
            + ["dp = " + " + ".join(f"di{f} * vj{f}" for f in F)]
            + [f"gv{f} += p * di{f}" for f in F],
            c_store=[f"dV[j, {f}] = gv{f}" for f in F])
    return dict(
        f_alloc=[f"accv = np.empty({fv}, T)"],
        f_init=[f"for f in range({fv}):", "    accv[f] = ZERO"],
        f_rescale=[f"for f in range({fv}):", "    accv[f] = accv[f] * corr + V[j, f]"],
        f_add=[f"for f in range({fv}):", "    accv[f] += p * V[j, f]"],
        f_store=[f"for f in range({fv}):", "    out[i, f] = accv[f] * inv"],
        r_hoist=[],
        r_delta=["delta = ZERO", f"for f in range({fv}):", "    delta += dout[i, f] * out[i, f]"],
        r_dp=["dp = ZERO", f"for f in range({fv}):", "    dp += dout[i, f] * V[j, f]"],
        c_alloc=[f"gV = np.empty({fv}, T)"],
        c_init=[f"for f in range({fv}):", "    gV[f] = ZERO"],
        c_dp=["dp = ZERO", f"for f in range({fv}):", "    dp += dout[i, f] * V[j, f]",
              "    gV[f] += p * dout[i, f]"],
        c_store=[f"for f in range({fv}):", "    dV[j, f] = gV[f]"])


class _Loops:
    """The per-edge network in small arrays walked by loops (A: activations, G0 / G1:
    gradients, ef / GE: edge features and their gradient), parameter-gradient partials added
    to this chunk's row PG[ch] as they come: any network size."""

    def __init__(self, spec, p_size):
        self.spec, self.p_size = spec, p_size
        self.value = _value_code(spec.fv, small=False)
        n_act = _offsets(layer_widths(spec))[1]
        fe1, gmax, h1 = max(spec.fe, 1), max(layer_widths(spec)), spec.h1
        self.net = [f"A = np.empty({n_act}, T)", f"ef = np.empty({fe1}, T)"]
        self.grads = [f"G0 = np.empty({gmax}, T)", f"G1 = np.empty({gmax}, T)", f"GE = np.empty({fe1}, T)"]
        self.h0_grad = {"dst": f"gAd = np.empty({h1}, T)", "src": f"gAs = np.empty({h1}, T)"}

    def prelude(self, kind):
        """the chunk's own state: 'fwd', 'rows' (dst-side backward) or 'cols' (src side)"""
        if kind == "fwd":
            return self.net
        return self.net + self.grads + [self.h0_grad["dst" if kind == "rows" else "src"]]

    def hoist(self, side):
        return []

    def score(self, side):
        return _emit_edge_features(self.spec, "") + _emit_score(self.spec, "")

    def h0_grad_init(self, side):
        return [f"for r in range({self.spec.h1}):", f"    {self._g(side)}[r] = ZERO"]

    def h0_grad_add(self, side):
        """the gradient of the first Linear's node terms (As[j] + Ad[i]) and, on the dst side,
        of its edge-feature weights (PG's slots after P's)"""
        h1 = self.spec.h1
        L = [f"for r in range({h1}):", f"    {self._g(side)}[r] += G0[r]"]
        if side == "dst" and self.spec.fe:
            # stored transposed (fe, h1): the inner loop runs along contiguous memory
            L += [f"for c in range({self.spec.fe}):",
                  "    v = ef[c]",
                  f"    for r in range({h1}):",
                  f"        PG[ch, {self.p_size} + c * {h1} + r] += G0[r] * v"]
        return L

    def h0_grad_store(self, side, row):
        out = "dAd" if side == "dst" else "dAs"
        return [f"for r in range({self.spec.h1}):", f"    {out}[{row}, r] = {self._g(side)}[r]"]

    def mlp_backward(self, param_grads):
        return _emit_mlp_backward(self.spec, "", param_grads)

    def edge_grad(self, side):
        return _emit_edge_grad(self.spec, "", side)

    def pg_init(self):
        return []

    def pg_store(self):
        return []

    @staticmethod
    def _g(side):
        return "gAd" if side == "dst" else "gAs"


class _Unrolled:
    """The per-edge network in scalar locals (tiga_numba.score_net_source, shared with the
    CUDA kernels): weights loaded once per chunk, the row's own terms once per row,
    parameter-gradient partials summed in locals and stored once per chunk."""

    def __init__(self, spec, p_size):
        self.spec, self.p_size = spec, p_size
        self.value = _value_code(spec.fv, small=spec.fv <= SMALL_VALUE)
        self.p_slots = [k for layer in spec.layers if layer[0] == "linear"
                        for k in range(layer[3], layer[3] + layer[1] * layer[2] + layer[2])]
        self.pe_slots = [(c, r) for c in range(spec.fe) for r in range(spec.h1)]

    def prelude(self, kind):
        return u_weights(self.spec)

    def hoist(self, side):
        return u_hoist(self.spec, side)

    def score(self, side):
        return u_features(self.spec, side) + u_score(self.spec, side)

    def h0_grad_init(self, side):
        return [f"{self._g(side)}{r} = ZERO" for r in range(self.spec.h1)]

    def h0_grad_add(self, side):
        L = [f"{self._g(side)}{r} += g0_{r}" for r in range(self.spec.h1)]
        if side == "dst":
            L += [f"pge{c}_{r} += g0_{r} * ef{c}" for c, r in self.pe_slots]
        return L

    def h0_grad_store(self, side, row):
        out = "dAd" if side == "dst" else "dAs"
        return [f"{out}[{row}, {r}] = {self._g(side)}{r}" for r in range(self.spec.h1)]

    def mlp_backward(self, param_grads):
        return u_backward(self.spec, param_grads)

    def edge_grad(self, side):
        return u_edge_grad(self.spec, side)

    def pg_init(self):
        return ([f"pg{k} = ZERO" for k in self.p_slots]
                + [f"pge{c}_{r} = ZERO" for c, r in self.pe_slots])

    def pg_store(self):
        h1 = self.spec.h1
        return ([f"PG[ch, {k}] = pg{k}" for k in self.p_slots]
                + [f"PG[ch, {self.p_size + c * h1 + r}] = pge{c}_{r}" for c, r in self.pe_slots])

    @staticmethod
    def _g(side):
        return "gad" if side == "dst" else "gas"


def generate_source(spec, p_size, dtype_name, unroll):
    """The module text of the three kernels (gat_forward, gat_backward_rows, gat_backward_cols)
    for `spec`: one template, the per-edge network written by _Unrolled (scalar locals) or
    _Loops (arrays and loops)."""
    code = (_Unrolled if unroll else _Loops)(spec, p_size)
    vc = code.value
    pd = spec.pd

    def at(n, lines):
        return indented(lines, n)

    def gp_store(row):
        return at(12, [f"dpos[{row}, {d}] = gp{d}" for d in range(pd)])

    gp_init = at(12, [f"gp{d} = ZERO" for d in range(pd)])
    fwd = f"""
@numba.njit(parallel=True, cache=True, fastmath={_FM})
def gat_forward(order, indptr, indices, As, Ad, WeT, pos, EX, P, V, out, M, L):
    nrows = order.shape[0]
    nch = min(nrows, {NUM_CHUNKS})
    for ch in numba.prange(nch):
{at(8, code.prelude("fwd") + vc["f_alloc"])}
        r0 = ch * nrows // nch
        r1 = (ch + 1) * nrows // nch
        for t in range(r0, r1):
            i = order[t]
{at(12, code.hoist("dst"))}
            m = T(-np.inf)
            l = ZERO
{at(12, vc["f_init"])}
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
{at(16, code.score("dst"))}
                if s > m:
                    # new running max: rescale what was accumulated so far
                    corr = T(math.exp(m - s))
                    l = l * corr + ONE
{at(20, vc["f_rescale"])}
                    m = s
                else:
                    p = T(math.exp(s - m))
                    l += p
{at(20, vc["f_add"])}
            inv = ONE / l if l > ZERO else ZERO
{at(12, vc["f_store"])}
            M[i] = m
            L[i] = l
"""
    bwd_rows = f"""
@numba.njit(parallel=True, cache=True, fastmath={_FM})
def gat_backward_rows(order, indptr, indices, As, Ad, WeT, pos, EX, P, V, out, dout, M, L,
                      Delta, dAd, dpos, dEX, PG):
    nrows = order.shape[0]
    nch = PG.shape[0]
    for ch in numba.prange(nch):
{at(8, code.prelude("rows") + code.pg_init())}
        r0 = ch * nrows // nch
        r1 = (ch + 1) * nrows // nch
        for t in range(r0, r1):
            i = order[t]
{at(12, code.hoist("dst") + vc["r_hoist"] + vc["r_delta"])}
            Delta[i] = delta
{at(12, code.h0_grad_init("dst"))}
{gp_init}
            mi = M[i]
            li = L[i]
            inv_l = ONE / li if li > ZERO else ZERO
            for e in range(indptr[i], indptr[i + 1]):
                j = indices[e]
{at(16, code.score("dst"))}
                p = T(math.exp(s - mi)) * inv_l
{at(16, vc["r_dp"])}
                ds = p * (dp - delta)
{at(16, code.mlp_backward(True) + code.h0_grad_add("dst") + code.edge_grad("dst"))}
{at(12, code.h0_grad_store("dst", "i"))}
{gp_store("i")}
{at(8, code.pg_store())}
"""
    bwd_cols = f"""
@numba.njit(parallel=True, cache=True, fastmath={_FM})
def gat_backward_cols(order, tptr, tind, perm, As, Ad, WeT, pos, EX, P, V, dout, M, L, Delta,
                      dAs, dV, dpos):
    nrows = order.shape[0]
    nch = min(nrows, {NUM_CHUNKS})
    for ch in numba.prange(nch):
{at(8, code.prelude("cols") + vc["c_alloc"])}
        r0 = ch * nrows // nch
        r1 = (ch + 1) * nrows // nch
        for tt_ in range(r0, r1):
            j = order[tt_]
{at(12, code.hoist("src") + code.h0_grad_init("src") + vc["c_init"])}
{gp_init}
            for t in range(tptr[j], tptr[j + 1]):
                i = tind[t]
{_read_perm(spec)}
{at(16, code.score("src"))}
                p = T(math.exp(s - M[i])) / L[i]
{at(16, vc["c_dp"])}
                ds = p * (dp - Delta[i])
{at(16, code.mlp_backward(False) + code.h0_grad_add("src") + code.edge_grad("src"))}
{at(12, code.h0_grad_store("src", "j") + vc["c_store"])}
{gp_store("j")}
"""
    header = (f"# generated by tiga_numba.cpu.gat ({'unrolled' if unroll else 'loops'}) for spec {spec!r}, "
              f"{dtype_name}\nimport math\nimport numba\nimport numpy as np\n"
              f"T = np.{dtype_name}\nZERO = T(0.0)\nONE = T(1.0)\n")
    return header + fwd + bwd_rows + bwd_cols


def _load(source, prefix="tiga_gat_cpu"):
    return disk_cache.import_source(source, prefix, "gat")


def get_kernels(spec, p_size, dtype, unroll=None):
    """(module with gat_forward, gat_backward_rows, gat_backward_cols, where the kernels came
    from (kernel_cache.KernelSource: "memory hit" / "disk hit" / "compiled", resolved when
    explain() shows it), variant 'unrolled'/'loops'). unroll=None picks unrolled code for small
    networks."""
    name = "float64" if str(dtype) == "float64" else "float32"
    if unroll is None:
        unroll = unrollable(spec, p_size)
    variant = "unrolled" if unroll else "loops"
    key = ("gat-cpu", spec, int(p_size), name, variant)
    module = KERNELS.get(key, lambda: _load(generate_source(spec, p_size, name, unroll)))
    return module, kernel_source(module, KERNELS.last_was_hit), variant


# --------------------------------------------------------------------------- relabelling
import numpy as _np  # noqa: E402


@numba.njit(parallel=True, cache=True)
def relabel_csr(order, inv, indptr, indices):
    """CSR of the same relation with node ids renamed old -> inv[old] and rows listed in the
    new order (row r is old row order[r]). Within a row the entries keep their order."""
    n = order.shape[0]
    new_ptr = _np.zeros(n + 1, _np.int64)
    for r in range(n):
        o = order[r]
        new_ptr[r + 1] = indptr[o + 1] - indptr[o]
    for r in range(n):
        new_ptr[r + 1] += new_ptr[r]
    new_idx = _np.empty(indices.shape[0], _np.int32)
    for r in numba.prange(n):
        o = order[r]
        base = new_ptr[r] - indptr[o]
        for e in range(indptr[o], indptr[o + 1]):
            new_idx[base + e] = inv[indices[e]]
    return new_ptr, new_idx


# --------------------------------------------------------------------------- node products
# The (N, hidden) products around the fused kernels run in numba too, not through numpy's
# BLAS: right after a numba parallel region the OpenMP workers are still spinning, and
# OpenBLAS's own threads then crawl (measured: a (16 x 100k) @ (100k x 64) product took
# 844 ms instead of 32 ms on 2 cores).
@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def node_matmul_add(X, W, out):
    """out (N, H) += X (N, K) @ W (K, H); rows independent."""
    n, k = X.shape
    h = W.shape[1]
    for i in numba.prange(n):
        for a in range(k):
            xv = X[i, a]
            for b in range(h):
                out[i, b] += xv * W[a, b]


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def node_outer_sum(A, X, nchunks):
    """A^T @ X ((H, K)) as per-chunk partial sums reduced in chunk order (deterministic)."""
    n, h = A.shape
    k = X.shape[1]
    part = _np.zeros((nchunks, h, k), A.dtype)
    for c in numba.prange(nchunks):
        i0 = c * n // nchunks
        i1 = (c + 1) * n // nchunks
        for i in range(i0, i1):
            for a in range(h):
                av = A[i, a]
                for b in range(k):
                    part[c, a, b] += av * X[i, b]
    out = _np.zeros((h, k), A.dtype)
    for c in range(nchunks):
        for a in range(h):
            for b in range(k):
                out[a, b] += part[c, a, b]
    return out
