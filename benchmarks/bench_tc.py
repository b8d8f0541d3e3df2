"""Tensor-core attention benchmark (GPU): ours vs torch SDPA flash and FlexAttention, same run.

  PYTHONPATH=. python benchmarks/bench_tc.py [--out DIR] [--quick] [--no-sweep] [--no-flex]
  PYTHONPATH=. python benchmarks/bench_tc.py --sanitize     # small fwd+bwd for compute-sanitizer
  PYTHONPATH=. python benchmarks/bench_tc.py --fp32-only --precompile --with-tests --tests-k float32
                                                            # the float32 section alone

Cells (H = 16, fp16, node-major (N, H, D) data; torch reads the same memory as (1, H, N, D)):
  forward and forward+backward at N = 4096, 16384, D = 64, 128, causal and not (ratio =
  torch time / ours); forward-only N sweep for the plot; varlen causal (random document lengths,
  total 16k and 64k tokens) vs FlexAttention with a document block mask (compiled once, mask
  creation not timed); bf16 vs fp16. Timing: CUDA events, median of REPS after warm-up.
Checks: ours vs an fp32 torch reference (forward and gradients) at N = 4096, vs torch flash at
16384. Writes DIR/tc_bench.json, DIR/tc_bench.txt and DIR/tc_tfs.png (matplotlib, if present).
float32 section: ours (the call's routing: bf16 x 3 on wgmma on H100 / H200, 3xTF32 elsewhere or
with tg.options(wgmma=False); its sweep tunes the 3xTF32 table, benchmarks/tuning/bench_fp32_wgmma.py the
wgmma one) vs torch SDPA's efficient kernel in fp32 (3xTF32) at
N = 4096, 16384, D = 64, 128, causal and not, forward and forward+backward, relative errors of
both vs a float64 reference (all heads at 4096, heads 0-1 at 16384), and at N = 4096 the
CUDA-core float32 kernels (tiga_numba.attention with tensor cores off) for the routing decision.
"""
import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


import tiga_numba  # noqa: E402,F401  (first: shields tiga_numba.cuda from numba-cuda's import redirector)

try:   # --build-wide runs where torch is absent (off-device cubin builds)
    import torch  # noqa: E402
    import torch.nn.functional as TF  # noqa: E402
except ImportError:
    torch = TF = None

from tiga_numba.cuda.tc import api, build, device, tuning  # noqa: E402

H = 16
REPS, WARM = 10, 3
LINES = []


_ENGINE = contextlib.ExitStack()


def engine(wgmma):
    """Pin the tensor-core engine for the calls that follow (the run option
    tg.options(wgmma=...), held open until the next engine() call): True = the wgmma kernels on
    compute capability 9.0, False = the mma.sync ones (float32 then as 3xTF32)."""
    _ENGINE.close()
    _ENGINE.enter_context(tiga_numba.options(wgmma=bool(wgmma)))


def say(s):
    print(s, flush=True)
    LINES.append(s)


class Stream:   # torch's current stream for our launches (cuda.core protocol + numba fallback)
    def __init__(self):
        self.ptr = torch.cuda.current_stream().cuda_stream

    def __cuda_stream__(self):
        return (0, self.ptr)

    def numba(self):
        from numba import cuda
        return cuda.external_stream(self.ptr) if self.ptr else cuda.default_stream()


def bench(fn):
    for _ in range(WARM):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    return ts[len(ts) // 2]


def op(x):
    """(address, row stride, head stride) in bytes of a node-major (N, H, D) torch tensor."""
    return (x.data_ptr(), x.stride(0) * x.element_size(), x.stride(1) * x.element_size())


class Ours:
    """raw-pointer calls of the tensor-core path on torch tensors (bf16 needs no cupy dtype);
    vf: the forward Variant to launch (default: the shipped one)."""

    def __init__(self, q, k, v, cu, causal, dtype, vf=None):
        self.q, self.k, self.v = q, k, v
        N, Hq, D = q.shape
        self.N, self.H, self.Hkv, self.D = N, Hq, k.shape[1], D
        nb = len(cu) - 1
        self.rec = api.relation_record(cu, cu, np.full(nb, 1 if causal else 0, np.uint8))
        self.dt = dtype
        self.out = torch.empty_like(q)
        self.m = torch.empty(N, Hq, device="cuda", dtype=torch.float32)
        self.l = torch.empty_like(self.m)
        self.m2 = torch.empty_like(self.m)   # the row max in the kernels' base-2 units: the backward's input
        self.scale = D ** -0.5
        self.st = Stream()
        self.vf = vf

    def fwd(self):
        vr = self.vf or tuning.variant("fwd", self.D, self.D, self.dt)
        api.launch_forward(vr, self.rec, self.H, self.Hkv, op(self.q), op(self.k), op(self.v),
                           self.out.data_ptr(), self.m.data_ptr(), self.l.data_ptr(), self.scale, self.st,
                           mkp=self.m2.data_ptr())

    def bwd(self, dout):
        if not hasattr(self, "dq"):
            self.dq, self.dk, self.dv = (torch.empty_like(x) for x in (self.q, self.k, self.v))
            # Delta (N, H) and the (m2, log2 l) pairs (N, H, 2): api.launch_backward's scratch
            self.delta = torch.empty_like(self.m)
            self.lse2 = torch.empty(tuple(self.m.shape) + (2,), dtype=self.m.dtype, device=self.m.device)
        vq, vk = tuning.backward_variants(self.D, self.D, self.dt, tuning.deterministic())
        api.launch_backward(vq, vk, self.rec, self.N, self.H, self.Hkv, op(self.q), op(self.k), op(self.v),
                            op(dout), op(self.out), self.m2.data_ptr(), self.l.data_ptr(), self.delta.data_ptr(),
                            self.lse2.data_ptr(), self.dq.data_ptr(), self.dk.data_ptr(), self.dv.data_ptr(),
                            self.scale, self.st)

    def fwd_bwd(self, dout):
        self.fwd()
        self.bwd(dout)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def sdpa(q, k, v, causal):
    # (N, H, D) node-major -> (1, H, N, D) views of the same memory
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return TF.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=causal)[0].transpose(0, 1)


