"""Head dim 256 backward through the public API: tg.attention_backward on the wgmma tensor cores
(16-bit, the dK/dV kernel in two column parts) against the same call with tg.options(tensor_cores=False)
(the CUDA-core kernels that served D = 256 before), float16, H = 16, dense and causal. GPU ms per
call (CUDA events around back-to-back calls, host work included as far as it overlaps) and the
relative L2 difference of the two results.

    python benchmarks/gpu/head256_backward.py [--reps 5] [--sizes 4096,8192]
"""
import argparse
import os
import sys

import cupy
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from run import gpu_seconds  # noqa: E402  (benchmarks/run.py: CUDA events around back-to-back calls)

H, D = 16, 256


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default="4096,8192")
    a = p.parse_args()
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, H={H} D={D} float16, backward ms per "
          f"call (events, {a.reps} back-to-back calls)")
    print("| N | causal | tensor cores | CUDA cores | speed-up | rel diff | families |")
    print("|---|---|---|---|---|---|---|")
    for N in (int(x) for x in a.sizes.split(",")):
        for causal in (False, True):
            rng = np.random.default_rng(N + causal)
            q, k, v, do = (cupy.asarray(rng.standard_normal((N, H, D)).astype(np.float16)) for _ in range(4))
            g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N, N)
            res, fams = {}, []
            for on in (True, False):
                with tg.options(tensor_cores=on):
                    out, st = tg.attention(q, k, v, g, return_stats=True)
                    grads = tg.attention_backward(do, q, k, v, out, st, g)
                    fams.append(tg.functional.last_plan().family)
                    ms = gpu_seconds(lambda: tg.attention_backward(do, q, k, v, out, st, g), a.reps) * 1e3
                    res[on] = (ms, [x.astype(cupy.float32) for x in grads])
            diff = max(float(cupy.linalg.norm(x - y) / cupy.linalg.norm(y)) for x, y in zip(res[True][1], res[False][1]))
            print(f"| {N} | {int(causal)} | {res[True][0]:.3f} ms | {res[False][0]:.3f} ms | "
                  f"{res[False][0] / res[True][0]:.1f}x | {diff:.1e} | {' / '.join(fams)} |", flush=True)


if __name__ == "__main__":
    main()
