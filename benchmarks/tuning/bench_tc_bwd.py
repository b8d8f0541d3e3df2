"""Tensor-core backward A/B on the GPU, same run, same inputs (H = 16, node-major (N, H, D)):
the fused dK/dV/dQ kernel (5 products, dQ added to a float32 accumulator in a fixed key-tile order)
vs the two-kernel backward it replaced (dQ kernel + dK/dV kernel, 7 products), next to our forward
(for the forward+backward / forward ratio) and torch SDPA forward+backward (flash for 16-bit,
efficient for float32) as the anchor.

  PYTHONPATH=. python benchmarks/tuning/bench_tc_bwd.py [--dtypes float16,float32] [--N 4096,16384]
         [--build sm_90]    # only fill the cubin cache for every kernel this run launches (no GPU)
         [--spills sm_90]   # ptxas registers / spill bytes of the backward kernels (no GPU)
         [--wgmma --dims 32,64,128]   # the sm_90a kernels: shipped two-kernel wgmma backward vs the
                                      # fused wgmma candidates (WG_CANDIDATES, ordered and atomic)
         [--wgmma --no-fused]         # ... vs its overlap twins, the dK/dV kernel reading its statistics
                                      # from global memory (Variant.stats_smem off) and WG_PAIRS' shapes

Checks in every cell: each fused candidate's dq, dk, dv vs the two-kernel backward (relative L2)
and the first fused candidate run twice is bit-identical (the ordered accumulation's promise).
Timing: CUDA events, median of REPS after warm-up.
"""
import argparse
import dataclasses
import os
import sys

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import tiga_numba  # noqa: E402,F401  (first: shields tiga_numba.cuda from numba-cuda's import redirector)
from tiga_numba.cuda.tc import api, build, tuning  # noqa: E402
from tiga_numba.cuda.tc import generator as G  # noqa: E402

H = 16
#: fused shapes tried next to tuning.FUSED_DKDV's, (dtype, D) -> [Variant fields]
CANDIDATES = {
    ("float16", 64): [dict(NW=4, MT=1, BN=64)],
    ("float16", 128): [dict(NW=4, MT=1, BN=64, a_smem=True)],
    ("float32", 64): [],
    ("float32", 128): [],
}


#: fused wgmma shapes (16-bit), D -> [Variant fields]; each runs ordered (deterministic) and with
#: float atomics; the first ordered one is the bitwise-repeat check
WG_CANDIDATES = {
    32: [dict(NW=8, BN=128), dict(NW=4, BN=128), dict(NW=8, BN=64)],
    64: [dict(NW=8, BN=64), dict(NW=8, BN=128), dict(NW=4, BN=128), dict(NW=4, BN=64)],
    128: [dict(NW=8, BN=64), dict(NW=4, BN=64)],
}
WG = dict(MT=1, a_smem=True, wgmma=True)
#: two-kernel wgmma shapes tried beside the shipped pair with --no-fused, D -> [(dQ fields, dK/dV fields)]
#: (Variant fields; overlap defaults to True). D = 256: the dK/dV kernel keeps its columns in parts
#: (Variant.col_parts); ptxas fits every one of these without spills but the NW = 4, BN = 64 dK/dV
#: kernel at D = 256 and the NW = 8, BN = 64 one at D = 128 (8 B each)
WG_PAIRS = {
    64: [(dict(NW=4, BN=128, overlap=False), dict(NW=8, BN=64)),
         (dict(NW=8, BN=128, overlap=False), dict(NW=4, BN=128))],
    128: [(dict(NW=8, BN=128, overlap=False), dict(NW=8, BN=32)),
          (dict(NW=8, BN=128, overlap=False), dict(NW=8, BN=64)),
          (dict(NW=4, BN=64, overlap=False), dict(NW=4, BN=64))],
    256: [(dict(NW=nwq, BN=bnq), dict(NW=nwk, BN=bnk, col_parts=2))
          for nwq, bnq in ((8, 32), (4, 32), (4, 64)) for nwk, bnk in ((8, 32), (4, 32), (4, 64))],
}


def wg_variants(dtype, D, fused=True):
    """the sm_90a counterpart of variants(): the shipped two-kernel wgmma backward; candidates: the
    same two kernels with Variant.overlap flipped (both; without `fused` also one at a time), or
    (fused) the fused wgmma shapes, ordered then atomic for each."""
    unf = (tuning.variant("dq", D, D, dtype, wgmma=True), tuning.variant("dkdv", D, D, dtype, wgmma=True))
    flip = [dataclasses.replace(x, overlap=not x.overlap).check() for x in unf]
    cands = [tuple(flip)] + ([] if fused else [(flip[0], unf[1]), (unf[0], flip[1])])   # both, or one kernel flipped
    pairs = [(G.Variant("dq", D, D, dtype=dtype, **WG, **fq).check(), G.Variant("dkdv", D, D, dtype=dtype, **WG, **fk).check())
             for fq, fk in WG_PAIRS.get(D, []) if not fused]
    if not fused and unf[1].stats_in_smem:   # the dK/dV kernel loading its statistics from global memory
        pairs.insert(0, (unf[0], dataclasses.replace(unf[1], stats_smem=False)))
    cands += [p for p in pairs if p != unf]
    cands += [(None, G.Variant("dkdv", D, D, dtype=dtype, fuse_dq=True, dq_atomic=at, **WG, **c).check())
              for at in (False, True) for c in (WG_CANDIDATES[D] if fused and dtype != "float32" else [])]
    return unf, cands


