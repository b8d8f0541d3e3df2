"""Fused GAT-MLP edge attention on the GPU (numba.cuda), forward and backward.

Same model, same generated per-edge code as tiga_numba.cpu.gat (the unrolled variant: the
score network lives in registers), one thread per row:
  forward     thread = destination row; online softmax and the value accumulator in
              registers/local memory.
  backward A  thread = destination row; dst-side node gradients per row; parameter-gradient
              partials in registers, reduced per block through shared memory in a fixed
              order and written to one row of PG per block (summed on the host side in
              block order): deterministic, no float atomics.
  backward B  thread = source row over the transposed relation; src-side node gradients.
Nothing (E,)-sized is allocated. Networks too large for the unrolled code are refused
(NotImplementedError) rather than run slowly.

Kernels are plain numba.cuda.jit functions generated per (layer stack, edge features, value
width, dtype), written to the per-user cache directory and imported (cache=True). They take
cupy arrays (or numpy arrays under NUMBA_ENABLE_CUDASIM=1, which the tests use).
"""
from __future__ import annotations

import math

import numpy as np

from ..cpu.gat import (_block, _cache_dir, _load, _u_backward, _u_edge_grad, _u_features,  # noqa: F401
                       _u_score, _u_weights, unrollable)
from ..kernel_cache import KERNELS

SHARED_BYTES = 40 * 1024  # parameter-gradient reduction buffer per block (static shared)


