"""The edges a layer attends over, and the per-edge sums and reductions its gradients need.

A layer sees the caller's Graph, optionally with PyG's self-loop rule applied (existing loops
(i -> i) removed, one loop added for every node i < min(num_src, num_dst)). `EdgeSet` holds that
relation in CSR order (the order the kernels and every per-edge array use) together with the map
back to the caller's edge order (`Graph.edge_permutation` for from_coo / from_edge_index graphs),
so `edge_attr` is given, and its gradient returned, in the caller's order.

Sums over edges are segment sums in a fixed order on numba's threads (numpy; `_cpu.py`) or
sparse products with cupyx.scipy.sparse (cupy), and no (E, H, C) array is ever formed. Edge
sets are cached on the graph (graphs are immutable), per device.

A sparse matrix's values always go in contiguous (`sparse_values`): cupyx keeps a strided view
(one head's column `alpha[:, h]` of an (E, H) array) as the matrix's data and hands its device
pointer to cuSPARSE, which reads E consecutive values from there, i.e. `alpha.flat[h:h + E]`,
not the column. scipy copies such a view correctly, so only the cupy path would go wrong.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph

__all__ = ["EdgeSet", "edge_set", "marked_edge_set", "xp_of", "sparse_of", "sparse_values", "scatter_rows",
           "gather"]


def xp_of(array):
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy


def sparse_of(xp):
    if xp is np:
        import scipy.sparse as sp
        return sp
    import cupyx.scipy.sparse as csp
    return csp


def gather(xp, array, index):
    """array[index] along axis 0. `take` rather than fancy indexing: for (N, H) rows gathered
    per edge it is ~7x faster in numpy (measured, 1.6M edges x 8 heads)."""
    return xp.take(array, index, axis=0)


def sparse_values(xp, weights):
    """`weights` as a contiguous 1-D array (itself when it already is): the values of a sparse
    matrix, which cuSPARSE reads from the array's pointer as if contiguous."""
    return xp.ascontiguousarray(weights)


def scatter_rows(xp, index, values, n):
    """(n, F) sums of the rows of `values` (m, F) into rows `index` (m,) (a sparse product)."""
    sp = sparse_of(xp)
    m = index.shape[0]
    ones = xp.ones(m, dtype=values.dtype)
    mat = sp.csr_matrix((ones, (index, xp.arange(m))), shape=(n, m))
    return xp.asarray(mat @ values)


