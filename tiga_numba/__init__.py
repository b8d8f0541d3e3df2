"""tiga-numba: attention over relations (dense, causal, varlen, graphs) for numpy and cupy.

numpy arrays run on numba parallel CPU kernels; cupy arrays on numba.cuda kernels (loaded on
the first GPU call: importing this package never touches CUDA).

Public names:

- `attention`, `attention_backward`, `AttentionStats`, `explain`: the functional API;
- `attention_merge`: the exact merge of results over disjoint edge subsets of the same rows;
- `Graph`: the relations (dense, triangular, band, cu_seqlens, cat, CSR, COO, edge_index,
  scipy, radius, knn);
- `MessagePassing`, `online_softmax`, `OnlineSoftmaxReducer`: programs whose `edge()` is
  traced and lowered onto the same kernels (loaded on first use);
- `nn`: score networks for `edge()` (`Linear`, `LeakyReLU`, `ReLU`, `Tanh`, `Sequential`,
  `trace`);
- `reference`: float64 numpy oracles of the same operations.

See README.md and docs/design.md.
"""
import importlib as _importlib
import sys as _sys


def _shield_from_numba_cuda_redirector():
    # numba-cuda's import redirector (a .pth-installed meta-path finder) matches any module
    # name *containing* "numba.cuda" and recurses forever on "tiga_numba.cuda". Narrow it to
    # the real numba.cuda names; a no-op where numba-cuda is not installed.
    for finder in _sys.meta_path:
        if type(finder).__name__ == "NumbaCudaFinder" and not getattr(finder, "_tiga_shielded", False):
            original = finder.find_spec

            def find_spec(name, path=None, target=None, _original=original):
                if name != "numba.cuda" and not name.startswith("numba.cuda."):
                    return None
                return _original(name, path, target)

            finder.find_spec = find_spec
            finder._tiga_shielded = True


_shield_from_numba_cuda_redirector()

from .graph import Graph  # noqa: E402
from .functional import AttentionStats, attention, attention_backward, explain, make_plan  # noqa: E402
from .merge import attention_merge  # noqa: E402
from .ordering import locality_order  # noqa: E402
from .score_mod import leaky_relu  # noqa: E402
from .run_options import Options, options  # noqa: E402
from . import reference  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Graph", "attention", "attention_backward", "attention_merge", "AttentionStats", "locality_order",
           "make_plan", "options", "Options", "explain", "reference", "leaky_relu",
           "MessagePassing", "online_softmax", "OnlineSoftmaxReducer", "nn"]

_LAZY = {"MessagePassing": "program", "online_softmax": "program",
         "OnlineSoftmaxReducer": "program", "nn": None}


def __getattr__(name):
    # The front end and tg.nn load on first use (importlib, not `from . import`, which would
    # re-enter this hook through hasattr()).
    if name not in _LAZY:
        raise AttributeError(f"module 'tiga_numba' has no attribute {name!r}")
    module = _importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    return module if _LAZY[name] is None else getattr(module, name)
