#!/bin/bash
# Extract the package (and the benchmark scripts) as they were at an earlier commit into a folder of
# their own, so that a benchmark can time that version and the working tree side by side, in turns,
# in one run on one machine: the only fair before / after on shared or virtual machines.
#
#   bash benchmarks/ab_base.sh REV [DIR]        # default DIR: build/base (ignored by git)
#   python benchmarks/bench_score_mods_gpu.py --no-flex          # the working tree
#   PYTHONPATH=$PWD/build/base python build/base/benchmarks/bench_score_mods_gpu.py --no-flex   # REV
#
# Put the copy first on PYTHONPATH as above: most benchmark scripts also put their own folder's
# parent first on sys.path, but not every one does, and an installed or PYTHONPATH copy of the
# working tree would otherwise be imported instead. numba's on-disk caches are kept per copy (their __pycache__
# folders), the tensor-core cubin cache (TIGA_NUMBA_CACHE_DIR) is shared: its records are keyed by
# the kernel text, so both versions find their own. For the GPU machine, carry the folder
# (`carry: ["build/base", ...]`).
set -euo pipefail
rev=${1:?usage: ab_base.sh REV [DIR]}
dir=${2:-build/base}
root=$(git rev-parse --show-toplevel)
cd "$root"
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || { echo "ab_base.sh: no commit $rev" >&2; exit 2; }
rm -rf "$dir"
mkdir -p "$dir"
git archive "$rev" tiga_numba benchmarks ":(exclude)benchmarks/results" | tar -x -C "$dir"
echo "$(git rev-parse --short "$rev") -> $dir ($(git log -1 --format=%cs "$rev"))"
