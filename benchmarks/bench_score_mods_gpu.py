"""GPU benchmark of score modifiers next to FlexAttention and torch SDPA, side by side in one run.

    python benchmarks/bench_score_mods_gpu.py                 # N = 16384, H = 16, D = 128, fp16
    python benchmarks/bench_score_mods_gpu.py --n 4096 --no-flex
    python benchmarks/bench_score_mods_gpu.py --prebuild      # only fill the cubin cache (no GPU)
    python benchmarks/bench_score_mods_gpu.py --global-stats  # dK/dV statistics loaded from global memory
    python benchmarks/bench_score_mods_gpu.py --no-fold       # soft-cap kernels without the fold

Rows (all causal): plain; tanh soft-cap 30 (softcap=); ALiBi (alibi_slopes=); sliding window of
1024 keys (Graph.band). Each: forward and forward+backward ms (CUDA events, median of --reps after
warm-up), next to FlexAttention (torch.compile'd flex_attention with the same score_mod /
block mask) and, for plain causal, torch SDPA (cuDNN, flash). Ratios: FlexAttention time / ours
(> 1: ours faster) and ours / our plain causal (the modifier's cost). torch is only the anchor.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402


def prebuild(D, dtype):
    """the modified kernels this benchmark launches, into the cubin cache (no GPU needed)."""
    from tiga_numba.cuda.tc import build
    for name in ("softcap", "alibi"):   # triangular relations: ALiBi without the alignment shift
        for kind in ("fwd", "dq", "dkdv"):
            v = build.modified_variant("wg:" + kind, D, dtype, name)
            t = time.time()
            build.kernel(v)[0].cubin("sm_90a")
            print(f"built {v.name()} in {time.time() - t:.0f} s", flush=True)


def timed(fn, reps):
    import cupy
    fn()
    cupy.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--global-stats", action="store_true",
                    help="the dK/dV kernels load their per-query statistics from global memory (Variant.stats_smem "
                         "off): the A/B twin of the shared-memory copy")
    ap.add_argument("--no-fold", action="store_true",
                    help="the soft-cap runs the kernels without its factor folded into the exponent scale "
                         "(modifier.Fold, FOLD_LIMIT set to 0): the A/B twin of the fold")
    a = ap.parse_args()
    if a.no_fold:
        from tiga_numba.cuda.tc.generator import modifier
        modifier.FOLD_LIMIT = 0.0
    if a.global_stats:
        from tiga_numba.cuda.tc import tuning
        tuning.TUNING_WGMMA[("dkdv", a.dim)] = dict(tuning.TUNING_WGMMA[("dkdv", a.dim)], stats_smem=False)
    if a.prebuild:
        return prebuild(a.dim, "float16")
    import cupy
    import torch
    N, H, D, W = a.n, a.heads, a.dim, a.window
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}, N={N} H={H} D={D} fp16 causal, "
          f"window {W}, softcap {a.softcap}, date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    g = torch.Generator(device="cuda").manual_seed(0)
    tq, tk, tv, tdo = (torch.randn(N, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    q, k, v, do = (cupy.asarray(x) for x in (tq, tk, tv, tdo))
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda", dtype=torch.float32)
    tri = tg.Graph.triangular(N)
    band = tg.Graph.band(N, left=W - 1, right=0)
    rows = [("causal", tri, {}), ("softcap", tri, dict(softcap=a.softcap)),
            ("alibi", tri, dict(alibi_slopes=cupy.asarray(slopes))), ("window", band, {})]
    ours = {}
    for name, graph, kw in rows:
        def fwd(graph=graph, kw=kw):
            return tg.attention(q, k, v, graph, return_stats=True, **kw)

        def fb(graph=graph, kw=kw):
            out, st = tg.attention(q, k, v, graph, return_stats=True, **kw)
            return tg.attention_backward(do, q, k, v, out, st, graph, **kw)
        f, b = timed(fwd, a.reps), timed(fb, a.reps)
        fwd()
        fam = [line for line in tg.explain().splitlines() if "kernel family" in line]
        ours[name] = (f, b)
        print(f"ours  {name:8s} fwd {f:8.3f} ms  fwd+bwd {b:8.3f} ms  | {fam[0].strip() if fam else ''}", flush=True)
    # anchors
    bq, bk, bv, bdo = (x.permute(1, 0, 2)[None].contiguous().requires_grad_(True) for x in (tq, tk, tv, tdo))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as TF
    anchors = {}
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(be):
                sf = lambda: TF.scaled_dot_product_attention(bq, bk, bv, is_causal=True)  # noqa: E731
                f = timed(sf, a.reps)
                b = timed(lambda: sf().backward(bdo), a.reps)
            anchors[f"sdpa {be.name.lower()}"] = (f, b)
        except Exception as ex:  # noqa: BLE001
            print(f"# sdpa {be.name}: {type(ex).__name__}: {ex}")
    flex = {}
    if not a.no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        fa = torch.compile(flex_attention)
        causal_mask = lambda b, h, qi, ki: qi >= ki  # noqa: E731
        window_mask = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W)  # noqa: E731
        bm_c = create_block_mask(causal_mask, None, None, N, N)
        bm_w = create_block_mask(window_mask, None, None, N, N)
        cap = a.softcap
        mods = {"causal": (None, bm_c),
                "softcap": (lambda s, b, h, qi, ki: cap * torch.tanh(s / cap), bm_c),
                "alibi": (lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs(), bm_c),
                "window": (None, bm_w)}
        for name, (mod, bm) in mods.items():
            try:
                run = lambda mod=mod, bm=bm: fa(bq, bk, bv, score_mod=mod, block_mask=bm)  # noqa: E731
                f = timed(run, a.reps)
                b = timed(lambda: run().backward(bdo), a.reps)
                flex[name] = (f, b)
            except Exception as ex:  # noqa: BLE001
                print(f"# flex {name}: {type(ex).__name__}: {str(ex)[:200]}")
    for name, (f, b) in anchors.items():
        print(f"{name:14s} causal fwd {f:8.3f} ms fwd+bwd {b:8.3f} ms | ours/them fwd {f / ours['causal'][0]:.2f}x "
              f"fwd+bwd {b / ours['causal'][1]:.2f}x")
    print("| row | ours fwd | ours f+b | flex fwd | flex f+b | flex/ours fwd | flex/ours f+b | ours/plain causal fwd, f+b |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (f, b) in ours.items():
        ff, fb = flex.get(name, (float("nan"), float("nan")))
        print(f"| {name} | {f:.3f} ms | {b:.3f} ms | {ff:.3f} ms | {fb:.3f} ms | {ff / f:.2f}x | {fb / b:.2f}x | "
              f"{f / ours['causal'][0]:.2f}, {b / ours['causal'][1]:.2f} |")


if __name__ == "__main__":
    main()
