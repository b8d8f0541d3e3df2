"""Input validation for the attention entry points: array library, dtypes, shapes.

Every check names the argument, the expected and the received value. Nothing here imports
cupy unless a non-numpy array arrives.

These checks run on every call, so they are written to cost a few microseconds: type tests
against the array classes (a cupy array's `__cuda_array_interface__` builds a dict on each
access), dtype sets built once, and no imports on the hot path.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from .errors import ThresholdTypeError
from .graph import Graph

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

_ACCUM = {d: (np.dtype(np.float64) if d == np.float64 else np.dtype(np.float32)) for d in FLOAT_DTYPES}
_BF16 = []  # memo of bfloat16_dtype(): [] = not looked up yet (a failed import is slow)


def bfloat16_dtype():
    """numpy's bfloat16 (ml_dtypes), or None where it is not installed."""
    if not _BF16:
        try:
            import ml_dtypes
            _BF16.append(np.dtype(ml_dtypes.bfloat16))
        except ImportError:
            _BF16.append(None)
    return _BF16[0]


_CUPY_NDARRAY = []  # cupy.ndarray once cupy has been imported by anyone


def _is_cupy_ndarray(array):
    if not _CUPY_NDARRAY:
        cp = sys.modules.get("cupy")
        if cp is None or not hasattr(cp, "ndarray"):
            return False
        _CUPY_NDARRAY.append(cp.ndarray)
    return isinstance(array, _CUPY_NDARRAY[0])


def library_of(name, array):
    """'numpy' or 'cupy' (anything with __cuda_array_interface__); TypeError otherwise."""
    if type(array) is np.ndarray:
        return "numpy"
    if isinstance(array, np.ndarray):
        _check_subclass(name, array)
        return "numpy"
    if _is_cupy_ndarray(array) or hasattr(array, "__cuda_array_interface__"):
        return "cupy"
    raise TypeError(f"{name} must be a numpy or cupy array, got {type(array).__name__}")


def _check_subclass(name, array):
    """Refuse ndarray subclasses whose meaning the kernels would drop: np.matrix is always
    2-D (indexing a row keeps 2 dimensions) and a masked array's mask would be ignored."""
    if isinstance(array, np.matrix):
        raise TypeError(f"{name} is a numpy.matrix; pass a numpy.ndarray instead "
                        "(np.asarray(x)), np.matrix keeps every slice 2-D")
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(f"{name} is a numpy masked array, whose mask the kernels cannot honour; "
                        "pass np.ma.filled(x) or express the mask in the graph")


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
    if library == "cupy" and not _is_cupy_ndarray(array):
        return _cupy(name).asarray(array)
    return array


def accumulation_dtype(dtype):
    acc = _ACCUM.get(dtype)
    if acc is None:
        acc = np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)
    return acc


class AttentionShape:
    """Sizes and dtype of one validated call (immutable by convention; a plain slotted class
    because a frozen dataclass costs microseconds to build on every call)."""

    __slots__ = ("library", "dtype", "num_dst", "num_src", "heads", "kv_heads", "head_dim",
                 "value_dim", "squeezed", "accum_dtype")

    def __init__(self, library, dtype, num_dst, num_src, heads, kv_heads, head_dim, value_dim,
                 squeezed):
        self.library = library  # "numpy" | "cupy"
        self.dtype = dtype
        self.num_dst = num_dst
        self.num_src = num_src
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.squeezed = squeezed  # inputs were 2-D (one head): results are returned 2-D
        self.accum_dtype = accumulation_dtype(dtype)

    def __eq__(self, other):
        return isinstance(other, AttentionShape) and all(
            getattr(self, s) == getattr(other, s) for s in self.__slots__)

    __hash__ = None

    def __repr__(self):
        fields = ", ".join(f"{s}={getattr(self, s)!r}" for s in self.__slots__[:-1])
        return f"AttentionShape({fields})"


# library -> frozenset of accepted dtypes; bfloat16 (ml_dtypes' numpy dtype) wherever ml_dtypes
# is installed: on the CPU it is widened to float32 inside the head-major copy every input gets
_ALLOWED = {}


def _allowed(library):
    allowed = _ALLOWED.get(library)
    if allowed is None:
        dts = list(FLOAT_DTYPES)
        bf16 = bfloat16_dtype()
        if bf16 is not None:
            dts.append(bf16)
        allowed = _ALLOWED[library] = (frozenset(dts), dts)
    return allowed


def accepted_dtypes(library):
    """The float dtypes attention takes (and returns) in `library`, in order: float16, float32,
    float64, and bfloat16 where ml_dtypes is installed."""
    return tuple(_allowed(library)[1])


