"""How long writing memory takes again after the process freed it and waited: the cost a Dask
worker's fresh buffers (received chunks, task outputs) pay on a virtual machine that hands freed
memory back to its host (virtio-balloon free page reporting; docs/dask.md, "Memory returned to
the host"). Per idle time: allocate and touch a buffer, free it, wait, allocate and touch it
again; then the first touch of fresh memory with and without numpy's huge-page advice.

    python benchmarks/tuning/memory_refault_probe.py [--mib 512]
"""
import argparse
import time

import numpy as np


def touch(nbytes):
    t = time.perf_counter()
    a = np.empty(nbytes, np.uint8)
    a[::4096] = 1   # one write per 4 KiB page
    return time.perf_counter() - t, a


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    n = ap.parse_args().mib << 20
    print(f"buffer {n >> 20} MiB, one write per 4 KiB page")
    for wait in (0, 0.5, 1, 2, 4, 8):
        _, a = touch(n)
        del a
        time.sleep(wait)
        dt, a = touch(n)
        del a
        print(f"freed, idle {wait:4.1f} s, written again: {dt * 1e3:7.1f} ms", flush=True)
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        return
    for hp in (True, False):
        _set_madvise_hugepage(hp)
        dts = []
        for _ in range(4):
            dt, a = touch(n)
            del a
            dts.append(dt)
        print(f"huge-page advice {hp!s:5}: back-to-back allocations {', '.join(f'{d * 1e3:.0f}' for d in dts)} ms")
    _set_madvise_hugepage(True)


if __name__ == "__main__":
    main()
