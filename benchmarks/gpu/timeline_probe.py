"""Where a GPU call's time goes: every device operation (kernels, memsets, copies) of a few
calls, with its start relative to the call's host start and its duration, from the CUDA
profiling interface (torch.profiler records every kernel of the process, also those cupy and
numba launch), next to the host's time per call.

    python benchmarks/gpu/timeline_probe.py [--cases window,window-fb,decode1,decode16] [--calls 3]

Reading: a call's span is (end of its last device operation) - (host start of the call); the
span minus the kernels' own time is what a synchronised call pays for host work, launch
latency and any extra device operations.
"""
import argparse
import json
import os
import tempfile
import time

import cupy
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import tiga_numba as tg


def cases(names):
    rng = np.random.default_rng(0)

    def arr(*shape):
        return cupy.asarray(rng.standard_normal(shape).astype(np.float16))
    if "window" in names or "window-fb" in names:
        N, H, D = 16384, 16, 128
        q, k, v, do = arr(N, H, D), arr(N, H, D), arr(N, H, D), arr(N, H, D)
        g = tg.Graph.band(N, left=1023)
        if "window" in names:
            yield "window", lambda: tg.attention(q, k, v, g, return_stats=True)

        def fb():
            out, st = tg.attention(q, k, v, g, return_stats=True)
            return tg.attention_backward(do, q, k, v, out, st, g)
        if "window-fb" in names:
            yield "window-fb", fb
    for B, L, name in ((1, 131072, "decode1"), (16, 8192, "decode16")):
        if name not in names:
            continue
        q, k, v = arr(B, 32, 128), arr(B * L, 8, 128), arr(B * L, 8, 128)
        g = tg.Graph.dense(L, 1) if B == 1 else \
            tg.Graph.cu_seqlens(np.arange(B + 1), cu_seqlens_k=np.arange(B + 1) * L, causal=True)
        yield name, lambda q=q, k=k, v=v, g=g: tg.attention(q, k, v, g)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="window,window-fb,decode1,decode16")
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name, fn in cases(a.cases.split(",")):
        for _ in range(3):
            fn()
        cupy.cuda.Device().synchronize()
        n = 30   # host time per call, back to back, no profiler
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n
        cupy.cuda.Device().synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(a.calls):
                with record_function(f"call{i}"):
                    fn()
                cupy.cuda.Device().synchronize()
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            ev = json.load(f)["traceEvents"]
        calls = sorted((e for e in ev if e.get("name", "").startswith("call") and e.get("ph") == "X"
                        and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
        dev = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                     key=lambda e: e["ts"])
        launches = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
        print(f"\n## {name}: host per call (back to back, no profiler) {host * 1e3:.3f} ms")
        for c in calls:
            t0, t1 = c["ts"], c["ts"] + c["dur"]
            nxt = [x["ts"] for x in calls if x["ts"] > t0]
            t_end = min(nxt) if nxt else float("inf")
            mine = [d for d in dev if t0 <= d["ts"] < t_end]
            ml = [x for x in launches if t0 <= x["ts"] < t1]
            if not mine:
                print(f"  {c['name']}: no device operations recorded")
                continue
            span = max(d["ts"] + d["dur"] for d in mine) - t0
            busy = sum(d["dur"] for d in mine)
            print(f"  {c['name']}: host {c['dur'] / 1e3:.3f} ms, span to last device op {span / 1e3:.3f} ms, "
                  f"device busy {busy / 1e3:.3f} ms, {len(mine)} device ops, {len(ml)} runtime/driver calls "
                  f"({sum(x['dur'] for x in ml) / 1e3:.3f} ms)")
            for d in mine:
                print(f"    +{(d['ts'] - t0) / 1e3:7.3f} ms  {d['dur'] / 1e3:7.3f} ms  {d.get('cat'):10s} "
                      f"{d['name'][:90]}")
            names = {}
            for x in ml:
                names.setdefault(x["name"], []).append(x["dur"])
            print("    driver/runtime: " + ", ".join(f"{k} x{len(v)} ({sum(v):.0f} us)" for k, v in
                                                     sorted(names.items(), key=lambda kv: -sum(kv[1]))))


if __name__ == "__main__":
    main()
