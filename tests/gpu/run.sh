#!/bin/bash
# make test-gpu: the GPU tests (ctest label gpu) on this machine's GPU(s).
# Fails, saying so, when the CUDA target is not built or no GPU is visible:
# GPU tests that could not run never count as passed.
set -euo pipefail
build="${1:-build}"
cfg="$build/lib/carve-runtime.txt"
if grep -q '^cuda_missing=' "$cfg"; then
  echo "make test-gpu: the CUDA target is not built ($(sed -n 's/^cuda_missing=//p' "$cfg")); no GPU test ran" >&2
  exit 1
fi
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "make test-gpu: no GPU is visible (nvidia-smi -L failed); no GPU test ran" >&2
  exit 1
fi
nvidia-smi -L
gpus=$(nvidia-smi -L | grep -c '^GPU ')
cd "$build"
# The NCCL test on N ranks needs N GPUs: with fewer it is left out, and this
# says so (it is not counted as passed).
exclude='^$'
for n in 2 4; do
  if [ "$gpus" -lt "$n" ]; then
    echo "make test-gpu: not run: gpu-comm_nccl_ranks_test-$n needs $n GPUs, this machine has $gpus"
    exclude="$exclude|^gpu-comm_nccl_ranks_test-$n\$"
  fi
done
# --no-tests=error: a build without the GPU tests is a failure, not a pass;
# so is a test that skipped itself (it found no device after all).
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
ctest --output-on-failure -L '^gpu$' -E "$exclude" --no-tests=error 2>&1 | tee "$log" || status=$?
if grep -q 'Skipped' "$log"; then
  echo "make test-gpu: some GPU tests skipped themselves (see above); that is a failure here" >&2
  exit 1
fi
exit $status
