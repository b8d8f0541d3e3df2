"""Drive the causal forward plain, with soft-cap and with ALiBi, and the sliding-window forward,
once each after a warm-up, for Nsight Compute to compare the kernels (fp16, N = 16384, H = 16,
D = 128; the inputs of bench_score_mods_gpu.py):

    ncu --kernel-name regex:^kernel --launch-skip 4 --section SpeedOfLight --section WarpStateStats \\
        --section InstructionStats --section Occupancy python benchmarks/gpu/mods_ncu.py

The launches after the warm-up are in the order printed; each profiled kernel's (mangled) name
carries its modifier digest (plain: none). --backward: each call runs its backward too (the
Delta pre-pass, dQ and dK/dV kernels follow its forward: launch-skip 16 after the warm-up).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import cupy  # noqa: E402
import tiga_numba as tg  # noqa: E402

N, H, D, W = 16384, 16, 128, 1024
rng = cupy.random.default_rng(0)
q, k, v = (rng.standard_normal((N, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
slopes = cupy.asarray([2.0 ** (-8 * (h + 1) / H) for h in range(H)], cupy.float32)
tri = tg.Graph.triangular(N)
calls = [("causal", tri, {}), ("softcap", tri, dict(softcap=30.0)), ("alibi", tri, dict(alibi_slopes=slopes)),
         ("window", tg.Graph.band(N, left=W - 1, right=0), {})]
backward = "--backward" in sys.argv


def run(g, kw):
    out, stats = tg.attention(q, k, v, g, return_stats=True, **kw)
    if backward:
        tg.attention_backward(q, q, k, v, out, stats, g, **kw)


for name, g, kw in calls:   # warm-up: compiles / loads every kernel (the first 4 or 16 launches)
    run(g, kw)
cupy.cuda.Device().synchronize()
for name, g, kw in calls:
    run(g, kw)
    cupy.cuda.Device().synchronize()
    kernel = [line for line in tg.explain().splitlines() if line.startswith("kernel:")]
    print(name, kernel[0] if kernel else "", flush=True)