class EdgeSet:
    """Edges (j -> i) = (cols[e] -> rows[e]) in CSR order of `graph` (destination rows)."""

    def __init__(self, graph, rows, cols, source, loop_pos, loop_node, kept_count, xp, num_in):
        self.graph = graph
        self.num_in = int(num_in)  # the caller's edges (edge_attr's rows), loops removed or not
        self.num_src = graph.num_src
        self.num_dst = graph.num_dst
        self.num_edges = graph.num_edges
        self.xp = xp
        self.rows = rows            # (E,) int64 destination of each edge
        self.cols = cols            # (E,) int64 source of each edge
        self.source = source        # (E,) int64 caller's edge id, -1 for an added loop
        self.loop_pos = loop_pos    # (L,) int64 positions of the added loops
        self.loop_node = loop_node  # (L,) int64 their nodes
        self.kept_count = kept_count  # (num_dst,) caller edges kept into each node
        self.has_loops = int(loop_pos.shape[0]) > 0
        kept = source >= 0
        self.kept_pos = xp.nonzero(kept)[0]
        self.kept_source = source[self.kept_pos]
        rel = graph.realize("cpu" if xp is np else "cuda")
        self.indptr = rel.indptr
        self.indices = rel.indices
        self._inc = {}
        self._caller_order = None

    # ------------------------------------------------------------------ incidence sums
    def caller_order(self):
        """Positions (int64, in this set's library) listing its edges in PyG's order: the caller's
        edges that were kept, in the caller's order (`source`), then the added loops by node (PyG's
        remove_self_loops + add_self_loops). How return_attention_weights lists edges."""
        if self._caller_order is None:
            xp = self.xp
            source, node, pos = ((a if xp is np else a.get()) for a in (self.source, self.loop_node, self.loop_pos))
            kept = np.flatnonzero(source >= 0)
            kept = kept[np.argsort(source[kept], kind="stable")]
            order = np.concatenate([kept, pos[np.argsort(node, kind="stable")]]).astype(np.int64)
            self._caller_order = order if xp is np else xp.asarray(order)
        return self._caller_order

    def _incidence(self, side, dtype):
        key = (side, np.dtype(dtype))
        mat = self._inc.get(key)
        if mat is None:
            xp, sp, E = self.xp, sparse_of(self.xp), self.num_edges
            ones = xp.ones(E, dtype=dtype)
            if side == "dst":  # (num_dst, E): row i holds the edges into i
                mat = sp.csr_matrix((ones, xp.arange(E, dtype=np.int64), self.indptr),
                                    shape=(self.num_dst, E))
            else:  # (num_src, E): row j holds the edges out of j
                t = self.graph.realize_transpose("cpu" if xp is np else "cuda")
                mat = sp.csr_matrix((ones, t.perm, t.indptr), shape=(self.num_src, E))
            self._inc[key] = mat
        return mat

    def _incidence_product(self, side, values):
        if self.xp is np and values.ndim == 2:
            from ._cpu import segment_sums
            if side == "dst":
                return segment_sums(values, np.asarray(self.indptr, np.int64))
            t = self.graph.realize_transpose("cpu")
            return segment_sums(values, np.asarray(t.indptr, np.int64), np.asarray(t.perm, np.int64))
        mat = self._incidence(side, values.dtype)
        if self.xp is not np and values.ndim == 2 and values.flags.c_contiguous:
            # cupyx's `mat @ values` first copies values to column-major (cuSPARSE's dense
            # layout), a strided transpose of the (E, F) array that cost more than the product;
            # values.T already is column-major, so cuSPARSE reads it as op(B) = transpose.
            from cupyx import cusparse
            if cusparse.check_availability("spmm"):
                return cusparse.spmm(mat, values.T, transb=True)
        return self.xp.asarray(mat @ values)

    def sum_by_dst(self, values):
        """(num_dst, F): sum of the rows of `values` (E, F) over each destination's edges."""
        return self._incidence_product("dst", values)

    def sum_by_src(self, values):
        """(num_src, F): sum of the rows of `values` (E, F) over each source's edges."""
        return self._incidence_product("src", values)

    def adjacency(self, weights):
        """Sparse (num_dst, num_src) with weights[e] at (rows[e], cols[e]): `A @ X` sums
        w_e X[j] into i, `A.T @ Y` sums w_e Y[i] into j."""
        sp = sparse_of(self.xp)
        return sp.csr_matrix((sparse_values(self.xp, weights), self.indices, self.indptr),
                             shape=(self.num_dst, self.num_src))

    def edge_matrix(self, weights):
        """Sparse (num_dst, E) with weights[e] at (rows[e], e): `M @ A` sums w_e A_e into i,
        `M.T @ Y` gives w_e Y[i] per edge."""
        sp = sparse_of(self.xp)
        return sp.csr_matrix((sparse_values(self.xp, weights),
                              self.xp.arange(self.num_edges, dtype=np.int64),
                              self.indptr), shape=(self.num_dst, self.num_edges))

    # ------------------------------------------------------------------ edge attributes
    def edge_attr(self, edge_attr, fill_value):
        """Caller-ordered (E_in, F) -> this set's (E, F); the added loops get PyG's fill: a
        constant, or a reduction of the node's incoming attributes (0 for a node without any;
        1 for "mul"), as torch_geometric.utils.scatter computes it."""
        xp = self.xp
        ea = xp.zeros((self.num_edges, edge_attr.shape[1]), dtype=edge_attr.dtype)
        ea[self.kept_pos] = gather(xp, edge_attr, self.kept_source)
        if self.has_loops:
            if isinstance(fill_value, str):
                node = self._fill_of(ea, fill_value)
                ea[self.loop_pos] = gather(xp, node, self.loop_node)
            else:
                ea[self.loop_pos] = xp.asarray(fill_value, dtype=ea.dtype)
        return ea

    def _fill_of(self, ea, fill_value):
        """(num_dst, F): the reduction `fill_value` of each node's kept incoming attributes
        (`ea` holds 0 at the loops' positions)."""
        xp = self.xp
        if fill_value in ("add", "sum", "mean"):
            node = self.sum_by_dst(ea)  # loops still hold 0
            if fill_value == "mean":
                node = node / xp.maximum(self.kept_count, 1).astype(ea.dtype)[:, None]
            return node
        if fill_value == "any":
            raise NotImplementedError("fill_value='any' with self loops and edge_attr: PyG takes "
                                      "whichever incoming attribute torch's scatter writes last "
                                      "(not deterministic); use 'mean', 'add', 'max', 'min', "
                                      "'mul' or a number")
        scan = self._kept_scan(ea, fill_value)
        if scan is None:
            return (xp.ones if fill_value == "mul" else xp.zeros)((self.num_dst, ea.shape[1]), ea.dtype)
        return scan.totals(xp, self.num_dst, 1 if fill_value == "mul" else 0)

    def _kept(self, ea):
        """The kept edges' attributes in CSR order and their destination rows (non-decreasing)."""
        return gather(self.xp, ea, self.kept_pos), gather(self.xp, self.rows, self.kept_pos)

    def _kept_scan(self, ea, op):
        """The kept edges' attributes in CSR order with their inclusive segmented scans under
        `op` ("max", "min" or "mul"), forward, and backward for "mul" (its gradient's product of
        the factors after each; a max / min needs only the totals); None without kept edges."""
        if int(self.kept_pos.shape[0]) == 0:
            return None
        xp = self.xp
        vals, seg = self._kept(ea)
        fn = {"max": xp.maximum, "min": xp.minimum, "mul": xp.multiply}[op]
        forward = _segmented_scan(xp, vals, seg, fn)
        backward = _segmented_scan(xp, vals[::-1], seg[::-1], fn)[::-1] if op == "mul" else None
        last = xp.nonzero(xp.concatenate([seg[1:] != seg[:-1], xp.ones(1, dtype=bool)]))[0]
        return _Scan(vals, seg, forward, backward, last)

    def edge_attr_grad(self, d_ea, fill_value, num_in, ea=None):
        """Gradient of edge_attr() w.r.t. the caller's (num_in, F) edge attributes; `ea` is
        edge_attr()'s result (needed by "max", "min" and "mul")."""
        xp = self.xp
        d_in = xp.zeros((num_in, d_ea.shape[1]), dtype=d_ea.dtype)
        d_kept = gather(xp, d_ea, self.kept_pos)
        if self.has_loops and isinstance(fill_value, str) and int(self.kept_pos.shape[0]):
            d_node = xp.zeros((self.num_dst, d_ea.shape[1]), dtype=d_ea.dtype)
            d_node[self.loop_node] = gather(xp, d_ea, self.loop_pos)
            if fill_value in ("add", "sum", "mean"):
                if fill_value == "mean":
                    d_node /= xp.maximum(self.kept_count, 1).astype(d_ea.dtype)[:, None]
                d_kept = d_kept + gather(xp, d_node, gather(xp, self.rows, self.kept_pos))
            else:
                d_kept = d_kept + self._reduction_grad(ea, d_node, fill_value)
        d_in[self.kept_source] = d_kept
        return d_in

    def _reduction_grad(self, ea, d_node, op):
        """d(node reduction)/d(kept attribute) times d_node, per kept edge, as torch's
        scatter_reduce (include_self=False for "max" / "min" from zeros, "prod" from ones)
        differentiates: a max / min shares the gradient evenly among the values equal to it,
        counting the zero it starts from when the result is 0; a product's factor gets the
        product of the others (exact with zeros)."""
        xp = self.xp
        if op == "mul":
            scan = self._kept_scan(ea, op)
            d_seg = gather(xp, d_node, scan.seg)
            same_prev = xp.concatenate([xp.zeros(1, dtype=bool), scan.seg[1:] == scan.seg[:-1]])
            same_next = xp.concatenate([scan.seg[1:] == scan.seg[:-1], xp.zeros(1, dtype=bool)])
            one = xp.ones_like(scan.vals[:1])
            before = xp.where(same_prev[:, None], xp.concatenate([one, scan.forward[:-1]]), 1)
            after = xp.where(same_next[:, None], xp.concatenate([scan.backward[1:], one]), 1)
            return d_seg * before * after
        # a max / min needs only each node's result, which edge_attr() wrote into the node's
        # loop; a node without a loop has d_node = 0, so its result is never read
        vals, seg = self._kept(ea)
        d_seg = gather(xp, d_node, seg)
        result = xp.zeros((self.num_dst, ea.shape[1]), dtype=ea.dtype)
        result[self.loop_node] = gather(xp, ea, self.loop_pos)
        ties = (vals == gather(xp, result, seg)).astype(ea.dtype)
        count = self.sum_by_dst(_zeros_but(xp, ea.shape, self.kept_pos, ties))
        count = count + (result == 0)
        return ties * d_seg / gather(xp, count, seg)


