"""Head dim 256 forward on the H200: this package's wgmma forward (tuning.TUNING_WGMMA[("fwd", 256)],
and the shapes given with --shapes) against torch SDPA's flash, cuDNN and efficient backends on the
same inputs, H = 16, N = 4096 / 16384, causal and not, float16 / bfloat16. CUDA events around
--reps back-to-back calls (GPU time per call) and the max difference to cuDNN's output.

    python benchmarks/gpu/head256_probe.py [--reps 10] [--shapes 8x64,4x64] [--dtypes float16,bfloat16]
"""
import argparse
import os
import sys

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from tiga_numba.cuda.tc import tuning  # noqa: E402
from run import gpu_seconds  # noqa: E402  (benchmarks/run.py: CUDA events around back-to-back calls)

H, D = 16, 256


def gpu_ms(f, reps):
    return gpu_seconds(f, reps) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--shapes", default="8x64,4x64", help="NWxBN forward shapes of ours")
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--sizes", default="4096,16384")
    a = p.parse_args()
    shipped = dict(tuning.TUNING_WGMMA[("fwd", D)])
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, H={H} D={D}, GPU ms per call (events, "
          f"{a.reps} back-to-back calls); TF/s = 4 N^2 H D (/2 causal) / time; shipped shape {shipped}")
    print("| dtype | N | causal | ours " + " | ".join(f"NW{s}" for s in a.shapes.split(",")) +
          " | flash | cuDNN | efficient | best torch / ours (shipped) | max diff vs cuDNN |")
    for dtn in a.dtypes.split(","):
        tdt = getattr(torch, dtn)
        for N in (int(x) for x in a.sizes.split(",")):
            for causal in (False, True):
                torch.manual_seed(0)
                qt, kt, vt = (torch.randn(N, H, D, device="cuda", dtype=tdt) for _ in range(3))
                q, k, v = (cupy.from_dlpack(x) for x in (qt, kt, vt))
                g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N, N)
                flops = 4 * N * N * H * D / (2 if causal else 1)
                ours, out = [], None
                for s in a.shapes.split(","):
                    nw, bn = (int(x) for x in s.split("x"))
                    tuning.TUNING_WGMMA[("fwd", D)] = dict(shipped, NW=nw, BN=bn)
                    ms = gpu_ms(lambda: tg.attention(q, k, v, g), a.reps)
                    ours.append(ms)
                    if out is None:
                        out = tg.attention(q, k, v, g)
                        fam = tg.functional.last_plan().family
                tuning.TUNING_WGMMA[("fwd", D)] = shipped
                hq, hk, hv = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (qt, kt, vt))
                them, ref = {}, None
                for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                 ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                    try:
                        with sdpa_kernel(be):
                            them[name] = gpu_ms(lambda: F.scaled_dot_product_attention(hq, hk, hv, is_causal=causal), a.reps)
                            if name == "cudnn":
                                ref = F.scaled_dot_product_attention(hq, hk, hv, is_causal=causal)
                    except Exception as exc:  # noqa: BLE001
                        them[name] = f"n/a ({type(exc).__name__})"
                diff = "n/a"
                if ref is not None:
                    mine = torch.from_dlpack(out).float().transpose(0, 1).unsqueeze(0)
                    diff = f"{(mine - ref.float()).abs().max().item():.1e}"
                best = min((x for x in them.values() if isinstance(x, float)), default=float("nan"))
                cell = lambda x: f"{x:.3f} ms ({flops / x / 1e9:.0f})" if isinstance(x, float) else x  # noqa: E731
                print(f"| {dtn} | {N} | {int(causal)} | {fam} " + " | ".join(cell(x) for x in ours) + " | " +
                      " | ".join(cell(them[n]) for n in ("flash", "cudnn", "efficient")) +
                      f" | {best / ours[0]:.2f}x | {diff} |", flush=True)


if __name__ == "__main__":
    main()
