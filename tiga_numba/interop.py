"""Arrays from other libraries (torch tensors, JAX arrays, anything with ``__dlpack__``).

The kernels run on numpy (CPU) and cupy (CUDA) arrays. Arrays of other libraries are viewed as
one of those through DLPack, without a copy: a CPU tensor becomes ``np.from_dlpack(x)``, a CUDA
tensor ``cupy.from_dlpack(x)``; the results are handed back the same way, so a caller that passed
torch tensors gets torch tensors (``torch.from_dlpack``), one that passed JAX arrays gets JAX arrays.

    @interop.foreign_arrays
    def attention(q, k, v, graph, ...): ...

``foreign_arrays`` converts every array argument (also inside dicts, lists and tuples), calls the
function on numpy/cupy arrays and converts its result back into the library of the first array
argument (q of ``attention``; a numpy q with torch k and v gives numpy results), or of the one it
names (``@foreign_arrays(primary="q")``: the backward's gradients follow q, not dout); a returned
function (a ``vjp``) is wrapped the same way. Calls whose arguments are all
numpy/cupy pass straight through. torch and JAX are never imported here unless the caller passed
one of their arrays (the check reads ``type(x).__module__``).

A torch tensor that requires grad is detached (a view, no copy): the package's own gradients are
explicit (``vjp``, ``attention_backward``); ``tiga_numba.torch`` connects them to autograd.
"""
from __future__ import annotations

import functools
import inspect
import sys
import types

import numpy as np

__all__ = ["foreign_arrays", "convert_args", "outward", "is_foreign", "to_native", "to_library",
           "library_name"]

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST, _DLPACK_CUDA_MANAGED = 1, 2, 3, 13


def _root_module(x):
    return type(x).__module__.partition(".")[0]


def _is_cupy(x):
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def library_name(x):
    """'torch', 'jax' or 'dlpack' for a foreign array; None for numpy, cupy and non-arrays."""
    if isinstance(x, np.ndarray) or _is_cupy(x):
        return None
    root = _root_module(x)
    if root == "torch":
        return "torch" if hasattr(x, "__dlpack__") else None
    if root in ("jax", "jaxlib"):
        return "jax"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    return None


def is_foreign(x):
    return library_name(x) is not None


def _cupy_from_dlpack(x, name):
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"{name} is a CUDA array but cupy is not installed: pip install "
                          "'tiga-numba[cuda]' to run on the GPU") from exc
    return cupy.from_dlpack(x)


def to_native(x, name="array"):
    """The numpy (CPU) or cupy (CUDA) view of a foreign array; numpy/cupy/other objects as given."""
    lib = library_name(x)
    if lib is None:
        return x
    if lib == "torch":
        if x.requires_grad:
            x = x.detach()
        if x.is_cuda:
            return _cupy_from_dlpack(x, name)
        if x.dtype.is_complex or str(x.dtype) == "torch.bfloat16":
            raise TypeError(f"{name} has torch dtype {x.dtype}, which numpy cannot view; "
                            "expected float16, float32 or float64 (or a CUDA tensor)")
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        return np.from_dlpack(x)
    device_type = int(x.__dlpack_device__()[0])
    if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        return _cupy_from_dlpack(x, name)
    if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        return np.from_dlpack(x)
    raise TypeError(f"{name} lives on DLPack device type {device_type}; only CPU and CUDA "
                    "arrays are supported")


def to_host(x, name="array"):
    """`x` (numpy, cupy, torch or another DLPack array) as a host numpy array: a view where it
    already is one, a device-to-host copy of a CUDA array."""
    x = to_native(x, name)
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):   # cupy
        return x.get()
    return np.asarray(x)


def to_library(x, lib):
    """A numpy/cupy array `x` as an array of library `lib` ('torch', 'jax'), without a copy."""
    if lib is None or lib == "dlpack" or not (isinstance(x, np.ndarray) or _is_cupy(x)):
        return x
    if lib == "torch":
        import torch
        if isinstance(x, np.ndarray) and not x.flags.writeable:
            x = x.copy()  # numpy exports no read-only buffer through DLPack
        return torch.from_dlpack(x)
    if lib == "jax":
        import jax.numpy as jnp
        return jnp.from_dlpack(x)
    return x


# --------------------------------------------------------------------------- the decorator
_NATIVE_TYPES = {np.ndarray, int, float, bool, str, type(None)}  # types seen not to be foreign


def _scan(obj, depth=0):
    """The library of the first foreign array in obj (dicts, lists and tuples searched).
    Runs on every call of a wrapped entry point: types already seen to be native (numpy,
    cupy, Graph, numbers, ...) cost one set lookup."""
    if type(obj) in _NATIVE_TYPES:
        return None
    if isinstance(obj, dict):
        for v in obj.values():
            lib = _scan(v, depth + 1)
            if lib is not None:
                return lib
        return None
    if isinstance(obj, (list, tuple)) and depth < 4:
        for v in obj:
            lib = _scan(v, depth + 1)
            if lib is not None:
                return lib
        return None
    if _is_stats(obj):
        return library_name(obj.m)
    lib = library_name(obj)
    if lib is None:
        # remembered as native, except containers (a list nested too deep to be searched here
        # says nothing about the next list: a later call may hold tensors in one) and objects
        # with attributes of their own (a SimpleNamespace of numpy m and l says nothing about
        # the next one, which may be stats of torch tensors: _is_stats reads the instance)
        if not isinstance(obj, (list, tuple, dict)) and not hasattr(obj, "__dict__"):
            _NATIVE_TYPES.add(type(obj))
    elif getattr(obj, "ndim", None) == 0:
        return None   # a 0-d scalar (softcap=torch.tensor(30.0)) does not choose the results' library
    return lib


