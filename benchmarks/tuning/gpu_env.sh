# Sourced by the benchmarks/gpu_*.sh device scripts (one prologue for all of them):
#   . "$(dirname "$0")/gpu_env.sh" NAME
# Goes to the repository root, puts it on the import path, uses a carried .tccubin as the cubin
# cache (else TIGA_NUMBA_CACHE_DIR or /tmp/tiga_numba_cubins: one cache for every step), makes
# $OUT (default /tmp/NAME), starts status=0 and the clock of stamp(), and writes the header
# (GPU, package versions, commit) to $OUT/gpu.txt.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .tccubin ]; then export TIGA_NUMBA_CACHE_DIR=${TIGA_NUMBA_CACHE_DIR:-$PWD/.tccubin}; fi
export TIGA_NUMBA_CACHE_DIR=${TIGA_NUMBA_CACHE_DIR:-/tmp/tiga_numba_cubins}
OUT=${OUT:-/tmp/$1}
mkdir -p "$OUT"
status=0
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.used --format=csv,noheader
  python3 -c "import numba, numba_cuda, cupy, numpy; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__)" 2>/dev/null || true
  git log -1 --format='commit %h %s' 2>/dev/null || true; } 2>&1 | tee "$OUT/gpu.txt"
# sanitize TOOL DTYPES TIMEOUT [SCRIPT ARGS...]: compute-sanitizer TOOL (memcheck, racecheck) over
# bench_tc.py --sanitize for the comma list DTYPES (small segments / tails / GQA case, forward, pruned
# forward, backward), or over the python SCRIPT ARGS given; output in $OUT/sanitize_TOOL.txt, a failure
# sets status=1.
sanitize() {
  local tool=$1 dtypes=$2 limit=$3
  shift 3
  [ $# -gt 0 ] || set -- benchmarks/bench_tc.py --sanitize --sanitize-dtypes "$dtypes"
  stamp "compute-sanitizer $tool ($*)"
  timeout "$limit" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 9 --print-limit 20 \
    python3 "$@" > "$OUT/sanitize_$tool.txt" 2>&1
  local rc=$?; tail -n 6 "$OUT/sanitize_$tool.txt"; stamp "$tool rc=$rc"; [ $rc -eq 0 ] || status=1
}
