"""Compile the CPU kernels ahead of time: ``python -m tiga_numba.precompile``.

The CPU kernels are numba functions compiled on first use and kept in numba's on-disk cache
(``cache=True``: next to the package's sources, or under ``NUMBA_CACHE_DIR``). A first call
therefore takes seconds (about 10 s for a small dense call on a 2-core machine); later
processes load the kernels from disk in about a second. This command makes one tiny call of
every CPU kernel family for each dtype asked for, so that the first real call of a script
finds them on disk:

    python -m tiga_numba.precompile                      # float32 and float64
    python -m tiga_numba.precompile --dtypes float32     # float16 inputs use these too
    python -m tiga_numba.precompile --modifiers softcap,alibi   # also softcap= / alibi_slopes=
    (alibi-rows: flash-attn's per-sequence (batch, H) slopes on cu_seqlens relations)

Families: block relations (dense, causal, cu_seqlens; bands at most 2 x BN keys wide take span
tiles, kernels of their own) forward, tile-pruned forward and
backward; the split-key forward of few-query blocks; CSR relations forward and backward.
The GAT score-network kernels are generated per network shape and compile on their first
call (see docs/gat.md); the GPU kernels have their own command, ``python -m tiga_numba.cuda.tc.prebuild``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

#: float16 inputs accumulate in float32 and run the float32 kernels
DEFAULT_DTYPES = ("float32", "float64")


def _narrow_band():
    """(rows, the narrow band of the span-tile calls): more query rows than the split-key
    (decode) kernels take, so that the block kernels are the ones chosen, and a band at most
    2 x BN keys wide, which takes span tiles (cpu/tiles.py)."""
    import tiga_numba as tg
    from tiga_numba.registry import DECODE_MAX_ROWS
    n = DECODE_MAX_ROWS + 8
    return n, tg.Graph.band(n, left=8)


def _calls(dtype, modifiers=()):
    """(label, thunk) for one tiny call per CPU kernel family (and, per name in `modifiers`,
    the forward and backward of that flash-attn modifier on block and CSR relations; each
    modifier is its own set of kernels); each thunk returns its plan."""
    import tiga_numba as tg
    from tiga_numba import functional

    rng = np.random.default_rng(0)
    # the block calls' rows (_narrow_band); the decode kernel gets its own call (dense(n, 1))
    n, narrow = _narrow_band()
    heads, width = 1, 4
    q, k, v, dout = (rng.standard_normal((n, heads, width)).astype(dtype) for _ in range(4))
    dense = tg.Graph.dense(n)
    ring = tg.Graph.from_csr(np.arange(0, 2 * n + 1, 2), (np.arange(2 * n) * 3) % n, num_src=n)

    def forward(graph, **options):
        def run():
            tg.attention(q[:graph.num_dst], k, v, graph, **options)
            return functional.last_plan()
        return run

    def backward(graph, **options):
        def run():
            qg, dg = q[:graph.num_dst], dout[:graph.num_dst]
            out, stats = tg.attention(qg, k, v, graph, return_stats=True, **options)
            tg.attention_backward(dg, qg, k, v, out, stats, graph, **options)
            return functional.last_plan()
        return run

    modified = []
    for name in modifiers:
        if name == "alibi-rows":
            # flash-attn's per-sequence (batch, H) slopes on cu_seqlens relations, square and
            # rectangular (bottom-right aligned): trees of their own
            kw = {"alibi_slopes": np.ones((2, heads))}
            calls = [("fwd+bwd, causal cu_seqlens", backward(tg.Graph.cu_seqlens([0, 2, n]), **kw)),
                     ("fwd+bwd, rectangular cu_seqlens (bottom-right aligned)",
                      backward(tg.Graph.cu_seqlens([0, 2, n // 2], cu_seqlens_k=[0, 4, n]), **kw))]
            modified += [(f"{name} {label}", run) for label, run in calls]
            continue
        kw = {"softcap": {"softcap": 30.0}, "alibi": {"alibi_slopes": np.ones(heads)}}[name]
        calls = [("fwd+bwd, causal", backward(tg.Graph.triangular(n), **kw)),
                 ("fwd+bwd, csr", backward(ring, **kw)),
                 ("fwd, dense (its taller tiles)", forward(dense, **kw))]
        if name == "alibi":
            # rectangular dense / cu_seqlens blocks align ALiBi bottom-right: a tree of its own
            rect = tg.Graph.dense(n, n // 2)
            calls += [("fwd+bwd, rectangular dense (bottom-right aligned)", backward(rect, **kw)),
                      ("fwd, rectangular cu_seqlens (bottom-right aligned)",
                       forward(tg.Graph.cu_seqlens([0, 2, n // 2], cu_seqlens_k=[0, 4, n]), **kw))]
        modified += [(f"{name} {label}", run) for label, run in calls]

    # dense relations' forward takes taller tiles than the others (cpu/tiles.py): two kernels
    return modified + [("blocks forward, dense", forward(dense)),
            ("blocks forward, causal / segments / wide bands", forward(tg.Graph.triangular(n))),
            ("blocks forward, narrow bands (span tiles)", forward(narrow)),
            ("blocks backward, narrow bands (span tiles)", backward(narrow)),
            ("blocks forward, tile-pruned", forward(dense, block_prune_threshold=0.5)),
            ("blocks backward", backward(dense)),
            ("decode forward (few query rows per block)", forward(tg.Graph.dense(n, 1))),
            ("csr forward", forward(ring)),
            ("csr backward", backward(ring))]


MODIFIERS = ("softcap", "alibi", "alibi-rows")


def precompile(dtypes=DEFAULT_DTYPES, out=None, modifiers=()):
    """Run one tiny call per CPU kernel family and dtype (and per modifier named in `modifiers`,
    a subset of MODIFIERS: flash-attn's ``softcap=`` / ``alibi_slopes=``). Returns a list of
    (dtype, family label, where the kernel came from, seconds); where is "compiled",
    "disk hit" (numba's on-disk cache) or "memory hit" (already in this process)."""
    for bad in set(modifiers) - set(MODIFIERS):
        raise ValueError(f"modifiers: expected names from {MODIFIERS}, got {bad!r}")
    records = []
    for dtype in dtypes:
        dtype = np.dtype(dtype).name
        if dtype not in DEFAULT_DTYPES:
            raise ValueError(f"dtypes: the CPU kernels are compiled for float32 (also used by "
                             f"float16 inputs) and float64, got {dtype!r}")
        for label, run in _calls(dtype, modifiers):
            t0 = time.perf_counter()
            plan = run()
            seconds = time.perf_counter() - t0
            record = (dtype, label, str(plan.run_info.get("cache", "n/a")), seconds)
            records.append(record)
            if out is not None:
                print(f"  {dtype:8s} {label:42s} {record[2]:11s} {seconds:6.1f} s", file=out,
                      flush=True)
    return records


def main(argv=None):
    """The command line: ``python -m tiga_numba.precompile [--dtypes ...] [--modifiers ...]``
    (see ``--help``); compiles the chosen CPU kernels into numba's disk cache."""
    parser = argparse.ArgumentParser(prog="python -m tiga_numba.precompile",
                                     description="Compile tiga_numba's CPU kernels into numba's "
                                                 "on-disk cache ahead of the first call.")
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES),
                        choices=list(DEFAULT_DTYPES),
                        help="input dtypes to compile for (float16 inputs use the float32 "
                             "kernels); default: %(default)s")
    parser.add_argument("--modifiers", default="",
                        help="also the kernels of these score modifiers, comma-separated from "
                             f"{', '.join(MODIFIERS)} (tg.attention's softcap= / alibi_slopes=)")
    args = parser.parse_args(argv)
    modifiers = tuple(m for m in args.modifiers.split(",") if m)
    print(f"tiga_numba.precompile: CPU kernels for {', '.join(args.dtypes)}"
          + (f", modifiers {', '.join(modifiers)}" if modifiers else ""), flush=True)
    t0 = time.perf_counter()
    try:
        records = precompile(args.dtypes, out=sys.stdout, modifiers=modifiers)
    except ValueError as exc:
        parser.error(str(exc))
    compiled = sum(r[2] == "compiled" for r in records)
    print(f"done in {time.perf_counter() - t0:.1f} s: {compiled} compiled, "
          f"{len(records) - compiled} already cached", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
