"""Node orders for locality: renumber a graph's nodes so that neighbours have nearby ids.

One job: `locality_order(graph)` returns the permutation and the renumbered graph; the caller
permutes its node arrays once. scipy does the ordering (reverse Cuthill-McKee); no graph
partitioner is needed for the contiguous partitions tiga_numba.dask uses.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph

__all__ = ["locality_order"]


def locality_order(graph):
    """A node order that keeps each node's neighbours near it in id: the reverse Cuthill-McKee
    order of the relation made symmetric (`scipy.sparse.csgraph`). It pays for graphs with
    locality hidden by their numbering (meshes, geometric and road graphs, graphs read with
    arbitrary ids), twice: the CSR kernels' K / V gathers hit the caches (one process), and
    contiguous row chunks of dask arrays read small halos (tiga_numba.dask, whose partitions
    are q's row chunks). A graph with no locality to find (uniformly random edges) gains
    nothing. Applied once by the caller, not on every call.

    Parameters
    ----------
    graph : Graph
        A square CSR relation (num_src == num_dst: one node set) without node positions
        (a radius / knn graph: reorder the positions and build it again).

    Returns
    -------
    perm : numpy.ndarray (num_nodes,) int64
        Node i of the new order is node ``perm[i]`` of the old one: arrays go in as
        ``x[perm]``; results come back with ``out_new[np.argsort(perm)]``.
    reordered : Graph
        The same relation on the new ids. Its edges are in the input order of ``graph``
        (``graph``'s CSR order, or its from_coo / from_edge_index order), so per-edge fields
        (``edge_attr``) are passed to it unchanged."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import reverse_cuthill_mckee
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    if graph.kind != "csr":
        raise ValueError(f"graph must be a CSR relation (an implicit relation's order is its "
                         f"structure), got kind {graph.kind!r}")
    if graph.num_src != graph.num_dst:
        raise ValueError(f"graph must be square (one node set), got num_src={graph.num_src}, "
                         f"num_dst={graph.num_dst}")
    if graph.edge_field_names:
        raise ValueError("graph has node positions (a radius / knn graph, whose edge fields "
                         "follow them): reorder the positions, e.g. with the order of "
                         "locality_order(Graph.from_scipy(graph.to_scipy())), and build it again")
    n = graph.num_dst
    cols, rows = _edges_in_input_order(graph)
    sym = sp.csr_matrix((np.ones(2 * cols.size, np.int8),
                         (np.concatenate([rows, cols]), np.concatenate([cols, rows]))), shape=(n, n))
    perm = np.asarray(reverse_cuthill_mckee(sym, symmetric_mode=True), dtype=np.int64)
    inverse = np.empty(n, np.int64)
    inverse[perm] = np.arange(n, dtype=np.int64)
    return perm, Graph.from_coo(inverse[cols], inverse[rows], n, n)


def _edges_in_input_order(graph):
    """(src, dst) of every edge, in the order the graph's constructor took them"""
    indptr, indices = (np.asarray(x) for x in graph._host_csr())
    dst = np.repeat(np.arange(graph.num_dst, dtype=np.int64), np.diff(indptr))
    src = indices.astype(np.int64)
    order = graph.edge_permutation
    if order is None:
        return src, dst
    s_in = np.empty_like(src)
    d_in = np.empty_like(dst)
    s_in[order] = src   # CSR edge e is input edge order[e]
    d_in[order] = dst
    return s_in, d_in
