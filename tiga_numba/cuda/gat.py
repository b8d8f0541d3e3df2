"""Fused GAT-MLP edge attention on the GPU (numba.cuda), forward and backward.

Same model and the same generated per-edge code as tiga_numba.cpu.gat (the unrolled
variant: the score network lives in registers), laid out for a GPU:

  lane groups   G consecutive lanes (G a power of two <= 32, a compile-time constant) share
                one row. The row's edges are taken G at a time: lane s runs the whole score
                network for edge base + s (edge-parallel, no redundant MLP work), then the
                value side is split by feature: lane s owns features s, s + G, ... and the
                group walks the G edges of the step, broadcasting each edge's source id and
                weight with a shuffle, so a gathered value row is read by G lanes at once
                (coalesced sectors instead of one thread reading a whole row).
  forward       destination rows; per step the group max and sum of the G new scores
                (xor butterflies: every lane gets the same bits), one rescale per step.
  backward A    destination rows, grid-stride over a fixed number of blocks; dp = dout_i .
                V_j is computed feature-split for the step's G edges and handed back to the
                edge's lane by a reduce-scatter butterfly (G - 1 shuffles); the MLP backward
                runs per lane; parameter-gradient partials stay in registers for all the
                rows a group handles, are summed over the group by a butterfly and then
                over the block's groups through shared memory in group order; one row of PG
                per block, summed in block order. Deterministic, no float atomics.
  backward B    source rows over the transposed relation, same step structure; dV is
                accumulated feature-split in registers.
Lanes past a row's last edge repeat that edge (valid addresses) with weight 0, so nothing
reads out of bounds and their contributions are exact zeros; only writes are guarded.
Nothing (E,)-sized is allocated.

Launch: every array is passed as a raw device address (tiga_numba.cuda.launch: explicit
all-scalar signature, cubin cache, cuda.core launch), not as a cupy array through numba's
dispatcher (which re-wraps, and may synchronise on, every array argument). Under
NUMBA_ENABLE_CUDASIM the same kernel bodies take flat host arrays.

Kernels are generated as Python source per (layer stack, edge features, value width, dtype,
lanes), written to the per-user cache directory and imported; the kernel names carry the
source digest, so the launcher's cubin cache can never serve a stale kernel.
"""
from __future__ import annotations

import os
import re

import numba
import numpy as np

from .. import disk_cache
from ..score_net_source import (indented, route_edge_grad, u_backward, u_features, u_hoist, u_score, u_weights,
                                unrollable)
from ..edge_mlp_records import GATState, col_runs, finish_grads, make_plan, row_width
from ..kernel_cache import KERNELS

DEFAULT_LANES = 4  # measured on one H200 (F = 8 and 64): 4 < 8 < 16 in fwd+bwd time
MAX_NT = 128
BLOCKS_PER_SM = 8  # backward A's fixed grid: this many blocks per multiprocessor
SHARED_BYTES = 40 * 1024


def lanes_for(spec):
    """Lanes per row: TIGA_NUMBA_GAT_LANES overrides (benchmarks); under the simulator 1
    unless it offers the lane-group shuffles (launch.simulator_has)."""
    from .launch import SIM, simulator_has
    env = os.environ.get("TIGA_NUMBA_GAT_LANES")
    g = int(env) if env else DEFAULT_LANES
    if g not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"TIGA_NUMBA_GAT_LANES must be a power of two <= 32, got {g}")
    if SIM and not simulator_has("shfl_sync", "shfl_xor_sync"):
        return 1
    return g


# --------------------------------------------------------------------------- code generation
_IDX2 = re.compile(r"\b(As|Ad|WeT|pos|EX|dEX)\[([^\[\],]+), ([^\[\]]+)\]")


def _flat(lines, widths):
    """The shared unrolled generator writes A[r, c]; the kernels see flat 1-D views."""
    def sub(mt):
        name, a, b = mt.group(1), mt.group(2), mt.group(3)
        return f"{name}[({a}) * {widths[name]} + {b}]"
    return [_IDX2.sub(sub, s) for s in lines]


