"""Input validation for the attention entry points: array library, dtypes, shapes.

Every check names the argument, the expected and the received value. Nothing here imports
cupy unless a non-numpy array arrives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .graph import Graph

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def bfloat16_dtype():
    """numpy's bfloat16 (ml_dtypes), or None where it is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def library_of(name, array):
    """'numpy' or 'cupy' (anything with __cuda_array_interface__); TypeError otherwise."""
    if isinstance(array, np.ndarray):
        return "numpy"
    if hasattr(array, "__cuda_array_interface__"):
        return "cupy"
    raise TypeError(f"{name} must be a numpy or cupy array, got {type(array).__name__}")


def _cupy(name):
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            f"{name} is a GPU array (__cuda_array_interface__) but cupy is not installed: "
            "pip install 'tiga-numba[cuda]' (numba-cuda and cupy) to run on the GPU") from exc
    return cupy


def as_library_array(array, library, name="array"):
    """A cupy view of any __cuda_array_interface__ object (numba device arrays, ...)."""
    if library == "cupy" and type(array).__module__.split(".")[0] != "cupy":
        return _cupy(name).asarray(array)
    return array


def accumulation_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@dataclass(frozen=True)
class AttentionShape:
    library: str  # "numpy" | "cupy"
    dtype: np.dtype
    num_dst: int
    num_src: int
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    squeezed: bool  # inputs were 2-D (one head): results are returned 2-D

    @property
    def accum_dtype(self):
        return accumulation_dtype(self.dtype)


def _check_dtype(name, array, library):
    dt = np.dtype(array.dtype)
    allowed = list(FLOAT_DTYPES)
    bf16 = bfloat16_dtype()
    if library == "cupy" and bf16 is not None:
        allowed.append(bf16)
    if dt not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} has unsupported dtype {dt}; expected one of {names}")
    return dt


def check_attention_inputs(q, k, v, graph, scale):
    """Validate q, k, v against `graph`; returns (q, k, v as 3-D views, shape, scale)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    libs = {name: library_of(name, a) for name, a in (("q", q), ("k", k), ("v", v))}
    if len(set(libs.values())) > 1:
        desc = ", ".join(f"{n} is {lib}" for n, lib in libs.items())
        raise TypeError(f"q, k and v must come from one array library (mixed numpy/cupy): {desc}")
    library = libs["q"]
    q, k, v = (as_library_array(a, library, n) for n, a in (("q", q), ("k", k), ("v", v)))
    ndims = {n: a.ndim for n, a in (("q", q), ("k", k), ("v", v))}
    if set(ndims.values()) == {2}:
        squeezed = True
        q, k, v = q[:, None, :], k[:, None, :], v[:, None, :]
    elif set(ndims.values()) == {3}:
        squeezed = False
    else:
        raise ValueError("q, k and v must all be 3-D (nodes, heads, dim) or all 2-D (nodes, dim), "
                         f"got q.ndim={ndims['q']}, k.ndim={ndims['k']}, v.ndim={ndims['v']}")
    dtype = _check_dtype("q", q, library)
    for name, a in (("k", k), ("v", v)):
        dt = _check_dtype(name, a, library)
        if dt != dtype:
            raise TypeError(f"{name} has dtype {dt} but q has dtype {dtype}; q, k and v must share one dtype")
    if q.shape[0] != graph.num_dst:
        raise ValueError(f"q has {q.shape[0]} rows (axis 0) but graph.num_dst is {graph.num_dst}")
    for name, a in (("k", k), ("v", v)):
        if a.shape[0] != graph.num_src:
            raise ValueError(f"{name} has {a.shape[0]} rows (axis 0) but graph.num_src is {graph.num_src}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k has {k.shape[1]} heads but v has {v.shape[1]}; they must match")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's heads ({kv_heads}) "
                         "(grouped-query attention)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q has head dim {q.shape[2]} but k has {k.shape[2]}; they must match")
    head_dim = int(q.shape[2])
    scale = resolve_scale(scale, head_dim)
    shape = AttentionShape(library=library, dtype=dtype, num_dst=int(q.shape[0]),
                           num_src=int(k.shape[0]), heads=int(heads), kv_heads=int(kv_heads),
                           head_dim=head_dim, value_dim=int(v.shape[2]), squeezed=squeezed)
    return q, k, v, shape, scale


def resolve_scale(scale, head_dim):
    if scale is None:
        return float(head_dim) ** -0.5 if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_prune_threshold(rho):
    if rho is None:
        return None
    if isinstance(rho, (bool, np.bool_)) or not isinstance(rho, (int, float, np.integer, np.floating)):
        raise TypeError(f"block_prune_threshold must be a real number in (0, 1] or None, got {type(rho).__name__}")
    rho = float(rho)
    if not (0.0 < rho <= 1.0):
        raise ValueError(f"block_prune_threshold must be in (0, 1], got {rho}")
    return rho


def check_like(name, array, library, dtype=None, expected_shape=None):
    """Check an auxiliary array (dout, out, stats) against the forward's library/shape."""
    lib = library_of(name, array)
    if lib != library:
        raise TypeError(f"{name} is a {lib} array but q is {library} (mixed numpy/cupy)")
    array = as_library_array(array, library, name)
    if expected_shape is not None and tuple(array.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have shape {tuple(expected_shape)}, got {tuple(array.shape)}")
    if dtype is not None and np.dtype(array.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {np.dtype(array.dtype)}")
    return array


def check_edge_bias(edge_bias, shape: AttentionShape, graph):
    """Per-edge additive scores: (E,) or (E, H) -> (E, H) in the accumulation dtype."""
    if edge_bias is None:
        return None
    lib = library_of("edge_bias", edge_bias)
    if lib != shape.library:
        raise TypeError(f"edge_bias is a {lib} array but q is {shape.library} (mixed numpy/cupy)")
    edge_bias = as_library_array(edge_bias, shape.library, "edge_bias")
    if not np.issubdtype(np.dtype(edge_bias.dtype), np.floating):
        raise TypeError(f"edge_bias must be floating point, got {edge_bias.dtype}")
    E, H = graph.num_edges, shape.heads
    if edge_bias.ndim == 1:
        edge_bias = edge_bias[:, None]
    if edge_bias.ndim != 2 or edge_bias.shape[0] != E or edge_bias.shape[1] not in (1, H):
        raise ValueError(f"edge_bias must have shape ({E},) or ({E}, {H}) (one value per edge "
                         f"[and head]), got {tuple(edge_bias.shape)}")
    xp = np if shape.library == "numpy" else _cupy("edge_bias")
    # no copy when the caller already passes (E, H) contiguous in the accumulation dtype
    return xp.ascontiguousarray(xp.broadcast_to(edge_bias, (E, H)), dtype=shape.accum_dtype)
