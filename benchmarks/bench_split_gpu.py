"""GPU benchmark of work-balanced shapes: CSR graphs of skewed degree and KV-cache decode.

(a) CSR forward and forward+backward, 1M nodes / 16M edges, H=4, D=32, float32: uniform
    in-degree, power-law in-degree (same edge count), and one row holding 3/4 of the edges.
    Reported against the gather bound: bytes of K and V rows gathered (E * Hkv * D * 4 * 2)
    over the time, compared with the copy bandwidth measured in the same run.
(b) decode, float16, Hq=32, Hkv=8, D=128: one sequence of 131,072 keys and 16 sequences of
    8,192 keys (one query each), tiga_numba's split-key kernel against torch SDPA's flash,
    cuDNN and memory-efficient backends on the same inputs; K+V read bandwidth. Two times per
    side: one synchronised call (median; what a decode loop that waits for each token sees,
    host overhead included) and the GPU time per call when 20 calls run back to back (CUDA
    events; the kernels alone, host work hidden behind them). torch runs twice: on its own
    contiguous (B, H, L, D) arrays and on the very memory tiga_numba reads ((B, L, H, D),
    flash-attn's layout, viewed as (B, H, L, D)); for one sequence tiga_numba also runs on
    torch's head-major arrays (a strided view), so the layout's share of a gap shows.

    python benchmarks/bench_split_gpu.py [--csr] [--decode] [--reps N] [--out FILE]

Prints a table with the date, GPU and versions (and writes it to --out).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

# this copy's package first (benchmarks/ab_base.sh: an extracted older copy times its own)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from run import gpu_seconds  # noqa: E402  (benchmarks/run.py: CUDA events around back-to-back calls)


def _timeit(fn, sync, reps, warm=1):
    for _ in range(warm):
        fn()
    sync()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def _header(lines):
    import cupy
    import numba
    props = cupy.cuda.runtime.getDeviceProperties(0)
    lines.append(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    lines.append(f"gpu: {props['name'].decode()}  (SMs {props['multiProcessorCount']})")
    v = [f"python {platform.python_version()}", f"numpy {np.__version__}",
         f"numba {numba.__version__}", f"cupy {cupy.__version__}"]
    try:
        import torch
        v.append(f"torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()})")
    except Exception:  # noqa: BLE001
        pass
    lines.append("versions: " + ", ".join(v))
    lines.append("command: python " + " ".join(sys.argv))


def copy_bandwidth():
    import cupy
    a = cupy.empty(1 << 29, np.float32)  # 2 GiB
    b = cupy.empty_like(a)
    t = _timeit(lambda: b.__setitem__(Ellipsis, a), cupy.cuda.Device().synchronize, 5)
    return 2 * a.nbytes / t


def csr_graphs(n, e, rng):
    """name -> indptr of n rows with e edges (sources drawn uniformly)."""
    out = {}
    out["uniform"] = np.arange(0, e + 1, e // n, dtype=np.int64)[: n + 1]
    w = 1.0 / np.arange(1, n + 1) ** 0.6  # power law (Zipf-like in-degree)
    deg = np.floor(w / w.sum() * e).astype(np.int64)
    deg[: e - deg.sum()] += 1
    rng.shuffle(deg)
    out["power-law"] = np.concatenate([[0], np.cumsum(deg)])
    deg = np.full(n, (e // 4) // (n - 1), np.int64)
    deg[0] = 0
    deg[0] = e - deg.sum()
    out["hub-3/4"] = np.concatenate([[0], np.cumsum(deg)])
    return out


def bench_csr(lines, reps):
    import cupy
    import tiga_numba as tg
    from tiga_numba import functional
    n, e, H, D = 1 << 20, 1 << 24, 4, 32
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    lines.append(f"\n(a) CSR, {n} nodes, {e} edges, H={H}, D={D}, float32; copy bandwidth "
                 f"{bw / 1e12:.2f} TB/s (read + write of 2 GiB)")
    lines.append(f"{'graph':<10} {'max deg':>9} {'fwd ms':>9} {'fwd+bwd ms':>11} {'gather TB/s':>12} "
                 f"{'% of copy':>9} {'vs uniform fwd':>14} {'fwd+bwd':>8}  kernel")
    q = cupy.asarray(rng.standard_normal((n, H, D), dtype=np.float32))
    k = cupy.asarray(rng.standard_normal((n, H, D), dtype=np.float32))
    v = cupy.asarray(rng.standard_normal((n, H, D), dtype=np.float32))
    do = cupy.asarray(rng.standard_normal((n, H, D), dtype=np.float32))
    sync = cupy.cuda.Device().synchronize
    base = base_b = None
    for name, indptr in csr_graphs(n, e, rng).items():
        indices = cupy.asarray(rng.integers(0, n, e, dtype=np.int32))
        g = tg.Graph.from_csr(cupy.asarray(indptr), indices, num_src=n)
        # the first call of a graph compiles its kernels and builds the split tables and the
        # transposed relation (cached on the Graph): timed apart, then warm calls
        t0 = time.perf_counter()
        out, st = tg.attention(q, k, v, g, return_stats=True)
        tg.attention_backward(do, q, k, v, out, st, g)
        sync()
        first = time.perf_counter() - t0
        tf = _timeit(lambda: tg.attention(q, k, v, g), sync, reps, warm=1)
        kern = functional.last_plan().run_info["kernel"]

        def fb():
            out, st = tg.attention(q, k, v, g, return_stats=True)
            tg.attention_backward(do, q, k, v, out, st, g)
        tb = _timeit(fb, sync, reps, warm=1)
        gathered = e * H * D * 4 * 2
        base = base or tf
        base_b = base_b or tb
        lines.append(f"{name:<10} {int(np.diff(indptr).max()):>9} {tf * 1e3:>9.2f} {tb * 1e3:>11.2f} "
                     f"{gathered / tf / 1e12:>12.2f} {100 * gathered / tf / bw:>8.0f}% "
                     f"{tf / base:>13.2f}x {tb / base_b:>7.2f}x  {kern}; first fwd+bwd call {first * 1e3:.0f} ms")
        g = indices = None   # the graph's device arrays freed before the next one
        cupy.get_default_memory_pool().free_all_blocks()


def decode_inputs(B, L, Hq, Hkv, D):
    """A decode shape in both layouts, float16, seeded: torch's (B, Hq, 1, D) / (B, Hkv, L, D)
    contiguous q, k, v; tiga_numba's q (B, Hq, D) (a view of torch's) and token-major k, v
    (B * L, Hkv, D) (contiguous copies); the relation (one query row per sequence)."""
    import cupy
    import torch
    import tiga_numba as tg
    torch.manual_seed(0)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16)
    v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16)
    qt = cupy.from_dlpack(q[:, :, 0, :])
    kt = cupy.from_dlpack(k.permute(0, 2, 1, 3).reshape(B * L, Hkv, D).contiguous())
    vt = cupy.from_dlpack(v.permute(0, 2, 1, 3).reshape(B * L, Hkv, D).contiguous())
    g = tg.Graph.dense(L, 1) if B == 1 else \
        tg.Graph.cu_seqlens(np.arange(B + 1), cu_seqlens_k=np.arange(B + 1) * L, causal=True)
    return q, k, v, qt, kt, vt, g


def bench_decode(lines, reps):
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import tiga_numba as tg
    from tiga_numba import functional
    Hq, Hkv, D = 32, 8, 128
    lines.append(f"\n(b) decode, float16, Hq={Hq}, Hkv={Hkv}, D={D}, one query per sequence")
    lines.append("per synchronised call, then (in brackets) GPU time per call back to back, ms")
    lines.append(f"{'shape':<16} {'tiga ms':>15} {'TB/s':>11} {'flash':>15} {'cudnn':>15} {'efficient':>15} "
                 f"{'vs fastest':>13}  kernel / notes")
    sync = torch.cuda.synchronize
    for B, L in ((1, 131072), (16, 8192)):
        q, k, v, qt, kt, vt, g = decode_inputs(B, L, Hq, Hkv, D)

        def ours():
            tg.attention(qt, kt, vt, g)
        t_ours = _timeit(ours, lambda: cupy.cuda.Device().synchronize(), reps, warm=3)
        g_ours = gpu_seconds(ours, 20)
        kern = functional.last_plan().run_info["kernel"]
        ref = torch.from_dlpack(tg.attention(qt, kt, vt, g)).float()
        extra = ""
        if B == 1:  # ours on torch's head-major memory too (a strided view: no copy)
            kh, vh = (cupy.from_dlpack(x[0].permute(1, 0, 2)) for x in (k, v))
            extra = (f"; tiga on torch's head-major k/v (strided view) "
                     f"{gpu_seconds(lambda: tg.attention(qt, kh, vh, g), 20) * 1e3:.3f} ms GPU")
        # torch on its own contiguous (B, H, L, D) arrays, and on the very memory tiga reads
        # (token-major, (B, L, H, D) viewed as (B, H, L, D): flash-attn's native layout)
        kk, vv = (torch.from_dlpack(x).view(B, L, Hkv, D).transpose(1, 2) for x in (kt, vt))
        for layout, (tq_, tk_, tv_) in (("torch head-major", (q, k, v)),
                                        ("torch on tiga's k/v", (q, kk, vv))):
            res, gres = {}, {}
            notes = []
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                             ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                try:
                    with sdpa_kernel([be]):
                        def run():
                            return F.scaled_dot_product_attention(tq_, tk_, tv_, enable_gqa=True)
                        o = run()
                        err = (o[:, :, 0].float() - ref).abs().max().item()
                        res[name] = _timeit(run, sync, reps, warm=3)
                        gres[name] = gpu_seconds(run, 20)
                        notes.append(f"{name} max|diff| {err:.1e}")
                except Exception as exc:  # noqa: BLE001
                    res[name] = None
                    notes.append(f"{name}: {type(exc).__name__}")
            kv = 2 * B * L * Hkv * D * 2
            best = min([t for t in res.values() if t], default=None)
            gbest = min([t for t in gres.values() if t], default=None)

            def fmt(name):
                t, gt = res.get(name), gres.get(name)
                return f"{t * 1e3:.3f} ({gt * 1e3:.3f})" if t else "n/a"
            ratio = (f"{best / t_ours:.2f}x ({gbest / g_ours:.2f}x)" if best else "n/a")
            lines.append(f"{f'{B} x {L}':<16} {f'{t_ours * 1e3:.3f} ({g_ours * 1e3:.3f})':>15} "
                         f"{f'{kv / t_ours / 1e12:.2f} ({kv / g_ours / 1e12:.2f})':>11} "
                         f"{fmt('flash'):>15} {fmt('cudnn'):>15} {fmt('efficient'):>15} "
                         f"{ratio:>13}  [{layout}] {kern}; " + "; ".join(notes) + extra)
            kern, extra = "", ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csr", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    if not (a.csr or a.decode):
        a.csr = a.decode = True
    lines = []
    _header(lines)
    if a.decode:
        bench_decode(lines, a.reps)
        print("\n".join(lines), flush=True)
    if a.csr:
        bench_csr(lines, a.reps)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