class _Scan:
    """A segmented scan's inputs and results: `last` holds each run's last position."""
    __slots__ = ("vals", "seg", "forward", "backward", "last")

    def __init__(self, vals, seg, forward, backward, last):
        self.vals, self.seg, self.forward, self.backward, self.last = vals, seg, forward, backward, last

    def totals(self, xp, num_dst, empty):
        """(num_dst, F): each run's reduction at its destination, `empty` for the others."""
        out = xp.full((num_dst, self.vals.shape[1]), empty, dtype=self.vals.dtype)
        out[self.seg[self.last]] = self.forward[self.last]
        return out


def _zeros_but(xp, shape, pos, rows):
    """An array of `shape` holding `rows` at positions `pos` and 0 elsewhere."""
    out = xp.zeros(shape, dtype=rows.dtype)
    out[pos] = rows
    return out


def _segmented_scan(xp, vals, seg, fn):
    """Inclusive scan of `vals` (n, F) under the binary ufunc `fn` within runs of equal `seg`
    (n,): log2(longest run) whole-array steps (Hillis-Steele), the same on numpy and cupy."""
    acc = xp.array(vals, copy=True)
    n = int(seg.shape[0])
    step = 1
    while step < n:
        same = (seg[step:] == seg[:-step])[:, None]
        if not bool(same.any()):
            break
        shifted = xp.where(same, fn(acc[step:], acc[:-step]), acc[step:])
        acc[step:] = shifted
        step *= 2
    return acc


