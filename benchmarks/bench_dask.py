"""tiga_numba.dask against the single-process call: time, bytes moved, the Dask layer's overhead.

    python benchmarks/bench_dask.py csr --nodes 1000000 --degree 16           # H=4, D=32
    python benchmarks/bench_dask.py csr-local --nodes 1000000 --degree 16     # sources near the row
    python benchmarks/bench_dask.py mesh --nodes 1000000 [--locality-order]   # a 2-D mesh, shuffled ids
    python benchmarks/bench_dask.py causal --n 32768                           # H=4, D=64
    python benchmarks/bench_dask.py gat --nodes 1000000 --degree 16           # GATConv(32, 8, heads=4)

The gat case runs a GNN layer (tiga_numba.dask.layer / layer_vjp against the layer's own call and
vjp, PyG's self loops added) on the csr case's graph. Its timed dask backward computes the
gradients alone, so each partition's forward runs in it (the single-process backward is the vjp
of a kept forward); --paired adds rounds of out and gradients computed together (layer_vjp's
forward tasks hand their state to the backward tasks) against the single-process forward +
backward.

For each worker count W (--workers, default 1 2) a dask.distributed.LocalCluster of W
single-thread worker processes runs the forward and the backward; numba gets 2 // W threads per
worker, so every configuration uses the same two cores as the single-process call. The inputs are
placed before timing (chunk i on worker i mod W, or --placement zigzag; checked), as data already
distributed would be; a timed call runs the tasks and leaves the results on the workers. Each timed
forward gets its inputs placed anew under new keys, so that it moves what its halos need (a chunk
fetched by an earlier call would otherwise still be on the worker that fetched it); the timed
backwards run on the last forward's inputs and results. Reported per configuration:

  plan s      client-side index plan (halos or blocks), first call; later calls reuse it
  fwd s, bwd s  wall time, best of --repeat
  cpu s       CPU seconds the call used: the benchmark's process for the single-process call;
              for dask the workers' processes plus the scheduler's plus the client's (graph
              build, serialisation). On a loaded machine wall times stretch with the load, CPU
              seconds much less: they are the load-independent measure of the layer's work
  moved MB    bytes the workers sent each other during the call (distributed's transfer counters)
  model MB    what the scaling model in docs/dask.md predicts for the same call
  busy s/wkr  task compute time per worker (task stream), the compute-per-worker of the model
  overhead    (dask time / single-process time) - 1, wall and CPU
  peak memory (a comment line per config) the largest resident size of each worker process

--keep-freed-memory runs the single-process call and the workers with glibc's malloc set to keep the
memory a process frees (one arena, no mmap'd chunks, no trimming: tiga_numba.dask.KEEP_FREED_MEMORY; the
benchmark restarts itself with it, and the workers get it before they start): on a virtual machine
that hands freed memory back to its host (free page reporting), a call that follows an idle pause
otherwise pays host page faults for every array it allocates (docs/dask.md, "Memory returned to the
host").
--keep-freed-memory-now leaves the processes as they start and calls tiga_numba.dask.keep_freed_memory(client)
on the running workers instead (glibc's mallopt: no fresh mappings for the main arena's large chunks, no
trimming; the task threads' arenas stay as they are).

--paired ROUNDS adds, after each configuration, ROUNDS rounds of a single-process call and a dask
call back to back (the order flipped every round) and prints each round's overhead and their median:
on a box whose speed drifts between minutes, a best-of-three measured minutes apart from its reference
says less than calls made seconds apart. --timeline prints the best timed call's task stream
(each worker's computes and incoming transfers, seconds from the call's start).

--touch-memory GIB first writes (and frees) that much memory and prints the rate of the first
write and of a second: on a virtual machine whose host backs memory lazily, memory not written
recently costs several times more on first write, and whichever configuration gets it pays that.

Warm-up: one untimed call of each configuration first compiles (or loads from numba's disk
cache) the kernels and builds what both sides cache per graph (the single-process graph's
realisations, the workers' memo of local relations), so the timed calls compare steady
states. Each timed dask call is checked to have run its tasks (not found earlier results).
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import time

import numpy as np


def _keep_freed_memory():
    """the glibc settings that keep freed memory in a process (tiga_numba.dask.KEEP_FREED_MEMORY),
    imported when asked: main() sets NUMBA_NUM_THREADS first, and numba reads it at import"""
    from tiga_numba.dask import KEEP_FREED_MEMORY
    return KEEP_FREED_MEMORY


def _graph(case, n, degree, rng):
    import tiga_numba as tg
    if case == "causal":
        return tg.Graph.triangular(n)
    if case == "mesh":   # a side x side 4-neighbour mesh whose node ids are a random permutation
        side = int(np.sqrt(n))
        ids = rng.permutation(side * side)
        r, c = np.divmod(np.arange(side * side), side)
        src, dst = [], []
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            rr, cc = r + dr, c + dc
            ok = (rr >= 0) & (rr < side) & (cc >= 0) & (cc < side)
            src.append(ids[rr[ok] * side + cc[ok]])
            dst.append(ids[np.arange(side * side)[ok]])
        return tg.Graph.from_coo(np.concatenate(src), np.concatenate(dst), side * side, side * side)
    dst = np.repeat(np.arange(n, dtype=np.int64), degree)
    if case in ("csr", "gat"):
        src = rng.integers(0, n, dst.shape[0])
    else:   # csr-local: every source within n / 64 rows of its destination
        width = max(n // 64, degree)
        src = np.clip(dst + rng.integers(-width, width + 1, dst.shape[0]), 0, n - 1)
    indptr = np.arange(0, dst.shape[0] + 1, degree, dtype=np.int64)
    return tg.Graph.from_csr(indptr, np.sort(src.reshape(n, degree), axis=1).reshape(-1), num_src=n)


def _print_timeline(epoch0, wall, records, addrs):
    """The timed call's task stream: per worker, each compute and each incoming transfer that
    took 10 ms or more, in seconds from the call's start (its wall time beside)."""
    print(f"# timeline of the best call ({wall:.2f} s): worker, action, start - stop s, key")
    rows = []
    for rec in records:
        name = str(rec["key"][0] if isinstance(rec["key"], tuple) else rec["key"])
        for ss in rec["startstops"]:
            if ss["stop"] - ss["start"] >= 0.01:
                rows.append((ss["start"] - epoch0, ss["stop"] - epoch0, addrs.index(rec["worker"])
                             if rec["worker"] in addrs else rec["worker"], ss["action"], name[:60]))
    for start, stop, worker, action, name in sorted(rows):
        print(f"#   w{worker} {action:<9} {start:6.2f} - {stop:6.2f}  {name}")


