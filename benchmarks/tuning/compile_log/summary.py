"""Summarise a compile log (compile_log/sitecustomize.py): processes, the compile seconds per
function (events over 1 s), and the compiles of one (function, signature) that a second process
started while the first was still compiling it (work two test workers did twice).

    python benchmarks/tuning/compile_log/summary.py LOG [--top 20]
"""
import argparse
import collections


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    rows = []
    with open(a.log) as f:
        for line in f:
            pid, t0, t1, name, sig = line.rstrip("\n").split("\t")
            if float(t0) > 0:
                rows.append((int(pid), float(t0), float(t1), name, sig))
    print(f"{len({r[0] for r in rows})} processes, {len(rows)} compile events")
    by_key = collections.defaultdict(list)
    for pid, t0, t1, name, sig in rows:
        by_key[name, sig].append((t0, t1, pid))
    twice, seconds = 0, 0.0
    for events in by_key.values():
        events.sort()
        first_end, first_pid = events[0][1], events[0][2]
        for t0, t1, pid in events[1:]:
            if pid != first_pid and t0 < first_end and t1 - t0 > 1.0:
                twice += 1
                seconds += t1 - t0
    print(f"compiled by a second process while the first still compiled: {twice} ({seconds:.0f} s)")
    per_name = collections.Counter()
    for pid, t0, t1, name, sig in rows:
        if t1 - t0 > 1.0:
            per_name[name] += t1 - t0
    for name, s in per_name.most_common(a.top):
        print(f"{s:6.0f} s  {name}")


if __name__ == "__main__":
    main()
