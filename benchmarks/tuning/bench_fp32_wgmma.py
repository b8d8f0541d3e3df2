"""float32 on the H200's wgmma (bf16 x 3 splits, 6 passes per product) vs the 3xTF32 mma.sync kernels
vs torch SDPA's efficient kernel in fp32, same run (H = 16, node-major (N, H, D) float32 data).

  PYTHONPATH=. python benchmarks/tuning/bench_fp32_wgmma.py [--out DIR] [--no-sweep] [--N 4096,16384]
  PYTHONPATH=. python benchmarks/tuning/bench_fp32_wgmma.py --build sm_90   # cubins of every kernel this run
                                                                      # launches, into the cache (no GPU)
  PYTHONPATH=. python benchmarks/tuning/bench_fp32_wgmma.py --resources --dims 32,64,96,128
                                                    # ptxas registers / spills of the shipped kernels (no GPU)

1. sweep: each candidate shape (CANDIDATES) on N = 4096 and 16384, causal and not, forward or
   backward time; results checked against torch SDPA efficient fp32 (relative L2 < 1e-4, else
   dropped); the fastest goes into tuning.TUNING_WGMMA_F32 for the rest of the run.
2. table: per cell, ours on wgmma (tg.options(wgmma=True)), ours 3xTF32 (wgmma=False) and torch, forward and
   forward+backward (ratio = torch time / ours), forward+backward / forward, and the relative L2
   error of out / dq / dk / dv against float64 (ours and torch).
Timing: CUDA events, median of bench_tc.REPS after warm-up (bench_tc.bench).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_tc
import bench_tc as B  # noqa: E402  (sets up the import path, torch, the Ours wrapper)
import bench_wgmma as W  # noqa: E402  (the shape sweep)
from tiga_numba.cuda.tc import build, tuning  # noqa: E402

S = dict(MT=1, a_smem=True, wgmma=True)
#: (kind, D) -> shapes; "bwd" entries are (dq shape, dkdv shape). Shared memory allows BN <= 128
#: (D = 64) / 64 (D = 128 forward) / 32 (D = 128 backward, one warpgroup).
CANDIDATES = {
    ("fwd", 64): [dict(NW=4, BN=64, **S), dict(NW=4, BN=128, **S), dict(NW=8, BN=64, **S)],
    ("fwd", 128): [dict(NW=4, BN=64, **S), dict(NW=4, BN=32, **S), dict(NW=8, BN=32, **S),
                   dict(NW=8, BN=32, pb_cols=32, **S)],
    ("bwd", 64): [(dict(NW=4, BN=64, **S), dict(NW=4, BN=64, **S)), (dict(NW=4, BN=128, **S), dict(NW=4, BN=64, **S)),
                  (dict(NW=4, BN=64, **S), dict(NW=4, BN=32, **S)), (dict(NW=8, BN=32, **S), dict(NW=8, BN=32, **S))],
    ("bwd", 128): [(dict(NW=4, BN=32, **S), dict(NW=4, BN=32, **S)), (dict(NW=4, BN=32, **S), dict(NW=4, BN=16, **S)),
                   # 32-column P B chains: fewer partial registers (the dK/dV kernel spills 236 B instead of 328)
                   (dict(NW=4, BN=32, **S), dict(NW=4, BN=32, pb_cols=32, **S)),
                   (dict(NW=4, BN=32, pb_cols=32, **S), dict(NW=4, BN=32, pb_cols=32, **S))],
}


def specs():
    """(kind, D, dtype, shape) of every kernel the run launches: candidates, both float32 tables, Delta."""
    out = W.candidate_specs(CANDIDATES, "float32")
    for D in (64, 128):
        for kind in ("fwd", "dq", "dkdv"):
            out.append((kind, D, "float32", dict(tuning.TUNING_WGMMA_F32[(kind, D)])))
            out.append((kind, D, "float32", dict(tuning.TUNING_F32[(kind, D)])))
        out.append(("fwd", D, "float32", dict(tuning.TUNING_WGMMA_F32[("fwd", D)], prune=True)))
        out.append(("delta", D, "float32"))
    return out


def resources(dims):
    """ptxas's registers / spills of the shipped float32 wgmma kernels (sm_90a, no GPU)."""
    for D in dims:
        for kind in ("fwd", "dq", "dkdv"):
            v = tuning.variant(kind, D, D, "float32", wgmma=True)
            r = build.kernel(v)[0].ptxas("sm_90a")
            print(f"{v.name():56s} regs {r['regs']!s:>4s}  spill stores/loads {r['spill_stores']} / "
                  f"{r['spill_loads']} B  smem {v.smem_bytes()} B{'  SERIALISED' if r['serialised'] else ''}",
                  flush=True)