def _paired_rounds(rounds, work, P, fwd, ref_fwd, client, fresh_inputs):
    """Rounds of (single-process call, dask call) back to back, the order flipped every round,
    forward then backward: on a box whose speed drifts between minutes, each round's ratio
    compares two calls made within seconds of each other. Prints every round and the median
    ratio (dask / single - 1)."""
    import distributed

    def wall(fn):
        gc.collect()
        time.sleep(0.5)   # the release of the previous results reaches the scheduler
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def dask_call(make):
        distributed.wait(client.persist(list(make())))

    cases = [("fwd", work.single_forward, lambda: work.dask_forward(P), fresh_inputs),
             ("bwd", lambda: work.single_backward(ref_fwd), lambda: work.dask_backward(P, fwd), None)]
    if hasattr(work, "dask_together"):   # gat: out and gradients in one computation
        cases.append(("fwd+bwd together", work.single_together, lambda: work.dask_together(P), fresh_inputs))
    for label, single, on_dask, before in cases:
        pairs = []
        for r in range(rounds):
            if before is not None:
                before()
            if r % 2 == 0:
                s, d = wall(single), wall(lambda: dask_call(on_dask))
            else:
                d, s = wall(lambda: dask_call(on_dask)), wall(single)
            pairs.append((s, d))
        overheads = [d / s - 1 for s, d in pairs]
        print(f"# paired {label} (single s / dask s per round): "
              + ", ".join(f"{s:.2f}/{d:.2f}" for s, d in pairs)
              + f"; overhead per round {', '.join(f'{o:+.0%}' for o in overheads)}; median {float(np.median(overheads)):+.0%}",
              flush=True)


def _best(fn, repeat):
    """(best wall s, CPU s of that call, result)."""
    best, result = None, None
    for _ in range(repeat):
        result = None
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        result = fn()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if best is None or dt < best[0]:
            best = (dt, dc)
    return best[0], best[1], result


