"""ptxas's register and spill report of the shipped tensor-core kernels (no GPU needed).

    python benchmarks/tuning/tc_registers.py [--kinds fwd dq dkdv] [--dims 64 128]
        [--dtypes float16] [--engine wgmma|mma] [--modifier softcap|alibi|...] [--narrow]

Occupancy follows from it: a 128-thread CTA holds at most 65536 / (128 x regs rounded up to 8)
CTAs per SM (168 registers: 3; 176: 2), so a change to a kernel's text is checked here first. --modifier (a name of
score_mod.FLASH_TREES) reports the kernels a softcap= / alibi_slopes= call launches instead;
--narrow the shapes a narrow band takes (tuning.NARROW; the others as shipped).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tiga_numba.cuda.tc import build, tuning  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["fwd", "dq", "dkdv"])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float16"])
    ap.add_argument("--engine", choices=["wgmma", "mma"], default="wgmma")
    ap.add_argument("--modifier", default=None)
    ap.add_argument("--narrow", action="store_true")
    a = ap.parse_args()
    wgmma = a.engine == "wgmma"
    for dt in a.dtypes:
        for D in a.dims:
            for kind in a.kinds:
                if a.modifier:
                    v = build.modified_variant(("wg:" if wgmma else "") + kind, D, dt, a.modifier)
                else:
                    v = tuning.variant(kind, D, D, dt, wgmma=wgmma)
                if a.narrow:   # 0 keys wide: every band tuning.narrow serves
                    v = tuning.narrow(v, 0)
                r = build.kernel(v)[0].ptxas("sm_90a" if wgmma else "sm_90")
                print(f"{v.name():52s} regs {r['regs']!s:>4s}  spill stores/loads {r['spill_stores']} / "
                      f"{r['spill_loads']} B  threads {v.NT}  shared {v.smem_bytes()} B", flush=True)


if __name__ == "__main__":
    main()
