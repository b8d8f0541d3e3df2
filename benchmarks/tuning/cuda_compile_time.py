"""Compile time of generated tensor-core kernels and of one CUDA-core configuration (no GPU:
numba's PTX plus, for the tensor-core kernels, nvJitLink's sm_90a link), with numba-cuda's
lowering pass as shipped ('stock') and with the linear form tiga_numba.cuda.numba_fixes puts in
its place ('fixed'). Each measurement runs in a fresh process with an empty kernel cache; the
PTX digest shows that both forms give the same code.

    python benchmarks/tuning/cuda_compile_time.py [--kernels fwd:128:8:128:float16,...] [--rounds 1]
"""
import argparse
import os
import subprocess
import sys
import tempfile

_TC = r"""
import hashlib, time
import tiga_numba.cuda.numba_fixes as fixes
if STOCK:
    fixes._installed = True   # install() does nothing: numba-cuda's own pass stays
from tiga_numba.cuda.tc import build, generator as G
kind, D, NW, BN, dtype = SPEC.split(":")
v = G.Variant(kind, int(D), int(D), dtype=dtype, NW=int(NW), BN=int(BN), wgmma=True, a_smem=True,
              MT=1).check()
t = time.perf_counter()
rep = build.kernel(v)[0].ptxas("sm_90a")
print(f"{SPEC:>24} {'stock' if STOCK else 'fixed'}: {time.perf_counter() - t:6.1f} s, "
      f"{rep['regs']} registers, PTX {hashlib.md5(rep['ptx'].encode()).hexdigest()[:12]}")
"""

_CORE = r"""
import sys, time
sys.path.insert(0, "tests")
import tiga_numba.cuda.numba_fixes as fixes
if STOCK:
    fixes._installed = True
import test_cuda_compile as T
dtype, D = SPEC.split(":")[1:]
t = time.perf_counter()
problems = T._compile_config(dtype, int(D), int(D))
print(f"{SPEC:>24} {'stock' if STOCK else 'fixed'}: {time.perf_counter() - t:6.1f} s "
      f"(every CUDA-core family of the configuration, PTX for sm_90){' ' + str(problems) if problems else ''}")
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="fwd:128:8:128:float16,fwd:64:4:128:bfloat16,dkdv:128:4:32:float16,"
                                          "core:float16:128",
                    help="kind:D:NW:BN:dtype per tensor-core kernel; core:dtype:D for a CUDA-core configuration")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for _ in range(args.rounds):
        for spec in args.kernels.split(","):
            for stock in (True, False):
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, TIGA_NUMBA_CACHE_DIR=cache, PYTHONPATH=root)
                    code = (_CORE if spec.startswith("core:") else _TC).replace("STOCK", str(stock)).replace(
                        "SPEC", repr(spec))
                    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True)


if __name__ == "__main__":
    main()
