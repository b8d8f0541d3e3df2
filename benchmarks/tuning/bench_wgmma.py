"""wgmma (sm_90a warpgroup) tensor-core kernels vs the mma.sync ones vs torch SDPA flash, same run
(H200; H = 16, node-major (N, H, D) fp16 / bf16 data; torch reads the same memory as (1, H, N, D)).

  PYTHONPATH=. python benchmarks/tuning/bench_wgmma.py [--out DIR] [--no-sweep] [--N 4096,16384]
  PYTHONPATH=. python benchmarks/tuning/bench_wgmma.py --build sm_90   # cubins of every kernel this run
                                                                # launches, into the cache (no GPU)

1. sweep: each candidate wgmma shape (CANDIDATES) on N = 4096 and 16384, causal and not, forward or
   backward time; results checked against torch flash (relative L2 < 2e-2, else the shape is
   dropped); the fastest goes into tuning.TUNING_WGMMA for the rest of the run (printed as a table to
   paste into api.py).
2. table: per cell, ours with wgmma (tg.options(wgmma=True)), ours with mma.sync (wgmma=False) and torch flash,
   forward and forward+backward (ratio = torch time / ours), plus bf16 with wgmma.
Timing: CUDA events, median of bench_tc.REPS after warm-up (bench_tc.bench).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_tc
import bench_tc as B  # noqa: E402  (sets up the import path, torch, the Ours wrapper)
from tiga_numba.cuda.tc import api, build, tuning  # noqa: E402

S = dict(MT=1, a_smem=True, wgmma=True)
#: (kind, D) -> shapes; "bwd" entries are (dq shape, dkdv shape)
CANDIDATES = {
    ("fwd", 64): [dict(NW=4, BN=64, **S), dict(NW=4, BN=128, **S), dict(NW=8, BN=64, **S), dict(NW=8, BN=128, **S),
                  dict(NW=4, BN=96, **S)],
    ("fwd", 128): [dict(NW=4, BN=64, **S), dict(NW=8, BN=64, **S), dict(NW=4, BN=128, **S),
                   dict(NW=8, BN=128, **S), dict(NW=8, BN=96, **S)],
    ("bwd", 64): [(dict(NW=4, BN=64, **S), dict(NW=4, BN=64, **S)), (dict(NW=8, BN=64, **S), dict(NW=8, BN=64, **S)),
                  (dict(NW=4, BN=128, **S), dict(NW=4, BN=128, **S)), (dict(NW=8, BN=128, **S), dict(NW=8, BN=32, **S)),
                  (dict(NW=8, BN=128, **S), dict(NW=8, BN=128, **S)), (dict(NW=8, BN=128, **S), dict(NW=4, BN=128, **S)),
                  (dict(NW=4, BN=96, **S), dict(NW=4, BN=96, **S)), (dict(NW=4, BN=128, **S), dict(NW=4, BN=96, **S)),
                  (dict(NW=4, BN=128, **S), dict(NW=8, BN=128, **S)), (dict(NW=4, BN=128, **S), dict(NW=8, BN=64, **S)),
                  (dict(NW=4, BN=128, **S), dict(NW=4, BN=64, **S))],
    ("bwd", 128): [(dict(NW=4, BN=64, **S), dict(NW=4, BN=32, **S)), (dict(NW=8, BN=64, **S), dict(NW=8, BN=32, **S)),
                   (dict(NW=4, BN=32, **S), dict(NW=4, BN=32, **S)), (dict(NW=8, BN=128, **S), dict(NW=8, BN=64, **S)),
                   (dict(NW=8, BN=128, **S), dict(NW=4, BN=64, **S)), (dict(NW=4, BN=128, **S), dict(NW=8, BN=64, **S)),
                   (dict(NW=8, BN=96, **S), dict(NW=4, BN=64, **S))],
    ("fwd", 96): [dict(NW=8, BN=128, **S), dict(NW=4, BN=64, **S), dict(NW=4, BN=128, **S)],
    ("bwd", 96): [(dict(NW=8, BN=128, **S), dict(NW=4, BN=64, **S)), (dict(NW=4, BN=128, **S), dict(NW=4, BN=64, **S)),
                  (dict(NW=8, BN=64, **S), dict(NW=4, BN=64, **S))],
    ("fwd", 32): [dict(NW=4, BN=128, **S), dict(NW=8, BN=128, **S), dict(NW=4, BN=64, **S)],
    ("bwd", 32): [(dict(NW=4, BN=128, **S), dict(NW=4, BN=128, **S)), (dict(NW=8, BN=128, **S), dict(NW=8, BN=128, **S)),
                  # overlapped backward chains: the other pairings of one / two warpgroups
                  (dict(NW=4, BN=128, **S), dict(NW=8, BN=128, **S)), (dict(NW=8, BN=128, **S), dict(NW=4, BN=128, **S)),
                  (dict(NW=4, BN=128, **S), dict(NW=8, BN=64, **S)), (dict(NW=8, BN=64, **S), dict(NW=8, BN=64, **S)),
                  (dict(NW=4, BN=128, **S), dict(NW=4, BN=64, **S))],
}


def candidate_specs(cands, dtype):
    """(kind, D, dtype, shape) of every kernel a sweep over `cands` launches."""
    return [(kk, D, dtype, cfg) for (kind, D), opts in cands.items() for o in opts
            for kk, cfg in ([("fwd", o)] if kind == "fwd" else [("dq", o[0]), ("dkdv", o[1])])]


def build_specs(specs, arch):
    """the cubins of `specs` (duplicates dropped) into the cache, 2 processes (no GPU needed)."""
    t0 = time.time()
    seen, uniq = set(), []
    for s in specs:
        if repr(s) not in seen:
            seen.add(repr(s))
            uniq.append(s)
    names = build.build_cubins(specs=uniq, arch=arch, jobs=2)
    print(f"{len(names)} cubins ({arch}; wgmma ones as sm_90a) in {time.time() - t0:.0f} s")


def specs():
    """(kind, D, dtype, shape) of every kernel the run launches: candidates, shipped tables, Delta."""
    out = candidate_specs(CANDIDATES, "float16")
    for dt in ("float16", "bfloat16"):
        for D in (64, 128):
            for kind in ("fwd", "dq", "dkdv"):
                out.append((kind, D, dt, dict(tuning.TUNING_WGMMA[(kind, D)])))
                out.append((kind, D, dt, dict(tuning.TUNING[(kind, D)])))
            out.append(("delta", D, dt))
    for dt, D in (("float16", 64), ("float16", 128), ("float32", 64)):   # pruned forwards (tests, prune_cells)
        for table in ((tuning.TUNING_WGMMA, tuning.TUNING) if dt == "float16" else (tuning.TUNING_F32,)):
            out.append(("fwd", D, dt, dict(table[("fwd", D)], prune=True)))
    return out


def build_all(arch):
    build_specs(specs(), arch)


def cell_time(kind, D, N, causal, dtype="float16"):
    """(forward or backward time in ms, max relative error vs torch: flash for 16-bit, the efficient
    kernel for float32) of one dense cell with the current tuning."""
    import numpy as np
    import torch
    g = torch.Generator(device="cuda").manual_seed(N + D + causal)
    tdt = getattr(torch, dtype)
    ref = B.sdpa_eff if dtype == "float32" else B.sdpa
    q, k, v, do = (torch.randn(N, B.H, D, device="cuda", dtype=tdt, generator=g) for _ in range(4))
    ours = B.Ours(q, k, v, np.array([0, N]), causal, dtype)
    if kind == "fwd":
        ours.fwd()
        err = B.rel(ours.out, ref(q, k, v, causal))
        return B.bench(ours.fwd), err
    ours.fwd_bwd(do)
    qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    ref(qt, kt, vt, causal).backward(do)
    err = max(B.rel(ours.dq, qt.grad), B.rel(ours.dk, kt.grad), B.rel(ours.dv, vt.grad))
    return B.bench(lambda: ours.bwd(do)), err


def sweep(Ns, cands=None, table=None, dtype="float16", tol=2e-2):
    """time every candidate of `cands` (default CANDIDATES) in the wgmma table `table` (default
    tuning.TUNING_WGMMA); results off torch by tol or more are dropped; the fastest stays in the table."""
    B.engine(True)
    cands = CANDIDATES if cands is None else cands
    table = tuning.TUNING_WGMMA if table is None else table
    for (kind, D), opts in cands.items():
        keys = [("fwd", D)] if kind == "fwd" else [("dq", D), ("dkdv", D)]
        saved = {k: table[k] for k in keys}
        best = None
        for o in opts:
            for k_, val in zip(keys, [o] if kind == "fwd" else o):
                table[k_] = val
            try:
                t0, tot, worst, parts = time.time(), 0.0, 0.0, []
                for N in Ns:
                    for causal in (False, True):
                        t, err = cell_time(kind, D, N, causal, dtype)
                        tot, worst = tot + t, max(worst, err)
                        parts.append(f"{t:.3f}")
                ok = worst < tol
                B.say(f"sweep {dtype} {kind} D={D} {short(o)}: {tot:.3f} ms ({' / '.join(parts)}; N={Ns} x causal 0/1) "
                      f"max rel err vs torch {worst:.1e}{'' if ok else '  WRONG: dropped'} ({time.time() - t0:.1f} s)")
                if ok and (best is None or tot < best[0]):
                    best = (tot, o)
            except Exception as ex:  # noqa: BLE001
                B.say(f"sweep {dtype} {kind} D={D} {short(o)}: FAILED {repr(ex)[:300]}")
        for k_, val in saved.items():
            table[k_] = val
        if best:
            for k_, val in zip(keys, [best[1]] if kind == "fwd" else best[1]):
                table[k_] = val
            B.say(f"sweep {dtype} {kind} D={D}: chose {short(best[1])}")
    B.say(f"{dtype} wgmma tuning = {{" + ", ".join(f"{k!r}: {short(v)}" for k, v in table.items()) + "}")


def short(o):
    if isinstance(o, tuple):
        return "(" + ", ".join(short(x) for x in o) + ")"
    return f"NW={o['NW']} BN={o['BN']}" + (f" pb_cols={o['pb_cols']}" if "pb_cols" in o else "")


def table(Ns):
    import torch
    B.say("\ncell | ours wgmma fwd ms (TF/s) | ours mma.sync fwd ms | torch flash fwd ms | ratio wgmma / mma.sync "
          "|| fwd+bwd ms wgmma / mma.sync / torch | ratio wgmma / mma.sync")
    for N in Ns:
        for D in (64, 128):
            for causal in (False, True):
                got = {}
                for wg in ("1", "0"):
                    B.engine(wg == "1")
                    got[wg] = B.dense_cell(N, D, causal, check=(N == Ns[0]))
                a, b = got["1"], got["0"]
                B.say(f"N={N:6d} D={D:3d} causal={int(causal)} | {a['fwd_ms_ours']:.3f} ({a['fwd_tfs_ours']:.0f}) | "
                      f"{b['fwd_ms_ours']:.3f} ({b['fwd_tfs_ours']:.0f}) | {a['fwd_ms_torch']:.3f} "
                      f"({a['fwd_tfs_torch']:.0f}) | {a['fwd_ratio']:.2f} / {b['fwd_ratio']:.2f} || "
                      f"{a['fb_ms_ours']:.3f} / {b['fb_ms_ours']:.3f} / {a['fb_ms_torch']:.3f} | "
                      f"{a['fb_ratio']:.2f} / {b['fb_ratio']:.2f}   fb/fwd {a['fb_ms_ours'] / a['fwd_ms_ours']:.2f}  "
                      + " ".join(f"{k[4:]}={v:.1e}" for k, v in a.items() if k.startswith("err")))
    B.engine(True)
    for D in (32, 96):   # wgmma only (the mma.sync kernels do not take them)
        for causal in (False, True):
            r = B.dense_cell(Ns[-1], D, causal)
            B.say(f"D={D} (wgmma only) " + B.fmt(r) + f"  fb/fwd {r['fb_ms_ours'] / r['fwd_ms_ours']:.2f}")
    for D in (64, 128):
        r16 = B.dense_cell(Ns[-1], D, False, bwd=False)
        r = B.dense_cell(Ns[-1], D, False, dtype=torch.bfloat16, bwd=False)
        B.say(f"bf16 wgmma N={Ns[-1]} D={D}: fwd {r['fwd_ms_ours']:.3f} ms vs fp16 {r16['fwd_ms_ours']:.3f} ms "
              f"(bf16/fp16 time {r['fwd_ms_ours'] / r16['fwd_ms_ours']:.3f}); torch bf16 ratio {r['fwd_ratio']:.2f}")


def local_qkv(n, D, seed=0):
    """a local workload (positions on a circle in the first 8 dims, as the tests'): fp16 cupy q, k, v
    of shape (n, H, D); far keys score low, so far tiles get pruned."""
    import cupy
    import numpy as np
    rng = np.random.default_rng(seed)
    pos = np.arange(n) / n * 2 * np.pi
    base = np.zeros((n, D), np.float32)
    base[:, :8] = np.stack([np.cos(pos * f) for f in (1, 2, 3, 4)] + [np.sin(pos * f) for f in (1, 2, 3, 4)], 1) * 3
    mk = lambda f: cupy.asarray((base[:, None] + f * rng.standard_normal((n, B.H, D))).astype(np.float16))  # noqa: E731
    return mk(0.3), mk(0.3), mk(1.0)


def prune_cells(n=16384, D=64):
    """tile pruning on the tensor-core path (shipped engine of this device), local workload
    (positions on a circle in the first 8 dims, as the tests'), exact vs rho: time, error, pruned fraction."""
    import dataclasses
    import types

    import cupy
    import numpy as np

    from tiga_numba.cuda import tc
    from tiga_numba.graph import BlockRelation
    q, k, v = local_qkv(n, D)
    err = lambda a, b: float(cupy.linalg.norm((a - b).astype(cupy.float32)) / cupy.linalg.norm(b.astype(cupy.float32)))  # noqa: E731
    for causal in (1, 0):
        rel_ = BlockRelation(cupy.asarray(np.array([0, n])), cupy.asarray(np.array([0, n])),
                             cupy.asarray(np.array([causal], np.uint8)), n, n)
        plan = lambda rho: types.SimpleNamespace(scale=D ** -0.5, prune_threshold=rho, score="dot", run_info={})  # noqa: E731
        exact = tc.forward(plan(None), q, k, v, rel_)[0]
        t_exact = B.bench(lambda: tc.forward(plan(None), q, k, v, rel_))
        # the kernels alone (raw launches, no counter read-back): exact vs pruned variant
        vr = tuning.variant("fwd", D, D, "float16")
        rec = api.relation_record([0, n], [0, n], [causal])
        o_, m_, l_ = cupy.empty_like(q), cupy.empty((n, B.H), cupy.float32), cupy.empty((n, B.H), cupy.float32)
        ops = [(int(x.data.ptr), x.strides[0], x.strides[1]) for x in (q, k, v)]
        raw = lambda vv, rho=None: api.launch_forward(vv, rec, B.H, B.H, *ops, int(o_.data.ptr), int(m_.data.ptr),  # noqa: E731
                                                      int(l_.data.ptr), D ** -0.5, B.Stream(), rho=rho)
        k_exact = B.bench(lambda: raw(vr))
        for rho in (1e-2, 1e-4):
            p = plan(rho)
            out = tc.forward(p, q, k, v, rel_)[0]
            t = B.bench(lambda: tc.forward(plan(rho), q, k, v, rel_))
            k_pr = B.bench(lambda: raw(dataclasses.replace(vr, prune=True), rho))
            B.say(f"pruning N={n} D={D} causal={causal} rho={rho:g}: tc.forward {t:.3f} ms vs exact {t_exact:.3f} ms "
                  f"(speed-up {t_exact / t:.2f}x); kernel alone {k_pr:.3f} vs {k_exact:.3f} ms ({k_exact / k_pr:.2f}x); "
                  f"{p.run_info['pruned_tiles']}/{p.run_info['total_tiles']} tiles pruned, rel err vs exact "
                  f"{err(out, exact):.1e}  [{p.run_info['kernel']}]")


def prune_paths(n=8192, D=64):
    """whole tg.attention calls, fp16 local workload (as prune_cells), pruned and exact, on the
    tensor-core path vs the CUDA-core kernels (tg.options(tensor_cores=False)): what a user asking
    for pruning gets on each path."""
    import tiga_numba as tg
    q, k, v = local_qkv(n, D)
    for causal in (True, False):
        g = tg.Graph.triangular(n) if causal else tg.Graph.dense(n)
        row = []
        for use_tc in (True, False):
            with tg.options(tensor_cores=use_tc):
                t_ex = B.bench(lambda: tg.attention(q, k, v, g))
                t_pr = B.bench(lambda: tg.attention(q, k, v, g, block_prune_threshold=1e-2))
            row.append((t_ex, t_pr))
        (tc_ex, tc_pr), (cc_ex, cc_pr) = row
        B.say(f"pruning paths N={n} D={D} fp16 causal={int(causal)} rho=1e-2 (tg.attention): tensor cores exact "
              f"{tc_ex:.3f} / pruned {tc_pr:.3f} ms; CUDA-core exact {cc_ex:.3f} / pruned {cc_pr:.3f} ms; "
              f"pruned tensor-core call vs pruned CUDA-core call {cc_pr / tc_pr:.1f}x faster")


def sweep_cli():
    """the options of a sweep-then-table script (this one and bench_fp32_wgmma.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the saved table")
    ap.add_argument("--build", default=None, metavar="ARCH", help="only build the cubins this run launches (no GPU)")
    ap.add_argument("--no-sweep", action="store_true", help="the table with the shipped shapes")
    ap.add_argument("--sweep-only", action="store_true", help="only the shape sweep")
    ap.add_argument("--N", default="4096,16384")
    return ap


def save(out, name):
    """every line said this run (bench_tc.LINES) -> out/name."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as fh:
        fh.write("\n".join(B.LINES) + "\n")


def main():
    ap = sweep_cli()
    ap.add_argument("--prune-only", action="store_true", help="only the tile-pruning cells")
    ap.add_argument("--keys", default=None, help="sweep (and --build) only these CANDIDATES entries, e.g. bwd:32,bwd:64")
    a = ap.parse_args()
    cands = CANDIDATES if a.keys is None else {k: v for k, v in CANDIDATES.items() if f"{k[0]}:{k[1]}" in a.keys.split(",")}
    if a.build:
        build_specs(candidate_specs(cands, "float16"), a.build) if a.keys else build_all(a.build)
        return
    Ns = [int(x) for x in a.N.split(",")]
    import cupy
    B.say(f"device {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"cc {cupy.cuda.Device().compute_capability}; torch {B.torch.__version__}")
    if not a.no_sweep and not a.prune_only:
        sweep(Ns, cands)
    if not a.prune_only and not a.sweep_only:
        table(Ns)
    if not a.sweep_only:
        for cells in (prune_cells, prune_paths):
            try:
                cells()
            except Exception as ex:  # noqa: BLE001
                B.say(f"{cells.__name__} FAILED {ex!r}"[:300])
    save(a.out, "wgmma_bench.txt")


if __name__ == "__main__":
    main()
