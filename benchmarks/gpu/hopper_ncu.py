"""Drive the D = 128 forward once through this package's wgmma kernel and once through torch's cuDNN
SDPA (fp16, N = 16384, H = 16, not causal; the inputs of bench_hopper.py), after a warm-up, with
the profiler range around the two measured calls only, for Nsight Compute to compare the kernels:

    ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats python benchmarks/gpu/hopper_ncu.py [--pingpong | --backward]

--pingpong: also the same forward with Variant.pingpong flipped (as shipped at D = 128: the
CTA-barrier pipeline), between ours and cuDNN's.
--backward: the backward instead (ours: the Delta pass, the dQ kernel and the dK/dV kernel as
shipped; cuDNN: its backward kernels), each after the same forward outside the profiled range.
"""
import dataclasses
import os
import sys

import numpy as np
import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_hopper as BH  # noqa: E402  (benchmarks/bench_hopper.py: the inputs' layout, bench_tc's Ours)
from tiga_numba.cuda.tc import tuning  # noqa: E402

N, H, D = 16384, BH.H, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(N, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
ours = BH.B.Ours(q, k, v, np.array([0, N]), False, "float16", vf=tuning.variant("fwd", D, D, "float16", wgmma=True))


def cudnn():
    return BH.torch_fwd(SDPBackend.CUDNN_ATTENTION, q, k, v, False)


if "--backward" in sys.argv:
    do = torch.randn(N, H, D, device="cuda", dtype=torch.float16, generator=g)
    qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref = BH.torch_fwd(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, False)
    ours.fwd()
    for _ in range(2):
        ours.bwd(do)
        torch.autograd.grad(ref, (qt, kt, vt), BH.heads_first(do), retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours.bwd(do)
    torch.autograd.grad(ref, (qt, kt, vt), BH.heads_first(do), retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled: our backward (Delta, dQ, dK/dV kernels), then cuDNN's")
else:
    runs = [ours]
    if "--pingpong" in sys.argv:
        runs.append(BH.B.Ours(q, k, v, np.array([0, N]), False, "float16", vf=dataclasses.replace(ours.vf, pingpong=not ours.vf.pingpong)))
    for _ in range(2):
        for o in runs:
            o.fwd()
        cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for o in runs:
        o.fwd()
    cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(o.vf.name() for o in runs), "then cuDNN")
