"""H200 benchmark of the CUDA backend, side by side with the anchors in one run.

    PYTHONPATH=$PWD python benchmarks/bench_cuda.py [--quick] [--out FILE] [--only-overhead [--profile]]

Tables: (1) dense/causal attention at N = 1024/4096/16384, H = 16, D = 64/128, forward and
forward+backward: torch SDPA flash (fp16) and efficient (fp32), cupy materialized attention,
this project's CUDA-core kernels (fp32, fp16) and whatever the dispatcher routes to ("tiga
routed fp32" always, "tiga routed fp16" when it is not the CUDA-core kernel: tensor cores when
tiga_numba.cuda.tc supports the call); (2) CSR attention, 1M nodes, average
degree 16, H = 4, D = 32, in edges/s and as a fraction of the gather-bandwidth bound (each edge
reads one key row and one value row; bandwidth = a device-to-device copy measured in the same
run); (3) launch overhead on a tiny problem; (4) tile pruning on a local and a random workload.
Timing: CUDA events around each call on the current stream, median of several calls after a
warm-up (first call = compile, excluded).
"""
import argparse
import contextlib
import sys
import time

import numpy as np


def _shield():
    """numba-cuda's import redirector matches any module name containing "numba.cuda"."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "NumbaCudaFinder" and not getattr(finder, "_tiga_shielded", False):
            original = finder.find_spec

            def find_spec(name, path=None, target=None, _original=original):
                if name == "tiga_numba.cuda" or name.startswith("tiga_numba.cuda."):
                    return None
                return _original(name, path, target)
            finder.find_spec = find_spec
            finder._tiga_shielded = True


_shield()
import cupy  # noqa: E402

import tiga_numba as tg  # noqa: E402
from tiga_numba import functional  # noqa: E402

try:
    import torch
    import torch.nn.functional as TF
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # pragma: no cover
    torch = None

LINES = []


def emit(s=""):
    print(s, flush=True)
    LINES.append(s)


def time_cupy(fn, budget_s=0.5, max_reps=15):
    """Median ms of fn() with cupy events, after one warm-up call (compiles on first use)."""
    fn()
    times = []
    spent = 0.0
    while len(times) < max_reps and (len(times) < 2 or spent < budget_s):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
        spent += times[-1] / 1e3
    return float(np.median(times))


def time_torch(fn, budget_s=0.5, max_reps=15):
    fn()
    times = []
    spent = 0.0
    while len(times) < max_reps and (len(times) < 2 or spent < budget_s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        spent += times[-1] / 1e3
    return float(np.median(times))


def sanitize_cases(dtypes=("float32", "float16", "float64")):
    """Small calls of every kernel (for compute-sanitizer memcheck / racecheck)."""
    set_tc(False)
    rng = np.random.default_rng(5)
    cu = np.array([0, 37, 37, 38, 100], np.int64)
    deg = rng.integers(0, 12, 50)
    deg[4] = 0
    indptr = np.zeros(51, np.int64)
    np.cumsum(deg, out=indptr[1:])
    indices = np.concatenate([np.sort(rng.choice(40, d, replace=False)) for d in deg]).astype(np.int32)
    graphs = [tg.Graph.dense(70, 45), tg.Graph.triangular(90), tg.Graph.cu_seqlens(cu),
              tg.Graph.from_csr(indptr, indices, num_src=40)]
    for dt in dtypes:
        for g in graphs:
            H, Hkv, D, DV = 4, 2, 64, 64  # the test suite's dims: its kernels come from the cubin cache
            q = cupy.asarray(rng.standard_normal((g.num_dst, H, D)), dtype=dt)
            k = cupy.asarray(rng.standard_normal((g.num_src, Hkv, D)), dtype=dt)
            v = cupy.asarray(rng.standard_normal((g.num_src, Hkv, DV)), dtype=dt)
            do = cupy.asarray(rng.standard_normal((g.num_dst, H, DV)), dtype=dt)
            out, st = tg.attention(q, k, v, g, return_stats=True)
            tg.attention_backward(do, q, k, v, out, st, g)
            if g.kind != "csr" and dt == "float32":
                tg.attention(q, k, v, g, block_prune_threshold=0.5)
            if g.kind == "csr" and dt == "float32":
                b = cupy.asarray(rng.standard_normal((g.num_edges, H)), dtype=cupy.float32)
                o, st, _ = functional.run_forward(q, k, v, g, edge_bias=b)
                functional.run_backward(do, q, k, v, o, st, g, edge_bias=b)
                z = q[:, :, :0]
                o, st, _ = functional.run_forward(z, k[:, :, :0], v, g, edge_bias=b, scale=1.0)
                functional.run_backward(do, z, k[:, :, :0], v, o, st, g, edge_bias=b, scale=1.0)
    cupy.cuda.Device().synchronize()
    emit("sanitize cases ran")


def flops(N, H, D, causal, bwd=False):
    f = 4.0 * N * N * H * D / (2 if causal else 1)
    return f * (3.5 if bwd else 1.0)  # fwd+bwd = fwd x (1 + 2.5)


_TC_OFF = contextlib.ExitStack()


def set_tc(on):
    """Tensor-core kernels allowed (True) or not for the calls that follow: the run option
    tg.options(tensor_cores=False), held open until the next set_tc."""
    _TC_OFF.close()
    if not on:
        _TC_OFF.enter_context(tg.options(tensor_cores=False))


def ours(q, k, v, g, bwd, dout=None):
    if not bwd:
        return lambda: tg.attention(q, k, v, g)

    def run():
        out, st = tg.attention(q, k, v, g, return_stats=True)
        tg.attention_backward(dout, q, k, v, out, st, g)
    return run


def rel(a, b):
    a = cupy.asarray(a, dtype=cupy.float64)
    b = cupy.asarray(b, dtype=cupy.float64)
    return float(cupy.linalg.norm(a - b) / cupy.linalg.norm(b))


def dense_table(Ns, Ds, quick):
    emit("== dense / causal attention, H=16 (ms; TF/s = 4*N^2*H*D (/2 causal) fwd, x3.5 fwd+bwd)")
    H = 16
    for D in Ds:
        for N in Ns:
            for causal in (False, True):
                g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N)
                row = {}
                rng = cupy.random.default_rng(N + D)
                q32 = rng.standard_normal((N, H, D), dtype=cupy.float32)
                k32 = rng.standard_normal((N, H, D), dtype=cupy.float32)
                v32 = rng.standard_normal((N, H, D), dtype=cupy.float32)
                do32 = rng.standard_normal((N, H, D), dtype=cupy.float32)
                q16, k16, v16, do16 = (x.astype(cupy.float16) for x in (q32, k32, v32, do32))
                if torch is not None:
                    tq = [torch.as_tensor(x).permute(1, 0, 2).unsqueeze(0) for x in (q16, k16, v16, do16)]
                    tq32 = [torch.as_tensor(x).permute(1, 0, 2).unsqueeze(0) for x in (q32, k32, v32, do32)]
                    for name, ts, be in (("sdpa flash fp16", tq, SDPBackend.FLASH_ATTENTION),
                                         ("sdpa efficient fp32", tq32, SDPBackend.EFFICIENT_ATTENTION)):
                        a, b, c, d = (t.detach().contiguous() for t in ts)
                        a.requires_grad_(True)
                        b.requires_grad_(True)
                        c.requires_grad_(True)

                        def f(a=a, b=b, c=c, be=be):
                            with sdpa_kernel(be):
                                return TF.scaled_dot_product_attention(a, b, c, is_causal=causal)

                        def fb(a=a, b=b, c=c, d=d, be=be):
                            with sdpa_kernel(be):
                                o = TF.scaled_dot_product_attention(a, b, c, is_causal=causal)
                            o.backward(d)
                        try:
                            with torch.no_grad():
                                row[name] = [time_torch(f)]
                            row[name].append(time_torch(fb))
                        except Exception as exc:
                            row[name] = [float("nan"), float("nan")]
                            emit(f"  {name} failed: {exc!r}"[:200])
                    if N <= 4096:
                        with torch.no_grad(), sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                            ref = TF.scaled_dot_product_attention(*tq32[:3], is_causal=causal)
                        ref = cupy.asarray(ref[0].permute(1, 0, 2).contiguous())
                # cupy materialized (what a cupy user writes), forward only
                for dt, (a, b, c) in (("fp16", (q16, k16, v16)), ("fp32", (q32, k32, v32))):
                    if N > 16384 or (quick and N > 4096):
                        continue
                    ah, bh, ch = (x.transpose(1, 0, 2) for x in (a, b, c))
                    mask = cupy.triu(cupy.ones((N, N), bool), 1) if causal else None

                    def mat(ah=ah, bh=bh, ch=ch, mask=mask):
                        s = cupy.matmul(ah, bh.transpose(0, 2, 1)) * (D ** -0.5)
                        if mask is not None:
                            s = cupy.where(mask, -cupy.inf, s)
                        s = s - s.max(axis=-1, keepdims=True)
                        p = cupy.exp(s)
                        p /= p.sum(axis=-1, keepdims=True)
                        return cupy.matmul(p, ch)
                    try:
                        row[f"cupy materialized {dt}"] = [time_cupy(mat, budget_s=0.3, max_reps=5), float("nan")]
                    except cupy.cuda.memory.OutOfMemoryError:
                        row[f"cupy materialized {dt}"] = [float("nan")] * 2
                    del mask
                    cupy.get_default_memory_pool().free_all_blocks()
                set_tc(False)
                for dt, (a, b, c, d) in (("fp32", (q32, k32, v32, do32)), ("fp16", (q16, k16, v16, do16))):
                    name = f"tiga cuda-core {dt}"
                    row[name] = [time_cupy(ours(a, b, c, g, False)), time_cupy(ours(a, b, c, g, True, d))]
                    if torch is not None and N <= 4096:
                        err = rel(tg.attention(a, b, c, g), ref)
                        row[name].append(err)
                set_tc(True)
                # what tg.attention picks for float32 cupy inputs (a tensor-core fp32 path when
                # tc.supports() takes it, else the CUDA-core kernels again), shown whatever it is
                out32 = tg.attention(q32, k32, v32, g)
                kname = functional.last_plan().run_info.get("kernel", "?")
                name = "tiga routed fp32 [" + kname.split(" (")[0] + "]"
                row[name] = [time_cupy(ours(q32, k32, v32, g, False)),
                             time_cupy(ours(q32, k32, v32, g, True, do32))]
                if torch is not None and N <= 4096:
                    row[name].append(rel(out32, ref))
                del out32
                tg.attention(q16, k16, v16, g)
                kname = functional.last_plan().run_info.get("kernel", "?")
                if not kname.startswith("cuda.blocks"):
                    name = "tiga routed fp16 [" + kname.split(" (")[0] + "]"
                    row[name] = [time_cupy(ours(q16, k16, v16, g, False)),
                                 time_cupy(ours(q16, k16, v16, g, True, do16))]
                emit(f"-- N={N} H={H} D={D} causal={causal}")
                base_ff, base_fb = row.get("sdpa efficient fp32", [float("nan")] * 2)[:2]
                mat16 = row.get("cupy materialized fp16", [float("nan")])[0]
                for name, vals in row.items():
                    f_ms, fb_ms = vals[0], vals[1]
                    tf_f = flops(N, H, D, causal) / f_ms / 1e9 if f_ms == f_ms else float("nan")
                    tf_b = flops(N, H, D, causal, True) / fb_ms / 1e9 if fb_ms == fb_ms else float("nan")
                    extra = ""
                    if name.startswith("tiga"):
                        extra = (f" | vs sdpa-eff-fp32: fwd {base_ff / f_ms:.2f}x fwd+bwd {base_fb / fb_ms:.2f}x"
                                 f" | fwd+bwd/fwd {fb_ms / f_ms:.2f}")
                        if "fp16" in name:
                            extra += f" | vs cupy-mat-fp16 {mat16 / f_ms:.1f}x"
                        if len(vals) > 2:
                            extra += f" | relerr vs sdpa-eff-fp32 {vals[2]:.1e}"
                    emit(f"  {name:34s} fwd {f_ms:9.3f} ms {tf_f:6.1f} TF/s | fwd+bwd {fb_ms:9.3f} ms "
                         f"{tf_b:6.1f} TF/s{extra}")
                del q32, k32, v32, do32, q16, k16, v16, do16
                cupy.get_default_memory_pool().free_all_blocks()


def copy_bandwidth():
    x = cupy.ones(2 ** 29, cupy.float32)  # 2 GiB
    y = cupy.empty_like(x)
    ms = time_cupy(lambda: cupy.copyto(y, x))
    bw = 2 * x.nbytes / (ms * 1e-3)
    cupy.get_default_memory_pool().free_all_blocks()
    return bw


def csr_table(quick):
    n = 200_000 if quick else 1_000_000
    H, D, deg = 4, 32, 16
    bw = copy_bandwidth()
    emit(f"== CSR attention, {n} nodes, avg degree {deg}, H={H}, D=Dv={D} "
         f"(device copy bandwidth {bw / 1e12:.2f} TB/s, read+write)")
    rng = np.random.default_rng(0)
    degs = rng.poisson(deg, n).astype(np.int64)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(degs, out=indptr[1:])
    E = int(indptr[-1])
    # random neighbours, sorted within each row
    idx = rng.integers(0, n, E).astype(np.int64)
    rows = np.repeat(np.arange(n), degs)
    order = np.lexsort((idx, rows))
    indices = idx[order].astype(np.int32)
    g = tg.Graph.from_csr(indptr, indices, num_src=n)
    for dt in ("float32", "float16"):
        crng = cupy.random.default_rng(1)
        q = crng.standard_normal((n, H, D), dtype=cupy.float32).astype(dt)
        k = crng.standard_normal((n, H, D), dtype=cupy.float32).astype(dt)
        v = crng.standard_normal((n, H, D), dtype=cupy.float32).astype(dt)
        do = crng.standard_normal((n, H, D), dtype=cupy.float32).astype(dt)
        set_tc(False)
        f_ms = time_cupy(ours(q, k, v, g, False))
        fb_ms = time_cupy(ours(q, k, v, g, True, do))
        item = np.dtype(dt).itemsize
        bound_bytes = E * H * (D + D) * item
        bound_ms = bound_bytes / bw * 1e3
        emit(f"  tiga csr {dt}: fwd {f_ms:.3f} ms = {E / f_ms / 1e6:.2f} Gedges/s, "
             f"{bound_ms / f_ms:.0%} of the gather bound ({bound_ms:.3f} ms for {bound_bytes / 1e9:.2f} GB) | "
             f"fwd+bwd {fb_ms:.3f} ms ({fb_ms / f_ms:.2f}x fwd) [{E} edges]")
        del q, k, v, do
    cupy.get_default_memory_pool().free_all_blocks()


def launch_overhead(profile=False):
    """Host time per call on a tiny problem (forward and backward, public call and backend
    entry, every launch path of cuda/launch.py, the host time of a tensor-core-routed call):
    benchmarks/tuning/bench_overhead.py's GPU part, so that both scripts print the same table."""
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning"))
    import bench_overhead
    bench_overhead.LINES = LINES  # one output file
    bench_overhead.gpu_part(profile)