def _first_array_is_native(args, kwargs):
    """Whether the first array argument (in argument order, containers searched) is a numpy or
    cupy array: q of attention, x of a layer, the first part of a merge. The results follow
    that argument's library ("Output in q's library"), also when later arguments are foreign."""
    def first(obj, depth=0):
        if isinstance(obj, np.ndarray) or _is_cupy(obj):
            return True
        if isinstance(obj, dict):
            obj = list(obj.values())
        if isinstance(obj, (list, tuple)) and depth < 4:
            for v in obj:
                found = first(v, depth + 1)
                if found is not None:
                    return found
            return None
        if _is_stats(obj):
            return first(obj.m, depth + 1)
        if library_name(obj) is not None and getattr(obj, "ndim", None) != 0:
            return False
        return None
    return bool(first(list(args) + list(kwargs.values())))


def _is_stats(obj):
    """An AttentionStats, or stats built by hand: any object with array `m` and `l` (what the
    backward and the merge accept) whose `m` is a foreign array."""
    if type(obj).__name__ == "AttentionStats":
        return True
    m = getattr(obj, "m", None)
    return m is not None and hasattr(obj, "l") and library_name(m) is not None and \
        library_name(obj) is None


def _stats_like(stats, convert):
    """A copy of an AttentionStats with its array fields (m, l and any kernel-side arrays)
    converted and everything else (plan, graph, ...) kept; stats built by hand (any object with
    m and l) become an AttentionStats of their converted m and l."""
    if type(stats).__name__ != "AttentionStats":
        from .functional import AttentionStats
        return AttentionStats(convert(stats.m), convert(stats.l))
    new = object.__new__(type(stats))
    for name in getattr(type(stats), "__slots__", ()):
        value = getattr(stats, name, None)
        if isinstance(value, np.ndarray) or _is_cupy(value) or library_name(value) is not None:
            value = convert(value)
        object.__setattr__(new, name, value)
    return new


def _inward(obj, name="array", depth=0):
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, dict):
        return {k: _inward(v, f"{name}[{k!r}]", depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and depth < 4:
        items = [_inward(v, f"{name}[{i}]", depth + 1) for i, v in enumerate(obj)]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if _is_stats(obj):
        return _stats_like(obj, lambda a: to_native(a, f"{name}.m/l"))
    return to_native(obj, name)


def _outward(obj, lib, depth=0):
    if isinstance(obj, np.ndarray) or _is_cupy(obj):
        return to_library(obj, lib)
    if isinstance(obj, dict):
        return {k: _outward(v, lib, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and depth < 4:
        items = [_outward(v, lib, depth + 1) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if isinstance(obj, types.FunctionType):  # a vjp closure: takes and returns lib arrays
        return _convert_call(obj, lib)
    if type(obj).__name__ == "AttentionStats":
        return _stats_like(obj, lambda a: to_library(a, lib))
    return obj


def _arg_names(fn):
    try:
        return [p for p in inspect.signature(fn).parameters]
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return []


def _convert_call(fn, lib, names=None):
    """fn with foreign arguments converted in and its results converted to `lib` (None: left
    as numpy / cupy)."""
    names = _arg_names(fn) if names is None else names

    @functools.wraps(fn)
    def call(*args, **kwargs):
        args = tuple(_inward(a, names[i] if i < len(names) else f"argument {i}")
                     for i, a in enumerate(args))
        kwargs = {k: _inward(v, k) for k, v in kwargs.items()}
        return outward(fn(*args, **kwargs), lib)
    return call


def foreign_arrays(fn=None, *, primary=None):
    """Let `fn` take foreign arrays (converted in, without a copy) and return its results in the
    caller's library: that of its first array argument, or of the argument named `primary`
    (`@foreign_arrays(primary="q")`). Argument names are kept in error messages for foreign
    inputs."""
    if fn is None:
        return functools.partial(foreign_arrays, primary=primary)
    names = _arg_names(fn)
    where = names.index(primary) if primary in names else None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        # the common call (numpy / cupy arrays, a Graph, numbers): one set lookup per argument
        for a in args:
            if type(a) not in _NATIVE_TYPES:
                break
        else:
            for a in kwargs.values():
                if type(a) not in _NATIVE_TYPES:
                    break
            else:
                return fn(*args, **kwargs)
        lib = _scan(args)
        if lib is None:
            for v in kwargs.values():
                lib = _scan(v)
                if lib is not None:
                    break
        if lib is None:
            return fn(*args, **kwargs)
        if where is not None:
            deciding = (args[where],) if where < len(args) else (kwargs.get(primary),)
            native = _first_array_is_native(deciding, {})
            out_lib = None if native else (_scan(deciding) or lib)
        else:   # numpy q with torch k: numpy results
            out_lib = None if _first_array_is_native(args, kwargs) else lib
        return _convert_call(fn, out_lib, names)(*args, **kwargs)
    return call


def convert_args(args, kwargs):
    """(library of the first foreign array or None, args, kwargs converted to numpy/cupy)."""
    lib = _scan(args)
    if lib is None:
        for v in kwargs.values():
            lib = _scan(v)
            if lib is not None:
                break
    if lib is None:
        return None, args, kwargs
    out_lib = None if _first_array_is_native(args, kwargs) else lib
    return out_lib, _inward(args), {k: _inward(v, k) for k, v in kwargs.items()}


def outward(obj, lib):
    """Results (arrays, containers, AttentionStats, vjp closures) into library `lib`."""
    return obj if lib is None else _outward(obj, lib)
