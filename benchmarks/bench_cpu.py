"""CPU benchmark: tiga_numba's numba kernels vs numpy materialized attention and torch CPU SDPA.

    python benchmarks/bench_cpu.py            # full tables (a few minutes on 2 cores)
    python benchmarks/bench_cpu.py --quick    # N = 1024 only, small CSR, fewer repetitions

Tables:
  1. dense and causal attention, N = 1024/4096/8192, H = 4, D = 64, float32: forward and
     forward+backward, ms and GFLOP/s (4 N^2 H D per forward, half for causal; fwd+bwd GFLOP/s
     counts 3.5x the forward flops: 2 matmuls forward + 5 backward), next to numpy
     materialized attention and torch.nn.functional.scaled_dot_product_attention (when torch
     is installed; never a package dependency);
  2. CSR attention on a random graph (100k nodes, average degree 32, H = 4, D = 64) in edges/s;
  3. tile pruning (rho = 1e-2, 1e-4) vs the exact kernel on a local and a random workload:
     speed-up and relative error.
Times are the best of --reps runs after one warm-up (compile) call.
"""
import argparse
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from run import best_seconds as best  # noqa: E402  (benchmarks/run.py: the benchmarks' CPU timer)
from tiga_numba import functional  # noqa: E402

try:
    import torch
except ImportError:  # torch is optional
    torch = None


def _ratio(other, ours, digits):
    """`other / ours` as a speed-up column, '-' where the other side was not measured."""
    if other is None or other != other or ours is None:
        return f"{'-':>7s}"
    return f"{other / ours:6.{digits}f}x"