def _host_csr(graph):
    rel = graph.realize("cpu")
    if hasattr(rel, "indptr"):
        return np.asarray(rel.indptr, np.int64), np.asarray(rel.indices, np.int64)
    csr = graph.to_scipy()  # an implicit relation: its edges, explicitly
    return csr.indptr.astype(np.int64), csr.indices.astype(np.int64)


def _build(graph, self_loops, xp):
    indptr, indices = _host_csr(graph)
    nd = graph.num_dst
    rows = np.repeat(np.arange(nd, dtype=np.int64), np.diff(indptr))
    perm = graph.edge_permutation
    source = np.asarray(perm, np.int64) if perm is not None else np.arange(rows.shape[0])
    empty = np.zeros(0, np.int64)
    if not self_loops:
        kept_count = np.diff(indptr)
        out_graph, loop_pos, loop_node = graph, empty, empty
        if graph.is_implicit:
            out_graph = Graph.from_csr(indptr, indices, num_src=graph.num_src)
    else:
        keep = rows != indices
        n_loops = min(graph.num_src, nd)
        k_rows, k_cols, k_src = rows[keep], indices[keep], source[keep]
        loop = np.arange(n_loops, dtype=np.int64)
        all_rows = np.concatenate([k_rows, loop])
        all_cols = np.concatenate([k_cols, loop])
        all_src = np.concatenate([k_src, np.full(n_loops, -1, np.int64)])
        is_loop = np.concatenate([np.zeros(k_rows.shape[0], np.int8), np.ones(n_loops, np.int8)])
        order = np.lexsort((is_loop, all_rows))  # by row; a row's loop after its edges
        rows, indices, source = all_rows[order], all_cols[order], all_src[order]
        kept_count = np.bincount(k_rows, minlength=nd)
        new_indptr = np.zeros(nd + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=nd), out=new_indptr[1:])
        out_graph = Graph.from_csr(new_indptr, indices, num_src=graph.num_src,
                                   device=graph.device)
        loop_pos = np.nonzero(source < 0)[0]
        loop_node = rows[loop_pos]
    return _edge_set(out_graph, rows, indices, source, loop_pos, loop_node, kept_count, xp,
                     graph.num_edges)


def _edge_set(graph, rows, cols, source, loop_pos, loop_node, kept_count, xp, num_in):
    on = (lambda a: a) if xp is np else xp.asarray
    return EdgeSet(graph, on(rows), on(cols), on(source), on(loop_pos), on(loop_node),
                   on(kept_count.astype(np.int64)), xp, num_in)


def marked_edge_set(graph, is_loop, xp):
    """The EdgeSet of a relation that already holds its added loops, marked by `is_loop` ((E,)
    bool in CSR order, or None: no loops): one destination partition of a layer's edge set
    (tiga_numba.dask), whose loops point into a renumbered source range, so they cannot be told
    by row == column. The caller's edges are the unmarked ones, numbered in CSR order (the order
    the partition's edge_attr rows arrive in). Cached on `graph`."""
    def build():
        indptr, indices = _host_csr(graph)
        nd = graph.num_dst
        rows = np.repeat(np.arange(nd, dtype=np.int64), np.diff(indptr))
        loop = np.zeros(rows.shape[0], np.bool_) if is_loop is None else np.asarray(is_loop, np.bool_)
        if loop.shape != rows.shape:
            raise ValueError(f"is_loop must have one entry per edge ({rows.shape[0]}), got {loop.shape}")
        kept = ~loop
        source = np.where(kept, np.cumsum(kept, dtype=np.int64) - 1, -1)
        loop_pos = np.flatnonzero(loop)
        kept_count = np.bincount(rows[kept], minlength=nd)
        return _edge_set(graph, rows, indices, source, loop_pos, rows[loop_pos], kept_count, xp,
                         int(kept.sum()))
    loops = 0 if is_loop is None else int(np.count_nonzero(is_loop))
    return graph._cached(("layers.marked_edge_set", loops, "numpy" if xp is np else "cupy"), build)


def edge_set(graph, self_loops, xp):
    """The (cached) EdgeSet of `graph`, with PyG's self-loop rule when `self_loops`. An EdgeSet
    is its own edge set (a dask partition's, see marked_edge_set)."""
    if isinstance(graph, EdgeSet):
        return graph
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    key = ("layers.edge_set", bool(self_loops), "numpy" if xp is np else "cupy")
    return graph._cached(key, lambda: _build(graph, self_loops, xp))
