"""The device the tensor-core kernels run on: its id, whether it takes the warpgroup (wgmma)
kernels, and cupy's current stream. Everything here is asked per call and answered from small
per-device memos; numba.cuda and cupy are imported on first use."""
from __future__ import annotations

from ... import run_options as _options

_WGMMA_DEVICES = {}


def use_wgmma(dtype):
    """True on a compute capability 9.0 device (sm_90a: H100 / H200) unless TIGA_NUMBA_WGMMA=0
    (read per call): the warpgroup kernels (float32: on bf16 x 3 splits); else the mma.sync ones
    (float32: 3xTF32)."""
    if not _options.current().wgmma:
        return False
    try:
        dev = current_device()
    except Exception:  # noqa: BLE001 - no GPU / no cupy: nothing to launch on
        return False
    hit = _WGMMA_DEVICES.get(dev)
    if hit is None:
        import cupy
        hit = _WGMMA_DEVICES[dev] = cupy.cuda.Device(dev).compute_capability == "90"
    return hit


def current_device():
    """the current CUDA device id (launch.py's, bound to cupy's runtime call on first use)."""
    from .. import launch as L
    return L._get_device()


def current_stream():
    """cupy's current stream (launch.StreamRef: one wrapper per stream, shared with the CUDA-core path)."""
    from .. import launch as L   # lazy: numba.cuda loads with the first GPU use
    return L.current_stream()
