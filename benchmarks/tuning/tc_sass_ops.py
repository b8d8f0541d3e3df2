"""SASS opcode counts of the shipped tensor-core kernels, plain and with a score modifier, side
by side (no GPU needed: the cubins are linked here, as tc_registers.py does, and disassembled
with cuobjdump).

    python benchmarks/tuning/tc_sass_ops.py [--kind fwd|dq|dkdv] [--dim 128] [--dtype float16]
        [--modifiers softcap alibi] [--no-fold] [--cuobjdump PATH]

cuobjdump: the one on PATH, else --cuobjdump (e.g. from the nvidia-cuda-cuobjdump wheel:
pip download nvidia-cuda-cuobjdump, unzip, nvidia/cu13/bin/cuobjdump). The counts are static
(instructions in the kernel text, not executed): each kernel's key loop body is emitted once,
so the difference between two columns divided by the cells a thread holds per key block (64 in
the D = 128 forward: 64 rows x 128 keys over 128 threads) is what a modifier adds per cell.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tiga_numba.cuda.tc import build, tuning  # noqa: E402

_OP = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def opcodes(variant, cuobjdump):
    """{opcode: count} of the variant's sm_90a cubin."""
    _, data = build.kernel(variant)[0].cubin("sm_90a")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return collections.Counter(m.group(1) for m in map(_OP.match, text.splitlines()) if m)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="fwd", choices=["fwd", "dq", "dkdv"])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--modifiers", nargs="*", default=["softcap", "alibi"])
    ap.add_argument("--no-fold", action="store_true",
                    help="the modifiers' kernels without the soft-cap's fold (modifier.Fold)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    a = ap.parse_args()
    if not a.cuobjdump:
        sys.exit("no cuobjdump on PATH: pass --cuobjdump PATH")
    cols = {"plain": opcodes(tuning.variant(a.kind, a.dim, a.dim, a.dtype, wgmma=True), a.cuobjdump)}
    for m in a.modifiers:
        cols[m] = opcodes(build.modified_variant("wg:" + a.kind, a.dim, a.dtype, m, not a.no_fold), a.cuobjdump)
    names = list(cols)
    ops = sorted(set().union(*cols.values()), key=lambda o: (-max(c[o] for c in cols.values()), o))
    print(f"# {a.kind} D={a.dim} {a.dtype} (wgmma, sm_90a): SASS instructions per opcode")
    print(f"{'opcode':14s}" + "".join(f"{n:>10s}" for n in names) + "".join(f"{'+' + n:>10s}" for n in names[1:]))
    for o in ops:
        row = [cols[n][o] for n in names]
        if len(set(row)) == 1 and row[0] < 8:
            continue   # the same few everywhere: left out
        print(f"{o:14s}" + "".join(f"{x:10d}" for x in row) + "".join(f"{x - row[0]:+10d}" for x in row[1:]))
    print(f"{'total':14s}" + "".join(f"{sum(cols[n].values()):10d}" for n in names))


if __name__ == "__main__":
    main()