def _peak_rss():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _process_cpu():
    import psutil
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _model_bytes(summary, q_rows, k_rows, q_owner, k_owner, heads, kv_heads, dim, value_dim, itemsize):
    """Bytes the scaling model of docs/dask.md predicts for (forward, backward), with q chunk p
    on worker q_owner[p] and k, v chunk c on k_owner[c]. A task runs on the worker that holds more of its input bytes (dask's
    rule); an input fetched to a worker stays there for the other tasks of the call.

    CSR: a partition's task (next to its rows) receives the remote halo rows of k and v; the
    backward receives them again and sends the partial dk/dv of the same rows back.
    Implicit: per block (p, c) on different workers, either k_c and v_c travel to p's worker
    (once per worker) or q_p travels to c's worker (once per worker) and the partial result
    comes back; the backward likewise, with the partial dk/dv (or dq) sent to its sum."""
    acc = 4 if itemsize <= 4 else 8
    if summary["kind"] == "csr":
        kv_row = kv_heads * (dim + value_dim) * itemsize
        fwd = sum(rows for p, halo in enumerate(summary["halo"])
                  for c, rows in halo.items() if k_owner[c] != q_owner[p]) * kv_row
        return fwd, 2 * fwd
    fwd, bwd, seen_f, seen_b = 0, 0, set(), set()
    for p, blocks in enumerate(summary["blocks"]):
        for c in blocks:
            wq, wk = q_owner[p], k_owner[c]
            if wq == wk:
                continue
            kv = k_rows[c] * kv_heads * (dim + value_dim) * itemsize
            q_in = q_rows[p] * heads * dim * itemsize
            partial_out = q_rows[p] * heads * (value_dim * acc + 2 * acc)
            if kv > q_in:
                fwd += (q_in if (wk, "q", p) not in seen_f else 0) + partial_out
                seen_f.add((wk, "q", p))
            else:
                fwd += kv if (wq, "kv", c) not in seen_f else 0
                seen_f.add((wq, "kv", c))
            q_side = q_rows[p] * heads * (dim * itemsize + 2 * value_dim * itemsize + 2 * acc)
            if kv > q_side:
                bwd += (q_side if (wk, "q", p) not in seen_b else 0) + q_rows[p] * heads * dim * acc
                seen_b.add((wk, "q", p))
            else:
                bwd += (kv if (wq, "kv", c) not in seen_b else 0) + kv // itemsize * acc
                seen_b.add((wq, "kv", c))
    return fwd, bwd


class _Attention:
    """tg.attention over q, k, v: H=4, D=32 on graphs, D=64 causal, float32."""
    rows, cols = "q", "k"

    def __init__(self, args, graph, rng):
        import tiga_numba as tg
        import tiga_numba.dask as tgd
        self.tg, self.tgd, self.graph = tg, tgd, graph
        n = graph.num_dst
        self.heads, self.dim = 4, (64 if args.case == "causal" else 32)
        self.arrays = {name: rng.standard_normal((n, self.heads, self.dim), dtype=np.float32)
                       for name in ("q", "k", "v", "dout")}
        self.describe = f"H={self.heads}, D={self.dim}, float32"

    def single_forward(self):
        a = self.arrays
        return self.tg.attention(a["q"], a["k"], a["v"], self.graph, return_stats=True)

    def single_backward(self, fwd):
        a = self.arrays
        return self.tg.attention_backward(a["dout"], a["q"], a["k"], a["v"], *fwd, self.graph)

    def dask_forward(self, P):
        o, st = self.tgd.attention(P["q"], P["k"], P["v"], self.graph, return_stats=True)
        return [o, st.m, st.l]

    def dask_backward(self, P, fwd):
        stats = self.tgd.DaskAttentionStats(fwd[1], fwd[2])
        return list(self.tgd.attention_backward(P["dout"], P["q"], P["k"], P["v"], fwd[0], stats, self.graph))

    def compared(self, fwd, bwd):
        """(forward result, gradient) that the error line compares: out and dk (single-process
        results or the dask lists)."""
        return fwd[0], bwd[1]

    def summary(self, P):
        return self.tgd.plan_summary(self.graph, P["q"], P["k"])

    def model(self, summary, P, q_owner, k_owner):
        return _model_bytes(summary, P["q"].chunks[0], P["k"].chunks[0], q_owner, k_owner, self.heads,
                            self.heads, self.dim, self.dim, 4)


