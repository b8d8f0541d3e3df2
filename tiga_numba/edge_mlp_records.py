"""What a score-network attention call hands between its front end (tiga_numba.edge_mlp:
validation, preparation, the registry's decision, the CPU kernels' host side) and the CUDA
backend (tiga_numba.cuda.gat): the field arguments, the forward's state, the plan with its
explain(), and the gradient assembly both backends finish with. Neither side imports the other
for these, so the backend never reaches back into the front end."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .plan import ir_stage

__all__ = ["FieldArg", "GATState", "GATPlan", "make_plan", "net_desc", "col_runs", "finish_grads", "row_width"]


def row_width(a):
    """The row width of `a` (N, ...) flattened to (N, width): reshape(N, -1) cannot tell it
    when N is 0 (a graph without nodes, a zero-row stand-in)."""
    return int(np.prod(a.shape[1:]))


class FieldArg(NamedTuple):
    role: str  # "src" | "dst" | "edge"
    name: str
    array: Any  # numpy/cupy; None for a geometric edge field computed from graph.positions


@dataclass
class GATState:
    """What the backward needs, all O(N): the per-row softmax state and the per-node halves
    of the first Linear (so the backward does not redo the node products)."""
    m: Any  # (num_dst,) accumulation dtype; -inf for an empty row (caller's node order)
    l: Any  # (num_dst,)
    out: Any  # (num_dst, Fv) accumulation dtype, kernel node order (for Delta = dout . out)
    As: Any  # (num_src, hidden), kernel node order
    Ad: Any  # (num_dst, hidden), first bias included, kernel node order
    prep: Any = None
    WeT: Any = None  # (edge columns, hidden) of the first Linear, as the forward used it (CUDA)


@dataclass
class GATPlan:
    op: str
    backend: str
    num_dst: int
    num_src: int
    num_edges: int
    net: str
    args: str
    dtype: Any
    accum_dtype: Any
    family: str = ""
    considered: tuple = ()
    run_info: dict = field(default_factory=dict)

    def explain(self):
        info = self.run_info
        from .kernel_cache import KERNELS
        stats = KERNELS.stats()
        lines = [
            f"op: {self.op}",
            f"backend: {self.backend}",
            f"kernel family: {self.family}"
            + (f" (considered: {'; '.join(f'{n} {w}' for n, w in self.considered)})"
               if self.considered else ""),
            f"kernel: {info.get('kernel', '(not run)')}",
            f"relation: CSR ({self.num_dst} dst x {self.num_src} src, {self.num_edges} edges)",
            f"score: net({self.args}) with net = {self.net}",
            f"dtypes: inputs {self.dtype}, accumulation {self.accum_dtype}",
        ]
        heads = info.get("heads")
        if heads:
            lines.append(
                f"structure: {heads} scores per edge (one softmax per head); first Linear split "
                "per argument: node products W_src x_j, W_dst x_i + b computed once per node "
                "(O(N x hidden)); edge columns and the rest of the network evaluated with array "
                f"operations in chunks of {info.get('chunk')} edges")
        else:
            lines.append(
                "structure: first Linear split per argument: node products W_src x_j, W_dst x_i "
                "+ b computed once per node (O(N x hidden)); edge columns and the rest of the "
                "network evaluated per edge in per-thread scratch")
        # the work unit where other kernels name their tiles: a score network is evaluated per
        # edge, so there are no query / key tiles to choose
        lines.append("tiles: none (the network is evaluated per edge; the schedule line says how "
                     "the edges are shared out)" if info.get("order") else
                     "tiles: none (the network is evaluated per edge)")
        if info.get("geometry"):
            lines.append(f"geometry: {info['geometry']}")
        if info.get("order"):
            lines.append(f"schedule: {info['order']}, {info.get('chunks', '')}".rstrip(", "))
        copies = info.get("copies") or []
        lines.append("copies: " + ("; ".join(copies) if copies else "none"))
        if heads:
            lines.append(f"materialized: per-head scores (E, {heads}) (kept for the backward) and "
                         f"their gradient (E, {heads}); per chunk: the chunk's activations. Not "
                         "materialized: hidden activations (E, hidden), attention weights, "
                         "concatenated inputs (E, in); persisted: per-row (m, l) and per-node "
                         "(N, hidden) products")
        else:
            lines.append("not materialized: scores (E,), attention weights (E,), hidden "
                         "activations (E, hidden), concatenated inputs (E, in)"
                         + (", displacement/distance (E, D)" if info.get("geometry") else "")
                         + "; persisted: per-row (m, l) and per-node (N, hidden) products")
        if self.op == "backward" and heads:
            lines.append("backward: the attention kernels' backward gives the scores' gradient "
                         "(E, H); the network's backward runs per edge chunk, per-edge gradients "
                         "summed into nodes with sparse products")
        elif self.op == "backward":
            lines.append("backward: deterministic; dst rows (dst-side grads, parameter partials "
                         "per fixed row chunk, reduced in order), then src rows over the "
                         "transposed relation (src-side grads); no float atomics")
        lines.append(f"kernel cache: this call {info.get('cache', 'n/a')}; "
                     f"total hits={stats['hits']}, misses={stats['misses']}")
        return "\n".join(lines)

    __str__ = explain

    def ir(self, stage):
        return ir_stage(self.run_info.get("ir") or {}, stage, "for this kernel")


def net_desc(net):
    """The traced network as one line (explain())."""
    return " -> ".join(repr(layer) for layer in net.layers())


def make_plan(op, prep, net, decision=None, family=""):
    """The GATPlan of one call: what was prepared and the registry's decision (family, refusals);
    without a decision, `family` names what runs."""
    return GATPlan(op=op, backend="cpu" if prep.library == "numpy" else "cuda",
                   num_dst=prep.num_dst, num_src=prep.num_src, num_edges=prep.num_edges,
                   net=net_desc(net), args=prep.arg_desc, dtype=np.dtype(prep.dtype),
                   accum_dtype=prep.acc,
                   family=decision.family.name if decision is not None else family,
                   considered=decision.considered if decision is not None else ())


def col_runs(cols):
    """[(first index in cols, first column, length)] of the consecutive runs in cols (slices
    instead of fancy indexing: one copy per run, on the host or the device)."""
    runs = []
    for k, c in enumerate(cols):
        if runs and c == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([k, c, 1])
    return runs


def finish_grads(prep, params, args, value, dW1, dAd, pg, dEX, dV, dpos, graph, arg_grads):
    """What both backends share once the node columns of dW1 and the node-argument gradients are
    in: the edge columns of dW1 and the later layers from the reduced partials pg (numpy or cupy),
    explicit edge-field gradients, the first layer's bias, positions; everything in the caller's
    dtypes and shapes."""
    h1 = dW1.shape[0]
    if prep.edge_cols:
        P = prep.P.shape[0]
        pge = pg[P:P + prep.spec.fe * h1].reshape(prep.spec.fe, h1)
        for k0, c0, length in col_runs(prep.edge_cols):
            dW1[:, c0:c0 + length] = pge[k0:k0 + length].T
    for k, width, xcol, _ in prep.explicit:
        orig = args[k][2]
        arg_grads[k] = dEX[:, xcol:xcol + width].reshape(orig.shape).astype(orig.dtype, copy=False)
    grads = {"0.weight": dW1.astype(params["0.weight"].dtype, copy=False),
             "0.bias": dAd.sum(axis=0).astype(params["0.bias"].dtype, copy=False)}
    for name, off, shape in prep.p_index:
        size = int(np.prod(shape))
        grads[name] = pg[off:off + size].reshape(shape).astype(params[name].dtype, copy=False)
    positions = None
    if dpos is not None:
        positions = dpos.astype(graph._positions.dtype, copy=False)
    return {"args": arg_grads, "value": dV.astype(value.dtype, copy=False).reshape(value.shape),
            "params": grads, "positions": positions}
