"""Dense attention on a Hopper GPU (H100 / H200) against every torch SDPA backend, one run, same inputs.

    PYTHONPATH=. python benchmarks/bench_hopper.py [--out DIR] [--reps 10] [--dims 64,128,256]
        [--sizes 4096,16384] [--dtypes float16,bfloat16] [--curve-sizes 1024,2048,4096,8192,16384] [--twin overlap|pingpong]

1. table: per (dtype, D, N, causal), H = 16, node-major (N, H, D) data (torch reads the same memory
   as (1, H, N, D) views): this package's forward as shipped and its twin with the other key loop
   (overlap flipped: where the shipped forward is the pipelined one, whose P V chain of one key
   block runs during the softmax of the next, Variant.fwd_pipelined, the twin waits for every chain
   at once; at D = 64, shipped serial, the twin is the pipelined loop), torch's flash, cuDNN and
   efficient backends;
   then forward+backward (every head dim whose backward runs on the tensor cores). TF/s = 4 N^2 H D
   (/2 causal) per forward, 3.5x that per forward+backward; ratio = fastest torch backend / ours.
   The pipelined and the serial forward must give the same bits (checked per cell), and ours is
   compared with cuDNN's output (relative L2).
2. curve: TF/s against N at D = 128, float16, not causal, for ours, cuDNN and flash (a CSV and, when
   matplotlib is present, a PNG in --out).
3. shapes: the pipelined forward at other tile shapes (--shapes D:NWxBN, float16), beside the shipped one.
Timing: CUDA events around --reps back-to-back calls after warm-up (GPU time per call); the
tensor-core kernels are launched through their raw-pointer entry (benchmarks/bench_tc.py's Ours),
so host overhead is not in our times (nor, with CUDA events on a busy stream, in torch's).
"""
import argparse
import dataclasses
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tc as B  # noqa: E402  (Ours: raw-pointer launches; the import path)
from tiga_numba.cuda.tc import tuning  # noqa: E402

H = 16
BACKENDS = (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))


def gpu_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def heads_first(x):
    return x.transpose(0, 1)[None]


def torch_fwd(be, q, k, v, causal):
    with sdpa_kernel(be):
        return F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=causal)


#: which key loop the twin column flips: "overlap" (pipelined vs serial) or "pingpong" (two
#: warpgroups taking turns through the mbarrier ring vs the CTA-barrier pipeline; where the
#: shipped shape cannot take it, the overlap flip)
TWIN = ["overlap"]


def twin_of(shipped, mode):
    """the shipped forward with `mode` flipped; pingpong where it changes the loop (two
    warpgroups, pipelined: Variant.pingpong_loop), else overlap."""
    if mode == "pingpong":
        twin = dataclasses.replace(shipped, pingpong=not shipped.pingpong)
        if twin.pingpong_loop != shipped.pingpong_loop:
            return twin
    return dataclasses.replace(shipped, overlap=not shipped.overlap)