def sdpa_eff(q, k, v, causal):
    """torch SDPA's memory-efficient kernel (cutlass; fp32 runs as 3xTF32 OpMultiplyAddFastF32)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
        return TF.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=causal)[0].transpose(0, 1)


def dense_cell(N, D, causal, dtype=None, check=False, bwd=True):
    dtype = dtype or torch.float16
    g = torch.Generator(device="cuda").manual_seed(N * 7 + D + causal)
    q, k, v, do = (torch.randn(N, H, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    name = "float16" if dtype == torch.float16 else "bfloat16"
    ours = Ours(q, k, v, np.array([0, N]), causal, name)
    res = dict(N=N, D=D, causal=causal, dtype=name)
    flops = 4 * N * N * H * D / (2 if causal else 1)
    ours.fwd()
    torch.cuda.synchronize()
    o_t = sdpa(q, k, v, causal)
    res["err_fwd_vs_torch"] = rel(ours.out, o_t)
    if check:
        qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
        qf.requires_grad_(True), kf.requires_grad_(True), vf.requires_grad_(True)
        s = torch.matmul(qf, kf.transpose(1, 2)) * D ** -0.5
        if causal:
            s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.matmul(torch.softmax(s, -1), vf)
        ref.backward(do.float().transpose(0, 1))
        res["err_fwd_vs_fp32"] = rel(ours.out, ref.transpose(0, 1))
        res["err_fwd_torch_vs_fp32"] = rel(o_t, ref.transpose(0, 1))
        ours.bwd(do)
        torch.cuda.synchronize()
        for nm, mine, r in (("dq", ours.dq, qf.grad), ("dk", ours.dk, kf.grad), ("dv", ours.dv, vf.grad)):
            res[f"err_{nm}_vs_fp32"] = rel(mine, r.transpose(0, 1))
        qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        sdpa(qt, kt, vt, causal).backward(do)
        res["err_dq_torch_vs_fp32"] = rel(qt.grad, qf.grad.transpose(0, 1))
        del s, ref, qf, kf, vf
    t_t = bench(lambda: sdpa(q, k, v, causal))
    t_o = bench(ours.fwd)
    res.update(fwd_ms_ours=t_o, fwd_ms_torch=t_t, fwd_tfs_ours=flops / t_o / 1e9, fwd_tfs_torch=flops / t_t / 1e9,
               fwd_ratio=t_t / t_o)
    if bwd:
        qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

        def torch_fb():
            qt.grad = kt.grad = vt.grad = None
            sdpa(qt, kt, vt, causal).backward(do)
        t_tb = bench(torch_fb)
        t_ob = bench(lambda: ours.fwd_bwd(do))
        res.update(fb_ms_ours=t_ob, fb_ms_torch=t_tb, fb_tfs_ours=3.5 * flops / t_ob / 1e9,
                   fb_tfs_torch=3.5 * flops / t_tb / 1e9, fb_ratio=t_tb / t_ob)
    return res


def fmt(r):
    s = (f"N={r['N']:6d} D={r['D']:3d} causal={int(r['causal'])} {r['dtype']:8s} fwd ours {r['fwd_ms_ours']:.3f} ms "
         f"{r['fwd_tfs_ours']:.0f} TF/s | torch {r['fwd_ms_torch']:.3f} ms {r['fwd_tfs_torch']:.0f} TF/s | "
         f"ratio {r['fwd_ratio']:.2f}")
    if "fb_ratio" in r:
        s += (f" || fwd+bwd ours {r['fb_ms_ours']:.3f} ms torch {r['fb_ms_torch']:.3f} ms ratio {r['fb_ratio']:.2f}")
    errs = {k: f"{v:.1e}" for k, v in r.items() if k.startswith("err")}
    return s + "  " + " ".join(f"{k[4:]}={v}" for k, v in errs.items())


def doc_lengths(total, rng):
    """a realistic mix: log-normal document lengths (median ~700 tokens), clipped to [32, 8192]."""
    out = []
    while sum(out) < total:
        out.append(int(np.clip(rng.lognormal(np.log(700), 1.0), 32, 8192)))
    out[-1] -= sum(out) - total
    return [x for x in out if x > 0]


def varlen_cell(total, D, flex_fn, create_block_mask, rng):
    lens = doc_lengths(total, rng)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    g = torch.Generator(device="cuda").manual_seed(total + D)
    q, k, v, do = (torch.randn(total, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
    ours = Ours(q, k, v, cu, True, "float16")
    useful = sum(4 * n * (n + 1) / 2 * H * D for n in lens)
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)
    bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=total, KV_LEN=total, device="cuda")
    qf, kf, vf = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))   # flex's own layout
    o_f = flex_fn(qf, kf, vf, block_mask=bm)
    ours.fwd()
    torch.cuda.synchronize()
    err = rel(ours.out, o_f[0].transpose(0, 1))
    t_f = bench(lambda: flex_fn(qf, kf, vf, block_mask=bm))
    t_o = bench(ours.fwd)
    res = dict(total=total, D=D, docs=len(lens), max_len=max(lens), fwd_ms_ours=t_o, fwd_ms_flex=t_f,
               fwd_ratio=t_f / t_o, useful_tfs_ours=useful / t_o / 1e9, useful_tfs_flex=useful / t_f / 1e9,
               err_vs_flex=err)
    try:
        qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (qf, kf, vf))
        dof = do.transpose(0, 1)[None].contiguous()

        def flex_fb():
            qg.grad = kg.grad = vg.grad = None
            flex_fn(qg, kg, vg, block_mask=bm).backward(dof)
        t_fb = bench(flex_fb)
        t_ob = bench(lambda: ours.fwd_bwd(do))
        res.update(fb_ms_ours=t_ob, fb_ms_flex=t_fb, fb_ratio=t_fb / t_ob)
    except Exception as ex:  # noqa: BLE001
        res["fb_error"] = repr(ex)[:200]
    return res


# ----------------------------------------------------------------------------- float32 (3xTF32)
S_ = dict(a_smem=True)
#: fp32 sweep candidates (register counts / spills checked with ptxas -v for sm_90 first)
SWEEP_F32 = {
    ("fwd", 64): [dict(NW=4, MT=1, BN=64), dict(NW=4, MT=1, BN=64, **S_)],
    ("fwd", 128): [dict(NW=4, MT=1, BN=32, **S_)],
    ("bwd", 64): [(dict(NW=4, MT=1, BN=32, **S_), dict(NW=4, MT=1, BN=32, **S_))],
    ("bwd", 128): [(dict(NW=4, MT=1, BN=32, **S_), dict(NW=4, MT=1, BN=16, **S_)),
                   (dict(NW=4, MT=1, BN=32, **S_), dict(NW=4, MT=1, BN=32, **S_))],
}
# first H200 run (before per-block partials) also tried: fwd D=64 MT=1 BN=32 smem (2.675 ms vs
# 2.358 for BN=64 registers), fwd D=128 BN=64 smem (6.792 vs 5.811 ms), bwd D=64 BN=64/64 smem
# (12.080 vs 9.903 ms for BN=32/32)


#: --wide: 8-warp CTAs (BM = 128 with MT = 1: each streamed block feeds twice the warps, so half
#: the shared-memory traffic per mma of the 4-warp MT = 1 shapes, at MT = 1's register count)
#: next to the shipped shapes; the cubins can be prebuilt off-device (--build-wide).
WIDE16 = {
    ("fwd", 128): [dict(NW=4, MT=2, BN=32, **S_), dict(NW=8, MT=1, BN=32), dict(NW=8, MT=1, BN=64, **S_),
                   dict(NW=8, MT=1, BN=32, **S_)],
    ("bwd", 64): [(dict(NW=4, MT=1, BN=64), dict(NW=4, MT=1, BN=64)),
                  (dict(NW=8, MT=1, BN=64), dict(NW=8, MT=1, BN=64)),
                  (dict(NW=8, MT=1, BN=32), dict(NW=8, MT=1, BN=32))],
    ("bwd", 128): [(dict(NW=4, MT=1, BN=64, **S_), dict(NW=4, MT=1, BN=32, **S_)),
                   (dict(NW=8, MT=1, BN=64, **S_), dict(NW=8, MT=1, BN=32, **S_)),
                   (dict(NW=8, MT=1, BN=32, **S_), dict(NW=8, MT=1, BN=16, **S_))],
}
WIDE32 = {
    ("fwd", 64): [dict(NW=4, MT=1, BN=64), dict(NW=8, MT=1, BN=64), dict(NW=8, MT=1, BN=32, **S_)],
    ("fwd", 128): [dict(NW=4, MT=1, BN=32, **S_), dict(NW=8, MT=1, BN=32, **S_)],
    ("bwd", 64): [(dict(NW=4, MT=1, BN=32, **S_), dict(NW=4, MT=1, BN=32, **S_)),
                  (dict(NW=8, MT=1, BN=32, **S_), dict(NW=8, MT=1, BN=32, **S_))],
    ("bwd", 128): [(dict(NW=4, MT=1, BN=32, **S_), dict(NW=4, MT=1, BN=16, **S_)),
                   (dict(NW=8, MT=1, BN=32, **S_), dict(NW=8, MT=1, BN=16, **S_))],
}


def build_wide(arch="sm_90", jobs=2):
    """compile the --wide sweep's cubins into the cubin cache without a GPU."""
    specs = [_as_spec(x) for x in _sweep_specs({"float16": WIDE16, "float32": WIDE32})]
    for name in build.build_cubins(arch=arch, jobs=jobs, specs=specs):
        print(name, flush=True)


