"""Print the README's headline tables on the machine at hand.

    python benchmarks/run.py                 # headline sizes (CPU: tens of minutes on 2 cores)
    python benchmarks/run.py --quick         # small sizes: every section once, a few minutes
    python benchmarks/run.py --out results/  # also write each section's output (and plots) there
    python benchmarks/run.py --only cpu gat  # some sections

Sections, in order (GPU sections only when cupy imports and sees a device):
  machine   the ceilings the tables should be read against: sgemm GFLOP/s (numpy's BLAS) and
            memory bandwidth (a numpy copy on one thread, a numba parallel copy on all), the
            rate of a first write to new memory;
            on a GPU, cupy matmul TFLOP/s (fp16, fp32) and device copy bandwidth
  cpu       benchmarks/bench_cpu.py: dense / causal attention vs numpy and torch CPU SDPA,
            memory, CSR edges/s, tile pruning vs exact
  gat       benchmarks/bench_gat.py: the GAT-MLP model vs eager torch + PyG (or numpy)
  neighbors benchmarks/bench_neighbors.py: radius / knn graphs vs scipy's cKDTree
  gpu-tc    benchmarks/bench_tc.py: tensor-core attention vs torch SDPA flash / FlexAttention
            (draws the TF/s plot into --out)
  gpu-cuda  benchmarks/bench_cuda.py: CUDA-core kernels, CSR, pruning, per-call overhead
  gpu-gat   benchmarks/bench_gat.py --device cuda

torch (and torch_geometric) are only the anchors: a table prints its tiga columns without
them. Each section is one subprocess running the script named; benchmarks/README.md lists the
exact command behind every README number.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --------------------------------------------------------------------------- machine ceilings
def wall_times(fn, reps):
    """wall seconds of each of `reps` calls of `fn`, after one warm-up call (compiles, first touches)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_seconds(fn, reps=3):
    """the fastest of `reps` timed calls (wall_times): the benchmarks' CPU timer."""
    return min(wall_times(fn, reps))


def cpu_ceilings(quick):
    """(sgemm GFLOP/s, numpy copy GB/s, numba parallel copy GB/s, threads)."""
    import numba

    n = 1024 if quick else 2048
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    gflops = 2 * n**3 / best_seconds(lambda: a @ b) / 1e9

    words = (16 if quick else 64) << 20  # float32 words: 64 / 256 MiB per array
    src = np.ones(words, np.float32)
    dst = np.empty_like(src)
    numpy_gbs = 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src)) / 1e9

    @numba.njit(parallel=True, cache=False)
    def parallel_copy(out, x):
        for i in numba.prange(x.size):
            out[i] = x[i]

    numba_gbs = 2 * src.nbytes / best_seconds(lambda: parallel_copy(dst, src)) / 1e9
    return gflops, numpy_gbs, numba_gbs, numba.get_num_threads()


def gpu_seconds(fn, reps=5):
    """Seconds per call of `fn` on the current device: one warm-up call, then CUDA events around
    `reps` back-to-back calls."""
    import cupy as cp
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def gpu_ceilings(quick):
    """(fp16 matmul TFLOP/s, fp32 matmul TFLOP/s, device copy GB/s, device name)."""
    import cupy as cp

    n = 4096 if quick else 8192
    out = []
    for dtype in (cp.float16, cp.float32):
        a = cp.ones((n, n), dtype)
        out.append(2 * n**3 / gpu_seconds(lambda: a @ a) / 1e12)
    x = cp.ones((256 if quick else 1024) << 20, cp.uint8)
    y = cp.empty_like(x)
    out.append(2 * x.nbytes / gpu_seconds(lambda: y.__setitem__(Ellipsis, x)) / 1e9)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return (*out, name)


def first_touch(gib):
    """Write once to `gib` GiB of new memory, 1 GiB at a time, freeing each, twice: (GiB/s of the
    first pass, GiB/s of the second). A virtual machine whose host backs its memory lazily (and
    takes freed memory back) pays far more on the first write of memory than on memory written
    moments before (a 2-vCPU Xeon microVM: 0.4-0.9 GiB/s against 7-8 GiB/s), and a benchmark
    configuration that happens to get such pages pays for them; writing memory just before the
    runs gives them memory the host has backed. Where the host takes freed memory back after a
    while, the effect returns."""
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(int(gib)):
            block = np.empty(2**30, np.uint8)
            block[::4096] = 1
            del block
        rates.append(int(gib) / (time.perf_counter() - t0))
    return rates


