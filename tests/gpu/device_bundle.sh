#!/bin/bash
# The GPU tests and the GPT-2 benchmark, prepared for a GPU machine that has no
# MLIR (so no carve compiler): everything carve compiles is compiled here, and
# tests/gpu/device_run.sh runs it there (docs/cuda.md, "On a GPU machine
# without carve's build tools").
#
#     tests/gpu/device_bundle.sh [DIR]     # here, from the repository root
#
# Needs `make build` and the test models (ctest -R export-models in build/).
# Builds the runtime without -march=native in build-dev/ (the GPU machine's
# processor is another), compiles train_vs_cpu.py's programs (--phase prepare,
# which also runs the CPU programs) and the benchmark's (gpt2_cuda.py
# --prepare-device) and the CNN benchmark's (cnn_step.py --prepare-device,
# ResNet-18 and the VGG-style CNN, batch CNN_BATCH=256) against it, adds the Debian libraries the programs link
# (OpenBLAS, Open MPI; CUDA's own are the GPU machine's), and writes
# DIR/bundle.tar.xz (DIR defaults to .devrun; about 25 MB).
set -euo pipefail
dir=${1:-.devrun}
build=build
dev="build-dev"
py=/usr/bin/python3
if [ ! -x "$build/bin/carve" ]; then
  echo "device_bundle: $build/bin/carve is not built (make build)" >&2
  exit 1
fi
if [ ! -f "$build/test-models/opset17/gpt.onnx" ]; then
  echo "device_bundle: no test models in $build/test-models (cd $build && ctest -R export-models)" >&2
  exit 1
fi
if grep -q '^cuda_missing=' "$build/lib/carve-runtime.txt"; then
  echo "device_bundle: the CUDA target is not built here ($(sed -n 's/^cuda_missing=//p' \
    "$build/lib/carve-runtime.txt"))" >&2
  exit 1
fi
[ -f "$dev/build.ninja" ] ||
  cmake -S . -B "$dev" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCARVE_NATIVE=OFF >/dev/null
bins="carve-gpu-kernels_basic_test carve-gpu-kernels_fused_test carve-gpu-comm_nccl_test
      carve-gpu-comm_nccl_ranks_test carve-bench-roofline"
# shellcheck disable=SC2086
ninja -C "$dev" carve_rt carve_rt_kernels carve_rt_safetensors carve_rt_cuda $bins
export CARVE_RUNTIME_CONFIG=$PWD/$dev/lib/carve-runtime.txt
mkdir -p "$dir"
"$py" tests/gpu/train_vs_cpu.py --phase prepare --carve "$build/bin/carve" \
  --models "$build/test-models" --workdir "$dir/tvc"
"$py" bench/gpt2_cuda.py --prepare-device --workdir "$dir/bench" --steps "${STEPS:-10}" \
  --warmup "${WARMUP:-3}"
for m in resnet18 vgg; do
  "$py" bench/cnn_step.py --prepare-device --model "$m" --batch "${CNN_BATCH:-256}" \
    --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" --workdir "$dir/cnn-$m"
done

stage=$dir/stage
rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/libs"
for b in $bins; do
  cp "$dev/bin/$b" "$stage/bin/"
done
cp -r "$dir/tvc" "$dir/bench" "$dir"/cnn-* "$stage/"
# What the GPU machine does not need: sources, build logs, the CPU programs
# (their logs and checkpoints stay: --phase device compares against them).
rm -rf "$stage"/tvc/*/src "$stage"/tvc/*/build.log "$stage"/bench/*/src "$stage"/bench/*/build.log \
  "$stage"/cnn-*/*/src "$stage"/cnn-*/*/build.log
for d in "$stage"/tvc/*-cpu; do
  rm -rf "${d:?}/bin"
done
strip "$stage"/bin/* "$stage"/tvc/*/bin/train "$stage"/bench/carve-cuda/bin/train \
  "$stage"/cnn-*/*/bin/train
for b in "$stage"/bin/* "$stage/tvc/gpt-fp32-cuda/bin/train"; do
  ldd "$b"
done | awk '$3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' | sort -u | while read -r lib; do
  case $(basename "$lib") in
  libc.so* | libm.so* | libstdc++* | libgcc_s* | libz.so* | libudev* | libdl.so* | libpthread.so* | librt.so*) ;;
  *) cp -L "$lib" "$stage/libs/" ;;
  esac
done
tar cJf "$dir/bundle.tar.xz" -C "$stage" .
rm -rf "$stage"
echo "device_bundle: $dir/bundle.tar.xz ($(du -h "$dir/bundle.tar.xz" | cut -f1)); on the GPU" \
  "machine, from the repository root: tests/gpu/device_run.sh $dir/bundle.tar.xz OUTDIR"
