#!/usr/bin/env bash
# Everything the lent H200 is needed for, in one device call, within one time budget:
#   1. the GPU tests (python3 -m pytest -m gpu -q tests/),
#   2. the compression benchmark (nvCOMP per tensor class, CPU codecs beside it),
#   3. the stall-time benchmark (~1B-parameter model, 16 GB of state, every method),
#   4. the cost model from the two results just measured.
# Each step runs under its own timeout and the next one starts whatever happened, so a failing
# step costs only itself. The stall benchmark gets what is left of the budget (--time-limit) and
# writes its results after every save. At most 8 files land in $OUT (the device tool's limit):
#   gpu-tests.log run.log stall_time.{json,md,png} compression.{json,md} cost_model.md
#
# Run from the repository root, after the wheel install line of ../shared/gpu/README.md:
#   bash benchmarks/run_h200.sh
# Knobs (environment): BENCH_BUDGET_SECONDS (540: the script's wall budget), BENCH_WIDTH/BENCH_LAYERS
# (2048/20: 1.0B parameters), BENCH_SCRATCH (./.bench-scratch), BENCH_TESTS_SECONDS (150).
set -uo pipefail

OUT=${OUT:?set OUT to the directory for results}
start=$(date +%s)
budget=${BENCH_BUDGET_SECONDS:-540}
width=${BENCH_WIDTH:-2048}
layers=${BENCH_LAYERS:-20}
scratch=${BENCH_SCRATCH:-$PWD/.bench-scratch}
tests_seconds=${BENCH_TESTS_SECONDS:-150}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
# One-rank gloo groups (DCP) need no network: keep gloo on the loopback interface.
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# KvikIO's POSIX/compat path writes with this many threads (its default is 1).
export KVIKIO_NTHREADS=${KVIKIO_NTHREADS:-16}
log=$OUT/run.log
left() { echo $((budget - ($(date +%s) - start))); }
say() { echo "[run_h200 +$(($(date +%s) - start))s, $(left)s left] $*" | tee -a "$log"; }
cleanup() { rm -rf "$scratch"; }
trap cleanup EXIT
mkdir -p "$scratch"

say "machine"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  nproc; free -g | head -2; df -hT "$scratch" /tmp 2>&1
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" 2>&1
  python3 - <<'EOF' 2>&1
import importlib
for name in ("nvidia.nvcomp", "kvikio", "cupy", "zstandard", "lz4", "matplotlib"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(name, "MISSING:", exc)
try:
    import kvikio.defaults
    print("kvikio compat mode preferred:", kvikio.defaults.is_compat_mode_preferred())
except Exception as exc:  # noqa: BLE001
    print("kvikio defaults:", exc)
EOF
} >>"$log" 2>&1

say "1/4 GPU tests (timeout ${tests_seconds}s)"
timeout -k 10 "$tests_seconds" python3 -m pytest -m gpu -q tests/ >"$OUT/gpu-tests.log" 2>&1
say "GPU tests exit status $? ($(tail -1 "$OUT/gpu-tests.log"))"

compression_seconds=$(( $(left) < 300 ? 60 : 90 ))
say "2/4 compression benchmark (timeout ${compression_seconds}s)"
timeout -k 10 "$compression_seconds" python3 -m benchmarks.compression --train-steps 150 \
  --out "$OUT" --name compression >>"$log" 2>&1
say "compression exit status $?"

stall_limit=$(( $(left) - 25 ))
say "3/4 stall-time benchmark: ${width}x${layers}, --time-limit ${stall_limit}s"
timeout -k 10 $((stall_limit + 20)) python3 -m benchmarks.stall_time --width "$width" --layers "$layers" \
  --time-limit "$stall_limit" --dir "$scratch" --out "$OUT" --name stall_time >>"$log" 2>&1
say "stall-time exit status $?"
if [ ! -f "$OUT/stall_time.json" ] && [ "$(left)" -gt 150 ]; then
  # Nothing measured at the full size (it failed before its first save): measure a smaller model instead.
  stall_limit=$(( $(left) - 25 ))
  say "3b/4 stall-time benchmark again at 1024x12, --time-limit ${stall_limit}s"
  rm -rf "$scratch" && mkdir -p "$scratch"
  timeout -k 10 $((stall_limit + 20)) python3 -m benchmarks.stall_time --width 1024 --layers 12 \
    --time-limit "$stall_limit" --dir "$scratch" --out "$OUT" --name stall_time >>"$log" 2>&1
  say "stall-time (smaller) exit status $?"
fi
rm -rf "$scratch"

say "4/4 cost model"
inputs=()
[ -f "$OUT/stall_time.json" ] && inputs+=(--stall-results "$OUT/stall_time.json")
[ -f "$OUT/compression.json" ] && inputs+=(--compression-results "$OUT/compression.json")
timeout -k 5 20 python3 docs/tools/cost_model.py "${inputs[@]}" --out "$OUT" --name cost_model >>"$log" 2>&1
status=$?
rm -f "$OUT/cost_model.json"  # the 8-file limit: the JSON is rebuilt here from the committed results
say "cost model exit status $status"
ls -la "$OUT" >>"$log"
say "done"