# ------------------------------------------------------------------------ baselines
def numpy_attention(q, k, v, causal, dout=None):
    """Materialized attention per head (N x N scores), float32; with dout also the backward."""
    N, H, D = q.shape
    scale = D ** -0.5
    out = np.empty_like(q)
    grads = [np.empty_like(q), np.empty_like(k), np.empty_like(v)] if dout is not None else None
    mask = np.tril(np.ones((N, N), bool)) if causal else None
    for h in range(H):
        s = (q[:, h] @ k[:, h].T) * np.float32(scale)
        if causal:
            s = np.where(mask, s, np.float32(-np.inf))
        s -= s.max(1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(1, keepdims=True)
        out[:, h] = p @ v[:, h]
        if dout is not None:
            do = dout[:, h]
            grads[2][:, h] = p.T @ do
            dp = do @ v[:, h].T
            ds = p * (dp - (do * out[:, h]).sum(1, keepdims=True))
            grads[0][:, h] = (ds @ k[:, h]) * scale
            grads[1][:, h] = (ds.T @ q[:, h]) * scale
    return out, grads


def _to_torch(x, dtype):
    x = np.ascontiguousarray(x.transpose(1, 0, 2))
    if dtype is not None and str(x.dtype) == "bfloat16":   # numpy has no bfloat16 for torch
        return torch.from_numpy(x.astype(np.float32))[None].to(dtype)
    return torch.from_numpy(x)[None]


def torch_sdpa(q, k, v, causal, dout=None, dtype=None):
    tq, tk, tv = (_to_torch(x, dtype) for x in (q, k, v))
    if dout is None:
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    o.backward(_to_torch(dout, dtype))
    return o


# ------------------------------------------------------------------------ tables
def interleaved(fns, reps, rounds=None):
    """Best time of each fn over `reps` rounds that run every fn once (after one warm-up
    each): on a shared machine, contention then hits all contenders alike. With a list
    `rounds`, every round's times are appended to it (one list per round)."""
    for fn in fns:
        fn()
    best_t = [float("inf")] * len(fns)
    for _ in range(reps):
        this = []
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            this.append(time.perf_counter() - t)
            best_t[i] = min(best_t[i], this[-1])
        if rounds is not None:
            rounds.append(this)
    return best_t


def round_ratios(rounds, other, ours):
    """'median (min-max)' of other / ours over rounds: each ratio from two calls of one round,
    seconds apart, so a machine whose speed drifts between rounds (a shared VM) moves both."""
    r = np.array([x[other] / x[ours] for x in rounds])
    return f"{np.median(r):.2f}x ({r.min():.2f}-{r.max():.2f})"


def machine_ceilings():
    """This machine's sgemm rate (float32 2048^3 through numpy's BLAS, every core) and copy
    bandwidth (256 MiB array copy, read + write): what the attention rates are measured against."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    b = a.copy()
    t = best(lambda: a @ b, 3)
    sgemm = 2 * 2048 ** 3 / t / 1e9
    x = np.ones(64 * 2 ** 20, np.float32)
    y = np.empty_like(x)
    t = best(lambda: np.copyto(y, x), 3)
    bw = 2 * x.nbytes / t / 1e9
    print(f"# machine ceilings: sgemm {sgemm:.0f} GFLOP/s (numpy float32 2048^3), copy bandwidth "
          f"{bw:.1f} GB/s (256 MiB copy, read + write)")
    return sgemm


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def table_dense(sizes, reps, args, sgemm=float("nan"), dtype="float32"):
    H, D = 4, 64
    dt = _dtype(dtype)
    torch_dt = None if torch is None else getattr(torch, dtype)
    print(f"== dense / causal attention, H={H}, D={D}, {dtype} "
          f"(GFLOP/s: fwd 4 N^2 H D, /2 causal; fwd+bwd 3.5x that; %sgemm: tiga fwd GFLOP/s / "
          f"the machine's sgemm rate)")
    print(f"{'N':>5} {'mask':>6} | {'tiga fwd':>14} {'tiga fwd+bwd':>16} | {'numpy fwd':>10} "
          f"{'numpy f+b':>10} | {'torch fwd':>10} {'torch f+b':>10} | "
          f"fwd: x numpy, x torch | f+b: x numpy, x torch   (x = speed-up of tiga: best "
          f"of --reps each; per round: the median of the rounds' own ratios)")
    rng = np.random.default_rng(0)
    for N in sizes:
        q, k, v, do = (rng.standard_normal((N, H, D), dtype=np.float32).astype(dt) for _ in range(4))
        for causal in (False, True):
            g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N)
            flops = 4 * N * N * H * D / (2 if causal else 1)

            def fwd():
                return tg.attention(q, k, v, g)

            def fwdbwd():
                out, st = tg.attention(q, k, v, g, return_stats=True)
                return tg.attention_backward(do, q, k, v, out, st, g)

            fns = [fwd, fwdbwd]
            use_torch = torch is not None and not args.no_torch
            if use_torch:
                fns += [lambda: torch_sdpa(q, k, v, causal, dtype=torch_dt),
                        lambda: torch_sdpa(q, k, v, causal, do, dtype=torch_dt)]
            rounds = []
            times = interleaved(fns, reps, rounds)
            tf, tb = times[:2]
            tf_t, tb_t = times[2:] if use_torch else (float("nan"),) * 2
            nf = nb = float("nan")
            if not args.no_numpy and N <= args.numpy_max and dtype == "float32":
                nf = best(lambda: numpy_attention(q, k, v, causal), 1)
                if N <= args.numpy_bwd_max:
                    nb = best(lambda: numpy_attention(q, k, v, causal, do), 1)

            def ms(t):
                return f"{t * 1e3:8.1f}ms" if t == t else f"{'-':>10}"

            print(f"{N:>5} {'causal' if causal else 'dense':>6} | "
                  f"{tf * 1e3:7.1f} ms {flops / tf / 1e9:4.0f}GF "
                  f"{tb * 1e3:8.1f} ms {3.5 * flops / tb / 1e9:4.0f}GF | "
                  f"{ms(nf)} {ms(nb)} | {ms(tf_t)} {ms(tb_t)} | "
                  f"{_ratio(nf, tf, 1)} {_ratio(tf_t, tf, 2)} | {_ratio(nb, tb, 1)} {_ratio(tb_t, tb, 2)} | "
                  f"fwd {100 * flops / tf / 1e9 / sgemm:3.0f}% sgemm, f+b "
                  f"{100 * 3.5 * flops / tb / 1e9 / sgemm:3.0f}% sgemm"
                  + (f" | x torch per round: fwd {round_ratios(rounds, 2, 0)}, f+b "
                     f"{round_ratios(rounds, 3, 1)}" if use_torch else ""))
            sys.stdout.flush()
        del q, k, v, do


def memory_line(N):
    H, D = 4, 64
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, H, D), dtype=np.float32) for _ in range(4))
    g = tg.Graph.triangular(N)
    out, st = tg.attention(q, k, v, g, return_stats=True)
    tg.attention_backward(do, q, k, v, out, st, g)
    tracemalloc.start()
    out, st = tg.attention(q, k, v, g, return_stats=True)
    _, peak_f = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    tg.attention_backward(do, q, k, v, out, st, g)
    _, peak_b = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    inp = q.nbytes
    print(f"memory (numpy-level allocations, tracemalloc peak), causal N={N}: forward "
          f"{peak_f / 2**20:.1f} MiB, backward {peak_b / 2**20:.1f} MiB; one input (N,H,D) f32 = "
          f"{inp / 2**20:.1f} MiB; an N x N x H f32 score tensor would be "
          f"{N * N * H * 4 / 2**20:.0f} MiB. In-kernel scratch: O(BM*BN) per thread.")


def table_csr(n_nodes, degree, reps):
    H, D = 4, 64
    rng = np.random.default_rng(1)
    E = n_nodes * degree
    indptr = np.arange(0, E + 1, degree, dtype=np.int64)
    indices = rng.integers(0, n_nodes, E).astype(np.int32)
    g = tg.Graph.from_csr(indptr, indices, num_src=n_nodes)
    q, k, v, do = (rng.standard_normal((n_nodes, H, D), dtype=np.float32) for _ in range(4))

    def fwd():
        return tg.attention(q, k, v, g)

    def fwdbwd():
        out, st = tg.attention(q, k, v, g, return_stats=True)
        return tg.attention_backward(do, q, k, v, out, st, g)

    g.realize_transpose("cpu")  # built once per graph and cached; not part of the timing
    tf = best(fwd, reps)
    tb = best(fwdbwd, reps)
    # the random-access ceiling: gathering the K and V rows of every edge (each a contiguous
    # H x D float32 row, read in the graph's order), as numpy's take does with every core idle
    # but one; the forward must read at least these bytes
    kf, vf = k.reshape(n_nodes, -1), v.reshape(n_nodes, -1)
    buf = np.empty((min(E, 1 << 20), kf.shape[1]), np.float32)

    def gather():
        for e0 in range(0, E, buf.shape[0]):
            idx = indices[e0:e0 + buf.shape[0]]
            np.take(kf, idx, axis=0, out=buf[:idx.shape[0]])
            np.take(vf, idx, axis=0, out=buf[:idx.shape[0]])
    tg_ = best(gather, reps)
    row_bytes = 2 * E * kf.shape[1] * 4
    print(f"== CSR attention, random graph: {n_nodes} nodes, {E} edges (degree {degree}), "
          f"H={H}, D={D}, float32")
    print(f"forward {tf * 1e3:8.1f} ms  {E / tf / 1e6:6.1f} M edges/s | forward+backward "
          f"{tb * 1e3:8.1f} ms  {E / tb / 1e6:6.1f} M edges/s")
    print(f"random-row gather of K and V (np.take, one thread): {tg_ * 1e3:.1f} ms, "
          f"{row_bytes / tg_ / 1e9:.1f} GB/s; the forward reads them at {row_bytes / tf / 1e9:.1f} GB/s "
          f"({tg_ / tf:.2f}x the one-thread gather rate)")


def local_inputs(N, H, D, sink, rng, width=16.0):
    """1-D positions x_i; score(i, j) = -(pos_i - pos_j)^2 / (2 width^2) (positions as units)
    through q_i = [2c x_i, -c, -c x_i^2, noise], k_j = [x_j, x_j^2, 1, noise]: each query is
    close to the ~width keys around it (64 positions away the weight is e^-8) and every row's
    max is ~0.  With `sink`, key 0 is [0, 0, 0]: score 0, the row's peak, for every query (an
    'attention sink'), so the first key tile visited already holds the block's max; without
    it, the key tiles before the query's own position raise the running max step by step and
    are all admitted (tiles are visited in increasing key order).  scale = 1."""
    x = np.linspace(-0.5, 0.5, N)
    c = N * N / (2 * width ** 2)
    q = 0.01 * rng.standard_normal((N, H, D))
    k = 0.01 * rng.standard_normal((N, H, D))
    q[:, :, 0] = 2 * c * x[:, None]
    q[:, :, 1] = -c
    q[:, :, 2] = -c * x[:, None] ** 2
    k[:, :, 0] = x[:, None]
    k[:, :, 1] = x[:, None] ** 2
    k[:, :, 2] = 1
    if sink:
        k[0, :, :3] = 0
    v = rng.standard_normal((N, H, D))
    return (a.astype(np.float32) for a in (q, k, v))


def table_prune(N, reps):
    H, D = 4, 64
    rng = np.random.default_rng(2)
    from tiga_numba.cpu import tiles as _tiles
    print(f"== tile pruning vs exact (CPU pruning tiles BM x BN = {_tiles.PRUNE_TILES}), N={N}, H={H}, D={D}, "
          f"float32, scale=1 for the local workloads, D^-0.5 for the random one "
          f"(rel err = max|pruned-exact| / max|exact|)")
    print(f"{'workload':>22} {'mask':>6} {'rho':>6} | {'exact':>9} {'pruned':>9} {'speed-up':>8} | "
          f"{'pruned tiles':>14} | rel err")
    work = [("local (1-D, +sink)", local_inputs(N, H, D, True, rng), 1.0),
            ("local (1-D, no sink)", local_inputs(N, H, D, False, rng), 1.0),
            ("random", (rng.standard_normal((N, H, D), dtype=np.float32) for _ in range(3)),
             None)]
    for name, (q, k, v), scale in work:
        for causal in (False, True):
            g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N)
            exact = tg.attention(q, k, v, g, scale=scale)
            rhos = (1e-2, 1e-4)
            outs, infos = [], []
            for rho in rhos:
                outs.append(tg.attention(q, k, v, g, scale=scale, block_prune_threshold=rho))
                infos.append(dict(functional.last_plan().run_info))
            # exact and pruned calls alternate within each round (shared-machine noise)
            te, *tps = interleaved(
                [lambda: tg.attention(q, k, v, g, scale=scale)]
                + [lambda rho=rho: tg.attention(q, k, v, g, scale=scale, block_prune_threshold=rho)
                   for rho in rhos], reps)
            for rho, out, info, tp in zip(rhos, outs, infos, tps):
                err = float(np.abs(out - exact).max() / np.abs(exact).max())
                frac = f"{info['pruned_tiles']}/{info['total_tiles']}"
                print(f"{name:>22} {'causal' if causal else 'dense':>6} {rho:>6.0e} | "
                      f"{te * 1e3:6.1f} ms {tp * 1e3:6.1f} ms {te / tp:7.2f}x | {frac:>14} | "
                      f"{err:.1e}")
                sys.stdout.flush()


def table_decode(keys, reps, H=8, D=128):
    """One query row over `keys` keys (Graph.dense(keys, 1)), H heads, D = Dv, float32: ours
    (the split-key kernel, k / v read in place) against torch CPU SDPA on the same values in its
    (1, H, L, D) layout, alternating calls; and the K + V bytes per second of each."""
    import tiga_numba as tg
    from tiga_numba import functional
    rng = np.random.default_rng(0)
    g = tg.Graph.dense(keys, 1)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    k = rng.standard_normal((keys, H, D)).astype(np.float32)
    v = rng.standard_normal((keys, H, D)).astype(np.float32)
    out = tg.attention(q, k, v, g)
    kern = functional.last_plan().run_info["kernel"]
    print(f"\n# decode: 1 query x {keys} keys, H={H}, D={D}, float32; ours: {kern}")
    ts, tt = [], []
    tq = tk = tv = None
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))[None] for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)[0].numpy().transpose(1, 0, 2)
        print(f"# max |ours - torch| {np.abs(out - ref).max():.1e}")
    for _ in range(reps):
        t0 = time.perf_counter()
        tg.attention(q, k, v, g)
        ts.append(time.perf_counter() - t0)
        if torch is not None:
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            tt.append(time.perf_counter() - t0)
    gb = 2 * keys * H * D * 4 / 1e9
    line = f"| decode 1 x {keys} | ours {min(ts) * 1e3:.1f} ms ({gb / min(ts):.1f} GB/s of K+V)"
    if tt:
        line += f" | torch {min(tt) * 1e3:.1f} ms ({gb / min(tt):.1f} GB/s) | ratio {min(tt) / min(ts):.2f}x"
    print(line + " |  (best of " + str(reps) + ")")
    # forward+backward: ours (split-key backward over the same items) against torch autograd, in
    # separate loops: right after a torch backward its OpenMP threads keep spinning for a while,
    # and a numba kernel started then shares the 2 cores with them (ours measured 1423 ms
    # alternating, 115 ms alone)
    fb, tfb = [], []
    n_fb = max(3, reps // 2)
    for _ in range(n_fb + 1):
        t0 = time.perf_counter()
        o, s_ = tg.attention(q, k, v, g, return_stats=True)
        tg.attention_backward(o, q, k, v, o, s_, g)
        fb.append(time.perf_counter() - t0)
    if torch is not None:
        for _ in range(n_fb + 1):
            gq, gk, gv = (x.clone().requires_grad_() for x in (tq, tk, tv))
            t0 = time.perf_counter()
            o_t = torch.nn.functional.scaled_dot_product_attention(gq, gk, gv)
            o_t.backward(o_t.detach())
            tfb.append(time.perf_counter() - t0)
    fb, tfb = fb[1:], tfb[1:]   # the first call of each: warm-up
    line = f"| decode fwd+bwd 1 x {keys} | ours {min(fb) * 1e3:.1f} ms"
    if tfb:
        line += f" | torch {min(tfb) * 1e3:.1f} ms | ratio {min(tfb) / min(fb):.2f}x"
    print(line + " |  (best of " + str(n_fb) + ", each side in its own loop)")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N=1024 only, 20k-node CSR, N=1024 pruning, 2 reps")
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--only", choices=["dense", "csr", "prune", "memory", "decode"], nargs="*", default=None)
    ap.add_argument("--decode-keys", type=int, default=131072, help="keys of the decode table")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--dtypes", default="float32",
                    help="dtypes of the dense table, e.g. float32,float16,bfloat16")
    ap.add_argument("--no-numpy", action="store_true")
    ap.add_argument("--numpy-max", type=int, default=8192, help="largest N for numpy forward")
    ap.add_argument("--numpy-bwd-max", type=int, default=4096,
                    help="largest N for numpy forward+backward")
    args = ap.parse_args()
    sizes = args.sizes or ([1024] if args.quick else [1024, 4096, 8192])
    reps = args.reps or (2 if args.quick else 5)
    only = set(args.only or ["dense", "memory", "csr", "prune", "decode"])
    import numba
    print(f"# {' '.join(sys.argv)}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, numba "
          f"{numba.__version__} ({numba.get_num_threads()} threads, layer "
          f"{numba.threading_layer() if hasattr(numba, 'threading_layer') else '?'}), numpy "
          f"{np.__version__}, torch {torch.__version__ if torch else 'not installed'}"
          f"{' (threads %d)' % torch.get_num_threads() if torch else ''}")
    sgemm = machine_ceilings()
    from tiga_numba import run_options
    from tiga_numba.cpu import tiles as _tiles
    print(f"# CPU tiles: {_tiles.choose(run_options.current(), False)} "
          "(dense forward: twice the query rows unless options.cpu_tiles is set)")
    if "dense" in only:
        for dtype in args.dtypes.split(","):
            table_dense(sizes, reps, args, sgemm, dtype)
    if "memory" in only:
        memory_line(max(sizes))
    if "csr" in only:
        table_csr(20_000 if args.quick else 100_000, 32, reps)
    if "prune" in only:
        table_prune(1024 if args.quick else 4096, reps)
    if "decode" in only:
        table_decode(16384 if args.quick else args.decode_keys, max(reps, 7))


if __name__ == "__main__":
    main()