def variants(dtype, D):
    """(two-kernel (dq, dkdv) as shipped, [fused candidates]); the first candidate is tuning.FUSED_DKDV's"""
    dq, dkdv = tuning.variant("dq", D, D, dtype), tuning.variant("dkdv", D, D, dtype)
    fields = {f: getattr(dkdv, f) for f in ("NW", "MT", "BN", "a_smem")}
    unf = (dq, G.Variant("dkdv", D, D, dtype=dtype, **fields).check())
    first = tuning.FUSED_DKDV[("float32" if dtype == "float32" else "float16", D)]
    cands = [(None, G.Variant("dkdv", D, D, dtype=dtype, fuse_dq=True, **c).check())
             for c in [first] + CANDIDATES[(dtype, D)]]
    # the same kernel with float atomics for dQ (FA2's scheme, not deterministic): what the turn
    # order costs
    cands.append((None, G.Variant("dkdv", D, D, dtype=dtype, fuse_dq=True, dq_atomic=True, **first).check()))
    return unf, cands


def fill_cache(arch, dtypes, dims, pick):
    specs = []
    for dt in dtypes:
        for D in dims:
            (vq, vk), cands = pick(dt, D)
            for v in (vq, vk, *(x for c in cands for x in c if x), tuning.variant("fwd", D, D, dt, wgmma=vq.wgmma)):
                fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.name not in ("kind", "D", "Dv", "dtype")}
                specs.append((v.kind, D, dt, fields))
            specs.append(("delta", D, dt))
    names = build.build_cubins(specs=specs, arch=arch, jobs=2)
    print(f"{len(names)} cubins for {arch}: {', '.join(names)}")


def spills(arch, dtypes, dims, pick):
    """ptxas's register / spill report (nvJitLink, verbose) of the backward kernels: no GPU needed."""
    for dt in dtypes:
        for D in dims:
            (vq, vk), cands = pick(dt, D)
            for v in dict.fromkeys((vq, vk, *(x for c in cands for x in c if x))):   # each kernel once
                r = build.kernel(v)[0].ptxas(arch)
                print(f"{v.name():52s} regs {r['regs']!s:>4s}  spill stores/loads {r['spill_stores']} / "
                      f"{r['spill_loads']} B  smem {v.smem_bytes()} B", flush=True)


def label(c):
    """a candidate (dQ variant or None, dK/dV variant) as a short name."""
    vq, vk = c
    if vq is None:
        return vk.name().split("_", 4)[-1]
    mode = lambda v: "overlap" if v.wg_async else "serial"  # noqa: E731
    shape = lambda v: (f"-nw{v.NW}bn{v.BN}" + (f"cp{v.col_parts}" if v.col_parts > 1 else "")  # noqa: E731
                       + ("-global-stats" if v.stats_streamable() and not v.stats_smem else ""))
    return f"2-kernel dq-{mode(vq)}{shape(vq)}/dkdv-{mode(vk)}{shape(vk)}"


def launch(BT, ours, vq, vk, do, out=None):
    """one backward of (vq, vk) on a bench_tc.Ours' forward, into `out` (dq, dk, dv) or its buffers."""
    dq, dk, dv = out or (ours.dq, ours.dk, ours.dv)
    api.launch_backward(vq, vk, ours.rec, ours.N, ours.H, ours.Hkv, BT.op(ours.q), BT.op(ours.k), BT.op(ours.v),
                        BT.op(do), BT.op(ours.out), ours.m2.data_ptr(), ours.l.data_ptr(), ours.delta.data_ptr(),
                        ours.lse2.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ours.scale, ours.st)