def cell(dtn, D, N, causal, reps, with_bwd=True):
    """one row: {name: (fwd ms, fwd+bwd ms or None)}, flops, the checks."""
    tdt = getattr(torch, dtn)
    g = torch.Generator(device="cuda").manual_seed(N + D + causal)
    q, k, v, do = (torch.randn(N, H, D, device="cuda", dtype=tdt, generator=g) for _ in range(4))
    shipped = tuning.variant("fwd", D, D, dtn, wgmma=True)
    twin = twin_of(shipped, TWIN[0])
    cu = np.array([0, N])
    ours = {"ours": B.Ours(q, k, v, cu, causal, dtn, vf=shipped), "twin": B.Ours(q, k, v, cu, causal, dtn, vf=twin)}
    res, outs = {}, {}
    for name, o in ours.items():
        o.fwd()
        torch.cuda.synchronize()
        outs[name] = o.out.clone()
        res[name] = [gpu_ms(o.fwd, reps), None]
    same_bits = torch.equal(outs["ours"], outs["twin"])
    ref = None
    for name, be in BACKENDS:
        try:
            res[name] = [gpu_ms(lambda: torch_fwd(be, q, k, v, causal), reps), None]
            if name == "cudnn":
                ref = torch_fwd(be, q, k, v, causal)[0].transpose(0, 1)
        except Exception as exc:  # noqa: BLE001  (a backend that does not take the shape)
            res[name] = [None, None]
            print(f"  {name} D={D} N={N}: {type(exc).__name__}", flush=True)
    err = B.rel(outs["ours"], ref) if ref is not None else float("nan")
    if with_bwd:
        o = ours["ours"]
        res["ours"][1] = gpu_ms(lambda: o.fwd_bwd(do), reps)
        qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        for name, be in BACKENDS:
            if res[name][0] is None:
                continue

            def fb():
                qt.grad = kt.grad = vt.grad = None
                torch_fwd(be, qt, kt, vt, causal).backward(heads_first(do))
            try:
                res[name][1] = gpu_ms(fb, reps)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name} backward D={D} N={N}: {type(exc).__name__}", flush=True)
    flops = 4 * N * N * H * D / (2 if causal else 1)
    return res, flops, same_bits, err


def ms_tf(ms, flops):
    return f"{ms:.3f} ({flops / ms / 1e9:.0f})" if ms else "n/a"


def table(a):
    print(f"\n## 1. forward and forward+backward, H={H}: ms per call (TF/s)\n")
    print("| dtype | D | N | causal | ours fwd | twin fwd | flash | cuDNN | efficient | best torch / ours "
          "| cuDNN / ours | twin / ours | same bits | rel err vs cuDNN | ours f+b | flash f+b | cuDNN f+b "
          "| efficient f+b | best torch / ours f+b | cuDNN / ours f+b |")
    print("|" + "---|" * 20)
    rows = []
    for dtn in a.dtypes.split(","):
        for D in (int(x) for x in a.dims.split(",")):
            for N in (int(x) for x in a.sizes.split(",")):
                for causal in (False, True):
                    r, fl, same, err = cell(dtn, D, N, causal, a.reps, with_bwd=D in tuning.head_dims(dtn, True, "backward"))
                    best = min((r[n][0] for n, _ in BACKENDS if r[n][0]), default=float("nan"))
                    bestb = min((r[n][1] for n, _ in BACKENDS if r[n][1]), default=float("nan"))
                    fb = r["ours"][1]
                    q = lambda x, y: f"{x / y:.2f}x" if x and y else "n/a"  # noqa: E731
                    print(f"| {dtn} | {D} | {N} | {int(causal)} | " +
                          " | ".join(ms_tf(r[n][0], fl) for n in ("ours", "twin", "flash", "cudnn", "efficient")) +
                          f" | {q(best, r['ours'][0])} | {q(r['cudnn'][0], r['ours'][0])} | "
                          f"{q(r['twin'][0], r['ours'][0])} | {same} | {err:.1e} | " +
                          " | ".join(ms_tf(r[n][1], 3.5 * fl) for n in ("ours", "flash", "cudnn", "efficient")) +
                          f" | {q(bestb, fb)} | {q(r['cudnn'][1], fb)} |", flush=True)
                    rows.append((dtn, D, N, causal, r))
    return rows


