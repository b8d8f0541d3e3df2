"""The dispatcher: one place that turns validated inputs into a Plan.

The array library picks the backend; `tiga_numba.registry` picks the kernel family (the plan
stores the decision and every refusal); the backend module (imported on first use, so importing
tiga_numba never touches numba.cuda) runs the family it is handed through its `forward` and
`backward` (docs/INTERNALS.md) and records what it did in `plan.run_info`.
"""
from __future__ import annotations

import importlib

from . import run_options as _options
from . import registry as _registry
from .arrays import dtype_name
from .plan import BACKEND_OF_LIBRARY, Plan
from .registry import Request
from .cpu import tiles as _cpu_tiles  # pure Python: the CPU tile rule, recorded in the plan

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
              arrays=None, options=None, score_mod=None):
    """Build the plan and refuse, before any kernel runs, what no kernel implements.

    `arrays` (q, k, v) let device-level families (the tensor cores) check strides and the
    device; `options` are the call's resolved run options (tiga_numba.run_options);
    `score_mod` a score_mod.BoundModifier (its tree is part of the score text the decision
    is keyed on, and the plan carries it: `Plan.modifier`)."""
    implicit = graph.is_implicit
    if score is None:
        score = "dot" if edge_bias is None else (
            "edge score" if shape.head_dim == 0 else "dot + edge bias")
        if score_mod is not None:
            score = f"modified: f = {score_mod.tree}" + (
                "" if score_mod.uses_score and shape.head_dim else " (no dot product: gather only)")
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
                f"dense, triangular, segments and band relations only, not {graph.kind}")
    for name, size in (("graph.num_dst", shape.num_dst), ("graph.num_src", shape.num_src)):
        if size >= 2**31:
            raise ValueError(f"{name}={size} is beyond what the kernels index (< 2**31 rows)")
    backend = BACKEND_OF_LIBRARY[shape.library]
    opts = options if options is not None else _options.current()
    banded = bool(implicit and not graph._blocks.standard)
    probed = []
    probe = _device_probe(backend, graph, arrays, scale, score, probed)
    # A decision depends on the facts in `key` only, so it is made once and then looked up: a
    # call's planning stays a few microseconds. The families are tried in a fixed order and none
    # of them reads the request's heads or scale; the tensor-core device probe reads, beyond the
    # key's dtype, head dims, relation and options, only the facts `_probe_facts` lists (the
    # device, the scale's sign, the sizes), looked up only for keys whose decision asked the
    # probe. A plan made without arrays (explain()
    # before a call) has no probe and is kept apart from the calls' decisions.
    rows = int(graph._blocks.max_block_dst) if implicit else 0
    modifier_grads = bool(op == "backward" and score_mod is not None and score_mod.grad_leaves)
    key = (op, backend, graph.kind, implicit, banded, score, modifier_grads, shape.dtype, shape.head_dim,
           shape.value_dim, prune_threshold is not None, min(rows, 9), opts, probe is not None)
    decision = _DECISIONS.get(key)
    facts_key = None
    if decision is _PROBED:   # decided with the probe: its facts are part of the key
        facts_key = (key, _probe_facts(shape, scale))
        decision = _DECISIONS.get(facts_key)
    if decision is None:
        request = Request(
            op=op, backend=backend, relation_kind=graph.kind, implicit=implicit, banded=banded,
            score=score, modified=score.startswith("modified"), modifier_grads=modifier_grads,
            dtype=dtype_name(shape.dtype),
            head_dim=shape.head_dim, value_dim=shape.value_dim, heads=shape.heads,
            kv_heads=shape.kv_heads, scale=float(scale), pruned=prune_threshold is not None,
            max_block_rows=rows, options=opts, probe=probe)
        decision = _registry.choose(request)
        if probed:
            _DECISIONS[key] = _PROBED
            _DECISIONS[facts_key or (key, _probe_facts(shape, scale))] = decision
        else:
            _DECISIONS[key] = decision
    return Plan(
        op=op,
        backend=backend,
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
        family=decision.family.name,
        considered=decision.considered,
        options=opts,
        tiles=_cpu_tiles.choose(opts, prune_threshold is not None,
                                full=op == "forward" and graph.kind == "dense",
                                band_width=graph._blocks.band_width if banded else None,
                                forward=op == "forward")
        if decision.family.name == "cpu.blocks" else (),
        modifier=None if score_mod is None else score_mod.tree,
    )


_DECISIONS = {}
_PROBED = object()   # marks a key whose decision asked the device probe (see make_plan)


def _device_probe(backend, graph, arrays, scale, score, probed):
    """For the CUDA backend: a lazy check of the tensor-core kernels on this device and these
    arrays (dtypes, head dims, scale, sizes, shared memory), asked only by the family that needs
    it; each asking appends to `probed`. Its answer is a function of the decision key plus
    `_probe_facts`, so the decision is cached under both."""
    if backend != "cuda" or arrays is None:
        return None

    def probe():
        probed.append(True)
        return backend_module("cuda").tensor_core_probe(graph, arrays, scale, score)
    return probe


def _probe_facts(shape, scale):
    """What the tensor-core probe reads beyond the decision key (cuda/tc/admission.supports) and
    beyond what input validation already guarantees (a finite scale, query heads grouping evenly
    over the key/value heads): the current device (compute capability, shared memory), whether
    the scale is positive, whether the sizes fit the kernels' 32-bit row indices."""
    from .cuda.tc import admission, device
    try:
        dev = device.current_device()
    except Exception:  # noqa: BLE001 - no device: the probe answers for that too
        dev = None
    return dev, scale > 0, max(shape.num_dst, shape.num_src) < admission.MAX_ROWS