def f64_reference(q, k, v, do, causal, heads):
    """float64 out and gradients for the given heads (node-major in, node-major out)."""
    qf, kf, vf = (x[:, heads].double().transpose(0, 1).detach().requires_grad_(True) for x in (q, k, v))
    N, D = q.shape[0], q.shape[2]
    s = torch.matmul(qf, kf.transpose(1, 2)) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    o = torch.matmul(torch.softmax(s, -1), vf)
    o.backward(do[:, heads].double().transpose(0, 1))
    return [x.transpose(0, 1).detach() for x in (o, qf.grad, kf.grad, vf.grad)]


class CudaCore:
    """the CUDA-core float32 kernels through the public API (tensor cores switched off)."""

    def __init__(self, q, k, v, causal):
        import cupy

        import tiga_numba as tg
        self.tg = tg
        self.q, self.k, self.v = (cupy.asarray(x) for x in (q, k, v))
        N = q.shape[0]
        self.g = tg.Graph.triangular(N) if causal else tg.Graph.dense(N)

    def fwd(self):
        with self.tg.options(tensor_cores=False):
            self.out, self.stats = self.tg.attention(self.q, self.k, self.v, self.g, return_stats=True)

    def fwd_bwd(self, do):
        import cupy
        self.fwd()
        with self.tg.options(tensor_cores=False):
            self.tg.attention_backward(cupy.asarray(do), self.q, self.k, self.v, self.out, self.stats, self.g)