def _feature_slice(fv, G):
    """(c, guarded) for the features lane s owns: f = s + c * G; guarded when f may be >= fv."""
    fs = -(-fv // G)
    return [(c, c * G + G - 1 >= fv) for c in range(fs)]


def _xor_all(var, G, op):
    """Butterfly over the group: every lane ends with the same value (same bits)."""
    lines = []
    o = G // 2
    while o >= 1:
        if op == "max":
            lines.append(f"{var} = max({var}, cuda.shfl_xor_sync(mask, {var}, {o}))")
        else:
            lines.append(f"{var} = {var} + cuda.shfl_xor_sync(mask, {var}, {o})")
        o //= 2
    return lines


def _reduce_scatter(parts, G, out):
    """parts[u] (u < G) are this lane's partial sums for the step's edge u; afterwards `out`
    holds, in lane s, the group total for edge s. log2(G) halving steps, G - 1 shuffles."""
    cur = list(parts)
    lines = []
    o = G // 2
    k = 0
    while o >= 1:
        lines.append(f"up_{k} = (lane & {o}) != 0")
        nxt = []
        for u in range(len(cur) // 2):
            lo, hi = cur[u], cur[u + len(cur) // 2]
            name = f"rs{k}_{u}"
            lines += [f"snd = {lo} if up_{k} else {hi}",
                      f"{name} = ({hi} if up_{k} else {lo}) + cuda.shfl_xor_sync(mask, snd, {o})"]
            nxt.append(name)
        cur = nxt
        o //= 2
        k += 1
    lines.append(f"{out} = {cur[0]}")
    return lines


def _edge_grad(spec, side):
    """gef = We^T gh0 (scalars ge<c>), routed to positions; explicit edge features are
    written by valid lanes only (an invalid lane repeats an edge another lane owns)."""
    if not spec.fe:
        return []
    L = [f"ge{c} = " + " + ".join(f"we{c}_{r} * g0_{r}" for r in range(spec.h1))
         for c in range(spec.fe)]
    L += route_edge_grad(spec, side, lambda i: f"ge{i}",
                          lambda off, width, xcol: ["if valid:"] + [
                              f"    dEX[e, {xcol + c}] = ge{off + c}" for c in range(width)])
    return L


_FWD_ARGS = ["indptr", "indices", "As", "Ad", "WeT", "pos", "EX", "P", "V", "out", "M", "L",
             "nrows"]
_ROWS_ARGS = ["indptr", "indices", "As", "Ad", "WeT", "pos", "EX", "P", "V", "out", "dout", "M",
              "L", "Delta", "dAd", "dpos", "dEX", "PG", "nrows"]
_COLS_ARGS = ["tptr", "tind", "perm", "As", "Ad", "WeT", "pos", "EX", "P", "V", "dout", "M", "L",
              "Delta", "dAs", "dV", "dpos", "nrows"]
_INT_ARGS = {"indptr": "i64", "indices": "i32", "tptr": "i64", "tind": "i32", "perm": "i64"}


def _kernel_head(name, args):
    """`def name(...)` of a generated kernel and the flat views of its arrays: every argument
    but the last (the row count) is an array passed as a raw device address (cuda/launch.py),
    its view's dtype from _INT_ARGS (the float arrays: T). The launch signature (_signature)
    reads the same lists, so the two cannot disagree."""
    views = {"i64": "AS_I64", "i32": "AS_I32", "T": "AS_T"}
    arrays, last = args[:-1], args[-1]
    return "\n".join([f"def {name}({', '.join([a + '_p' for a in arrays] + [last])}):"]
                     + [f"    {a} = {views[_INT_ARGS.get(a, 'T')]}({a}_p)" for a in arrays])


def _lane_group(row, G, nt, bounded):
    """Thread -> (`row`, lane) of a G-lane group, and the group's lanes in its warp (gbase,
    mask: the shuffles' source lanes and member mask); `bounded`: threads past the last row
    return."""
    return (["tid = cuda.threadIdx.x",
             f"gid = i64(cuda.blockIdx.x) * {nt} + tid",
             f"{row} = gid // {G}",
             f"lane = gid - {row} * {G}"]
            + ([f"if {row} >= nrows:", "    return"] if bounded else [])
            + ["gbase = (tid % 32) - lane",
               f"mask = u32({(1 << G) - 1} << gbase)"])


def generate_source(spec, p_size, dtype_name, G, nt, sim):
    h1, fe, fv, pd = spec.h1, spec.fe, spec.fv, spec.pd
    xw = sum(it[2] for it in spec.edge_items if it[0] == "x")
    widths = {"As": h1, "Ad": h1, "WeT": h1, "pos": max(pd, 1), "EX": max(xw, 1),
              "dEX": max(xw, 1)}
    explicit = xw > 0
    n_pg = p_size + fe * h1
    gpb = nt // G  # groups per block
    fsl = _feature_slice(fv, G)

    def fl(lines, n):
        return indented(_flat(lines, widths), n)

    weights = fl(u_weights(spec), 4)
    p_slots = [k for layer in spec.layers if layer[0] == "linear"
               for k in range(layer[3], layer[3] + layer[1] * layer[2] + layer[2])]
    pg_names = [f"pg{k}" for k in p_slots] + [f"pge{c}_{r}" for c in range(fe) for r in range(h1)]
    pg_slots = p_slots + [p_size + c * h1 + r for c in range(fe) for r in range(h1)]
    # slots no gradient lands in (parameters this kernel does not differentiate, e.g. the first
    # layer's when it is folded into the node products) are written as zeros: the reduction below
    # reads every slot, and shared memory starts as garbage
    unset_pg = [f"sh[grp % {gpb}, {k}] = ZERO" for k in sorted(set(range(n_pg)) - set(pg_slots))]

    def fidx(c):
        return f"lane + {c * G}" if c else "lane"

    def guard(c, guarded, line, ind=0):
        pad = " " * ind
        if guarded:
            return [f"{pad}if {fidx(c)} < {fv}:", f"{pad}    {line}"]
        return [f"{pad}{line}"]

    shfl = G > 1

    def bcast(var, u):
        return f"cuda.shfl_sync(mask, {var}, gbase + {u})" if shfl else var

    step_head = [
        "e = base + lane",
        "valid = e < e1",
        "if not valid:",
        "    e = e1 - 1",
    ]
    # ------------------------------------------------------------------ forward
    fwd_u = []
    for u in range(G):
        body = [f"pu = {bcast('p', u)}", f"ju = {bcast('j', u)}", f"vb = ju * {fv}"]
        for c, gd in fsl:
            body += guard(c, gd, f"acc{c} += pu * V[vb + {fidx(c)}]")
        fwd_u += ([f"if base + {u} < e1:"] + ["    " + b for b in body]) if u else body
    fwd = f"""
{_kernel_head("gat_forward", _FWD_ARGS)}
{indented(_lane_group("i", G, nt, bounded=True), 4)}
{weights}
{fl(u_hoist(spec, "dst"), 4)}
    m = NEG
    l = ZERO
{indented([f"acc{c} = ZERO" for c, _ in fsl], 4)}
    e1 = indptr[i + 1]
    for base in range(indptr[i], e1, {G}):
{indented(step_head, 8)}
        j = indices[e]
{fl(u_features(spec, "dst"), 8)}
{fl(u_score(spec, "dst"), 8)}
        if not valid:
            s = NEG
{indented(["mx = s"] + _xor_all("mx", G, "max"), 8)}
        mn = max(m, mx)
        alpha = T(math.exp(m - mn))
        p = T(math.exp(s - mn))
{indented(["ps = p"] + _xor_all("ps", G, "sum"), 8)}
        l = l * alpha + ps
{indented([f"acc{c} = acc{c} * alpha" for c, _ in fsl], 8)}
{indented(fwd_u, 8)}
        m = mn
    inv = ONE / l if l > ZERO else ZERO
{indented([x for c, gd in fsl for x in guard(c, gd, f"out[i * {fv} + {fidx(c)}] = acc{c} * inv")], 4)}
    if lane == 0:
        M[i] = m
        L[i] = l
"""
    # ------------------------------------------------------------------ backward A (dst rows)
    rows_u = []
    for u in range(G):
        body = [f"ju = {bcast('j', u)}", f"vb = ju * {fv}"]
        for c, gd in fsl:
            body += guard(c, gd, f"dq{u} += do{c} * V[vb + {fidx(c)}]")
        rows_u += ([f"if base + {u} < e1:"] + ["    " + b for b in body]) if u else body
    gad_lines = [f"gad{r} += g0_{r}" for r in range(h1)]
    gad_lines += [f"pge{c}_{r} += g0_{r} * ef{c}" for c in range(fe) for r in range(h1)]
    row_end = []
    for r in range(h1):
        row_end += _xor_all(f"gad{r}", G, "sum")
    for d in range(pd):
        row_end += _xor_all(f"gp{d}", G, "sum")
    row_store = ([f"dAd[i * {h1} + {r}] = gad{r}" for r in range(h1)]
                 + [f"dpos[i * {pd} + {d}] = gp{d}" for d in range(pd)])
    pg_group = []
    for nm in pg_names:
        pg_group += _xor_all(nm, G, "sum")
    npg1 = max(n_pg, 1)
    bwd_rows = f"""
{_kernel_head("gat_backward_rows", _ROWS_ARGS)}
{indented(_lane_group("grp", G, nt, bounded=False), 4)}
    ngroups = i64(cuda.gridDim.x) * {gpb}
{weights}
{indented([f"{nm} = ZERO" for nm in pg_names], 4)}
    i = grp
    while i < nrows:
{fl(u_hoist(spec, "dst"), 8)}
{indented([f"do{c} = ZERO" for c, gd in fsl if gd], 8)}
{indented([x for c, gd in fsl for x in guard(c, gd, f"do{c} = dout[i * {fv} + {fidx(c)}]")], 8)}
{indented(["delta = ZERO"] + [x for c, gd in fsl for x in guard(c, gd, f"delta += do{c} * out[i * {fv} + {fidx(c)}]")], 8)}
{indented(_xor_all("delta", G, "sum"), 8)}
        if lane == 0:
            Delta[i] = delta
{indented([f"gad{r} = ZERO" for r in range(h1)] + [f"gp{d} = ZERO" for d in range(pd)], 8)}
        mi = M[i]
        li = L[i]
        inv_l = ONE / li if li > ZERO else ZERO
        e1 = indptr[i + 1]
        for base in range(indptr[i], e1, {G}):
{indented(step_head, 12)}
            j = indices[e]
{fl(u_features(spec, "dst"), 12)}
{fl(u_score(spec, "dst"), 12)}
            p = T(math.exp(s - mi)) * inv_l if valid else ZERO
{indented([f"dq{u} = ZERO" for u in range(G)], 12)}
{indented(rows_u, 12)}
{indented(_reduce_scatter([f"dq{u}" for u in range(G)], G, "dp"), 12)}
            ds = p * (dp - delta)
{fl(u_backward(spec, True), 12)}
{indented(gad_lines, 12)}
{fl(_edge_grad(spec, "dst"), 12)}
{indented(row_end, 8)}
        if lane == 0:
{fl(row_store, 12) if row_store else " " * 12 + "pass"}
        i += ngroups
    # parameter partials: group butterfly, then the block's groups in order (deterministic)
{indented(pg_group, 4)}
    sh = cuda.shared.array(({gpb}, {npg1}), T)
    if lane == 0:
{indented([f"sh[grp % {gpb}, {k}] = {nm}" for k, nm in zip(pg_slots, pg_names)] + unset_pg or ["pass"], 8)}
    cuda.syncthreads()
    for k in range(tid, {n_pg}, {nt}):
        acc = ZERO
        for t in range({gpb}):
            acc += sh[t, k]
        PG[i64(cuda.blockIdx.x) * {npg1} + k] = acc
"""
    # ------------------------------------------------------------------ backward B (src rows)
    read_perm = ["e = perm[t]"] if explicit else []
    cols_u = []
    for u in range(G):
        body = [f"iu = {bcast('i', u)}", f"pu = {bcast('p', u)}", f"db = iu * {fv}"]
        for c, gd in fsl:
            if gd:
                body += [f"if {fidx(c)} < {fv}:",
                         f"    dd = dout[db + {fidx(c)}]",
                         f"    dq{u} += dd * vj{c}",
                         f"    gv{c} += pu * dd"]
            else:
                body += [f"dd = dout[db + {fidx(c)}]", f"dq{u} += dd * vj{c}", f"gv{c} += pu * dd"]
        cols_u += ([f"if base + {u} < t1:"] + ["    " + b for b in body]) if u else body
    col_end = []
    for r in range(h1):
        col_end += _xor_all(f"gas{r}", G, "sum")
    for d in range(pd):
        col_end += _xor_all(f"gp{d}", G, "sum")
    col_store = ([f"dAs[j * {h1} + {r}] = gas{r}" for r in range(h1)]
                 + [f"dpos[j * {pd} + {d}] = dpos[j * {pd} + {d}] + gp{d}" for d in range(pd)])
    bwd_cols = f"""
{_kernel_head("gat_backward_cols", _COLS_ARGS)}
{indented(_lane_group("j", G, nt, bounded=True), 4)}
{weights}
{fl(u_hoist(spec, "src"), 4)}
{indented([f"vj{c} = ZERO" for c, gd in fsl if gd], 4)}
{indented([x for c, gd in fsl for x in guard(c, gd, f"vj{c} = V[j * {fv} + {fidx(c)}]")], 4)}
{indented([f"gv{c} = ZERO" for c, _ in fsl] + [f"gas{r} = ZERO" for r in range(h1)] + [f"gp{d} = ZERO" for d in range(pd)], 4)}
    t1 = tptr[j + 1]
    for base in range(tptr[j], t1, {G}):
        t = base + lane
        valid = t < t1
        if not valid:
            t = t1 - 1
        i = tind[t]
{indented(read_perm, 8)}
{fl(u_features(spec, "src"), 8)}
{fl(u_score(spec, "src"), 8)}
        p = T(math.exp(s - M[i])) / L[i] if valid else ZERO
        dl = Delta[i]
{indented([f"dq{u} = ZERO" for u in range(G)], 8)}
{indented(cols_u, 8)}
{indented(_reduce_scatter([f"dq{u}" for u in range(G)], G, "dp"), 8)}
        ds = p * (dp - dl)
{fl(u_backward(spec, False), 8)}
{indented([f"gas{r} += g0_{r}" for r in range(h1)], 8)}
{fl(_edge_grad(spec, "src"), 8)}
{indented(col_end, 4)}
    if lane == 0:
{fl(col_store, 8) if col_store else " " * 8 + "pass"}
{indented([x for c, gd in fsl for x in guard(c, gd, f"dV[j * {fv} + {fidx(c)}] = gv{c}")], 4)}
"""
    header = (f"# generated by tiga_numba.cuda.gat for spec {spec!r}, {dtype_name}, "
              f"lanes={G}, nt={nt}, sim={sim}\n"
              "import math\nimport numba\nimport numpy as np\n"
              "import tiga_numba.cuda  # numpy compat shim\n"
              "from numba import cuda\n"
              "from tiga_numba.cuda.launch import array_view\n"
              f"T = np.{dtype_name}\nZERO = T(0.0)\nONE = T(1.0)\nNEG = T(-math.inf)\n"
              "i64 = numba.int64\nu32 = numba.uint32\n"
              f"AS_T = array_view(numba.{dtype_name})\n"
              "AS_I64 = array_view(numba.int64)\nAS_I32 = array_view(numba.int32)\n")
    return header + fwd + bwd_rows + bwd_cols



# --------------------------------------------------------------------------- node kernels
def generate_node_source(layout, h1, n_in, dtype_name, nt, sim):
    """Two small kernels around the edge kernels, one launch each instead of a handful of
    array-library calls (on this problem size their host cost exceeds their GPU time):
      gat_node_products  thread (n, r): As[n, r] = sum over src args of W1[r, cols] . x[n],
                         Ad[n, r] = b1[r] + the same over dst args (first Linear split per node)
      gat_node_grads     thread (n, q) over all node-argument columns q:
                         dx[n, q] = sum_r dA_role[n, r] W1[r, col(q)]
    layout: ((role, width, first column of W1), ...) of the node arguments; their arrays come
    as (address, row stride, column stride) in elements."""
    x_params = ", ".join(f"x{a}_p, x{a}s0, x{a}s1" for a in range(len(layout)))
    g_params = ", ".join(f"g{a}_p" for a in range(len(layout)))
    views_x = [f"x{a} = AS_T(x{a}_p)" for a in range(len(layout))]
    views_g = [f"g{a} = AS_T(g{a}_p)" for a in range(len(layout))]

    # W1 staged in shared memory: the 16-ish threads of a node read 16 rows of W1 per
    # column, one cache line each from global memory, conflict-free from shared memory
    hw = h1 * n_in
    stage = hw * (8 if dtype_name == "float64" else 4) <= NODE_SHARED_BYTES
    if stage:
        w_read = "shW"
        stage_lines = [f"shW = cuda.shared.array({hw}, T)",
                       f"for k in range(cuda.threadIdx.x, {hw}, {nt}):",
                       "    shW[k] = W[k]",
                       "cuda.syncthreads()"]
    else:
        w_read, stage_lines = "W", []

    def sums(role, acc):
        L = []
        for a, (rl, width, c0) in enumerate(layout):
            if rl == role:
                L += [f"for c in range({width}):",
                      f"    {acc} += {w_read}[r * {n_in} + {c0} + c] * x{a}[n * x{a}s0 + c * x{a}s1]"]
        return L
    prod = f"""
def gat_node_products(W_p, b_p, As_p, Ad_p, {x_params + ", " if x_params else ""}ns, nd):
    W = AS_T(W_p)
    b = AS_T(b_p)
    As = AS_T(As_p)
    Ad = AS_T(Ad_p)
{indented(views_x, 4)}
{indented(stage_lines, 4)}
    gid = i64(cuda.blockIdx.x) * {nt} + cuda.threadIdx.x
    n = gid // {h1}
    r = gid - n * {h1}
    if n < ns:
        a = ZERO
{indented(sums("src", "a"), 8)}
        As[n * {h1} + r] = a
    if n < nd:
        a = b[r]
{indented(sums("dst", "a"), 8)}
        Ad[n * {h1} + r] = a
"""
    tw = sum(w for _, w, _ in layout)
    chain, off = [], 0
    for a, (rl, width, c0) in enumerate(layout):
        nrows = "ns" if rl == "src" else "nd"
        dA = "dAs" if rl == "src" else "dAd"
        chain += [f"{'if' if a == 0 else 'elif'} q < {off + width}:",
                  f"    if n < {nrows}:",
                  "        acc = ZERO",
                  f"        for r in range({h1}):",
                  f"            acc += {dA}[n * {h1} + r] * W[r * {n_in} + {c0 - off} + q]",
                  f"        g{a}[n * {width} + q - {off}] = acc"]
        off += width
    grads = f"""
def gat_node_grads(W_p, dAs_p, dAd_p, {g_params + ", " if g_params else ""}ns, nd):
    W = AS_T(W_p)
    dAs = AS_T(dAs_p)
    dAd = AS_T(dAd_p)
{indented(views_g, 4)}
    gid = i64(cuda.blockIdx.x) * {nt} + cuda.threadIdx.x
    n = gid // {max(tw, 1)}
    q = gid - n * {max(tw, 1)}
{indented(chain or ["pass"], 4)}
"""
    header = (f"# generated by tiga_numba.cuda.gat (node kernels) for layout {layout!r}, "
              f"h1={h1}, in={n_in}, {dtype_name}, nt={nt}, sim={sim}\n"
              "import math\nimport numba\nimport numpy as np\n"
              "import tiga_numba.cuda  # numpy compat shim\n"
              "from numba import cuda\n"
              "from tiga_numba.cuda.launch import array_view\n"
              f"T = np.{dtype_name}\nZERO = T(0.0)\ni64 = numba.int64\n"
              f"AS_T = array_view(numba.{dtype_name})\n")
    return header + prod + grads

# --------------------------------------------------------------------------- kernels
def _signature(names, arrays, T):
    """Kernel parameter spec for launch.Kernel: arrays by dtype, trailing int64 scalars."""
    i64, i32 = numba.int64, numba.int32
    kinds = {"T": T, "i64": i64, "i32": i32}
    return ([(n, "a", kinds[arrays[n]]) for n in names[:-1]] + [(names[-1], "s", i64)])


class GATKernels:
    """The three launchable kernels of one (spec, dtype, lanes) plus their geometry."""

    def __init__(self, module, digest, T, G, nt, n_pg):
        from .launch import Kernel
        kinds = {n: _INT_ARGS.get(n, "T") for n in set(_FWD_ARGS + _ROWS_ARGS + _COLS_ARGS)}
        self.forward = Kernel(f"gat_fwd_{digest}", module.gat_forward,
                              _signature(_FWD_ARGS, kinds, T))
        self.rows = Kernel(f"gat_bwd_rows_{digest}", module.gat_backward_rows,
                           _signature(_ROWS_ARGS, kinds, T))
        self.cols = Kernel(f"gat_bwd_cols_{digest}", module.gat_backward_cols,
                           _signature(_COLS_ARGS, kinds, T))
        self.G, self.nt, self.n_pg = G, nt, n_pg
        self.source_path = module.__file__

    def blocks(self, nrows):
        return max(1, -(-nrows * self.G // self.nt))


def get_kernels(spec, p_size, dtype):
    """(GATKernels, cache 'hit'/'miss'). Networks that do not fit the register-resident
    unrolled code are refused rather than run slowly."""
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
    G = lanes_for(spec)
    n_pg = p_size + spec.fe * spec.h1
    nt = 32 if SIM else MAX_NT
    while nt > max(G, 32) and (nt // G) * max(n_pg, 1) * itemsize > SHARED_BYTES:
        nt //= 2
    if (nt // G) * max(n_pg, 1) * itemsize > SHARED_BYTES:
        raise NotImplementedError(f"score network has {n_pg} parameter-gradient slots per "
                                  "edge; the CUDA kernel's shared reduction takes at most "
                                  f"{SHARED_BYTES // ((nt // G) * itemsize)}")
    key = ("gat-cuda", spec, int(p_size), name, G, nt, SIM)

    def build():
        module = disk_cache.import_source(generate_source(spec, p_size, name, G, nt, SIM), "tiga_gat_cuda", "gat")
        digest = module.__name__.rsplit("_", 1)[-1]
        return GATKernels(module, digest, numba.float64 if name == "float64" else numba.float32,
                          G, nt, n_pg)
    kern = KERNELS.get(key, build)
    return kern, ("hit" if KERNELS.last_was_hit else "miss")



class NodeKernels:
    """The node-side kernels of one (argument layout, hidden, in, dtype)."""

    def __init__(self, module, digest, T, layout, h1):
        from .launch import Kernel
        i64 = numba.int64
        xs = [sp for a in range(len(layout))
              for sp in ((f"x{a}", "a", T), (f"x{a}s0", "s", i64), (f"x{a}s1", "s", i64))]
        self.products = Kernel(f"gat_node_products_{digest}", module.gat_node_products,
                               [("W", "a", T), ("b", "a", T), ("As", "a", T), ("Ad", "a", T)]
                               + xs + [("ns", "s", i64), ("nd", "s", i64)])
        self.grads = Kernel(f"gat_node_grads_{digest}", module.gat_node_grads,
                            [("W", "a", T), ("dAs", "a", T), ("dAd", "a", T)]
                            + [(f"g{a}", "a", T) for a in range(len(layout))]
                            + [("ns", "s", i64), ("nd", "s", i64)])
        self.layout, self.h1, self.nt = layout, h1, NODE_NT
        self.width = sum(w for _, w, _ in layout)

    def blocks(self, nthreads):
        return max(1, -(-nthreads // self.nt))


NODE_NT = 256
NODE_SHARED_BYTES = 32 * 1024


def get_node_kernels(layout, h1, n_in, dtype):
    from .launch import SIM
    name = "float64" if str(dtype) == "float64" else "float32"
    nt = 32 if SIM else NODE_NT
    key = ("gat-cuda-nodes", layout, int(h1), int(n_in), name, nt, SIM)

    def build():
        module = disk_cache.import_source(generate_node_source(layout, h1, n_in, name, nt, SIM),
                                          "tiga_gat_cuda_nodes", "gat")
        digest = module.__name__.rsplit("_", 1)[-1]
        nk = NodeKernels(module, digest, numba.float64 if name == "float64" else numba.float32,
                         layout, h1)
        nk.nt = nt
        return nk
    return KERNELS.get(key, build)

_SMS = {}


def _rows_grid(kern, nrows):
    """Backward A's fixed grid (grid-stride over rows): a function of the device only, so
    the parameter partials, and their rounding, are the same on every run."""
    from .launch import SIM
    if SIM:
        cap = 3  # small, so that the simulator exercises the grid-stride loop
    else:
        import cupy
        dev = cupy.cuda.Device().id
        if dev not in _SMS:
            _SMS[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
        cap = _SMS[dev] * BLOCKS_PER_SM
    return min(kern.blocks(nrows), cap)


def _ptrs(xp, *arrays):
    """Device addresses (GPU) or flat host views (simulator) of C-contiguous arrays."""
    if xp is np:
        return [a.reshape(-1) for a in arrays]
    return [a.data.ptr for a in arrays]


def _stream(xp):
    if xp is np:
        return None
    from .launch import current_stream
    return current_stream()


# --------------------------------------------------------------------------- host glue
def _node_args(prep, xp):
    """(layout, [(array acc-dtype, row stride, col stride)]) of the node arguments; arrays
    are passed in place when their dtype is the accumulation dtype and their strides are
    non-negative (the simulator gets contiguous copies: it has no addresses)."""
    layout, arrays = [], []
    for _, role, arr, cols in prep.node_cols:
        a = arr
        if (a.dtype != prep.acc or xp is np or any(st < 0 for st in a.strides)
                or a.strides[1] % a.itemsize or a.strides[0] % a.itemsize):
            a = xp.ascontiguousarray(a, dtype=prep.acc)
        layout.append((role, int(a.shape[1]), int(cols.start)))
        arrays.append((a, a.strides[0] // a.itemsize, a.strides[1] // a.itemsize))
    return tuple(layout), arrays


def _node_products(prep, params, xp):
    """As, Ad ((N, hidden), acc) in one launch; WeT (edge columns, hidden) of W1."""
    acc = prep.acc
    W1 = xp.ascontiguousarray(params["0.weight"], dtype=acc)
    b1 = xp.ascontiguousarray(params["0.bias"], dtype=acc)
    h1, n_in = W1.shape
    layout, arrays = _node_args(prep, xp)
    nk = get_node_kernels(layout, h1, n_in, acc)
    ns, nd = prep.num_src, prep.num_dst
    As = xp.empty((ns, h1), acc)
    Ad = xp.empty((nd, h1), acc)
    n = max(ns, nd)
    if n:
        xs = []
        for a, s0, s1 in arrays:
            xs += [_ptrs(xp, a)[0], s0, s1]
        nk.products((nk.blocks(n * h1), 1, 1), (nk.nt, 1, 1), _stream(xp),
                    *_ptrs(xp, W1, b1, As, Ad), *xs, ns, nd)
    return As, Ad, _edge_weights_t(W1, prep, xp), W1, nk


def _edge_weights_t(W1, prep, xp):
    """WeT = W1[:, edge columns].T, contiguous (edge columns, hidden); column runs are sliced
    (a list index would cost the array library a host-to-device copy of the list)."""
    h1 = W1.shape[0]
    if not prep.edge_cols:
        return xp.zeros((0, h1), W1.dtype)
    runs = col_runs(prep.edge_cols)
    if len(runs) == 1:
        _, c0, length = runs[0]
        return xp.ascontiguousarray(W1[:, c0:c0 + length].T)
    return xp.ascontiguousarray(W1[:, prep.edge_cols].T)


def forward(graph, net, prep, return_state, decision, xp=None, device="cuda"):
    """The forward of a prepared call (edge_mlp._prepare) on the GPU, for the registry's `decision`."""
    if xp is None:
        import cupy as xp
    params = dict(net.named_parameters())
    As, Ad, WeT, _, _ = _node_products(prep, params, xp)
    kern, cache = get_kernels(prep.spec, prep.P.shape[0], prep.acc)
    rel = graph.realize(device)
    nd = prep.num_dst
    out = xp.empty((nd, prep.spec.fv), prep.acc)
    M = xp.empty(nd, prep.acc)
    L = xp.empty(nd, prep.acc)
    if nd:
        kern.forward((kern.blocks(nd), 1, 1), (kern.nt, 1, 1), _stream(xp),
                     *_ptrs(xp, rel.indptr, rel.indices, As, Ad, WeT, prep.pos, prep.EX, prep.P,
                            prep.V, out, M, L), nd)
    plan = make_plan("forward", prep, net, decision)
    plan.run_info.update(kernel=f"cuda.gat_forward ({kern.G} lanes per destination row, "
                                f"{kern.nt} threads/block; score MLP in registers per edge, "
                                "online softmax, feature-split value accumulation)",
                         cache=cache, copies=list(prep.copies),
                         order=f"{kern.G}-lane group per row, caller's node order",
                         ir=_cuda_ir(kern.forward),
                         geometry=("displacement/distance computed per edge from positions"
                                   if prep.geometric else None))
    result = out.astype(prep.dtype, copy=False).reshape((nd,) + prep.value_shape[1:])
    state = GATState(m=M, l=L, out=out, As=As, Ad=Ad, prep=prep, WeT=WeT) if return_state else None
    return result, state, plan


def backward(graph, net, prep, state, dout, args, value, decision, xp=None, device="cuda"):
    """The backward of a prepared call on the GPU, for the registry's `decision`."""
    if xp is None:
        import cupy as xp
    params = dict(net.named_parameters())
    acc = prep.acc
    W1 = xp.ascontiguousarray(params["0.weight"], dtype=acc)
    h1 = W1.shape[0]
    WeT = state.WeT
    if WeT is None:
        WeT = _edge_weights_t(W1, prep, xp)
    kern, cache = get_kernels(prep.spec, prep.P.shape[0], acc)
    rel = graph.realize(device)
    tr = graph.realize_transpose(device)
    nd, ns = prep.num_dst, prep.num_src
    D = xp.ascontiguousarray(dout.reshape(nd, row_width(dout)), dtype=acc)
    pd = prep.pd
    stream = _stream(xp)
    Delta = xp.empty(nd, acc)
    dAd = xp.empty((nd, h1), acc)
    # positions' gradient: backward A writes the dst part per row, backward B adds the src
    # part in place (geometric graphs are square: one positions array for both roles)
    dpos = xp.empty((nd if prep.geometric else 0, pd), acc)
    dEX = xp.zeros(prep.EX.shape, acc) if prep.explicit else xp.zeros((0, 0), acc)
    n_pg = kern.n_pg
    nblocks = _rows_grid(kern, nd) if nd else 0
    PG = (xp.empty if n_pg else xp.zeros)((nblocks, max(n_pg, 1)), acc)
    if nd:
        kern.rows((nblocks, 1, 1), (kern.nt, 1, 1), stream,
                  *_ptrs(xp, rel.indptr, rel.indices, state.As, state.Ad, WeT, prep.pos,
                         prep.EX, prep.P, prep.V, state.out, D, state.m, state.l, Delta, dAd,
                         dpos, dEX, PG), nd)
    dAs = xp.empty((ns, h1), acc)
    dV = xp.empty((ns, prep.spec.fv), acc)
    if ns:
        kern.cols((kern.blocks(ns), 1, 1), (kern.nt, 1, 1), stream,
                  *_ptrs(xp, tr.indptr, tr.indices, tr.perm, state.As, state.Ad, WeT, prep.pos,
                         prep.EX, prep.P, prep.V, D, state.m, state.l, Delta, dAs, dV, dpos),
                  ns)
    pg = PG.sum(axis=0) if nblocks else xp.zeros(max(n_pg, 1), acc)  # block order: fixed
    grads = _assemble_grads(prep, params, args, value, W1, dAs, dAd, pg, dEX, dV,
                            dpos if prep.geometric else None, graph, xp)
    plan = make_plan("backward", prep, net, decision)
    plan.run_info.update(kernel=f"cuda.gat_backward_rows ({kern.G} lanes per row, {nblocks} "
                                f"blocks x {kern.nt} threads, grid-stride; parameter partials "
                                "reduced per group and block in a fixed order) + "
                                f"cuda.gat_backward_cols ({kern.G} lanes per source row)",
                         cache=cache, copies=list(prep.copies),
                         order=f"{kern.G}-lane group per row, caller's node order",
                         ir=_cuda_ir(kern.rows),
                         geometry=("displacement/distance gradients routed to positions per edge"
                                   if prep.geometric else None))
    grads["plan"] = plan
    return grads


def _assemble_grads(prep, params, args, value, W1, dAs, dAd, pg, dEX, dV, dpos, graph, xp):
    """Gradients in the caller's arrays and dtypes: node-argument gradients in one launch
    (dx = dA_role W1[:, cols]), the node columns of dW1 as dA^T x (BLAS, deterministic); the
    rest (edge columns, later layers, explicit fields, positions) in edge_mlp_records.finish_grads."""
    acc = prep.acc
    h1, n_in = W1.shape
    layout, arrays = _node_args(prep, xp)
    nk = get_node_kernels(layout, h1, n_in, acc)
    ns, nd = prep.num_src, prep.num_dst
    outs = [xp.empty((ns if role == "src" else nd, w), acc) for role, w, _ in layout]
    n = max(ns, nd)
    if n and nk.width:
        nk.grads((nk.blocks(n * nk.width), 1, 1), (nk.nt, 1, 1), _stream(xp),
                 *_ptrs(xp, W1, dAs, dAd, *outs), ns, nd)
    dW1 = xp.empty((h1, n_in), acc)
    arg_grads = [None] * len(args)
    for (k, role, _, cols), (a, _, _), g in zip(prep.node_cols, arrays, outs):
        dW1[:, cols] = (dAs if role == "src" else dAd).T @ a
        orig = args[k][2]
        arg_grads[k] = g.reshape(orig.shape).astype(orig.dtype, copy=False)
    return finish_grads(prep, params, args, value, dW1, dAd, pg, dEX, dV, dpos, graph, arg_grads)


def _cuda_ir(kernel):
    def llvm():
        return kernel.llvm()

    def ptx():
        return kernel.ptx()
    return {"llvm": llvm, "ptx": ptx}
