"""Does the H200's wgmma accumulation (bf16 operands, fp32 accumulator) lose accuracy when the
running sum is fed back into the chain across many blocks? float32 on wgmma (bf16 x 3 splits) with
and without per-block partials (generator.SPLIT_PARTIALS), forward and backward, N = 4096 / 16384,
relative L2 error vs float64 (2 heads). Compiles its kernels in-process (no cubin cache needed).

  PYTHONPATH=. python benchmarks/tuning/probe_accumulation.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_tc
import bench_tc as B  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tiga_numba.cuda.tc.generator import wgmma as GW  # noqa: E402  (the module that reads SPLIT_PARTIALS)
from tiga_numba.kernel_cache import KERNELS  # noqa: E402

B.engine(True)
for partials in (True, False):
    GW.SPLIT_PARTIALS = partials
    KERNELS.clear()   # kernels are cached per Variant: the other text needs its own compile
    for N in (4096, 16384):
        D = 64
        g = torch.Generator(device="cuda").manual_seed(N + 3)
        q, k, v, do = (torch.randn(N, B.H, D, device="cuda", dtype=torch.float32, generator=g) for _ in range(4))
        ours = B.Ours(q, k, v, np.array([0, N]), False, "float32")
        ours.fwd_bwd(do)
        ref = B.f64_reference(q, k, v, do, False, [0, 1])
        errs = [B.rel64(x[:, [0, 1]], r) for x, r in zip((ours.out, ours.dq, ours.dk, ours.dv), ref)]
        print(f"partials={partials} N={N} D={D}: rel L2 vs float64 out {errs[0]:.2e} dq {errs[1]:.2e} "
              f"dk {errs[2]:.2e} dv {errs[3]:.2e}", flush=True)
