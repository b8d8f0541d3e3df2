"""Drive one decode shape through this package's kernel and torch's cuDNN SDPA, a few calls
each, for a profiler (Nsight Compute) to compare the two kernels:

    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        --section MemoryWorkloadAnalysis --section LaunchStats python benchmarks/gpu/decode_ncu.py
"""
import cupy
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tiga_numba as tg

B, L, Hq, Hkv, D = 1, 131072, 32, 8, 128
torch.manual_seed(0)
q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16)
k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16)
v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16)
qt = cupy.from_dlpack(q[:, :, 0, :])
kt = cupy.from_dlpack(k.permute(0, 2, 1, 3).reshape(B * L, Hkv, D).contiguous())
vt = cupy.from_dlpack(v.permute(0, 2, 1, 3).reshape(B * L, Hkv, D).contiguous())
g = tg.Graph.dense(L, 1)
for _ in range(2):
    tg.attention(qt, kt, vt, g)
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
print(tg.functional.last_plan().run_info["kernel"], np.__version__)