def rel64(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def fp32_cell(N, D, causal):
    g = torch.Generator(device="cuda").manual_seed(N * 7 + D + causal + 1)
    q, k, v, do = (torch.randn(N, H, D, device="cuda", dtype=torch.float32, generator=g) for _ in range(4))
    ours = Ours(q, k, v, np.array([0, N]), causal, "float32")
    res = dict(N=N, D=D, causal=causal, dtype="float32")
    flops = 4 * N * N * H * D / (2 if causal else 1)
    heads = list(range(H)) if N <= 4096 else [0, 1]
    ref = f64_reference(q, k, v, do, causal, heads)
    ours.fwd_bwd(do)
    qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o_t = sdpa_eff(qt, kt, vt, causal)
    o_t.backward(do)
    torch.cuda.synchronize()
    for nm, mine, theirs, r in zip(("out", "dq", "dk", "dv"), (ours.out, ours.dq, ours.dk, ours.dv),
                                   (o_t, qt.grad, kt.grad, vt.grad), ref):
        res[f"err_{nm}_ours_vs_f64"] = rel64(mine[:, heads], r)
        res[f"err_{nm}_torch_vs_f64"] = rel64(theirs[:, heads], r)
    del ref, o_t
    t_t = bench(lambda: sdpa_eff(q, k, v, causal))
    t_o = bench(ours.fwd)

    def torch_fb():
        qt.grad = kt.grad = vt.grad = None
        sdpa_eff(qt, kt, vt, causal).backward(do)
    t_tb = bench(torch_fb)
    t_ob = bench(lambda: ours.fwd_bwd(do))
    res.update(fwd_ms_ours=t_o, fwd_ms_torch=t_t, fwd_tfs_ours=flops / t_o / 1e9, fwd_tfs_torch=flops / t_t / 1e9,
               fwd_ratio=t_t / t_o, fb_ms_ours=t_ob, fb_ms_torch=t_tb, fb_tfs_ours=3.5 * flops / t_ob / 1e9,
               fb_tfs_torch=3.5 * flops / t_tb / 1e9, fb_ratio=t_tb / t_ob)
    return res


def fmt32(r):
    s = (f"fp32 N={r['N']:6d} D={r['D']:3d} causal={int(r['causal'])} | fwd ours {r['fwd_ms_ours']:.3f} ms "
         f"{r['fwd_tfs_ours']:.1f} TF/s, sdpa-eff {r['fwd_ms_torch']:.3f} ms {r['fwd_tfs_torch']:.1f} TF/s, "
         f"ratio {r['fwd_ratio']:.2f} | fwd+bwd ours {r['fb_ms_ours']:.3f} ms {r['fb_tfs_ours']:.1f} TF/s, "
         f"sdpa-eff {r['fb_ms_torch']:.3f} ms {r['fb_tfs_torch']:.1f} TF/s, ratio {r['fb_ratio']:.2f}")
    if "cc_fwd_ms" in r:
        s += (f" | cuda-core fp32 fwd {r['cc_fwd_ms']:.3f} ms fwd+bwd {r['cc_fb_ms']:.3f} ms: tc/cuda-core speed-up "
              f"fwd {r['cc_fwd_ms'] / r['fwd_ms_ours']:.2f}x fwd+bwd {r['cc_fb_ms'] / r['fb_ms_ours']:.2f}x")
    elif "cc_error" in r:
        s += f" | cuda-core: {r['cc_error']}"
    errs = " ".join(f"{k[4:]}={v:.1e}" for k, v in r.items() if k.startswith("err"))
    return s + "\n    rel L2 err vs float64: " + errs


def precompile(dtypes, jobs=14, with_sweep=True):
    """compile the shipped kernels of `dtypes` (and the float32 sweep's) in parallel processes
    into the cubin cache (tc.build.build_cubins), which hands them to this process without NVVM."""
    specs = set(build.shipped_kernels(dtypes))
    if "float32" in dtypes and with_sweep:
        specs |= set(_sweep_specs({"float32": SWEEP_F32}))
    t0 = time.time()
    try:
        names = build.build_cubins(arch=_arch(), jobs=jobs, specs=[_as_spec(x) for x in sorted(specs, key=str)])
        say(f"precompile {dtypes}: {len(names)} kernels in {time.time() - t0:.0f}s")
    except Exception as e:  # noqa: BLE001 - the timed sections compile what is missing
        say(f"precompile FAILED {e!r}"[:300])


def _arch():
    import cupy
    return f"sm_{cupy.cuda.Device().compute_capability}"


def _sweep_specs(cands_by_dtype):
    """(kind, D, dtype, shape items) of every kernel a sweep's candidate lists launch."""
    out = set()
    for dtype, cands in cands_by_dtype.items():
        for (kind, D), opts in cands.items():
            for o in opts:
                for kk, cfg in ([("fwd", o)] if kind == "fwd" else [("dq", o[0]), ("dkdv", o[1])]):
                    out.add((kk, D, dtype, tuple(sorted(cfg.items()))))
    return sorted(out)


def _as_spec(x):
    return x if len(x) == 3 else (*x[:3], dict(x[3]))


TUNING_OUT = None
TESTS_FAILED = False


def save_tuning():
    if TUNING_OUT:
        with open(TUNING_OUT, "w") as fh:
            json.dump([[k[0], k[1], v] for k, v in tuning.TUNING.items()]
                      + [[k[0], k[1], v, "float32"] for k, v in tuning.TUNING_F32.items()], fh)


def sweep(quick, dtype="float16", cands=None):
    """try a few tile shapes per head dim on N=4096 (causal and not); keep the fastest in the
    dtype's tuning table (tuning.TUNING, or tuning.TUNING_F32 for float32)"""
    import tiga_numba as tg
    # the mma.sync shapes (bench_wgmma.py sweeps the wgmma ones): pinned for the whole sweep
    with tg.options(wgmma=False):
        _sweep(quick, dtype, cands)


def _sweep(quick, dtype, cands):
    S = dict(a_smem=True)
    table = tuning.tuning_table(dtype, wgmma=False)
    tdt = {"float16": torch.float16, "float32": torch.float32}[dtype]
    cands = cands or (SWEEP_F32 if dtype == "float32" else {
        ("fwd", 64): [dict(NW=4, MT=2, BN=64), dict(NW=4, MT=2, BN=32)],
        ("fwd", 128): [dict(NW=4, MT=2, BN=16, **S), dict(NW=4, MT=1, BN=32), dict(NW=4, MT=2, BN=32, **S)],
        # backward: (dq shape, dkdv shape); the a_smem shapes above 48 KB use dynamic shared memory
        ("bwd", 64): [(dict(NW=4, MT=1, BN=64), dict(NW=4, MT=1, BN=64)),
                      (dict(NW=4, MT=2, BN=32, **S), dict(NW=4, MT=2, BN=16, **S))],
        ("bwd", 128): [(dict(NW=4, MT=1, BN=32), dict(NW=4, MT=1, BN=32)),
                       (dict(NW=4, MT=1, BN=32), dict(NW=4, MT=1, BN=16, **S)),
                       (dict(NW=4, MT=1, BN=64, **S), dict(NW=4, MT=1, BN=32, **S))],
    })
    for (kind, D), opts in cands.items():
        best = None
        for o in opts[:2] if quick else opts:
            keys = [("fwd", D)] if kind == "fwd" else [("dq", D), ("dkdv", D)]
            vals = [o] if kind == "fwd" else list(o)
            saved = {k: table[k] for k in keys}
            for k_, val in zip(keys, vals):
                table[k_] = val
            try:
                t0 = time.time()
                tot = 0.0
                for causal in (False, True):
                    N = 4096
                    g = torch.Generator(device="cuda").manual_seed(1)
                    q, k, v, do = (torch.randn(N, H, D, device="cuda", dtype=tdt, generator=g)
                                   for _ in range(4))
                    ours = Ours(q, k, v, np.array([0, N]), causal, dtype)
                    ref = sdpa_eff if dtype == "float32" else sdpa
                    if kind == "fwd":
                        ours.fwd()
                        err = rel(ours.out, ref(q, k, v, causal))
                        tot += bench(ours.fwd)
                    else:
                        ours.fwd_bwd(do)
                        qt, kt, vt = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
                        ref(qt, kt, vt, causal).backward(do)
                        err = max(rel(ours.dq, qt.grad), rel(ours.dk, kt.grad), rel(ours.dv, vt.grad))
                        ours.fwd()
                        tot += bench(lambda: ours.bwd(do))
                    if not err < (1e-4 if dtype == "float32" else 2e-2):
                        raise RuntimeError(f"wrong result, rel err {err:.2e}")
                say(f"sweep {dtype} {kind} D={D} {o}: {tot:.3f} ms (N=4096 causal+non-causal){'' if kind == 'fwd' else ' bwd'}"
                    f"  (incl. compile {time.time() - t0:.1f}s)")
                if best is None or tot < best[0]:
                    best = (tot, o)
            except Exception as ex:  # noqa: BLE001
                say(f"sweep {dtype} {kind} D={D} {o}: FAILED {repr(ex)[:300]}")
            for k_, val in saved.items():
                table[k_] = val
        if best:
            keys = [("fwd", D)] if kind == "fwd" else [("dq", D), ("dkdv", D)]
            for k_, val in zip(keys, [best[1]] if kind == "fwd" else list(best[1])):
                table[k_] = val
            say(f"sweep {dtype} {kind} D={D}: chose {best[1]}")
            save_tuning()   # per section: a later crash (sticky CUDA error) keeps what was chosen


def resources():
    for key in list(api.KERNELS._kernels):
        if isinstance(key, tuple) and key and key[0] == "tc":
            k = api.KERNELS._kernels[key]
            try:
                say(f"resources {key[1].name()}: {k.resources()} disk_cache={k.disk_cache}")
            except Exception as ex:  # noqa: BLE001
                say(f"resources {key[1].name()}: {ex!r}")


SANITIZE_DTYPES = ("float16",)


def sanitize():
    """small fwd + bwd over segments with tails and GQA: run under compute-sanitizer."""
    cu = np.array([0, 1, 1, 70, 200, 201, 333])
    N = int(cu[-1])
    for dt in SANITIZE_DTYPES:
        tdt = {"float16": torch.float16, "float32": torch.float32}[dt]
        for D in (64, 128):
            q, do = (torch.randn(N, 4, D, device="cuda", dtype=tdt) for _ in range(2))
            k, v = (torch.randn(N, 2, D, device="cuda", dtype=tdt) for _ in range(2))
            for causal in (True, False):
                o = Ours(q, k, v, cu, causal, dt)
                o.fwd_bwd(do)
                torch.cuda.synchronize()
                print(f"sanitize {dt} D={D} causal={causal}: out finite {bool(torch.isfinite(o.out).all())}, "
                      f"dq finite {bool(torch.isfinite(o.dq).all())}")
                # the pruned forward (tensor-core path, the call's engine) on the same case
                import types

                import cupy

                from tiga_numba.cuda import tc
                from tiga_numba.graph import BlockRelation
                rel_ = BlockRelation(cupy.asarray(cu), cupy.asarray(cu),
                                     cupy.asarray(np.full(len(cu) - 1, int(causal), np.uint8)),
                                     int(np.diff(cu).max()), int(np.diff(cu).max()))
                p = types.SimpleNamespace(scale=D ** -0.5, prune_threshold=0.3, score="dot", run_info={})
                qc, kc, vc = (cupy.asarray(x.cpu().numpy()) for x in (q, k, v))
                out = tc.forward(p, qc, kc, vc, rel_)[0]
                cupy.cuda.runtime.deviceSynchronize()
                print(f"sanitize pruned {dt} D={D} causal={causal}: out finite {bool(cupy.isfinite(out).all())}, "
                      f"{p.run_info['pruned_tiles']}/{p.run_info['total_tiles']} tiles pruned")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, D in zip(axes, (64, 128)):
        for causal, ls in ((False, "-"), (True, "--")):
            rr = sorted((r for r in rows if r["D"] == D and r["causal"] == causal and r["dtype"] == "float16"),
                        key=lambda r: r["N"])
            if not rr:
                continue
            Ns = [r["N"] for r in rr]
            ax.plot(Ns, [r["fwd_tfs_ours"] for r in rr], "o" + ls, color="C0",
                    label=f"tiga-numba tc {'causal' if causal else 'dense'}")
            ax.plot(Ns, [r["fwd_tfs_torch"] for r in rr], "s" + ls, color="C1",
                    label=f"torch SDPA flash {'causal' if causal else 'dense'}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel("forward TF/s")
        ax.set_title(f"H200, fp16, H=16, D={D}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fp32_section(a, late):
    if not a.no_sweep:
        sweep(a.quick, "float32")
    say(f"float32 tuning in use: {tuning.TUNING_F32}")
    rows = []
    for N in (4096, 16384):
        for D in (64, 128):
            for causal in (False, True):
                if late() and N != 4096:
                    say(f"fp32 N={N} D={D} causal={causal}: skipped (time budget)")
                    continue
                try:
                    r = fp32_cell(N, D, causal)
                    rows.append(r)
                    say(fmt32(r))
                except Exception as ex:  # noqa: BLE001
                    say(f"fp32 N={N} D={D} causal={causal}: FAILED {repr(ex)[:300]}")
    # routing check: the CUDA-core float32 kernels on the N = 4096 cells (their compile is slow,
    # so after the main table)
    for r in rows:
        if r["N"] != 4096 or late():
            continue
        g = torch.Generator(device="cuda").manual_seed(5)
        q, k, v, do = (torch.randn(r["N"], H, r["D"], device="cuda", dtype=torch.float32, generator=g)
                       for _ in range(4))
        try:
            cc = CudaCore(q, k, v, r["causal"])
            cc.fwd_bwd(do)
            torch.cuda.synchronize()
            r["cc_fwd_ms"] = bench(cc.fwd)
            r["cc_fb_ms"] = bench(lambda: cc.fwd_bwd(do))
        except Exception as ex:  # noqa: BLE001
            r["cc_error"] = repr(ex)[:200]
        say("routing " + fmt32(r).split("\n")[0])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--with-tests", action="store_true", help="run tests/test_tc_gpu.py in-process first "
                    "(shares the compiled kernels with the benchmark)")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--tuning-out", default=None, help="write the swept tuning here (JSON)")
    ap.add_argument("--tuning-in", default=None, help="read a tuning written by --tuning-out")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later sections are skipped past it")
    ap.add_argument("--fp32-only", action="store_true", help="only the float32 (3xTF32) sweep and table")
    ap.add_argument("--no-fp32", action="store_true")
    ap.add_argument("--precompile", action="store_true", help="compile the section's kernels in parallel first")
    ap.add_argument("--tests-k", default=None, help="pytest -k expression for --with-tests")
    ap.add_argument("--sanitize-dtypes", default="float16", help="comma list for --sanitize")
    ap.add_argument("--wide", action="store_true", help="sweep WIDE16/WIDE32 (8-warp shapes) for fp16 and "
                    "float32, write --tuning-out, then stop")
    ap.add_argument("--build-wide", default=None, metavar="ARCH",
                    help="no GPU needed: compile the --wide sweep's cubins for ARCH (e.g. sm_90) and stop")
    a = ap.parse_args()
    if a.build_wide:
        build_wide(a.build_wide)
        return
    global SANITIZE_DTYPES
    SANITIZE_DTYPES = tuple(a.sanitize_dtypes.split(","))
    if a.tuning_in and os.path.exists(a.tuning_in):
        with open(a.tuning_in) as fh:
            for kind, D, cfg, *dt in json.load(fh):   # rows: [kind, D, shape(, "float32")]
                tuning.tuning_table(dt[0] if dt else "float16", wgmma=False)[(kind, D)] = cfg
    if a.sanitize:
        sanitize()
        return
    if a.with_tests:
        import pytest
        here = os.path.dirname(os.path.abspath(__file__))
        if a.precompile:
            precompile(("float32",) if a.fp32_only else ("float16",), with_sweep=not a.no_sweep)
        rc = pytest.main([os.path.join(here, "..", "tests", "test_tc_gpu.py"), "-q", "-p", "no:cacheprovider"]
                         + (["-k", a.tests_k] if a.tests_k else []))
        say(f"tests/test_tc_gpu.py exit code {int(rc)}")
        global TESTS_FAILED
        TESTS_FAILED = int(rc) != 0   # finish the tables, but the run reports the failure
    T0 = time.time()
    late = lambda: time.time() - T0 > a.budget  # noqa: E731
    os.makedirs(a.out, exist_ok=True)
    say(f"{torch.cuda.get_device_name()} torch {torch.__version__} H={H} reps={REPS} "
        f"date {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    t0 = time.time()
    global TUNING_OUT
    TUNING_OUT = a.tuning_out
    if a.precompile and not a.with_tests:
        precompile(("float32",) if a.fp32_only else ("float16",), with_sweep=not a.no_sweep)
    if a.wide:
        sweep(a.quick, "float16", WIDE16)
        sweep(a.quick, "float32", WIDE32)
        say(f"tuning in use: {tuning.TUNING} | float32: {tuning.TUNING_F32}")
        save_tuning()
        with open(os.path.join(a.out, "tc_wide_sweep.txt"), "w") as fh:
            fh.write("\n".join(LINES) + "\n")
        return
    if a.fp32_only:
        rows32 = fp32_section(a, late)
        resources()
        say(f"total bench time {time.time() - t0:.0f}s")
        with open(os.path.join(a.out, "tc_fp32_bench.json"), "w") as fh:
            json.dump(dict(fp32=rows32, tuning_f32={str(k): v for k, v in tuning.TUNING_F32.items()}), fh, indent=1)
        with open(os.path.join(a.out, "tc_bench.txt"), "w") as fh:
            fh.write("\n".join(LINES) + "\n")
        return
    if not a.no_sweep:
        sweep(a.quick)
    say(f"tuning in use: {tuning.TUNING_WGMMA if device.use_wgmma('float16') else tuning.TUNING}"
        f" ({'wgmma, sm_90a' if device.use_wgmma('float16') else 'mma.sync'})")
    save_tuning()
    if a.sweep_only:
        return
    rows = []
    Ns_plot = (1024, 2048, 4096, 8192, 16384)
    for D in (64, 128):
        for causal in (False, True):
            for N in Ns_plot:
                full = N in (4096, 16384)
                if late() and N != 4096:
                    continue
                try:
                    r = dense_cell(N, D, causal, check=(N == 4096), bwd=full)
                    rows.append(r)
                    say(fmt(r))
                except Exception as ex:  # noqa: BLE001
                    say(f"N={N} D={D} causal={causal}: FAILED {repr(ex)[:300]}")
    for D in (64, 128):
        if late():
            say("bf16: skipped (time budget)")
            break
        try:
            r = dense_cell(16384, D, False, dtype=torch.bfloat16, bwd=True)
            rows.append(r)
            f16 = next(x for x in rows if x["N"] == 16384 and x["D"] == D and not x["causal"] and x["dtype"] == "float16")
            say(fmt(r) + f"  | bf16/fp16 fwd time {r['fwd_ms_ours'] / f16['fwd_ms_ours']:.3f}"
                f" fwd+bwd {r['fb_ms_ours'] / f16['fb_ms_ours']:.3f}")
        except Exception as ex:  # noqa: BLE001
            say(f"bf16 D={D}: FAILED {repr(ex)[:300]}")
    var = []
    if not a.no_flex and not late():
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex_fn = torch.compile(flex_attention)
            rng = np.random.default_rng(0)
            for total, D in ((16384, 64), (65536, 64), (32768, 128)):
                if late():
                    break
                try:
                    r = varlen_cell(total, D, flex_fn, create_block_mask, rng)
                    var.append(r)
                    say(f"varlen causal total={total} D={D} docs={r['docs']} max_len={r['max_len']}: "
                        f"ours {r['fwd_ms_ours']:.3f} ms ({r['useful_tfs_ours']:.0f} TF/s) flex "
                        f"{r['fwd_ms_flex']:.3f} ms ({r['useful_tfs_flex']:.0f}) ratio {r['fwd_ratio']:.2f}"
                        + (f" || fwd+bwd ours {r['fb_ms_ours']:.3f} flex {r['fb_ms_flex']:.3f} ratio "
                           f"{r['fb_ratio']:.2f}" if "fb_ratio" in r else f" fb: {r.get('fb_error')}")
                        + f"  err vs flex {r['err_vs_flex']:.1e}")
                except Exception as ex:  # noqa: BLE001
                    say(f"varlen total={total} D={D}: FAILED {repr(ex)[:300]}")
        except Exception as ex:  # noqa: BLE001
            say(f"flex unavailable: {ex!r}")
    resources()
    say(f"total bench time {time.time() - t0:.0f}s")
    with open(os.path.join(a.out, "tc_bench.json"), "w") as fh:
        json.dump(dict(dense=rows, varlen=var, tuning={str(k): v for k, v in tuning.TUNING.items()}), fh, indent=1)
    with open(os.path.join(a.out, "tc_bench.txt"), "w") as fh:
        fh.write("\n".join(LINES) + "\n")
    plot(rows, os.path.join(a.out, "tc_tfs.png"))


if __name__ == "__main__":
    main()
    sys.exit(1 if TESTS_FAILED else 0)
