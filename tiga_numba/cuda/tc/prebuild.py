"""Fill the tensor-core cubin cache ahead of the first call (no GPU needed):

    python -m tiga_numba.cuda.tc.prebuild [--arch sm_90] [--dtypes float16,bfloat16,float32] [--jobs N]

The cache lives in $TIGA_NUMBA_CACHE_DIR/tc (default ~/.cache/tiga_numba/tc); each kernel takes
seconds (fp16) to minutes (float32 3xTF32 backward) of NVVM time, once per generated text,
numba-cuda version and architecture.
"""
import argparse
import time

import tiga_numba.cuda  # noqa: F401  (numpy >= 2.5 shim before numba.cuda compiles)

from .build import build_cubins


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    t0 = time.time()
    names = build_cubins(tuple(a.dtypes.split(",")), a.arch, a.jobs)
    print(f"{len(names)} kernels for {a.arch} in {time.time() - t0:.0f} s: " + ", ".join(names))


if __name__ == "__main__":
    main()