def curve(a):
    sizes = [int(x) for x in a.curve_sizes.split(",")]
    print("\n## 2. TF/s against N: D=128, float16, not causal, forward\n")
    print("| N | ours | twin | flash | cuDNN | efficient |")
    print("|---|---|---|---|---|---|")
    lines = ["N,ours,twin,flash,cudnn,efficient"]
    for N in sizes:
        r, fl, _, _ = cell("float16", 128, N, False, a.reps, with_bwd=False)
        tfs = [fl / r[n][0] / 1e9 if r[n][0] else float("nan") for n in ("ours", "twin", "flash", "cudnn", "efficient")]
        print(f"| {N} | " + " | ".join(f"{x:.0f}" for x in tfs) + " |", flush=True)
        lines.append(f"{N}," + ",".join(f"{x:.1f}" for x in tfs))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "hopper_fwd_tfs.csv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: CSV only)")
        return
    data = np.array([[float(x) for x in ln.split(",")] for ln in lines[1:]])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(("ours", "twin (serial)", "flash", "cuDNN", "efficient"), start=1):
        ax.plot(data[:, 0], data[:, i], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (keys = queries)")
    ax.set_ylabel("TF/s")
    ax.set_title(f"{torch.cuda.get_device_name()}: forward, fp16, D=128, H={H}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "hopper_fwd_tfs.png"), dpi=120)


def shapes(a):
    from tiga_numba.cuda.tc import generator as G
    # D:NWxBN, or D:NWxBNpp for the ping-pong loop (Variant.pingpong), D:NWxBNpp2 with two V slots
    import re
    specs = []
    for d, nb in (x.split(":") for x in a.shapes.split(",")):
        nw, bn, pp, slots = re.fullmatch(r"(\d+)x(\d+)(pp(\d)?)?", nb).groups()
        specs.append((int(d), int(nw), int(bn), int(slots or 3) if pp else 0))
    print("\n## 3. forward tile shapes, float16 (pipelined): ms per call (TF/s)\n")
    for D in sorted({d for d, _, _, _ in specs}):
        mine = [(nw, bn, pp) for d, nw, bn, pp in specs if d == D]
        print("\n| D | N | causal | shipped | " + " | ".join(f"NW={nw} BN={bn}{f' ping-pong {pp} V slots' if pp else ''}"
                                                          for nw, bn, pp in mine) + " |")
        print("|---|---|---|---|" + "---|" * len(mine))
        for N in (int(x) for x in a.sizes.split(",")):
            for causal in (False, True):
                g = torch.Generator(device="cuda").manual_seed(N + D)
                q, k, v = (torch.randn(N, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
                flops = 4 * N * N * H * D / (2 if causal else 1)
                cols, ref = [], None
                for vf in [tuning.variant("fwd", D, D, "float16", wgmma=True)] + [
                        G.Variant("fwd", D, D, dtype="float16", NW=nw, MT=1, BN=bn, a_smem=True, wgmma=True,
                                  pingpong=bool(pp), ring_v_slots=pp).check()
                        for nw, bn, pp in mine]:
                    o = B.Ours(q, k, v, np.array([0, N]), causal, "float16", vf=vf)
                    o.fwd()
                    torch.cuda.synchronize()
                    ref = o.out.clone() if ref is None else ref
                    err = B.rel(o.out, ref)
                    cols.append(ms_tf(gpu_ms(o.fwd, a.reps), flops) + (f" err {err:.0e}" if err > 1e-2 else ""))
                print(f"| {D} | {N} | {int(causal)} | " + " | ".join(cols) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dims", default="64,128,256")
    p.add_argument("--sizes", default="4096,16384")
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--curve-sizes", default="1024,2048,4096,8192,16384")
    p.add_argument("--shapes", default="", help="comma list of D:NWxBN[pp[2]], e.g. 128:4x128,128:8x128pp2 (pp: ping-pong, pp2: with two V slots)")
    p.add_argument("--twin", default="overlap", choices=("overlap", "pingpong"),
                   help="what the twin column flips (see TWIN)")
    a = p.parse_args()
    TWIN[0] = a.twin
    n = 8192
    x = torch.randn(n, n, device="cuda", dtype=torch.float16)
    mm = 2 * n ** 3 / gpu_ms(lambda: x @ x, 10) / 1e9
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"fp16 matmul (cuBLAS, 8192^3) {mm:.0f} TF/s; H={H}, GPU ms per call, CUDA events over {a.reps} calls")
    table(a)
    if a.shapes:
        shapes(a)
    if a.curve_sizes:
        curve(a)


if __name__ == "__main__":
    main()
