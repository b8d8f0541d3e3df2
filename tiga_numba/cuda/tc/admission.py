"""Admission: whether the tensor-core kernels compute a request exactly as the contract says
(relation kind, score, dtypes, head dims, strides, scale, sizes) and whether the current device
can run them (compute capability, shared memory). `supports()` never raises: anything
unexpected means "not this path", and the caller runs the CUDA-core kernels."""
from __future__ import annotations

import math

from ... import run_options as _options
from . import device
from .tuning import TC_DTYPES, head_dims, variant

_DTYPE_NAMES = {}
#: rows (queries or keys) the kernels index in 32 bits, with a tile of headroom
MAX_ROWS = 2 ** 31 - 1024


def _dtype_name(x):
    dt = getattr(x, "dtype", None)
    name = _DTYPE_NAMES.get(dt)
    if name is None:   # str(dtype) costs ~2 us per call: once per dtype object
        name = _DTYPE_NAMES[dt] = str(dt) if dt is not None else ""
    return name


def supports(plan, q, k, v, relation):
    """True when the tensor-core kernels compute this request exactly as the contract says."""
    try:
        if type(relation).__name__ != "BlockRelation":
            return False
        score = getattr(plan, "score", "dot")
        if score != "dot" and not (score.startswith("modified") and "no dot product" not in score):
            return False
        op = getattr(plan, "op", "forward")
        dn = _dtype_name(q)
        if dn not in TC_DTYPES or _dtype_name(k) != dn or _dtype_name(v) != dn:
            return False
        # the type first: cupy's property builds the interface dict on every instance access
        if not all(hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__")
                   for x in (q, k, v)):
            return False
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            return False
        D, Dv = int(q.shape[2]), int(v.shape[2])
        if Dv != D or int(k.shape[2]) != D:
            return False
        wgmma = device.use_wgmma(dn)
        if D not in head_dims(dn, wgmma, op):
            return False
        if D not in head_dims(dn, wgmma) and (
                score != "dot" or getattr(plan, "prune_threshold", None) is not None):
            return False   # a plain-call head dim (tuning.WGMMA_PLAIN_DIMS): what has run on the GPU there
        if dn == "float32" and not _options.current().fp32_tensor_cores:
            return False   # the user's opt-out: float32 stays on the CUDA-core (SIMT fp32) kernels
        H, Hkv = int(q.shape[1]), int(k.shape[1])
        if Hkv < 1 or H % Hkv:
            return False
        scale = float(plan.scale)
        if not (scale > 0 and math.isfinite(scale)):
            return False   # the running max is taken on raw scores, then scaled
        if max(int(q.shape[0]), int(k.shape[0])) >= MAX_ROWS:
            return False
        return _device_can_run(D, Dv, dn, op)
    except Exception:  # noqa: BLE001 - anything unexpected means "not this path"
        return False


_DEVICE_OK = {}


def _device_can_run(D, Dv, dtype, op="forward"):
    """mma.sync m16n8k16 (f16/bf16) / m16n8k8 (tf32), cp.async and ldmatrix need sm_80+; every kernel's shared
    memory must fit the device's opt-in per-block limit (99 KB on sm_86/89, 227 KB on sm_90). The
    kernels asked: the forward's, and (a head dim both passes serve) the backward's, whatever the
    op, so that a forward never runs where its backward could not."""
    try:
        import cupy
        kinds = ("fwd", "dq", "dkdv") if D in head_dims(dtype, device.use_wgmma(dtype), "backward") else ("fwd",)
        key = (cupy.cuda.runtime.getDevice(), D, Dv, dtype, kinds)
        if key not in _DEVICE_OK:
            dev = cupy.cuda.Device(key[0])
            cc = int(dev.compute_capability)
            # opt-in per-block shared memory by architecture, refined by the runtime when it answers
            limit = {80: 163, 87: 163, 90: 227, 100: 227, 103: 227}.get(cc, 99) * 1024
            try:
                limit = int(cupy.cuda.runtime.deviceGetAttribute(97, dev.id))  # ...SharedMemoryPerBlockOptin
            except Exception:  # noqa: BLE001
                pass
            need = max(variant(kind, D, Dv, dtype).smem_bytes() for kind in kinds)
            _DEVICE_OK[key] = cc >= 80 and need <= limit
        return _DEVICE_OK[key]
    except Exception:  # noqa: BLE001 - anything unexpected means "not this path"
        return False
