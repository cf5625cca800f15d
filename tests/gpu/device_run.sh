#!/bin/bash
# Runs a bundle of tests/gpu/device_bundle.sh on a GPU machine without carve's
# build tools, from the repository root (a checkout of the same commit):
#
#     tests/gpu/device_run.sh BUNDLE OUTDIR
#
# The kernel and NCCL test programs, train_vs_cpu.py --phase device, the GPT-2
# benchmark and one profiled GPT-2 step (CARVE_GPU_PROFILE=shapes: GEMMs by
# shape; BENCH=0 leaves
# both out), the CNN benchmark (bench/cnn_step.py --device, ResNet-18 and the
# VGG-style CNN; CNN=0 leaves it out) and ResNet-18's step profiled in float32
# and bf16 (CARVE_GPU_PROFILE=shapes). PROFILE=0 leaves the profiles out. OUTDIR gets tests.log, bench.log,
# gpt2_cuda.json, roofline.json, profile.log, cnn.log and cnn-MODEL.json. CUDA's libraries
# (cuBLAS, cuDNN, NCCL, the runtime) are found on the machine: its CUDA toolkit or
# PyTorch's wheels. Exits 1 if a test or the benchmark failed.
set -u
bundle=${1:?usage: device_run.sh BUNDLE OUTDIR}
out=${2:?usage: device_run.sh BUNDLE OUTDIR}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
out=$(cd "$out" && pwd)
D=$(mktemp -d /tmp/carve-device.XXXXXX)
tar xJf "$bundle" -C "$D" || exit 1
libdirs=$(find /usr/local /opt /usr/lib -xdev \( -name 'libcublasLt.so.13' -o -name 'libcublas.so.13' \
  -o -name 'libnccl.so.2' -o -name 'libcudart.so.13' -o -name 'libcudnn.so.9' \) -printf '%h\n' 2>/dev/null | sort -u |
  tr '\n' ':')
export LD_LIBRARY_PATH=$D/libs:${libdirs}${LD_LIBRARY_PATH:-}
L=$out/tests.log
failed=0
{
  date -u
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  nvidia-smi
  lscpu | grep -E "Model name|^CPU\(s\)"
  for b in "$D"/bin/* "$D/tvc/gpt-fp32-cuda/bin/train"; do
    if ldd "$b" | grep "not found"; then echo "MISSING libraries of $b"; fi
  done
} >"$L" 2>&1
for t in kernels_basic_test kernels_fused_test comm_nccl_test "comm_nccl_ranks_test --ranks 2"; do
  s=$(date +%s)
  echo "=== gpu-$t" >>"$L"
  # shellcheck disable=SC2086
  timeout 300 "$D"/bin/carve-gpu-$t >>"$L" 2>&1
  rc=$?
  echo "=== gpu-$t exit $rc, $(($(date +%s) - s)) s" | tee -a "$L"
  # 77: not run (fewer GPUs than ranks), which the line above says.
  [ $rc = 0 ] || [ $rc = 77 ] || failed=1
done
s=$(date +%s)
echo "=== gpu-train-vs-cpu (--phase device)" >>"$L"
timeout 600 python3 tests/gpu/train_vs_cpu.py --phase device --carve none --models none \
  --workdir "$D/tvc" >>"$L" 2>&1
rc=$?
echo "=== gpu-train-vs-cpu exit $rc, $(($(date +%s) - s)) s" | tee -a "$L"
[ $rc = 0 ] || failed=1
grep -E "^(ok|FAIL|not run|train-vs-cpu)" "$L" | cut -c1-300
if [ "${BENCH:-1}" != 0 ]; then
  s=$(date +%s)
  timeout 900 python3 bench/gpt2_cuda.py --device --workdir "$D/bench" --steps "${STEPS:-10}" \
    --warmup "${WARMUP:-3}" --roofline "$D/bin/carve-bench-roofline" --json "$out/gpt2_cuda.json" \
    --timeout 600 >"$out/bench.log" 2>&1
  rc=$?
  echo "=== bench exit $rc, $(($(date +%s) - s)) s"
  [ $rc = 0 ] || failed=1
  cp "$D/bench/roofline.json" "$out/" 2>/dev/null
  tail -25 "$out/bench.log"
fi
if [ "${CNN:-1}" != 0 ]; then
  for m in resnet18 vgg; do
    s=$(date +%s)
    echo "=== cnn_step.py --device, $m" >>"$out/cnn.log"
    timeout 300 python3 bench/cnn_step.py --device --workdir "$D/cnn-$m" \
      --json "$out/cnn-$m.json" --timeout 240 >>"$out/cnn.log" 2>&1
    rc=$?
    echo "=== cnn $m exit $rc, $(($(date +%s) - s)) s" | tee -a "$out/cnn.log"
    [ $rc = 0 ] || failed=1
  done
  grep -E "^\| |^cnn_step" "$out/cnn.log"
  # ResNet-18's step in both precisions and the VGG-style CNN's in float32,
  # the GEMMs by shape.
  for mp in resnet18/fp32 resnet18/bf16 vgg/fp32; do
    r=$D/cnn-${mp%/*} p=${mp#*/}
    if [ "${PROFILE:-1}" != 0 ] && [ -f "$r/carve-$p/init.safetensors" ]; then
      echo "=== $mp, 4 steps, CARVE_GPU_PROFILE=shapes" >>"$out/cnn.log"
      CARVE_GPU_PROFILE=shapes timeout 120 "$r/carve-$p/bin/train" --steps 4 \
        --data "$r/images.safetensors" --progress none >>"$out/cnn.log" 2>&1 || failed=1
    fi
  done
  grep -A25 "GPU time by kernel" "$out/cnn.log" | cut -c1-150
fi
if [ "${PROFILE:-1}" != 0 ] && [ "${BENCH:-1}" != 0 ]; then
  if [ ! -f "$D/bench/carve-cuda/init.safetensors" ]; then
    python3 -c "
import json, sys
sys.path[:0] = ['bench', 'tests/e2e', 'models']
import gpt2_cuda as g
w = json.load(open('$D/bench/prepared.json'))
g.write_seeded_init(w['config'], w['batch'], w['seq'], '$D/bench/carve-cuda/init.header.json',
                    '$D/bench/carve-cuda/init.safetensors')" || failed=1
  fi
  # By shape: each GEMM shape's rate, what the GPU model's GEMM figure needs.
  echo "=== GPT-2 small bf16, 4 steps, CARVE_GPU_PROFILE=shapes"
  CARVE_GPU_PROFILE=shapes timeout 300 "$D/bench/carve-cuda/bin/train" --steps 4 \
    --data "$D/bench/tokens.i32" --progress none >"$out/profile.log" 2>&1 || failed=1
  grep -A80 "GPU time by kernel" "$out/profile.log"
fi
rm -rf "$D"
exit $failed