def prune_table(quick):
    N = 4096
    H, D = 16, 64
    emit(f"== tile pruning (CUDA), N={N} H={H} D={D} fp32 causal; speed vs exact, rel. error vs exact")
    set_tc(False)
    g = tg.Graph.triangular(N)
    pos = cupy.arange(N, dtype=cupy.float64) / 8.0  # locality width ~8 keys
    qf = cupy.zeros((N, H, D), cupy.float64)
    kf = cupy.zeros((N, H, D), cupy.float64)
    qf[:, :, 0] = pos[:, None]
    qf[:, :, 1] = 1.0
    qf[:, :, 2] = -pos[:, None] ** 2 / 2
    kf[:, :, 0] = pos[:, None]
    kf[:, :, 1] = -pos[:, None] ** 2 / 2
    kf[:, :, 2] = 1.0  # q.k = -(i - j)^2 / 128
    rng = cupy.random.default_rng(3)
    work = {
        "local": (qf.astype(cupy.float32), kf.astype(cupy.float32)),
        "random": (rng.standard_normal((N, H, D), dtype=cupy.float32),
                   rng.standard_normal((N, H, D), dtype=cupy.float32)),
    }
    v = rng.standard_normal((N, H, D), dtype=cupy.float32)
    for name, (q, k) in work.items():
        scale = 1.0 if name == "local" else D ** -0.5
        exact = tg.attention(q, k, v, g, scale=scale)
        t_exact = time_cupy(lambda: tg.attention(q, k, v, g, scale=scale))
        for rho in (1e-2, 1e-4):
            out = tg.attention(q, k, v, g, scale=scale, block_prune_threshold=rho)
            info = functional.last_plan().run_info
            t = time_cupy(lambda: tg.attention(q, k, v, g, scale=scale, block_prune_threshold=rho))
            emit(f"  {name:6s} rho={rho:g}: exact {t_exact:.3f} ms, pruned {t:.3f} ms ({t_exact / t:.2f}x), "
                 f"{info['pruned_tiles']}/{info['total_tiles']} tiles pruned, rel err {rel(out, exact):.1e}")


