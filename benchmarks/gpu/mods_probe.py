"""How the tensor-core kernels should compile a score modifier: times and errors of the choices,
side by side in one process (H200; fp16, N = 16384, H = 16, D = 128, causal, soft-cap 30, ALiBi).

    python benchmarks/gpu/mods_probe.py --prebuild --jobs 15   # the probe's cubins (no GPU needed)
    python benchmarks/gpu/mods_probe.py [--reps 10]

Choices: tanh as ex2 + rcp or as the hardware tanh.approx.f32 (generator/modifier.py: TANH, the 16-bit entries), and the
modified D = 128 forward's and dQ kernel's key block widths (tuning.MODIFIED). Rows: plain causal, then soft-cap and
ALiBi per choice, forward and forward+backward ms (CUDA events, median of --reps after a warm-up),
their ratio to plain causal, and for the soft-cap the largest error of the output against a float64
evaluation of the first --check-rows query rows of two heads.
"""
import argparse
import os
import sys
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiga_numba as tg  # noqa: E402
from tiga_numba.cuda.tc import tuning  # noqa: E402
from tiga_numba.cuda.tc.generator import modifier as M  # noqa: E402
from bench_score_mods_gpu import timed  # noqa: E402  (CUDA events, median of reps after a warm-up)

#: (label, tanh flavour, modified-kernel shape changes)
CHOICES = [("exp2 tanh, fwd BN=128", "exp2", {}),
           ("hardware tanh, fwd BN=128", "hardware", {}),
           ("exp2 tanh, fwd BN=64", "exp2", {("wgmma", "fwd", 128): dict(BN=64)}),
           ("exp2 tanh, fwd+dq BN=64", "exp2", {("wgmma", "fwd", 128): dict(BN=64),
                                                ("wgmma", "dq", 128): dict(BN=64)})]
MODS = ("softcap", "alibi")


def _choose(choice):
    from tiga_numba.cuda.tc import api
    _, tanh, shapes = choice
    M.TANH.update(float16=tanh, bfloat16=tanh)
    tuning.MODIFIED.clear()
    tuning.MODIFIED.update(shapes)
    api._MODIFIERS.clear()


def _build(job):
    """one (choice, modifier, kernel kind) cubin into the cache."""
    from tiga_numba.cuda.tc import build
    c, name, kind = job
    _choose(CHOICES[c])
    if name == "plain":
        vr = tuning.variant(kind, 128, 128, "float16", wgmma=True)
    elif name == "alibi" and CHOICES[c][1] != "exp2":
        return f"skip {job}"   # no tanh in ALiBi: the exp2 choice's kernel
    else:   # triangular relations: ALiBi without the alignment shift
        vr = build.modified_variant("wg:" + kind, 128, "float16", name)
    t = time.time()
    build.kernel(vr)[0].cubin("sm_90a")
    return f"built {vr.name()} in {time.time() - t:.0f} s"


def prebuild(jobs):
    from concurrent.futures import ProcessPoolExecutor
    kinds = ("fwd", "dq", "dkdv")
    work = [(0, "plain", kind) for kind in kinds] + [(c, name, kind) for c in range(len(CHOICES))
                                                     for name in MODS for kind in kinds]
    with ProcessPoolExecutor(jobs) as pool:
        for line in pool.map(_build, work):
            print(line, flush=True)


def softcap_reference(q, k, v, rows, cap, scale):
    """float64 soft-capped causal attention of the first `rows` queries, heads 0 and 1 (torch)."""
    import torch
    out = []
    for h in (0, 1):
        qq, kk, vv = (torch.as_tensor(x[:rows, h]).double() for x in (q, k, v))
        s = qq @ kk.T * scale
        s = cap * torch.tanh(s / cap)
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -float("inf"))
        out.append(torch.softmax(s, -1) @ vv)
    return torch.stack(out, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--check-rows", type=int, default=2048)
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--jobs", type=int, default=8)
    a = ap.parse_args()
    if a.prebuild:
        return prebuild(a.jobs)
    import cupy
    import torch
    N, H, D = a.n, a.heads, 128
    print(f"# {torch.cuda.get_device_name()}, N={N} H={H} D={D} fp16 causal, softcap {a.softcap}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((N, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    slopes = cupy.asarray([2.0 ** (-8 * (h + 1) / H) for h in range(H)], cupy.float32)
    tri = tg.Graph.triangular(N)
    kws = {"plain": {}, "softcap": dict(softcap=a.softcap), "alibi": dict(alibi_slopes=slopes)}
    ref = softcap_reference(q, k, v, a.check_rows, a.softcap, D ** -0.5)

    def run(name):
        kw = kws[name]

        def fwd():
            return tg.attention(q, k, v, tri, return_stats=True, **kw)

        def fb():
            out, st = fwd()
            return tg.attention_backward(do, q, k, v, out, st, tri, **kw)
        f, b = timed(fwd, a.reps), timed(fb, a.reps)
        err = ""
        if name == "softcap":
            out = torch.as_tensor(fwd()[0][:a.check_rows, :2]).double()
            err = f" max|out - float64| {float((out - ref).abs().max()):.2e}"
        return f, b, err

    plain = run("plain")
    print(f"plain causal                      fwd {plain[0]:7.3f} ms  fwd+bwd {plain[1]:7.3f} ms")
    for choice in CHOICES:
        _choose(choice)
        for name in MODS:
            if name == "alibi" and choice[1] != "exp2":
                continue
            f, b, err = run(name)
            print(f"{name:8s} {choice[0]:26s} fwd {f:7.3f} ms  fwd+bwd {b:7.3f} ms  | / plain {f / plain[0]:.2f}, "
                  f"{b / plain[1]:.2f}{err}", flush=True)
    plain = run("plain")
    print(f"plain causal (again)              fwd {plain[0]:7.3f} ms  fwd+bwd {plain[1]:7.3f} ms")


if __name__ == "__main__":
    main()
