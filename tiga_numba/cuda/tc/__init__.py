"""Tensor-core (mma.sync) attention kernels for float16 / bfloat16, and float32 as 3xTF32
(fp32-class accuracy), on NVIDIA GPUs (sm_80+,
tuned on the H200). The CUDA backend asks `supports()` and routes here; see api.py for the
scope and docs/tensor_cores.md for the design. Importing this package needs only numpy:
numba.cuda is imported when a kernel is first compiled."""
from .api import backward, forward, supports
from .tuning import TUNING, TUNING_F32

__all__ = ["supports", "forward", "backward", "TUNING", "TUNING_F32"]
