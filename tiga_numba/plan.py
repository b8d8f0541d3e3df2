"""The plan: one record of what a call will run and why, built once from the validated
inputs and handed to the kernel. The backend adds what it did (`run_info`); `explain()`
only reads the record."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kernel_cache import KERNELS

BACKEND_OF_LIBRARY = {"numpy": "cpu", "cupy": "cuda"}


@dataclass
class Plan:
    op: str  # "forward" | "backward"
    backend: str  # "cpu" | "cuda"
    relation_kind: str  # graph.kind
    realization: str  # "implicit blocks" | "CSR"
    score: str  # "dot" | "dot + edge bias" | "edge score"
    dtype: np.dtype
    accum_dtype: np.dtype
    num_dst: int
    num_src: int
    num_edges: int
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    scale: float
    prune_threshold: float | None = None
    run_info: dict = field(default_factory=dict)

    def explain(self):
        info = self.run_info
        lines = [
            f"op: {self.op}",
            f"backend: {self.backend}",
            f"kernel: {info.get('kernel', '(not run)')}",
            f"relation: {self.relation_kind}, realization: {self.realization} "
            f"({self.num_dst} dst x {self.num_src} src, {self.num_edges} edges)",
            f"score: {self.score}, scale={self.scale:.6g}",
            f"heads: {self.heads} query / {self.kv_heads} key-value"
            + (" (grouped-query)" if self.kv_heads != self.heads else ""),
            f"dtypes: inputs {self.dtype}, accumulation {self.accum_dtype}; "
            f"head dim {self.head_dim}, value dim {self.value_dim}",
        ]
        if info.get("tiles"):
            lines.append(f"tiles: {info['tiles']}")
        copies = info.get("copies") or []
        lines.append("copies: " + ("; ".join(copies) if copies else "none (inputs read in place)"))
        if info.get("materialized"):
            lines.append(f"materialized: {info['materialized']}")
        else:
            lines.append("no score or probability tensor was materialized "
                         "(streaming online softmax keeps per-row (m, l) only)")
        if self.prune_threshold is not None:
            total = info.get("total_tiles")
            pruned = info.get("pruned_tiles")
            frac = (f"{pruned}/{total} tiles pruned ({pruned / total:.1%})"
                    if total else "no tiles")
            lines.append(f"tile pruning: APPROXIMATE, rho={self.prune_threshold:g}; last call: {frac}")
        else:
            lines.append("tile pruning: off (exact)")
        cache = KERNELS.stats()
        lines.append(f"kernel cache: this call {info.get('cache', 'n/a')}; "
                     f"total hits={cache['hits']}, misses={cache['misses']}")
        return "\n".join(lines)

    def __str__(self):
        return self.explain()

    def ir(self, stage):
        stages = self.run_info.get("ir") or {}
        if stage not in stages:
            raise KeyError(f"IR stage {stage!r} is not available for this kernel; "
                           f"available: {sorted(stages)}")
        return stages[stage]()
