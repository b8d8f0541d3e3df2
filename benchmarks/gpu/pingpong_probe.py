"""The ping-pong forward's loop knobs on the H200 (forward.PINGPONG_COPIES, PINGPONG_SLEEP_NS)
beside the CTA-barrier pipeline it replaces and torch's cuDNN SDPA: fp16 D = 128, H = 16,
GPU ms per call (CUDA events over --reps calls after warm-up), same bits checked per row.

    PYTHONPATH=. python benchmarks/gpu/pingpong_probe.py [--sizes 4096,16384] [--reps 20]
    PYTHONPATH=. python benchmarks/gpu/pingpong_probe.py --build   # the cubins, on any machine
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tiga_numba.cuda.tc import build, tuning  # noqa: E402
from tiga_numba.cuda.tc.generator import forward as GF  # noqa: E402

KNOBS = [("turn", None), ("after_s", None), ("turn", 1000000), ("after_s", 1000000)]


def variants(dt="float16", D=128):
    """[(label, knobs or None, Variant)]: the shipped CTA-barrier pipeline, then each knob setting."""
    shipped = tuning.variant("fwd", D, D, dt, wgmma=True)
    out = [("barrier", None, shipped)]
    for copies, ns in KNOBS:
        out.append((f"pp {copies} sleep={ns}", (copies, ns), dataclasses.replace(shipped, pingpong=True)))
    return out


def use(knobs):
    """set the generator knobs and drop compiled kernels (their cache is keyed by the Variant)."""
    GF.PINGPONG_COPIES, GF.PINGPONG_SLEEP_NS = knobs or ("turn", None)
    build.KERNELS.clear()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,16384")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--build", action="store_true")
    a = p.parse_args()
    if a.build:
        for label, knobs, vr in variants():
            use(knobs)
            build.kernel(vr)[0].cubin("sm_90a")
            print("built", label, flush=True)
        return
    import numpy as np
    import torch
    import bench_hopper as BH
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"fp16, D=128, H={BH.H}; GPU ms per call over {a.reps} calls (TF/s)")
    for N in (int(x) for x in a.sizes.split(",")):
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(N + causal)
            q, k, v = (torch.randn(N, BH.H, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
            fl = 4 * N * N * BH.H * 128 / (2 if causal else 1)
            ref = None
            cells = []
            for label, knobs, vr in variants():
                use(knobs)
                o = BH.B.Ours(q, k, v, np.array([0, N]), causal, "float16", vf=vr)
                o.fwd()
                torch.cuda.synchronize()
                same = True if ref is None else bool(torch.equal(o.out, ref))
                ref = o.out.clone() if ref is None else ref
                ms = BH.gpu_ms(o.fwd, a.reps)
                cells.append(f"{label}: {ms:.3f} ({fl / ms / 1e9:.0f}){'' if same else ' BITS DIFFER'}")
            ms = BH.gpu_ms(lambda: BH.torch_fwd(BH.SDPBackend.CUDNN_ATTENTION, q, k, v, causal), a.reps)
            cells.append(f"cuDNN: {ms:.3f} ({fl / ms / 1e9:.0f})")
            print(f"N={N} causal={int(causal)} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
