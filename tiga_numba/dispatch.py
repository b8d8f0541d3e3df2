"""The dispatcher: one place that turns validated inputs into a Plan and picks the backend.

Backends register by array library; their modules are imported on first use, so importing
tiga_numba never touches numba.cuda. A backend module exposes `forward` and `backward`
(docs/INTERNALS.md) and chooses among its own kernel families, recording the choice in
`plan.run_info["kernel"]`.
"""
from __future__ import annotations

import importlib

from .plan import BACKEND_OF_LIBRARY, Plan

_BACKEND_MODULES = {"cpu": "tiga_numba.cpu.api", "cuda": "tiga_numba.cuda.api"}
_LOADED = {}


def backend_module(name):
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(_BACKEND_MODULES[name])
        except ImportError as exc:
            if name == "cuda":
                raise ImportError(
                    "cupy arrays need the CUDA backend: pip install 'tiga-numba[cuda]' "
                    f"(numba-cuda and cupy); import failed with: {exc}") from exc
            raise
    return _LOADED[name]


def make_plan(op, graph, shape, scale, *, prune_threshold=None, edge_bias=None, score=None,
              score_mod=None):
    """Build the plan and refuse, before any kernel runs, what no kernel implements."""
    implicit = graph.is_implicit
    if score is None:
        score = "dot" if edge_bias is None else (
            "edge score" if shape.head_dim == 0 else "dot + edge bias")
        if score_mod is not None:
            score = f"modified: f = {score_mod.tree}" + (
                "" if score_mod.uses_score and shape.head_dim else " (no dot product: gather only)")
    if score_mod is not None and BACKEND_OF_LIBRARY[shape.library] != "cpu":
        raise NotImplementedError(
            f"the score modifier [{score_mod.tree}] (softcap / alibi_slopes / a modified edge() "
            "score) is implemented on the CPU backend only; the CUDA kernels do not compile "
            "score modifiers yet (numpy inputs run it)")
    if edge_bias is not None and implicit:
        raise NotImplementedError(
            f"per-edge fields (edge bias / edge score) need a CSR relation; graph is {graph.kind} "
            "(implicit). Use Graph.from_scipy(graph.to_scipy()) to make it explicit.")
    if prune_threshold is not None:
        if op != "forward":
            raise NotImplementedError("tile pruning is forward-only: the backward of a pruned "
                                      "forward is not implemented (approximation is never dropped)")
        if not implicit:
            raise NotImplementedError(
                f"tile pruning (block_prune_threshold={prune_threshold:g}) is implemented for "
                f"dense, triangular and segments relations only, not {graph.kind}")
    return Plan(
        op=op,
        backend=BACKEND_OF_LIBRARY[shape.library],
        relation_kind=graph.kind,
        realization="implicit blocks" if implicit else "CSR",
        score=score,
        dtype=shape.dtype,
        accum_dtype=shape.accum_dtype,
        num_dst=shape.num_dst,
        num_src=shape.num_src,
        num_edges=graph.num_edges,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        value_dim=shape.value_dim,
        scale=scale,
        prune_threshold=prune_threshold,
    )