def block_size(n_pg, itemsize):
    """Threads per block for the backward rows kernel: its shared buffer is (NT, n_pg)."""
    nt = (SHARED_BYTES // max(n_pg * itemsize, 1)) // 32 * 32
    return int(min(128, nt))


def generate_source(spec, p_size, dtype_name, nt_fwd, nt_rows, sim):
    h1, fe, fv, pd = spec.h1, spec.fe, spec.fv, spec.pd
    n_pg = p_size + fe * h1
    weights = _block(_u_weights(spec), 4)
    feat8, feat12 = _block(_u_features(spec), 8), _block(_u_features(spec), 12)
    score8, score12 = _block(_u_score(spec), 8), _block(_u_score(spec), 12)
    read_perm = " " * 8 + "e = perm[t]" if any(it[0] == "x" for it in spec.edge_items) else ""
    p_slots = list(range(p_size)) if any(la[0] == "linear" for la in spec.layers) else []
    pg_init = _block([f"pg{k} = ZERO" for k in p_slots]
                     + [f"pge{c}_{r} = ZERO" for c in range(fe) for r in range(h1)], 4)
    pg_share = _block([f"sh[tid, {k}] = pg{k}" for k in p_slots]
                      + [f"sh[tid, {p_size + c * h1 + r}] = pge{c}_{r}"
                         for c in range(fe) for r in range(h1)], 4)
    gp_init = _block([f"gp{d} = ZERO" for d in range(pd)], 8)
    fwd = f"""
@cuda.jit(cache={not sim})
def gat_forward(indptr, indices, As, Ad, WeT, pos, EX, P, V, out, M, L, nrows):
    i = cuda.grid(1)
    if i >= nrows:
        return
{weights}
    accv = cuda.local.array({fv}, T)
    m = T(-math.inf)
    l = ZERO
    for f in range({fv}):
        accv[f] = ZERO
    for e in range(indptr[i], indptr[i + 1]):
        j = indices[e]
{feat8}
{score8}
        if s > m:
            corr = T(math.exp(m - s))
            l = l * corr + ONE
            for f in range({fv}):
                accv[f] = accv[f] * corr + V[j, f]
            m = s
        else:
            p = T(math.exp(s - m))
            l += p
            for f in range({fv}):
                accv[f] += p * V[j, f]
    inv = ONE / l if l > ZERO else ZERO
    for f in range({fv}):
        out[i, f] = accv[f] * inv
    M[i] = m
    L[i] = l
"""
    gad_lines = [f"gad{r} += g0_{r}" for r in range(h1)]
    gad_lines += [f"pge{c}_{r} += g0_{r} * ef{c}" for c in range(fe) for r in range(h1)]
    bwd_rows = f"""
@cuda.jit(cache={not sim})
def gat_backward_rows(indptr, indices, As, Ad, WeT, pos, EX, P, V, out, dout, M, L,
                      Delta, dAd, dpos, dEX, PG, nrows):
    tid = cuda.threadIdx.x
    i = cuda.blockIdx.x * {nt_rows} + tid
{weights}
{pg_init}
    if i < nrows:
        delta = ZERO
        for f in range({fv}):
            delta += dout[i, f] * out[i, f]
        Delta[i] = delta
{_block([f"gad{r} = ZERO" for r in range(h1)], 8)}
{gp_init}
        mi = M[i]
        li = L[i]
        inv_l = ONE / li if li > ZERO else ZERO
        for e in range(indptr[i], indptr[i + 1]):
            j = indices[e]
{feat12}
{score12}
            p = T(math.exp(s - mi)) * inv_l
            dp = ZERO
            for f in range({fv}):
                dp += dout[i, f] * V[j, f]
            ds = p * (dp - delta)
{_block(_u_backward(spec, True), 12)}
{_block(gad_lines, 12)}
{_block(_u_edge_grad(spec, "dst"), 12)}
{_block([f"dAd[i, {r}] = gad{r}" for r in range(h1)], 8)}
{_block([f"dpos[i, {d}] = gp{d}" for d in range(pd)], 8)}
    # block reduction of the parameter partials, fixed order (deterministic)
    sh = cuda.shared.array(({nt_rows}, {max(n_pg, 1)}), T)
{pg_share}
    cuda.syncthreads()
    for k in range(tid, {n_pg}, {nt_rows}):
        acc = ZERO
        for t in range({nt_rows}):
            acc += sh[t, k]
        PG[cuda.blockIdx.x, k] = acc
"""
    bwd_cols = f"""
@cuda.jit(cache={not sim})
def gat_backward_cols(tptr, tind, perm, As, Ad, WeT, pos, EX, P, V, dout, M, L, Delta,
                      dAs, dV, dpos, nrows):
    j = cuda.grid(1)
    if j >= nrows:
        return
{weights}
    gV = cuda.local.array({fv}, T)
{_block([f"gas{r} = ZERO" for r in range(h1)], 4)}
    for f in range({fv}):
        gV[f] = ZERO
{_block([f"gp{d} = ZERO" for d in range(pd)], 4)}
    for t in range(tptr[j], tptr[j + 1]):
        i = tind[t]
{read_perm}
{feat8}
{score8}
        p = T(math.exp(s - M[i])) / L[i]
        dp = ZERO
        for f in range({fv}):
            dp += dout[i, f] * V[j, f]
            gV[f] += p * dout[i, f]
        ds = p * (dp - Delta[i])
{_block(_u_backward(spec, False), 8)}
{_block([f"gas{r} += g0_{r}" for r in range(h1)], 8)}
{_block(_u_edge_grad(spec, "src"), 8)}
{_block([f"dAs[j, {r}] = gas{r}" for r in range(h1)], 4)}
    for f in range({fv}):
        dV[j, f] = gV[f]
{_block([f"dpos[j, {d}] = gp{d}" for d in range(pd)], 4)}
"""
    header = (f"# generated by tiga_numba.cuda.gat for spec {spec!r}, {dtype_name}, "
              f"nt_rows={nt_rows}, sim={sim}\n"
              "import math\nimport numpy as np\nimport tiga_numba.cuda  # numpy compat shim\n"
              "from numba import cuda\n"
              f"T = np.{dtype_name}\nZERO = T(0.0)\nONE = T(1.0)\n")
    return header + fwd + bwd_rows + bwd_cols


def get_kernels(spec, p_size, dtype):
    from .launch import SIM
    name = "float64" if str(dtype) == "float64" else "float32"
    if not unrollable(spec, p_size):
        raise NotImplementedError(
            f"score network too large for the CUDA GAT kernel (weights of layers >= 1 plus "
            f"hidden x edge columns = {p_size + spec.h1 * spec.fe}, widths up to "
            f"{max([spec.h1] + [la[2] for la in spec.layers if la[0] == 'linear'])}; the CUDA "
            "kernel keeps the network in registers and takes <= 1200 and <= 64); use numpy "
            "inputs for the CPU kernel")
    itemsize = 8 if name == "float64" else 4
    n_pg = p_size + spec.fe * spec.h1
    nt_rows = block_size(n_pg, itemsize)
    if nt_rows < 32:
        raise NotImplementedError(f"score network has {n_pg} parameter-gradient slots per "
                                  "edge; the CUDA kernel's shared reduction takes at most "
                                  f"{SHARED_BYTES // (32 * itemsize)}")
    nt_fwd = 128
    key = ("gat-cuda", spec, int(p_size), name, nt_rows, SIM)
    module = KERNELS.get(key, lambda: _load(generate_source(spec, p_size, name, nt_fwd, nt_rows,
                                                            SIM), prefix="tiga_gat_cuda"))
    return module, ("hit" if KERNELS.last_was_hit else "miss"), nt_fwd, nt_rows


def _grid(n, nt):
    return max(1, math.ceil(n / nt))


def _arg(a, xp):
    """Kernels never touch an array their spec does not use; give them a 1-element stand-in
    instead of a zero-size one (whose device pointer may be null)."""
    if a.size:
        return a
    return xp.zeros((1,) * a.ndim, a.dtype)


# --------------------------------------------------------------------------- host glue
def forward(graph, net, prep, return_state, xp=None, device="cuda"):
    from .. import edge_mlp as em
    if xp is None:
        import cupy as xp
    params = dict(net.named_parameters())
    As, Ad, WeT = em._node_products(prep, params, xp)
    kern, cache, nt_fwd, _ = get_kernels(prep.spec, prep.P.shape[0], prep.acc)
    rel = graph.realize(device)
    nd = prep.num_dst
    out = xp.empty((nd, prep.spec.fv), prep.acc)
    M = xp.empty(nd, prep.acc)
    L = xp.empty(nd, prep.acc)
    if nd:
        kern.gat_forward[_grid(nd, nt_fwd), nt_fwd](
            rel.indptr, _arg(rel.indices, xp), As, Ad, _arg(WeT, xp), _arg(prep.pos, xp),
            _arg(prep.EX, xp), prep.P, prep.V, out, M, L, nd)
    plan = em._plan("forward", prep, net)
    plan.run_info.update(kernel=f"cuda.gat_forward (one thread per destination row, {nt_fwd} "
                                "threads/block; score MLP in registers + online softmax)",
                         cache=cache, copies=list(prep.copies),
                         order="one thread per row, caller's node order",
                         ir=_cuda_ir(kern.gat_forward),
                         geometry=("displacement/distance computed per edge from positions"
                                   if prep.geometric else None))
    result = out.astype(prep.dtype, copy=False).reshape((nd,) + prep.value_shape[1:])
    state = em.GATState(m=M, l=L, out=out, As=As, Ad=Ad) if return_state else None
    return result, state, plan


def backward(graph, net, prep, state, dout, args, value, xp=None, device="cuda"):
    from .. import edge_mlp as em
    if xp is None:
        import cupy as xp
    params = dict(net.named_parameters())
    acc = prep.acc
    W1 = params["0.weight"].astype(acc)
    h1 = W1.shape[0]
    WeT = xp.ascontiguousarray(W1[:, prep.edge_cols].T) if prep.edge_cols else xp.zeros((0, h1), acc)
    kern, cache, _, nt_rows = get_kernels(prep.spec, prep.P.shape[0], acc)
    rel = graph.realize(device)
    tr = graph.realize_transpose(device)
    nd, ns = prep.num_dst, prep.num_src
    D = xp.ascontiguousarray(dout.reshape(nd, -1), dtype=acc)
    pd = prep.pd
    Delta = xp.empty(nd, acc)
    dAd = xp.empty((nd, h1), acc)
    dposA = xp.zeros((nd if prep.geometric else 0, pd), acc)
    dEX = xp.zeros(prep.EX.shape, acc) if prep.explicit else xp.zeros((0, 0), acc)
    n_pg = prep.P.shape[0] + h1 * prep.spec.fe
    nblocks = _grid(nd, nt_rows)
    PG = xp.zeros((nblocks, max(n_pg, 1)), acc)
    if nd:
        kern.gat_backward_rows[nblocks, nt_rows](
            rel.indptr, _arg(rel.indices, xp), state.As, state.Ad, _arg(WeT, xp),
            _arg(prep.pos, xp), _arg(prep.EX, xp), prep.P, prep.V, state.out, D, state.m,
            state.l, Delta, dAd, _arg(dposA, xp), _arg(dEX, xp), PG, nd)
    dAs = xp.empty((ns, h1), acc)
    dV = xp.empty((ns, prep.spec.fv), acc)
    dposB = xp.zeros((ns if prep.geometric else 0, pd), acc)
    perm = tr.perm if prep.explicit else xp.zeros(1, np.int64)
    if ns:
        kern.gat_backward_cols[_grid(ns, 128), 128](
            tr.indptr, _arg(tr.indices, xp), perm, state.As, state.Ad, _arg(WeT, xp),
            _arg(prep.pos, xp), _arg(prep.EX, xp), prep.P, prep.V, D, state.m, state.l, Delta,
            dAs, dV, _arg(dposB, xp), ns)
    pg = PG.sum(axis=0)  # block order fixed: deterministic
    grads = em._assemble_grads(prep, params, args, value, W1, dAs, dAd, pg, dEX, dV,
                               (dposA + dposB) if prep.geometric else None, graph, xp)
    plan = em._plan("backward", prep, net)
    plan.run_info.update(kernel=f"cuda.gat_backward_rows ({nt_rows} threads/block, per-block "
                                "shared-memory parameter reduction) + cuda.gat_backward_cols",
                         cache=cache, copies=list(prep.copies),
                         order="one thread per row, caller's node order",
                         ir=_cuda_ir(kern.gat_backward_rows),
                         geometry=("displacement/distance gradients routed to positions per edge"
                                   if prep.geometric else None))
    grads["plan"] = plan
    return grads


def _cuda_ir(kernel):
    def llvm():
        return "\n".join(str(v) for v in kernel.inspect_llvm().values())

    def ptx():
        return "\n".join(str(v) for v in kernel.inspect_asm().values())
    return {"llvm": llvm, "ptx": ptx}