def have_gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return False


def machine_section(quick, gpu):
    import numba

    lines = [f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} logical CPUs; python {platform.python_version()}, numpy "
             f"{np.__version__}, numba {numba.__version__}"]
    gflops, numpy_gbs, numba_gbs, threads = cpu_ceilings(quick)
    lines.append(f"CPU ceilings: sgemm {gflops:.0f} GFLOP/s (numpy BLAS, float32); memory copy "
                 f"{numpy_gbs:.1f} GB/s (numpy, 1 thread), {numba_gbs:.1f} GB/s (numba, "
                 f"{threads} threads); read + write bytes")
    first, again = first_touch(1)
    lines.append(f"first write of 1 GiB of new memory: {first:.2f} GiB/s, again {again:.2f} GiB/s "
                 "(far apart on a machine whose host backs memory lazily: see first_touch)")
    if gpu:
        f16, f32, gbs, name = gpu_ceilings(quick)
        lines.append(f"GPU ceilings ({name}): matmul {f16:.0f} TFLOP/s fp16, {f32:.1f} TFLOP/s "
                     f"fp32 (cupy); device copy {gbs:.0f} GB/s (read + write)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- sections
def sections(quick, out_dir):
    """name -> (needs a GPU, argv after `python`)."""
    return {
        "cpu": (False, ["benchmarks/bench_cpu.py"] + (["--quick"] if quick else
                                                      ["--sizes", "1024", "4096"])),
        "gat": (False, ["benchmarks/bench_gat.py"] + (["--nodes", "5000", "--feats", "8",
                                                       "--reps", "1", "--rounds", "1"]
                                                      if quick else [])),
        "neighbors": (False, ["benchmarks/bench_neighbors.py", "--part", "cpu"]
                      + (["--n", "20000", "--reps", "2"] if quick else [])),
        "gpu-tc": (True, ["benchmarks/bench_tc.py", "--no-sweep"] + (["--quick"] if quick else [])
                   + (["--out", out_dir] if out_dir else [])),
        "gpu-cuda": (True, ["benchmarks/bench_cuda.py"] + (["--quick"] if quick else [])),
        "gpu-gat": (True, ["benchmarks/bench_gat.py", "--device", "cuda"]
                    + (["--nodes", "20000", "--feats", "8", "--reps", "2"] if quick else [])),
    }


def run_section(name, argv, out_dir):
    """Run one script, echoing its output (and writing it to out_dir/name.txt). Returns rc."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"\n======== {name}: python {' '.join(argv)}", flush=True)
    sink = open(os.path.join(out_dir, f"{name}.txt"), "w") if out_dir else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
        for line in proc.stdout:
            sys.stdout.write(line)
            if sink:
                sink.write(line)
        rc = proc.wait()
    finally:
        if sink:
            sink.close()
    print(f"======== {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every section")
    ap.add_argument("--out", default=None, help="folder for each section's output and the plots")
    ap.add_argument("--only", nargs="+", default=None,
                    choices=["machine", "cpu", "gat", "neighbors", "gpu-tc", "gpu-cuda", "gpu-gat"])
    args = ap.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    gpu = have_gpu()
    wanted = args.only or ["machine", "cpu", "gat", "neighbors", "gpu-tc", "gpu-cuda", "gpu-gat"]
    print(f"# benchmarks/run.py {'--quick ' if args.quick else ''}"
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); GPU sections: "
          f"{'yes' if gpu else 'no (no cupy or no device)'}", flush=True)
    failed = []
    if "machine" in wanted:
        text = machine_section(args.quick, gpu)
        print(text, end="", flush=True)
        if args.out:
            with open(os.path.join(args.out, "machine.txt"), "w") as f:
                f.write(text)
    for name, (needs_gpu, script_argv) in sections(args.quick, args.out).items():
        if name not in wanted:
            continue
        if needs_gpu and not gpu:
            print(f"\n======== {name}: skipped (no GPU)")
            continue
        if run_section(name, script_argv, args.out) != 0:
            failed.append(name)
    if failed:
        print(f"\nsections that failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
