"""The kernel registry: every kernel family the package has, and the one rule that picks one.

A call becomes a `Request` (what is asked: operation, relation, score, dtypes, head dims,
backend, options); `choose(request)` walks the families registered for the request's operation
and backend in priority order, asks each whether it computes the request exactly, and returns a
`Decision`: the chosen family and, for every family considered, why it was chosen or refused.
The plan stores the decision; backends execute the family they are handed and never re-decide;
`explain()` prints the decision, before or after the call.

Adding a kernel family is one `register(Family(...))` call in this file. A family's `accepts`
returns None when it takes the request, or a short reason when it does not. When no family
accepts, the call raises NotImplementedError listing every refusal (nothing falls back
silently).

| family | backend | serves |
|---|---|---|
| ``cuda.decode`` | cuda | forward of blocks with at most 8 query rows (decode): key range split across CTAs, fixed-order merge |
| ``cuda.tc`` | cuda | implicit (block) relations, dot scores and score modifiers (not their field / param gradients), fp16/bf16 (fp32 on request), tensor cores: wgmma on sm_90, mma.sync on sm_80+ |
| ``cuda.blocks`` | cuda | implicit relations on CUDA cores (any head dim, float64, compiled score modifiers) |
| ``cuda.csr`` | cuda | CSR relations, per-edge bias / scores, compiled score modifiers, CUDA cores |
| ``cpu.decode`` | cpu | forward and backward of blocks with at most 8 query rows (decode): k / v read in place, key chunks merged in fixed order |
| ``cpu.blocks`` | cpu | implicit relations (dense, causal, segments, bands), tiled products (BLAS or cpu/microgemm.py), key ranges split for few queries |
| ``cpu.csr`` | cpu | CSR relations, edge-balanced pieces for long rows |
| ``cpu.gat`` / ``cuda.gat`` | cpu / cuda | score networks (``tg.nn.trace``) over CSR relations |
| ``cpu.neighbors`` / ``cuda.neighbors`` | cpu / cuda | radius / k-nearest-neighbour graph builders |
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Family", "Request", "Decision", "register", "choose", "families"]


@dataclass(frozen=True)
class Request:
    """What one call asks for; built by the dispatcher from validated inputs."""
    op: str                      # "forward" | "backward" | "gat.forward" | ... | "neighbors"
    backend: str                 # "cpu" | "cuda"
    relation_kind: str = ""      # graph.kind
    implicit: bool = False       # the relation is a BlockRelation (no index arrays)
    banded: bool = False         # some block is neither full nor square-causal
    score: str = "dot"           # "dot" | "dot + edge bias" | "edge score" | "modified: ..."
    modified: bool = False       # a compiled score modifier is part of the score
    modifier_grads: bool = False  # backward: gradients of the modifier's fields / params wanted
    dtype: str = ""
    head_dim: int = 0
    value_dim: int = 0
    heads: int = 0
    kv_heads: int = 0
    scale: float = 1.0
    pruned: bool = False
    max_block_rows: int = 0      # most destination rows of any block (implicit relations)
    options: Any = None
    # device-level facts are asked lazily, only by the families that need them
    probe: Callable[[], Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Family:
    name: str
    ops: tuple
    backend: str
    module: str        # module holding the family's entry points
    summary: str
    accepts: Callable[[Request], "str | None"]


@dataclass(frozen=True)
class Decision:
    family: Family
    considered: tuple    # ((family name, "chosen" or the refusal reason), ...)

    def describe(self):
        return "; ".join(f"{name}: {why}" for name, why in self.considered)


_FAMILIES: list = []


def register(family):
    """Add a family; families are tried in registration order (first = preferred)."""
    if any(f.name == family.name for f in _FAMILIES):
        raise ValueError(f"kernel family {family.name!r} is already registered")
    _FAMILIES.append(family)
    return family


def families(op=None, backend=None):
    return [f for f in _FAMILIES if (op is None or op in f.ops)
            and (backend is None or f.backend == backend)]


def choose(request):
    """The first registered family that accepts `request`, with every family's answer."""
    considered = []
    for fam in families(request.op, request.backend):
        why = fam.accepts(request)
        if why is None:
            considered.append((fam.name, "chosen"))
            return Decision(fam, tuple(considered))
        considered.append((fam.name, f"refused ({why})"))
    reasons = "; ".join(f"{n}: {w}" for n, w in considered) or "no family is registered"
    raise NotImplementedError(
        f"no {request.backend} kernel family computes this {request.op} request "
        f"({request.relation_kind} relation, score {request.score}, {request.dtype}): {reasons}")


# --------------------------------------------------------------------------- attention families
_ATTENTION = ("forward", "backward")
_CUDA_SCORES = ("dot", "dot + edge bias", "edge score")


