"""GNN layers: tiga_numba.layers (fused kernels) vs PyG's layers on the CPU, same graph, same
weights, same run.

Configurations (PyG's names):
  gat8x8     GATConv(64, 8, heads=8)        (Velickovic et al.'s hidden layer)
  gat4x32    GATConv(128, 32, heads=4)
  tconv8x8   TransformerConv(64, 8, heads=8)
Graphs: `random` (uniform sources and destinations) and `powerlaw` (destinations drawn with
Zipf-like weights: a few hubs receive most edges), both with --nodes nodes and --edges edges.

Each (method, configuration, graph) runs in its own subprocess so that its peak memory is its
own: kernels are compiled/warmed on a small graph and once on the measured one, then the
peak-RSS counter is reset (/proc/self/clear_refs) and "extra peak" = peak RSS during the
measured calls minus RSS before them (--device cuda: device memory, torch's allocator statistics
for PyG, a cupy memory hook for tiga_numba). Times: median of --reps forward and forward+backward
(dout given, gradients for x and every parameter).

    PYTHONPATH=. python benchmarks/bench_layers.py [--nodes 100000] [--edges 1600000] [--reps 3]
        [--configs gat8x8 gat4x32 tconv8x8] [--graphs random powerlaw] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "gat8x8": ("GATConv", 64, 8, 8),
    "gat4x32": ("GATConv", 128, 32, 4),
    "tconv8x8": ("TransformerConv", 64, 8, 8),
}


def _status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def make_graph(kind, n, e, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, n, e)
    if kind == "random":
        dst = rng.integers(0, n, e)
    else:
        w = (np.arange(n, dtype=np.float64) + 1.0) ** -0.9
        w = rng.permutation(w)
        dst = np.searchsorted(np.cumsum(w), rng.random(e) * w.sum())
        dst = np.minimum(dst, n - 1)
    return src, dst


class _GpuPeak:
    """Peak of the device memory a method allocates: torch's allocator statistics for PyG,
    a cupy memory hook (pool mallocs and frees) for tiga_numba."""

    def __init__(self, method):
        self.method = method
        if method == "tiga":
            import cupy
            from cupy.cuda import memory_hook

            class Hook(memory_hook.MemoryHook):
                name = "PeakHook"

                def __init__(self):
                    self.now = self.peak = 0

                def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                    self.now += mem_size
                    self.peak = max(self.peak, self.now)

                def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
                    self.now -= mem_size

            self.hook = Hook()
            cupy.get_default_memory_pool().free_all_blocks()  # every block is malloc'ed anew
            self.hook.__enter__()

    def reset(self):
        if self.method == "tiga":
            self.hook.peak = self.hook.now
            self.base = self.hook.now
        else:
            import torch
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def extra(self):
        if self.method == "tiga":
            return self.hook.peak - self.base
        import torch
        return torch.cuda.max_memory_allocated() - self.base


def _sync(device):
    if device == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()
        import torch
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()


# --------------------------------------------------------------------------- one measurement
def worker(method, config, graph_kind, n, e, reps, device="cpu"):
    import torch
    import torch_geometric.nn as pyg_nn
    import tiga_numba as tg
    import tiga_numba.layers as layers
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    gpu = device == "cuda"
    if gpu:
        import cupy
    name, f_in, c, h = CONFIGS[config]
    torch.manual_seed(0)
    pyg = getattr(pyg_nn, name)(f_in, c, heads=h)
    state = {k: v.detach().numpy() for k, v in pyg.state_dict().items()}

    def problem(nn_, ee):
        src, dst = make_graph(graph_kind, nn_, ee)
        rng = np.random.default_rng(1)
        x = rng.standard_normal((nn_, f_in)).astype(np.float32)
        return src, dst, x

    if method == "tiga":
        conv = getattr(layers, name)(f_in, c, heads=h)
        conv.load_state_dict(state)
        if gpu:
            conv.to("cuda")

        def setup(nn_, ee):
            src, dst, x = problem(nn_, ee)
            g = tg.Graph.from_coo(src, dst, nn_, nn_)
            if gpu:
                x = cupy.asarray(x)
            out = conv(x, g)  # builds and caches the edge structures (self loops, transpose)
            dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
            return (g, x, cupy.asarray(dout) if gpu else dout)

        def fwd(g, x, dout):
            return conv(x, g)

        def fwd_bwd(g, x, dout):
            _, vjp = conv.vjp(x, g)
            return vjp(dout)
    else:
        dev = torch.device(device)
        pyg.to(dev)

        def setup(nn_, ee):
            src, dst, x = problem(nn_, ee)
            ei = torch.from_numpy(np.stack([src, dst])).to(dev)
            xt = torch.from_numpy(x).to(dev).requires_grad_(True)
            with torch.no_grad():
                out = pyg(xt, ei)
            return ei, xt, torch.randn_like(out)

        def fwd(ei, xt, dout):
            with torch.no_grad():
                return pyg(xt, ei)

        def fwd_bwd(ei, xt, dout):
            pyg.zero_grad()
            xt.grad = None
            pyg(xt, ei).backward(dout)

    small = setup(2000, 32000)
    fwd(*small)
    fwd_bwd(*small)
    args = setup(n, e)
    fwd_bwd(*args)  # warm on the measured size (allocator, caches)
    res = {}
    probe = _GpuPeak(method) if gpu else None
    for label, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        _sync(device)
        if gpu:
            probe.reset()
        else:
            have = _reset_peak()
            base = _status("VmRSS")
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            r = fn(*args)
            _sync(device)
            times.append(time.perf_counter() - t0)
            del r
        if gpu:
            extra = probe.extra() / 2**20
        else:
            extra = (_status("VmHWM") - base) / 2**20 if have else None
        res[label] = {"ms": 1e3 * float(np.median(times)), "extra_peak_mb": extra}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--edges", type=int, default=1_600_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--graphs", nargs="+", default=["random", "powerlaw"])
    ap.add_argument("--methods", nargs="+", default=["tiga", "pyg"])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: tiga_numba on cupy arrays vs PyG on CUDA tensors; device memory")
    ap.add_argument("--json")
    ap.add_argument("--worker", nargs=3, metavar=("METHOD", "CONFIG", "GRAPH"))
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(*a.worker, a.nodes, a.edges, a.reps, a.device)))
        return
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # see examples/gat_training.py
    print(f"# device {a.device}; {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'all')}; "
          f"{a.nodes} nodes, {a.edges} edges, median of {a.reps}")
    print(f"{'config':9s} {'graph':9s} {'method':6s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} "
          f"{'extra peak MB (fwd+bwd)':>24s}")
    rows = []
    for config in a.configs:
        for graph in a.graphs:
            got = {}
            for method in a.methods:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, config, graph,
                       "--nodes", str(a.nodes), "--edges", str(a.edges), "--reps", str(a.reps),
                       "--device", a.device]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    print(f"{config:9s} {graph:9s} {method:6s} FAILED: {proc.stderr[-500:]}")
                    continue
                r = json.loads(line[0][7:])
                got[method] = r
                peak = r["fwd_bwd"]["extra_peak_mb"]
                print(f"{config:9s} {graph:9s} {method:6s} {r['fwd']['ms']:9.1f} "
                      f"{r['fwd_bwd']['ms']:11.1f} {peak if peak is None else round(peak):>24}",
                      flush=True)
                rows.append({"config": config, "graph": graph, "method": method, **r})
            if "tiga" in got and "pyg" in got:
                t, p = got["tiga"]["fwd_bwd"], got["pyg"]["fwd_bwd"]
                mem = (f"{t['extra_peak_mb'] / p['extra_peak_mb']:.2f}x the memory"
                       if t["extra_peak_mb"] and p["extra_peak_mb"] else "memory n/a")
                print(f"{'':9s} {'':9s} ratio  fwd {got['pyg']['fwd']['ms'] / got['tiga']['fwd']['ms']:.2f}x "
                      f"faster, fwd+bwd {p['ms'] / t['ms']:.2f}x faster, {mem}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"nodes": a.nodes, "edges": a.edges, "reps": a.reps, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
