"""Fill the tensor-core cubin cache ahead of the first call (no GPU needed):

    python -m tiga_numba.cuda.tc.prebuild [--arch sm_90] [--dtypes float16,bfloat16,float32] [--jobs N]
        [--modifiers softcap,alibi,alibi-aligned,softcap+alibi,softcap+alibi-aligned] [--dims 64,128]

The cache lives in $TIGA_NUMBA_CACHE_DIR/tc (default ~/.cache/tiga_numba/tc); each kernel takes
seconds (fp16) to minutes (float32 3xTF32 backward) of NVVM time, once per generated text,
numba-cuda version and architecture. --modifiers adds (or, with --only-modifiers, builds only)
the kernels of flash-attn's soft-cap / ALiBi score modifiers (score_mod.FLASH_TREES; "-aligned":
ALiBi bottom-right aligned, as dense and cu_seqlens relations take it; triangular and band
relations take the plain one; "-rows": flash-attn's per-sequence (batch, H) slopes), forward and
backward, every tensor-core head dim or --dims; with ALiBi also the forward a causal relation runs
(its distance split per key block: modifier.Split).
"""
import argparse
import time

import tiga_numba.cuda  # noqa: F401  (numpy >= 2.5 shim before numba.cuda compiles)

from .build import build_cubins, modified_kernels, shipped_kernels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--modifiers", default="", help="comma-separated names of score_mod.FLASH_TREES")
    ap.add_argument("--only-modifiers", action="store_true")
    ap.add_argument("--dims", default="", help="comma-separated head dims of the modifier kernels")
    a = ap.parse_args(argv)
    dtypes = tuple(a.dtypes.split(","))
    specs = [] if a.only_modifiers else shipped_kernels(dtypes)
    if a.modifiers:
        dims = {int(d) for d in a.dims.split(",")} if a.dims else None
        specs += [s for s in modified_kernels(a.modifiers.split(","), dtypes) if dims is None or s[1] in dims]
    t0 = time.time()
    names = build_cubins(dtypes, a.arch, a.jobs, specs)
    print(f"{len(names)} kernels for {a.arch} in {time.time() - t0:.0f} s: " + ", ".join(names))


if __name__ == "__main__":
    main()