def sanitize(dtypes, dims, pick):
    """every candidate's backward once on a small case (segments of length 0 / 1 / tails, GQA 4 / 2,
    causal and not): run under compute-sanitizer memcheck / racecheck."""
    import torch

    import bench_tc as BT
    cu = np.array([0, 1, 1, 70, 200, 201, 333])
    N = int(cu[-1])
    for dt in dtypes:
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dt]
        for D in dims:
            (vq, vk), cands = pick(dt, D)
            for causal in (True, False):
                q, do = (torch.randn(N, 4, D, device="cuda", dtype=tdt) for _ in range(2))
                k, v = (torch.randn(N, 2, D, device="cuda", dtype=tdt) for _ in range(2))
                ours = BT.Ours(q, k, v, cu, causal, dt)
                ours.fwd()
                ours.bwd(do)
                ref = [x.clone() for x in (ours.dq, ours.dk, ours.dv)]
                for c in cands:
                    for x in (ours.dq, ours.dk, ours.dv):
                        x.fill_(float("nan"))
                    launch(BT, ours, *c, do)
                    torch.cuda.synchronize()
                    err = max(BT.rel(x, r) for x, r in zip((ours.dq, ours.dk, ours.dv), ref))
                    print(f"sanitize {label(c)} causal={int(causal)}: vs shipped {err:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float16,float32")
    ap.add_argument("--N", default="4096,16384")
    ap.add_argument("--build", default=None, metavar="ARCH")
    ap.add_argument("--spills", default=None, metavar="ARCH", help="print ptxas register/spill counts (no GPU)")
    ap.add_argument("--wgmma", action="store_true", help="the sm_90a kernels (16-bit dtypes): WG_CANDIDATES")
    ap.add_argument("--dims", default=None, help="head dims (default 64,128; --wgmma 32,64,128)")
    ap.add_argument("--sanitize", action="store_true", help="each candidate once on a small case (compute-sanitizer)")
    ap.add_argument("--no-fused", action="store_true", help="--wgmma: only the overlap A/B of the two-kernel backward "
                    "(both kernels flipped, then the dQ and the dK/dV kernel alone)")
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    pick = (lambda dt, D: wg_variants(dt, D, not a.no_fused)) if a.wgmma else variants
    dims = [int(x) for x in (a.dims or ("32,64,128" if a.wgmma else "64,128")).split(",")]
    if a.build:
        return fill_cache(a.build, dtypes, dims, pick)
    if a.spills:
        return spills(a.spills, dtypes, dims, pick)
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_tc
    if a.sanitize:
        return sanitize(dtypes, dims, pick)
    import bench_tc as BT
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    print(f"# {torch.cuda.get_device_name()}  H={H}  reps={BT.REPS}")
    print("# columns: fwd, shipped two-kernel bwd, bwd per candidate (ms); torch fwd+bwd (ms); "
          "ratio = torch / (our fwd + best candidate bwd) (shipped: torch / (fwd + shipped bwd)); fwd+bwd / fwd, "
          "shipped and best candidate")
    for dt in dtypes:
        for D in dims:
            (vq, vk), cands = pick(dt, D)
            for N in (int(x) for x in a.N.split(",")):
                for causal in (False, True):
                    g = torch.Generator(device="cuda").manual_seed(N + D + causal)
                    q, k, v, do = (torch.randn(N, H, D, device="cuda", dtype=tdt[dt], generator=g) for _ in range(4))
                    ours = BT.Ours(q, k, v, np.array([0, N]), causal, dt)
                    ours.fwd()
                    ours.bwd(do)   # allocates dq/dk/dv, delta, lse2

                    def bwd(vq_, vk_, out=None, ours=ours, do=do):   # bound now: the cell's names are deleted below
                        launch(BT, ours, vq_, vk_, do, out)
                    t_fwd = BT.bench(ours.fwd)
                    t_unf = BT.bench(lambda: bwd(vq, vk))
                    ref = [x.clone() for x in (ours.dq, ours.dk, ours.dv)]
                    times, errs = [], []
                    for c in cands:
                        times.append(BT.bench(lambda c=c: bwd(*c)))
                        errs.append(max(BT.rel(x, r) for x, r in zip((ours.dq, ours.dk, ours.dv), ref)))
                    bufs = [tuple(torch.empty_like(x) for x in (q, k, v)) for _ in range(2)]
                    for b in bufs:
                        bwd(*cands[0], b)
                    torch.cuda.synchronize()
                    same = all(torch.equal(x, y) for x, y in zip(*bufs))   # cands[0]: deterministic
                    qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
                    anchor = BT.sdpa_eff if dt == "float32" else BT.sdpa

                    def torch_fb(qt=qt, kt=kt, vt=vt, do=do):
                        anchor(qt, kt, vt, causal).backward(do)
                    t_torch = BT.bench(torch_fb)
                    best = min(times)
                    print(f"{dt:8s} N={N:6d} D={D:3d} causal={int(causal)} | fwd {t_fwd:7.3f} | shipped bwd {t_unf:7.3f}"
                          f" | candidates " + " ".join(f"{label(c)}={t:.3f}" for c, t in zip(cands, times))
                          + f" | torch f+b {t_torch:7.3f} | ratio {t_torch / (t_fwd + best):.2f}"
                          f" (shipped {t_torch / (t_fwd + t_unf):.2f}) | f+b/f {(t_fwd + t_unf) / t_fwd:.2f}"
                          f" (best candidate {(t_fwd + best) / t_fwd:.2f})"
                          f" | err vs shipped {max(errs):.1e} | bitwise repeat {same}", flush=True)
                    del ours, q, k, v, do, qt, kt, vt, bufs, ref
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
