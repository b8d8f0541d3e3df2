"""The plan: one record of what a call will run and why, built once from the validated
inputs and handed to the kernel. The backend adds what it did (`run_info`); `explain()`
only reads the record."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kernel_cache import KERNELS

BACKEND_OF_LIBRARY = {"numpy": "cpu", "cupy": "cuda"}


class RunInfo(dict):
    """What the backend did (`Plan.run_info`). Entries that need a device read (a pruned forward's
    tile counts) may be deferred: `defer(keys, fetch)` stores them unread, and the first access to
    any of them calls fetch() once (a device-to-host copy that waits for the kernel), so the call
    itself never blocks the host. Every way of reading the dict (item, get, items, values, copy,
    dict(info), iteration) sees the fetched values."""

    class _Pending:
        def __init__(self, keys, fetch):
            self.keys, self.fetch = tuple(keys), fetch

    def defer(self, keys, fetch):
        pending = RunInfo._Pending(keys, fetch)
        for k in pending.keys:
            dict.__setitem__(self, k, pending)

    def _resolve(self, pending):
        for k, x in zip(pending.keys, pending.fetch()):
            if dict.get(self, k) is pending:
                dict.__setitem__(self, k, x)

    def _resolve_all(self):
        for v in list(dict.values(self)):
            if isinstance(v, RunInfo._Pending):
                self._resolve(v)

    def __getitem__(self, k):
        v = dict.__getitem__(self, k)
        if isinstance(v, RunInfo._Pending):
            self._resolve(v)
            v = dict.__getitem__(self, k)
        return v

    def get(self, k, default=None):
        return self[k] if k in self else default

    def __iter__(self):   # not dict's own: dict(info) then copies through __getitem__
        self._resolve_all()
        return dict.__iter__(self)

    def items(self):
        self._resolve_all()
        return dict.items(self)

    def values(self):
        self._resolve_all()
        return dict.values(self)

    def copy(self):
        self._resolve_all()
        return RunInfo(dict.items(self))

    def __repr__(self):
        self._resolve_all()
        return dict.__repr__(self)


def defer_counts(info, fetch):
    """a pruned forward's run_info["pruned_tiles"] / ["total_tiles"] from fetch() -> (pruned,
    total): deferred until read where info is a RunInfo (the Plan's), read now otherwise."""
    if isinstance(info, RunInfo):
        info.defer(("pruned_tiles", "total_tiles"), fetch)
    else:
        info["pruned_tiles"], info["total_tiles"] = fetch()


@dataclass(frozen=True, eq=False)
class Plan:
    """What a call runs and why, fixed before any kernel runs: the request's facts, the kernel
    family the registry chose (`family`) with every family it considered (`considered`), and
    the run options. `run_info` is the one mutable part: what the backend then did (kernel
    variant, tiles, copies, cache)."""
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
    family: str = ""
    considered: tuple = ()
    options: object = None
    tiles: tuple = ()  # cpu.blocks: (BM, BN, why) the kernels run with (cpu/tiles.py); else ()
    modifier: object = None  # the score-modifier tree compiled into the kernels (score_mod.Expr)
    run_info: dict = field(default_factory=RunInfo)

    def fresh(self):
        """The same plan with an empty run_info: what a later call with the same validated
        facts runs (functional's call memo), without building and checking it again."""
        new = object.__new__(Plan)
        new.__dict__.update(self.__dict__)
        new.__dict__["run_info"] = RunInfo()
        return new

    def explain(self):
        info = self.run_info
        lines = [
            f"op: {self.op}",
            f"backend: {self.backend}",
            f"kernel family: {self.family or '(none)'}"
            + (f" (considered: {'; '.join(f'{n} {w}' for n, w in self.considered)})"
               if self.considered else ""),
            f"kernel: {info.get('kernel', '(not run yet)')}",
            f"relation: {self.relation_kind}, realization: {self.realization} "
            f"({self.num_dst} dst x {self.num_src} src, {self.num_edges} edges)",
            f"score: {self.score}, scale={self.scale:.6g}",
            f"heads: {self.heads} query / {self.kv_heads} key-value"
            + (" (grouped-query)" if self.kv_heads != self.heads else ""),
            f"dtypes: inputs {self.dtype}, accumulation {self.accum_dtype}; "
            f"head dim {self.head_dim}, value dim {self.value_dim}",
        ]
        if self.modifier is not None:
            lines.append(f"score modifier (compiled into the {self.backend} kernels): "
                         f"f = {self.modifier}")
        if info.get("tiles"):
            lines.append(f"tiles: {info['tiles']}")
        elif self.tiles:
            lines.append(f"tiles: BM={self.tiles[0]} BN={self.tiles[1]} ({self.tiles[2]})")
        if info.get("products"):
            lines.append(f"tile products: {info['products']}")
        if "kernel" not in info:   # a plan made without running (make_plan): nothing copied yet
            lines.append("copies: (not run yet)")
        else:
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
            frac = ("not run yet" if "kernel" not in info   # a make_plan plan: no call to count
                    else f"{pruned}/{total} tiles pruned ({pruned / total:.1%})" if total else "no tiles")
            lines.append(f"tile pruning: APPROXIMATE, rho={self.prune_threshold:g}; last call: {frac}")
        else:
            lines.append("tile pruning: off (exact)")
        if self.options is not None:
            lines.append(f"options: {self.options.describe()}")
        cache = info.get("cache_totals") or KERNELS.stats()   # as the call left them (fixed then)
        lines.append(f"kernel cache: this call {info.get('cache', 'n/a')}; "
                     f"total hits={cache['hits']}, misses={cache['misses']}")
        return "\n".join(lines)

    def __str__(self):
        return self.explain()

    def ir(self, stage):
        return ir_stage(self.run_info.get("ir") or {}, stage, "for this kernel")


def ir_stage(stages, stage, where):
    """The artefact `stage` from a run's {stage: thunk}; KeyError listing the available stages
    for anything else (also a stage that is not a string, which a dict lookup would turn into
    TypeError)."""
    if not isinstance(stage, str) or stage not in stages:
        raise KeyError(f"IR stage {stage!r} is not available {where}; available: {sorted(stages)}")
    return stages[stage]()