def _tensor_cores(req):
    if req.options is not None and not req.options.tensor_cores:
        return "tensor cores switched off (options.tensor_cores=False)"
    if req.modified:
        if req.modifier_grads:
            return "gradients of score-modifier fields and params are computed on the CUDA cores"
        if req.pruned:
            return "tile pruning with a score modifier: the admission rule bounds raw dot scores"
        if "no dot product" in req.score:
            return "a score without a dot product gathers on the CUDA cores"
    if not req.implicit:
        return "needs an implicit (block) relation"
    if req.banded and req.pruned:
        return "tile pruning is not compiled into the banded tensor-core kernels (its first tile must face every row)"
    if req.score != "dot" and not req.modified:
        return f"score {req.score!r}: the tensor-core kernels compute dot scores and score modifiers"
    if req.dtype == "float32" and req.options is not None and not req.options.fp32_tensor_cores:
        return "float32 kept off the tensor cores (options.fp32_tensor_cores=False)"
    probe = req.probe() if req.probe is not None else None
    if probe is None:
        return "no tensor-core kernels on this device"
    return probe(req)


# few query rows per block: the split-key (flash-decoding) kernel reads each K/V row once
DECODE_MAX_ROWS = 8
_DECODE_DTYPES = ("float16", "float32", "float64")


def _few_query_rows(req):
    """the split-key kernels' rule, CPU and CUDA alike: implicit blocks of at most
    DECODE_MAX_ROWS query rows, plain dot scores, no pruning."""
    if not req.implicit:
        return "needs an implicit (block) relation"
    if req.max_block_rows == 0:
        return "blocks without query rows"
    if not req.max_block_rows <= DECODE_MAX_ROWS:
        return f"blocks of more than {DECODE_MAX_ROWS} query rows"
    if req.pruned:
        return "tile pruning is not implemented in the split-key kernel"
    if req.modified:
        return "score modifiers are not compiled into the split-key kernel"
    if req.score != "dot":
        return f"score {req.score!r}: plain dot scores only"
    return None


def _cuda_decode(req):
    why = _few_query_rows(req)
    if why is None and req.dtype not in _DECODE_DTYPES:
        why = f"{req.dtype} (bfloat16 runs on the tensor cores)"
    return why


def _cuda_blocks(req):
    # score modifiers included: compiled into the kernels (cuda/score_codegen.py)
    if req.dtype == "bfloat16":
        return _CUDA_CORE_BF16
    return None if req.implicit else "needs an implicit (block) relation"


def _cuda_csr(req):
    # score modifiers included: compiled into the kernels (cuda/score_codegen.py)
    if req.dtype == "bfloat16":
        return _CUDA_CORE_BF16
    return None if not req.implicit else "needs a CSR relation"


_CUDA_CORE_BF16 = "bfloat16 runs on the tensor cores only (the CUDA-core kernels take float16, float32, float64)"


_CPU_DECODE_DTYPES = ("float32", "float64")


def _cpu_decode(req):
    why = _few_query_rows(req)
    if why is None and req.dtype not in _CPU_DECODE_DTYPES:
        why = f"{req.dtype}: the split-key kernel reads k / v in place, float32 / float64 only"
    return why


def _cpu_blocks(req):
    return None if req.implicit else "needs an implicit (block) relation"


def _cpu_csr(req):
    return None if not req.implicit else "needs a CSR relation"


register(Family("cuda.decode", ("forward",), "cuda", "tiga_numba.cuda.decode",
                "split-key forward for few query rows per block, partials merged in fixed order",
                _cuda_decode))
register(Family("cuda.tc", _ATTENTION, "cuda", "tiga_numba.cuda.tc",
                "generated tensor-core kernels (wgmma on sm_90, mma.sync on sm_80+)", _tensor_cores))
register(Family("cuda.blocks", _ATTENTION, "cuda", "tiga_numba.cuda.api",
                "CUDA-core tiled online softmax over implicit blocks", _cuda_blocks))
register(Family("cuda.csr", _ATTENTION, "cuda", "tiga_numba.cuda.api",
                "CUDA-core row-streaming online softmax over CSR", _cuda_csr))
register(Family("cpu.decode", _ATTENTION, "cpu", "tiga_numba.cpu.api",
                "split-key forward and backward for few query rows per block, k / v read in place, "
                "fixed-order merges",
                _cpu_decode))
register(Family("cpu.blocks", _ATTENTION, "cpu", "tiga_numba.cpu.api",
                "numba tiled online softmax over implicit blocks (BLAS or own tile products)", _cpu_blocks))
register(Family("cpu.csr", _ATTENTION, "cpu", "tiga_numba.cpu.api",
                "numba edge-balanced online softmax over CSR", _cpu_csr))

# --------------------------------------------------------------------------- score networks (GAT)
_GAT = ("gat.forward", "gat.backward")


def _gat_relation(req):
    return None if req.relation_kind == "csr" else (
        f"score networks run over CSR relations, got {req.relation_kind!r}")


register(Family("cpu.gat", _GAT, "cpu", "tiga_numba.cpu.gat",
                "fused per-edge score network + online softmax (numba)", _gat_relation))
register(Family("cuda.gat", _GAT, "cuda", "tiga_numba.cuda.gat",
                "fused per-edge score network + online softmax (CUDA cores)", _gat_relation))

# --------------------------------------------------------------------------- neighbour graphs
register(Family("cpu.neighbors", ("neighbors",), "cpu", "tiga_numba.neighbors",
                "cell-list radius / k-nearest-neighbour builder (numba)", lambda req: None))
register(Family("cuda.neighbors", ("neighbors",), "cuda", "tiga_numba.cuda.neighbors",
                "cell-list radius / k-nearest-neighbour builder (CUDA)", lambda req: None))
