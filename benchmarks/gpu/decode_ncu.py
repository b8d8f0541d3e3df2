"""Drive one decode shape through this package's kernel and torch's cuDNN SDPA, a few calls
each, for a profiler (Nsight Compute) to compare the two kernels:

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        --section MemoryWorkloadAnalysis --section LaunchStats python benchmarks/gpu/decode_ncu.py
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from bench_split_gpu import decode_inputs  # noqa: E402  (benchmarks/bench_split_gpu.py)

q, k, v, qt, kt, vt, g = decode_inputs(1, 131072, 32, 8, 128)
for _ in range(2):
    tg.attention(qt, kt, vt, g)
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
print(tg.functional.last_plan().run_info["kernel"])
