"""The SASS instructions with the most warp-stall samples in one kernel of an Nsight Compute
report, from its source page as CSV:

    ncu -i REPORT --page source --csv --print-source sass [kernel filter] > k.csv
    python benchmarks/gpu/sass_hotspots.py k.csv [TOP]
"""
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
# find header
hi = next(i for i, r in enumerate(rows) if any("Source" == c or "Address" in c for c in r))
hdr = rows[hi]; data = rows[hi + 1:]
print(hdr)
def col(name):
    for i, h in enumerate(hdr):
        if h.strip().startswith(name):
            return i
    return None
src = col("Source"); samp = col("Warp Stall Sampling (All"); ex = col("Instructions Executed")
print(src, samp, ex)
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
tot = sum(num(r[samp]) for r in data if len(r) > samp)
print("total samples", tot)
for r in sorted(data, key=lambda r: -num(r[samp]) if len(r) > samp else 0)[:int(sys.argv[2]) if len(sys.argv) > 2 else 45]:
    print(f"{num(r[samp]):8.0f} {100*num(r[samp])/tot:5.1f}% ex={r[ex] if ex is not None else ''} | {r[src]}")