def _check_dtype(name, array, library):
    dt = array.dtype
    allowed, ordered = _allowed(library)
    if dt not in allowed:
        dt = np.dtype(dt)
        if dt in allowed:
            return dt
        names = ", ".join(str(d) for d in ordered)
        if dt.byteorder not in "=|" and dt.newbyteorder("=") in allowed:
            raise TypeError(f"{name} has dtype {dt} in non-native byte order; the kernels read "
                            f"native {dt.newbyteorder('=')}: pass {name}.astype('{dt.newbyteorder('=')}')")
        raise TypeError(f"{name} has unsupported dtype {dt}; expected one of {names}")
    return dt


def check_attention_inputs(q, k, v, graph, scale):
    """Validate q, k, v against `graph`; returns (q, k, v as 3-D views, shape, scale)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a tiga_numba.Graph, got {type(graph).__name__}")
    library = library_of("q", q)
    lk, lv = library_of("k", k), library_of("v", v)
    if lk != library or lv != library:
        desc = f"q is {library}, k is {lk}, v is {lv}"
        raise TypeError(f"q, k and v must come from one array library (mixed numpy/cupy): {desc}")
    if library == "cupy":
        q, k, v = (as_library_array(a, library, n) for n, a in (("q", q), ("k", k), ("v", v)))
    nq, nk, nv = q.ndim, k.ndim, v.ndim
    if nq == 3 and nk == 3 and nv == 3:
        squeezed = False
    elif nq == 2 and nk == 2 and nv == 2:
        squeezed = True
        q, k, v = q[:, None, :], k[:, None, :], v[:, None, :]
    else:
        raise ValueError("q, k and v must all be 3-D (nodes, heads, dim) or all 2-D (nodes, dim), "
                         f"got q.ndim={nq}, k.ndim={nk}, v.ndim={nv}")
    dtype = _check_dtype("q", q, library)
    if k.dtype != dtype or v.dtype != dtype:
        for name, a in (("k", k), ("v", v)):
            dt = _check_dtype(name, a, library)
            if dt != dtype:
                raise TypeError(f"{name} has dtype {dt} but q has dtype {dtype}; "
                                "q, k and v must share one dtype")
    (nd, heads, head_dim), (ns, kv_heads, kd), (nvs, vh, value_dim) = q.shape, k.shape, v.shape
    if nd != graph.num_dst:
        raise ValueError(f"q has {nd} rows (axis 0) but graph.num_dst is {graph.num_dst}")
    if ns != graph.num_src:
        raise ValueError(f"k has {ns} rows (axis 0) but graph.num_src is {graph.num_src}")
    if nvs != graph.num_src:
        raise ValueError(f"v has {nvs} rows (axis 0) but graph.num_src is {graph.num_src}")
    if kv_heads != vh:
        raise ValueError(f"k has {kv_heads} heads but v has {vh}; they must match")
    if kv_heads == 0:   # (q with no heads over k's is an empty call, like one with no rows)
        raise ValueError(f"k has 0 heads (axis 1); k and v need at least one (q has {heads})")
    if heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's heads ({kv_heads}) "
                         "(grouped-query attention)")
    if head_dim != kd:
        raise ValueError(f"q has head dim {head_dim} but k has {kd}; they must match")
    scale = resolve_scale(scale, head_dim)
    shape = AttentionShape(library, dtype, int(nd), int(ns), int(heads), int(kv_heads),
                           int(head_dim), int(value_dim), squeezed)
    return q, k, v, shape, scale


_DTYPE_NAMES = {}


def dtype_name(dtype):
    """dtype.name, memoised: numpy computes it in Python on every access (microseconds; the plan
    and a call's copy notes ask for it several times per call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return name


def scalar_value(x):
    """A 0-d array or tensor (numpy, cupy, torch, ...) as its Python number; anything else as it
    is, for the caller's own type check (softcap=, scale=)."""
    if getattr(x, "ndim", None) == 0 and hasattr(x, "item"):
        return x.item()
    return x


def resolve_scale(scale, head_dim):
    if scale is None:
        return float(head_dim) ** -0.5 if head_dim > 0 else 1.0
    scale = scalar_value(scale)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_prune_threshold(rho):
    if rho is None:
        return None
    rho = scalar_value(rho)   # a 0-d array or tensor, as scale= and softcap= take
    if isinstance(rho, (bool, np.bool_)) or not isinstance(rho, (int, float, np.integer, np.floating)):
        raise ThresholdTypeError(f"block_prune_threshold must be a real number in (0, 1] or None, "
                                 f"got {type(rho).__name__}")
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
    if expected_shape is not None and array.shape != expected_shape:
        if tuple(array.shape) != tuple(expected_shape):
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
