"""ptxas's register and spill report of the shipped tensor-core kernels (no GPU needed).

    python benchmarks/tuning/tc_registers.py [--kinds fwd dq dkdv] [--dims 64 128]
        [--dtypes float16] [--engine wgmma|mma] [--modifier softcap|alibi|...] [--no-fold] [--narrow]
        [--overlap 0|1] [--min-ctas N]

Occupancy follows from it: a 128-thread CTA holds at most 65536 / (128 x regs rounded up to 8)
CTAs per SM (168 registers: 3; 176: 2), so a change to a kernel's text is checked here first. --modifier (a name of
score_mod.FLASH_TREES) reports the kernels a softcap= / alibi_slopes= call launches instead (with
--no-fold the ones a call takes where the soft-cap's fold does not hold: modifier.Fold);
--narrow the shapes a narrow band takes (tuning.NARROW; the others as shipped). --overlap sets
Variant.overlap (1: the wgmma forward's software pipeline, 0: its serial loop); --min-ctas N links
with ptxas held to N CTAs per SM (.maxntid / .minnctapersm on the entry), the register cap that
occupancy would need.
"""
import argparse
import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tiga_numba.cuda.tc import build, tuning  # noqa: E402


def report(kernel, arch, threads, min_ctas):
    """kernel.ptxas(arch), or with min_ctas the same report of its PTX linked under an occupancy
    target of min_ctas CTAs of `threads` threads per SM."""
    if not min_ctas:
        return kernel.ptxas(arch)
    ptx = kernel._ptx(kernel._target(arch))
    ptx, n = re.subn(r"(\.entry\s+[\w$]+\s*\([^)]*\))", rf"\1\n.maxntid {threads}, 1, 1\n.minnctapersm {min_ctas}",
                     ptx, count=1)
    assert n == 1, "no .entry in the kernel's PTX"
    log = kernel._link(ptx, kernel._target(arch), verbose=True)[0].get_info_log()
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(regs=int(regs.group(1)) if regs else None, spill_stores=int(spill.group(1)) if spill else 0,
                spill_loads=int(spill.group(2)) if spill else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["fwd", "dq", "dkdv"])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["float16"])
    ap.add_argument("--engine", choices=["wgmma", "mma"], default="wgmma")
    ap.add_argument("--modifier", default=None)
    ap.add_argument("--no-fold", action="store_true")
    ap.add_argument("--narrow", action="store_true")
    ap.add_argument("--overlap", type=int, choices=[0, 1], default=None)
    ap.add_argument("--min-ctas", type=int, default=0)
    a = ap.parse_args()
    wgmma = a.engine == "wgmma"
    for dt in a.dtypes:
        for D in a.dims:
            for kind in a.kinds:
                if a.modifier:
                    v = build.modified_variant(("wg:" if wgmma else "") + kind, D, dt, a.modifier, not a.no_fold)
                else:
                    v = tuning.variant(kind, D, D, dt, wgmma=wgmma)
                if a.narrow:   # 0 keys wide: every band tuning.narrow serves
                    v = tuning.narrow(v, 0)
                if a.overlap is not None:
                    v = dataclasses.replace(v, overlap=bool(a.overlap))
                r = report(build.kernel(v)[0], "sm_90a" if wgmma else "sm_90", v.NT, a.min_ctas)
                print(f"{v.name():52s} regs {r['regs']!s:>4s}  spill stores/loads {r['spill_stores']} / "
                      f"{r['spill_loads']} B  threads {v.NT}  shared {v.smem_bytes()} B", flush=True)


if __name__ == "__main__":
    main()