def sweep():
    """Tile variants of the block kernels (fp32, N=4096, H=16, non-causal): which geometry
    is fastest on this GPU. Prints one line per variant; the defaults are in tiles.py."""
    import dataclasses
    from tiga_numba.cuda import api, tiles
    from tiga_numba.kernel_cache import KERNELS
    set_tc(False)
    N, H = 4096, 16
    g = tg.Graph.dense(N)
    orig = api._block_tiles
    emit("== tile sweep (fp32, N=4096, H=16, dense): ms")
    for D in (64, 128):
        rng = cupy.random.default_rng(D)
        q, k, v, do = (rng.standard_normal((N, H, D), dtype=cupy.float32) for _ in range(4))
        for kind in ("fwd", "dq", "dkdv"):
            base = tiles.block_tiles(kind, "float32", D, D)
            variants = []
            for G in (D // 32, D // 16, D // 8):
                for R in ((2, 4) if kind == "fwd" else (1, 2, 4)):
                    for bm in (64, 128):
                        NT = bm * G // R
                        if G < 1 or not 32 <= NT <= 256:
                            continue
                        ds = D // G
                        regs = R * ds * (2 if kind == "fwd" else 4)
                        if regs > 160:
                            continue
                        t = dataclasses.replace(base, G=G, R=R, NT=NT)
                        DP = -(-D // (G * t.VEC)) * G * t.VEC
                        for BN in (64, 32, 16):
                            need = (BN * 2 * DP + (t.BM * (BN + 4) if kind == "fwd" else 3 * BN)) * 4
                            if need <= tiles.SMEM_BUDGET:
                                break
                        variants.append(dataclasses.replace(t, BN=BN))
            for t in variants:
                def pick(k_, dt, D_, DV_, t=t, kind=kind):
                    return t if k_ == kind else orig(k_, dt, D_, DV_)
                api._block_tiles = pick
                KERNELS.clear()  # launch records memoise the tiles they were built with
                try:
                    if kind == "fwd":
                        ms = time_cupy(lambda: tg.attention(q, k, v, g), max_reps=5)
                    else:
                        out, st = tg.attention(q, k, v, g, return_stats=True)
                        ms = time_cupy(lambda: tg.attention_backward(do, q, k, v, out, st, g), max_reps=5)
                    tag = " (default)" if t == base else ""
                    emit(f"  D={D} {kind:4s} G={t.G:2d} R={t.R} NT={t.NT:3d} BM={t.BM:3d} BN={t.BN:2d}: "
                         f"{ms:8.3f} ms{tag}")
                except Exception as exc:
                    emit(f"  D={D} {kind} {t}: failed {exc!r}"[:160])
                finally:
                    api._block_tiles = orig
                    KERNELS.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="launch,dense,csr,prune")
    ap.add_argument("--sanitize-dtypes", default="float32,float16,float64")
    ap.add_argument("--only-overhead", action="store_true",
                    help="only the launch-overhead part (same as --parts launch)")
    ap.add_argument("--profile", action="store_true",
                    help="with the overhead part: cProfile tables of the tiny calls")
    a = ap.parse_args()
    if a.only_overhead:
        a.parts = "launch"
    dev = cupy.cuda.runtime.getDeviceProperties(0)
    emit(f"# bench_cuda.py on {dev['name'].decode()} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), "
         f"cupy {cupy.__version__}, torch {torch.__version__ if torch else 'n/a'}")
    parts = a.parts.split(",")
    t0 = time.time()
    if "sanitize" in parts:
        sanitize_cases(tuple(a.sanitize_dtypes.split(",")))
    if "sweep" in parts:
        sweep()
    if "launch" in parts:
        launch_overhead(a.profile)
    if "dense" in parts:
        dense_table([1024, 4096] if a.quick else [1024, 4096, 16384], [64] if a.quick else [64, 128], a.quick)
    if "csr" in parts:
        csr_table(a.quick)
    if "prune" in parts:
        prune_table(a.quick)
    emit(f"# total {time.time() - t0:.0f} s")
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