class _Layer:
    """tiga_numba.layers.GATConv(32, 8, heads=4) (self loops added, eval) over x (N, 32) float32."""
    rows = cols = "x"

    def __init__(self, args, graph, rng):
        import tiga_numba.dask as tgd
        from tiga_numba.layers import GATConv
        self.tgd, self.graph = tgd, graph
        self.conv = GATConv(32, 8, heads=4, seed=0).eval()
        n = graph.num_dst
        self.arrays = {"x": rng.standard_normal((n, 32), dtype=np.float32),
                       "dout": rng.standard_normal((n, 32), dtype=np.float32)}
        self.describe = "GATConv(32, 8, heads=4), float32"

    def single_forward(self):
        return self.conv.vjp(self.arrays["x"], self.graph)

    def single_backward(self, fwd):
        return fwd[1](self.arrays["dout"])

    def dask_forward(self, P):
        return [self.tgd.layer(self.conv, P["x"], self.graph)]

    def dask_backward(self, P, fwd):
        grads = self.tgd.layer_vjp(self.conv, P["x"], self.graph)[1](P["dout"])
        return [grads["x"], *grads["params"].values()]

    def single_together(self):
        return self.single_backward(self.single_forward())

    def dask_together(self, P):
        """out and the gradients of one layer_vjp computed together, as a training step would"""
        out, vjp = self.tgd.layer_vjp(self.conv, P["x"], self.graph)
        grads = vjp(P["dout"])
        return [out, grads["x"], *grads["params"].values()]

    def compared(self, fwd, bwd):
        """out and dx (single-process results or the dask lists)."""
        return fwd[0], (bwd["x"] if isinstance(bwd, dict) else bwd[0])

    def summary(self, P):
        from tiga_numba.layers._edges import edge_set   # the relation the layer's tasks run on
        return self.tgd.plan_summary(edge_set(self.graph, True, np).graph, P["x"], P["x"])

    def model(self, summary, P, q_owner, k_owner):
        # the halo rows of x (32 float32 each); backward: again, and the partial dx sent back
        return _model_bytes(summary, P["x"].chunks[0], P["x"].chunks[0], q_owner, k_owner, 1, 1, 32, 0, 4)


