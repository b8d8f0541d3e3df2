"""Fingerprints of the tensor-core kernels, to show that a refactor changed no kernel (no GPU).

  PYTHONPATH=. python benchmarks/tuning/tc_fingerprint.py          # generated-source hashes (CPU only)
  PYTHONPATH=. python benchmarks/tuning/tc_fingerprint.py --ptx    # + sm_90 PTX of kernels that use every
                                                            #   intrinsic (needs numba-cuda)

Run it before and after a change (e.g. in a `git worktree` of the old commit): equal source hashes
mean every generated kernel text is the same, so cubins verified on a GPU stay valid; equal PTX
hashes mean an edit of ptx.py (the intrinsics) lowered to the same instructions.
"""
import argparse
import hashlib
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import tiga_numba  # noqa: E402,F401  (first: shields tiga_numba.cuda from numba-cuda's import redirector)
from tiga_numba.cuda.tc import generator as G  # noqa: E402


def variants(**axes):
    """every Variant of the product of `axes` that check() and the generator accept."""
    keys = list(axes)
    for combo in itertools.product(*axes.values()):
        f = dict(zip(keys, combo))
        kind, D = f.pop("kind"), f.pop("D")
        try:
            v = G.Variant(kind, D, D, **f).check()
            yield v, G.gen_source(v)
        except (ValueError, AssertionError):   # shapes the generator refuses
            continue


FAMILIES = {
    "mma.sync": dict(kind=("fwd", "dq", "dkdv"), D=(64, 128), dtype=("float16", "bfloat16", "float32"),
                     NW=(4, 8), MT=(1, 2), BN=(16, 32, 64), a_smem=(False, True)),
    "fused dK/dV/dQ": dict(kind=("dkdv",), D=(64, 128), dtype=("float16", "bfloat16", "float32"), NW=(4, 8),
                           MT=(1,), BN=(16, 32, 64), a_smem=(False, True), fuse_dq=(True,),
                           dq_atomic=(False, True)),
    "wgmma": dict(kind=("fwd", "dq", "dkdv"), D=(32, 64, 96, 128), dtype=("float16", "bfloat16", "float32"), NW=(4, 8),
                  MT=(1,), BN=(32, 64, 96, 128), a_smem=(True,), wgmma=(True,)),
    "wgmma serial twins": dict(kind=("dq", "dkdv"), D=(32, 64, 96, 128), dtype=("float16", "float32"), NW=(4, 8),
                               MT=(1,), BN=(32, 64, 128), a_smem=(True,), wgmma=(True,), overlap=(False,)),
    "fused wgmma": dict(kind=("dkdv",), D=(32, 64, 96, 128), dtype=("float16", "bfloat16"), NW=(4, 8), MT=(1,),
                        BN=(64, 128), a_smem=(True,), wgmma=(True,), fuse_dq=(True,), dq_atomic=(False, True)),
    "pruned forward": dict(kind=("fwd",), D=(64, 128), dtype=("float16", "float32"), NW=(4, 8), MT=(1, 2),
                           BN=(32, 64, 128), a_smem=(False, True), wgmma=(False, True), prune=(True,)),
}

#: kernels whose PTX together uses every intrinsic of ptx.py
PTX_SET = [
    dict(kind="fwd", D=64, NW=4, MT=1, BN=64),                                       # ldmatrix, cp.async
    dict(kind="fwd", D=64, dtype="float32", NW=8, MT=1, BN=64),                      # lds64, tf32, stg_v4
    dict(kind="dq", D=64, dtype="float32", NW=4, MT=1, BN=32, a_smem=True),
    dict(kind="dkdv", D=64, NW=4, MT=1, BN=64, a_smem=True, fuse_dq=True),          # turns, sts_*, lds_f32x4
    dict(kind="dkdv", D=64, dtype="float32", NW=4, MT=1, BN=32, a_smem=True, fuse_dq=True),
    dict(kind="dkdv", D=64, NW=4, MT=1, BN=64, a_smem=True, fuse_dq=True, dq_atomic=True),   # red_v2
    dict(kind="dkdv", D=64, dtype="float32", NW=4, MT=1, BN=32, a_smem=True, fuse_dq=True, dq_atomic=True),
    dict(kind="fwd", D=64, NW=4, MT=1, BN=128, a_smem=True, wgmma=True, prune=True),  # wgmma, fence, gate
    dict(kind="dq", D=64, dtype="float32", NW=4, MT=1, BN=64, a_smem=True, wgmma=True),  # split3x2, sts_u32x2, stg_v2
    dict(kind="dkdv", D=64, NW=8, MT=1, BN=64, a_smem=True, wgmma=True, fuse_dq=True),  # st chain, wgmma_wait
]


def ptx_hash():
    import numba
    from numba import cuda

    from tiga_numba.cuda.tc import build
    h = hashlib.sha1()
    for f in PTX_SET:
        f = dict(f)
        kind, D = f.pop("kind"), f.pop("D")
        v = G.Variant(kind, D, D, **f).check()
        env = build._env(v.dtype)
        exec(compile(G.gen_source(v), "<k>", "exec"), env)
        ni, nf = build.signature(v)
        ptx, _ = cuda.compile_ptx(env["kernel"], numba.void(*((numba.int64,) * ni + (numba.float32,) * nf)),
                                  cc=(9, 0), fastmath=True)
        h.update(ptx.encode())
    env = build._env("float16")
    exec(compile(G.gen_delta("float16", 64), "<k>", "exec"), env)
    ptx, _ = cuda.compile_ptx(env["kernel"], numba.void(*((numba.int64,) * 12)), cc=(9, 0), fastmath=True)
    h.update(ptx.encode())
    return h.hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptx", action="store_true")
    a = ap.parse_args()
    for name, axes in FAMILIES.items():
        h, n = hashlib.sha1(), 0
        for _, src in variants(**axes):
            h.update(src.encode())
            n += 1
        print(f"source {name:16s} {n:4d} variants  {h.hexdigest()[:16]}")
    h = hashlib.sha1()
    for dt in ("float16", "bfloat16", "float32"):
        for Dv in (32, 64, 96, 128):
            h.update(G.gen_delta(dt, Dv).encode())
    print(f"source {'Delta':16s} {12:4d} variants  {h.hexdigest()[:16]}")
    if a.ptx:
        print(f"ptx    {len(PTX_SET) + 1} kernels (sm_90)         {ptx_hash()}")


if __name__ == "__main__":
    main()
