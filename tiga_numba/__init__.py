"""tiga-numba: attention over relations (dense, causal, varlen, graphs) for numpy and cupy.

numpy arrays run on numba parallel CPU kernels; cupy arrays on numba.cuda kernels (loaded on
the first GPU call: importing this package never touches CUDA). See DESIGN.md / README.md.
"""
from .graph import Graph
from .functional import AttentionStats, attention, attention_backward, explain
from . import reference

__version__ = "0.1.0"

__all__ = ["Graph", "attention", "attention_backward", "AttentionStats", "explain", "reference",
           "MessagePassing", "online_softmax", "nn"]


def __getattr__(name):
    # The front end and tg.nn are written in their own modules; import them on first use so a
    # partially installed tree still gives the functional API.
    if name in ("MessagePassing", "online_softmax"):
        from . import program
        return getattr(program, name)
    if name == "nn":
        from . import nn
        return nn
    raise AttributeError(f"module 'tiga_numba' has no attribute {name!r}")