def run(args):
    import dask.array as da
    import distributed

    if args.touch_memory:
        from run import first_touch   # benchmarks/run.py: the machine's ceilings
        first, again = first_touch(args.touch_memory)
        print(f"# memory touched before the runs: {args.touch_memory} GiB, first write {first:.2f} GiB/s, "
              f"again {again:.2f} GiB/s", flush=True)

    rng = np.random.default_rng(0)
    n = args.n if args.case == "causal" else args.nodes
    t0 = time.perf_counter()
    graph = _graph(args.case, n, args.degree, rng)
    n = graph.num_dst
    if args.locality_order:   # the inputs are random: reordering them too changes nothing measured
        import tiga_numba.dask as tgd
        graph = tgd.locality_order(graph)[1]
    build_s = time.perf_counter() - t0
    work = (_Layer if args.case == "gat" else _Attention)(args, graph, rng)
    print(f"# {args.case}: N={n}, edges={graph.num_edges}, {work.describe}; "
          f"graph built in {build_s:.1f} s" + ("; nodes in locality_order (reverse Cuthill-McKee)"
                                               if args.locality_order else "") + ("; dask low-level fusion off" if args.no_fuse else "")
          + ("; freed memory kept (" + " ".join(f"{k}={v}" for k, v in _keep_freed_memory().items()) + ")"
             if args.keep_freed_memory else ""))
    if args.keep_freed_memory:   # for the workers; this process got the variables at its start (main)
        import dask
        import tiga_numba.dask as tgd
        dask.config.set(tgd.keep_freed_memory_config())
    # single process (warm: one call first compiles or loads the kernels)
    work.single_forward()
    t_fwd, c_fwd, ref_fwd = _best(work.single_forward, args.repeat)
    work.single_backward(ref_fwd)
    t_bwd, c_bwd, ref_bwd = _best(lambda: work.single_backward(ref_fwd), args.repeat)
    ref_out, ref_grad = work.compared(ref_fwd, ref_bwd)
    print("| config | plan s | fwd s | bwd s | cpu s fwd / bwd | moved MB fwd / bwd | model MB fwd / bwd | "
          "busy s/wkr fwd / bwd | overhead wall fwd / bwd | overhead cpu fwd / bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| single process, 2 threads | - | {t_fwd:.2f} | {t_bwd:.2f} | {c_fwd:.2f} / {c_bwd:.2f} | 0 / 0 | - "
          f"| - | - | - |", flush=True)
    for workers in args.workers:
        chunks = workers * args.chunks_per_worker
        rows = -(-n // chunks)
        threads = max(1, 2 // workers)
        with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                      dashboard_address=":0", silence_logs=40,
                                      env={"NUMBA_NUM_THREADS": str(threads)}) as cluster, \
                distributed.Client(cluster) as client:
            addrs = sorted(client.scheduler_info()["workers"])
            if args.keep_freed_memory_now:
                import tiga_numba.dask as tgd
                print(f"# tiga_numba.dask.keep_freed_memory(client): {tgd.keep_freed_memory(client)}", flush=True)
            if args.keep_freed_memory:   # the settings reached the workers before they started
                keep = _keep_freed_memory()
                seen = client.run(lambda: {k: os.environ.get(k) for k in keep})
                assert all(e == keep for e in seen.values()), seen

            def owner(i):
                """the worker of chunk i: cyclic (i mod W), or zigzag (W = 2: chunks 0, 3 | 1, 2), which
                gives each worker the same share of a causal relation's blocks"""
                if args.placement == "cyclic" or (i // workers) % 2 == 0:
                    return i % workers
                return workers - 1 - i % workers

            def place(a):
                parts = []
                for i, s in enumerate(range(0, n, rows)):
                    # hash=False: new keys on every placement (see fresh_inputs)
                    fut = client.scatter(a[s:s + rows], workers=[addrs[owner(i)]], hash=False)
                    parts.append(da.from_delayed(fut, a[s:s + rows].shape, dtype=a.dtype))
                placed = client.persist(da.concatenate(parts))
                distributed.wait(placed)
                return placed

            def owners(x):
                where = client.who_has(x)
                return [addrs.index(where[key][0]) for key in (
                    (x.name, i) + (0,) * (x.ndim - 1) for i in range(len(x.chunks[0])))]

            P = {name: place(a) for name, a in work.arrays.items()}

            def fresh_inputs():
                """the inputs placed again under new keys: a chunk a worker fetched for an earlier
                call stays there as a replica (dask keeps it until the key is released), so a
                forward timed on the same keys moved nothing in some runs and all the halos in
                others; each timed forward starts from new data instead, as a model's next step
                would, and moves what its halos need"""
                for name, a in work.arrays.items():
                    P[name] = None
                    P[name] = place(a)
            placed = {name: owners(a) for name, a in P.items()}
            q_owner, k_owner = placed[work.rows], placed[work.cols]
            if any(o != [owner(i) for i in range(chunks)] for o in placed.values()):
                print(f"# note: chunks placed {placed}")
            t0 = time.perf_counter()
            summary = work.summary(P)
            plan_s = time.perf_counter() - t0

            def moved():
                return sum(client.run(lambda dask_worker: dask_worker.transfer_outgoing_bytes_total).values())

            # a LocalCluster's scheduler runs in this process: its CPU is then in the client's
            same_process = client.run_on_scheduler(os.getpid) == os.getpid()

            def cpu_now():
                return (sum(client.run(_process_cpu).values()),
                        0.0 if same_process else client.run_on_scheduler(_process_cpu),
                        _process_cpu())

            def timed(make, before_each=None):
                best, result, sent, busy, cpu, split, timeline = None, None, 0, None, None, None, None
                distributed.wait(client.persist(list(make())))   # warm: kernels compiled or loaded
                for _ in range(args.repeat):
                    result = None
                    if before_each is not None:
                        before_each()
                    gc.collect()
                    time.sleep(0.5)   # the release of the previous results reaches the scheduler
                    before, (w0, s0, c0) = moved(), cpu_now()
                    with distributed.get_task_stream(client) as stream:
                        epoch0 = time.time()   # the task stream's clock
                        t0 = time.perf_counter()
                        result = client.persist(list(make()))
                        distributed.wait(result)
                        dt = time.perf_counter() - t0
                    w1, s1, c1 = cpu_now()
                    per, ran = {}, 0
                    for rec in stream.data:
                        ran += "-tasks-" in str(rec["key"])
                        for ss in rec["startstops"]:
                            if ss["action"] == "compute":
                                per[rec["worker"]] = per.get(rec["worker"], 0) + ss["stop"] - ss["start"]
                    assert ran, "the timed call ran no attention task (results were still in memory)"
                    if best is None or dt < best:
                        best, sent, busy, cpu = dt, moved() - before, per, (w1 - w0) + (s1 - s0) + (c1 - c0)
                        split = (w1 - w0, s1 - s0, c1 - c0)
                        timeline = (epoch0, dt, list(stream.data))
                if args.timeline:
                    _print_timeline(*timeline, addrs)
                print(f"# {'fwd' if '-out-' in str(result[0].name) else 'bwd'} cpu s: workers {split[0]:.2f}, "
                      + (f"client and scheduler (one process) {split[2]:.2f}" if same_process else
                         f"scheduler {split[1]:.2f}, client {split[2]:.2f}"), flush=True)
                return best, result, sent, busy, cpu

            f_s, fwd, f_bytes, f_busy, f_cpu = timed(lambda: work.dask_forward(P), fresh_inputs)
            b_s, grads, b_bytes, b_busy, b_cpu = timed(functools.partial(work.dask_backward, P, fwd))
            got = [np.asarray(x) for x in client.gather([a.persist() for a in work.compared(fwd, grads)])]
            err = max(float(np.abs(got[0] - ref_out).max() / np.abs(ref_out).max()),
                      float(np.abs(got[1] - ref_grad).max() / np.abs(ref_grad).max()))
            m_f, m_b = work.model(summary, P, q_owner, k_owner)
            peak = sorted(client.run(_peak_rss).values())
            print(f"# peak resident memory per worker process (whole run: inputs, warm and timed calls): "
                  f"{', '.join(f'{x / 2**30:.2f}' for x in peak)} GiB", flush=True)
            fmt_busy = lambda b: "/".join(f"{x:.1f}" for x in sorted(b.values()))  # noqa: E731
            print(f"| {workers} worker{'s' if workers > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}, "
                  f"{chunks} chunks | {plan_s:.2f} | {f_s:.2f} | {b_s:.2f} | {f_cpu:.2f} / {b_cpu:.2f} | "
                  f"{f_bytes / 1e6:.0f} / {b_bytes / 1e6:.0f} | {m_f / 1e6:.0f} / {m_b / 1e6:.0f} | "
                  f"{fmt_busy(f_busy)} / {fmt_busy(b_busy)} | "
                  f"{f_s / t_fwd - 1:+.0%} / {b_s / t_bwd - 1:+.0%} | {f_cpu / c_fwd - 1:+.0%} / {b_cpu / c_bwd - 1:+.0%} |"
                  f"  max |err| / max |ref| (out, {'dx' if args.case == 'gat' else 'dk'}) {err:.1e}", flush=True)
            if args.paired:
                _paired_rounds(args.paired, work, P, fwd, ref_fwd, client, fresh_inputs)
            grads = fwd = P = None   # freed before the next configuration


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=["csr", "csr-local", "mesh", "causal", "gat"])
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--degree", type=int, default=16)
    p.add_argument("--n", type=int, default=32768, help="sequence length (causal)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--chunks-per-worker", type=int, default=1)
    p.add_argument("--placement", choices=["cyclic", "zigzag"], default="cyclic",
                   help="which worker holds chunk i: i mod W, or zigzag (balanced causal blocks)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--touch-memory", type=int, default=0, metavar="GIB",
                   help="first write GIB GiB of memory and free it before the runs (benchmarks/run.py: first_touch)")
    p.add_argument("--no-stealing", action="store_true",
                   help="turn dask.distributed's work stealing off (tasks stay with their data)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="glibc malloc keeps freed memory in every process of the run (KEEP_FREED_MEMORY; the "
                        "benchmark restarts itself with it): no host page faults after idle pauses on a VM "
                        "with free page reporting (docs/dask.md)")
    p.add_argument("--keep-freed-memory-now", action="store_true",
                   help="call tiga_numba.dask.keep_freed_memory(client) on the running workers (mallopt)")
    p.add_argument("--locality-order", action="store_true",
                   help="renumber the graph's nodes with tiga_numba.dask.locality_order (CSR cases) first")
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="after each configuration, ROUNDS rounds of (single-process call, dask call) back to back, "
                        "order flipped every round: per-round overheads and their median")
    p.add_argument("--timeline", action="store_true",
                   help="print the task stream of each configuration's best timed call (computes and transfers)")
    p.add_argument("--no-fuse", action="store_true",
                   help="turn dask's low-level task fusion off for every array (optimization.fuse.active: "
                        "False); the arrays tiga_numba.dask returns keep their placement hints without it "
                        "(docs/dask.md, \"Placement hints\")")
    args = p.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", "2")   # before numba is imported (_keep_freed_memory imports it)
    if args.keep_freed_memory and any(os.environ.get(k) != v for k, v in _keep_freed_memory().items()):
        import sys
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **_keep_freed_memory()})
    if args.no_stealing:
        import dask
        dask.config.set({"distributed.scheduler.work-stealing": False})
    if args.no_fuse:
        import dask
        dask.config.set({"optimization.fuse.active": False})
    run(args)


if __name__ == "__main__":
    main()
