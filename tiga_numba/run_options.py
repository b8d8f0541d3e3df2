"""Run options: the choices a caller makes about HOW a result is computed (never what).

    tg.attention_backward(..., deterministic=False)        # one call
    with tg.options(wgmma=False, fp32_tensor_cores=False):  # a block of code (this thread /
        ...                                                 # this asyncio task only)

| option | default | meaning |
|---|---|---|
| ``deterministic`` | True | the backward gives the same bits on every run (no float atomics); ``False`` allows a faster float-atomic backward where one is registered |
| ``tensor_cores`` | True | CUDA: the tensor-core kernel families may be chosen; ``False`` keeps every call on the CUDA-core kernels |
| ``wgmma`` | True | CUDA, compute capability 9.0: the warpgroup (wgmma) tensor-core kernels; ``False`` uses the mma.sync ones |
| ``fp32_tensor_cores`` | True | CUDA: float32 inputs run on the tensor cores at fp32-class precision (bf16 x 3 splits on wgmma, 3xTF32 on mma.sync); ``False`` keeps float32 on the SIMT fp32 kernels |
| ``cpu_tiles`` | None | CPU block kernels: ``(BM, BN)`` query rows x keys per tile; ``None`` takes the machine's rule (``tiga_numba/cpu/tiles.py``: from the L2 cache size). Results agree within rounding whatever the tiles; tile pruning keeps its own fixed tiles |
| ``cpu_products`` | "auto" | CPU float32 block kernels: how their tiles are multiplied: ``"own"`` (``tiga_numba/cpu/microgemm.py``'s register-blocked kernel), ``"blas"``, or ``"auto"``: the faster of the two on this machine, timed once and cached on disk. Results agree within rounding either way |
| ``poison_outputs`` | False | debugging, CUDA-core kernels: the outputs (and the backward's per-row Delta) are filled with NaN before the kernels run, so an element that no kernel writes shows up as NaN (one fill per array) |

Environment variables only set the defaults, and they are read here, once per process:
``TIGA_NUMBA_DETERMINISTIC``, ``TIGA_NUMBA_TENSOR_CORES``, ``TIGA_NUMBA_WGMMA``,
``TIGA_NUMBA_FP32_TENSOR_CORES`` (``0`` / ``false`` / ``no`` / ``off`` turn the option off,
``1`` / ``true`` / ``yes`` / ``on`` on, any case), ``TIGA_NUMBA_CPU_TILES``
(``256x256``), ``TIGA_NUMBA_CPU_PRODUCTS`` (``own``, ``blas`` or ``auto``: ``cpu_products``),
``TIGA_NUMBA_POISON_OUTPUTS`` (on / off as above). A value that is none of these is ignored
with a RuntimeWarning (the default holds): importing the package never fails on a setting.
The plan records the options it was made with, and ``explain()`` prints them.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from dataclasses import dataclass, fields, replace

__all__ = ["Options", "options", "current", "resolve"]


@dataclass(frozen=True)
class Options:
    deterministic: bool = True
    tensor_cores: bool = True
    wgmma: bool = True
    fp32_tensor_cores: bool = True
    cpu_tiles: "tuple | None" = None
    cpu_products: str = "auto"
    poison_outputs: bool = False

    def describe(self):
        """The options as one line, `name=value, ...` (what explain() prints)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_flag(name, default=True):
    """An on/off default from the environment: 1 / true / yes / on or 0 / false / no / off (any
    case); anything else is ignored with a warning (the default holds), never guessed."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    warnings.warn(f"{name}={value!r} is not one of {_TRUE + _FALSE}; ignored (default {default})",
                  RuntimeWarning, stacklevel=2)
    return default


def _env_tiles(name):
    """CPU tiles from the environment (BMxBN, e.g. 256x256); a malformed value is ignored with a
    warning (the machine's rule holds): import must not fail on a setting."""
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return _check_tiles(tuple(int(x) for x in value.lower().split("x")))
    except (TypeError, ValueError) as exc:
        warnings.warn(f"{name}={value!r} ignored: expected BMxBN, e.g. 256x256 ({exc})",
                      RuntimeWarning, stacklevel=2)
        return None


def _check_tiles(value):
    if value is None:
        return None
    if (not isinstance(value, tuple) or len(value) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)):
        raise TypeError(f"option cpu_tiles must be None or a pair of ints (BM, BN), got {value!r}")
    if not all(8 <= x <= 1024 for x in value):
        raise ValueError(f"option cpu_tiles: BM and BN must lie in [8, 1024], got {value!r}")
    return value


_PRODUCTS = ("auto", "own", "blas")


def _check_products(value, name="option cpu_products"):
    if value not in _PRODUCTS:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(repr(x) for x in _PRODUCTS)}")
    return value


def _env_products(name):
    value = os.environ.get(name, "").strip().lower() or "auto"
    try:
        return _check_products(value, name)
    except ValueError as exc:
        warnings.warn(f"{exc}; ignored ('auto' holds)", RuntimeWarning, stacklevel=2)
        return "auto"


_DEFAULTS = Options(
    deterministic=_env_flag("TIGA_NUMBA_DETERMINISTIC"),
    tensor_cores=_env_flag("TIGA_NUMBA_TENSOR_CORES"),
    wgmma=_env_flag("TIGA_NUMBA_WGMMA"),
    fp32_tensor_cores=_env_flag("TIGA_NUMBA_FP32_TENSOR_CORES"),
    cpu_tiles=_env_tiles("TIGA_NUMBA_CPU_TILES"),
    cpu_products=_env_products("TIGA_NUMBA_CPU_PRODUCTS"),
    poison_outputs=_env_flag("TIGA_NUMBA_POISON_OUTPUTS", default=False),
)
_CURRENT = contextvars.ContextVar("tiga_numba_options", default=_DEFAULTS)
_NAMES = frozenset(f.name for f in fields(Options))


def _checked(changes):
    for name, value in changes.items():
        if name not in _NAMES:
            raise TypeError(f"unknown option {name!r}; options are {sorted(_NAMES)}")
        if name == "cpu_tiles":
            changes[name] = _check_tiles(tuple(value) if isinstance(value, list) else value)
        elif name == "cpu_products":
            changes[name] = _check_products(value)
        elif not isinstance(value, bool):
            raise TypeError(f"option {name} must be True or False, got {value!r}")
    return changes


def current():
    """The options in force in this context (thread / asyncio task)."""
    return _CURRENT.get()


def resolve(**overrides):
    """current() with the non-None keyword overrides of one call applied."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    base = _CURRENT.get()
    return replace(base, **_checked(changes)) if changes else base


def options(**changes):
    """Context manager: the given options hold for the calls made inside the block. A name or
    value that is not an option's raises here, at the call (TypeError / ValueError naming the
    option), not only when the block is entered."""
    return _block(_checked(changes))


@contextlib.contextmanager
def _block(checked):
    """the options block of checked `changes`, applied to the options in force at its entry."""
    token = _CURRENT.set(replace(_CURRENT.get(), **checked))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