def sweep(Ns, dims):
    W.sweep(Ns, {k: c for k, c in CANDIDATES.items() if k[1] in dims}, tuning.TUNING_WGMMA_F32, "float32", tol=1e-4)


def table(Ns, engines, dims=(64, 128)):
    B.say("\ncell | fwd ms (TF/s): ours wgmma bf16x3 / ours 3xTF32 / torch eff | fwd ratio wgmma / 3xTF32 || "
          "fwd+bwd ms (TF/s) wgmma / 3xTF32 / torch | fb ratio wgmma / 3xTF32 | fb/fwd (wgmma) | errors vs f64")
    for N in Ns:
        for D in dims:
            for causal in (False, True):
                got = {}
                for wg in engines if D in tuning.F32_HEAD_DIMS else ("1",):   # 3xTF32 serves 64 / 128 only
                    B.engine(wg == "1")
                    got[wg] = B.fp32_cell(N, D, causal)
                a = got["1"]
                b = got.get("0")
                m = lambda r, k: f"{r[k]:.3f}" if r else "-"  # noqa: E731
                rt = lambda r, k: f"{r[k]:.2f}" if r else "-"  # noqa: E731
                B.say(f"N={N:6d} D={D:3d} causal={int(causal)} | {a['fwd_ms_ours']:.3f} ({a['fwd_tfs_ours']:.0f}) / "
                      f"{m(b, 'fwd_ms_ours')} / {a['fwd_ms_torch']:.3f} ({a['fwd_tfs_torch']:.0f}) | "
                      f"{a['fwd_ratio']:.2f} / {rt(b, 'fwd_ratio')} || {a['fb_ms_ours']:.3f} ({a['fb_tfs_ours']:.0f}) / "
                      f"{m(b, 'fb_ms_ours')} / {a['fb_ms_torch']:.3f} ({a['fb_tfs_torch']:.0f}) | {a['fb_ratio']:.2f} / "
                      f"{rt(b, 'fb_ratio')} | {a['fb_ms_ours'] / a['fwd_ms_ours']:.2f} | "
                      + " ".join(f"{k[4:]}={v:.1e}" for k, v in a.items() if k.startswith("err")))
    B.engine(True)


def main():
    ap = W.sweep_cli()
    ap.add_argument("--no-tf32", action="store_true", help="table without the 3xTF32 column")
    ap.add_argument("--dims", default="64,128", help="head dims of the sweep, the table and --resources")
    ap.add_argument("--resources", action="store_true", help="ptxas registers / spills of the shipped kernels (no GPU)")
    a = ap.parse_args()
    dims = tuple(int(x) for x in a.dims.split(","))
    if a.build:
        return W.build_specs(specs(), a.build)
    if a.resources:
        return resources(dims)
    Ns = [int(x) for x in a.N.split(",")]
    B.say(f"float32 tuning (wgmma) at start: {tuning.TUNING_WGMMA_F32}")
    if not a.no_sweep:
        sweep(Ns, dims)
    if not a.sweep_only:
        table(Ns, ("1",) if a.no_tf32 else ("1", "0"), dims)
    W.save(a.out, "fp32_wgmma_bench.txt")


if __name__ == "__main__":
    main()
