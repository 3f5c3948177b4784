#!/usr/bin/env bash
# The GPU tests, then the GPU pipeline benchmark, in one call on the lent H200 (../shared/gpu/README.md).
# Run from the repository root with .whl/ carried (filled by ../shared/gpu/fetch-wheels.sh pytest-timeout==2.3.1
# hypothesis==6.151.9 sortedcontainers attrs; tests/gpu/test_gpu_property.py needs hypothesis):
#   bash tests/gpu/run_on_device.sh [pytest selection...]
# Environment: OUT (results folder, default gpu-out), BENCH=full|tiny|full_gpu|none, BENCH_ARGS, TEST_TIMEOUT,
# BENCH_TIMEOUT.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; df -h .; nproc; } > "$out/machine.txt" 2>&1
selection=("$@")
[ ${#selection[@]} -gt 0 ] || selection=(tests/gpu)
# The tests' checkpoints go to one folder, deleted after: pytest keeps its temporary folders, and on
# a 64 GB disk they left too little for a full-GPU benchmark run after them in the same call.
basetemp=$(mktemp -d /tmp/gpu-tests-XXXX)
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfEs --basetemp "$basetemp" "${selection[@]}" 2>&1 | tee "$out/gpu-tests.log"
rm -rf "$basetemp"
case "${BENCH:-full}" in
  none) ;;
  # The full-GPU runs issues 15 and 18 wait for: delta on and off after preallocate, and a first
  # save without it (2.8B parameters, 10 GB free; ~250 s on an H100/H200 after the suite).
  full_gpu) rm -rf .bench-scratch
    timeout "${BENCH_TIMEOUT:-330}" python3 -m benchmarks.full_gpu --out "$out" --gpu-free-gb 10 --sizes 4096x14 \
      --saves 3 --methods asyncckpt:auto:auto:delta+preallocate,asyncckpt:auto:auto+preallocate,asyncckpt:auto:auto \
      ${BENCH_ARGS:-} 2>&1 | tee "$out/full-gpu.log" ;;
  tiny) timeout "${BENCH_TIMEOUT:-120}" python3 -m benchmarks.gpu_pipeline --out "$out" --tiny ${BENCH_ARGS:-} 2>&1 | tee "$out/gpu-bench.log" ;;
  *) timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks.gpu_pipeline --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/gpu-bench.log" ;;
esac
