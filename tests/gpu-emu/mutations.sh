#!/bin/bash
# tests/gpu-emu/mutations.sh: the deliberate kernel and library-call mistakes of
# README.md ("It can fail"), each applied alone to runtime/cuda, built, run on
# the emulation (the fused and basic kernel tests) and reverted. Needs a
# configured build/ (ninja); takes about 5 minutes on 2 cores. Not part of make
# test.
cd "$(dirname "$0")/../.." || exit 1
TMP=$(mktemp -d)
run() {
  name=$1; file=$2; py=$3
  cp $file "$TMP/mut.bak"
  python3 -c "$py"
  (cd build && ninja -j2 carve-gpu-emu-kernels_fused_test carve-gpu-emu-kernels_basic_test > "$TMP/build.log" 2>&1)
  echo "== $name"
  ASAN_OPTIONS=detect_leaks=0 timeout 600 build/bin/carve-gpu-emu-kernels_fused_test > "$TMP/fused.log" 2>&1; echo "fused rc=$?"
  grep -E "^FAIL|carve-emu|ERROR: AddressSanitizer|check\(s\)" "$TMP/fused.log" | head -4
  ASAN_OPTIONS=detect_leaks=0 timeout 600 build/bin/carve-gpu-emu-kernels_basic_test > "$TMP/basic.log" 2>&1; echo "basic rc=$?"
  grep -E "^FAIL|carve-emu|ERROR: AddressSanitizer|check\(s\)" "$TMP/basic.log" | head -4
  cp "$TMP/mut.bak" $file
}
run "missing __syncthreads (blockSum, after the warp sums are stored)" runtime/cuda/row_reduce.cuh "
p='runtime/cuda/row_reduce.cuh'; s=open(p).read()
old='''  if (lane == 0)
    sh[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < nw ? sh[lane] : T(0);'''
assert old in s; s=s.replace(old, old.replace('  __syncthreads();\n',''),1); open(p,'w').write(s)"
run "wrong shuffle width (warpSum starts at offset 8, not 16)" runtime/cuda/row_reduce.cuh "
p='runtime/cuda/row_reduce.cuh'; s=open(p).read()
old='''__device__ __forceinline__ float warpSum(float v) {
  for (int o = 16; o > 0; o >>= 1)'''
assert old in s; s=s.replace(old, old.replace('o = 16','o = 8'),1); open(p,'w').write(s)"
run "off-by-one index (the grid-stride loop runs to i <= n)" runtime/cuda/kernel_util.cuh "
p='runtime/cuda/kernel_util.cuh'; s=open(p).read()
old='i < (n);'
assert old in s; s=s.replace(old, 'i <= (n);',1); open(p,'w').write(s)"
run "a transposed epilogue (matmul16_bias's cuBLASLt plan ignores transB)" runtime/cuda/kernels_matmul.cu "
p='runtime/cuda/kernels_matmul.cu'; s=open(p).read()
old='const int32_t opA = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opB = CUBLAS_OP_N;'
assert old in s; s=s.replace(old, 'const int32_t opA = CUBLAS_OP_N, opB = CUBLAS_OP_N;',1); open(p,'w').write(s)"
run "a wrong stride (cuDNN reads q, k, v in place with rows of h * d, not the row stride)" runtime/cuda/attention_cudnn.cpp "
p='runtime/cuda/attention_cudnn.cpp'; s=open(p).read()
old='return r ? Dims4{t * r, d, r, 1} : rowMajor(s.b, s.h, t, d);'
assert old in s; s=s.replace(old, 'return r ? Dims4{t * r, d, s.h * d, 1} : rowMajor(s.b, s.h, t, d);',1); open(p,'w').write(s)"
run "TF32 never asked for (gemmBatch keeps CUBLAS_COMPUTE_32F under the plan field tf32)" runtime/cuda/kernels_matmul.cu "
p='runtime/cuda/kernels_matmul.cu'; s=open(p).read()
old='viaTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;'
assert old in s; s=s.replace(old, 'CUBLAS_COMPUTE_32F;',1); open(p,'w').write(s)"
run "the other operand's bias gradient (matmul16_to16_bgrad asks for BGRADA where it means BGRADB)" runtime/cuda/kernels_matmul.cu "
p='runtime/cuda/kernels_matmul.cu'; s=open(p).read()
old='biasOfA ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_BGRADA;'
assert old in s; s=s.replace(old, 'biasOfA ? CUBLASLT_EPILOGUE_BGRADA : CUBLASLT_EPILOGUE_BGRADB;',1); open(p,'w').write(s)"
run "GELU's input read with the wrong leading dimension (matmul16_dgelu's AUX_LD is k, not n)" runtime/cuda/kernels_matmul.cu "
p='runtime/cuda/kernels_matmul.cu'; s=open(p).read()
old='const int64_t auxLd = n;'
assert old in s; s=s.replace(old, 'const int64_t auxLd = k;',1); open(p,'w').write(s)"
run "the pre-activation never handed to cuBLASLt (GELU_AUX_BIAS without its EPILOGUE_AUX_POINTER)" runtime/cuda/kernels_matmul.cu "
p='runtime/cuda/kernels_matmul.cu'; s=open(p).read()
old='  if (aux)\n'
assert old in s; s=s.replace(old, '  if (false)\n',1); open(p,'w').write(s)"
run "the mask handed to cuDNN as an fp32 bias (the fused engine adds a 16-bit one)" runtime/cuda/attention_cudnn.cpp "
p='runtime/cuda/attention_cudnn.cpp'; s=open(p).read()
old='const Desc &bias = g.input(kBias, g.io, bd,'
assert old in s; s=s.replace(old, 'const Desc &bias = g.input(kBias, CUDNN_DATA_FLOAT, bd,',1); open(p,'w').write(s)"
run "the mask's finite values not clamped (a -FLT_MAX mask becomes -inf in bf16)" runtime/cuda/kernels_attention.cu "
p='runtime/cuda/kernels_attention.cu'; s=open(p).read()
old='if (v < -hi && v != -INFINITY)'
assert old in s; s=s.replace(old, 'if (false)',1); open(p,'w').write(s)"
run "TF32 taken for an fp32 convolution (the engine filter lets cuDNN's tensor-core engines through)" runtime/cuda/conv_cudnn.cpp "
p='runtime/cuda/conv_cudnn.cpp'; s=open(p).read()
old='    if (fp32 && !k.tf32 &&'
assert old in s; s=s.replace(old, '    if (false &&',1); open(p,'w').write(s)"
run "a convolution's paddings swapped (cuDNN gets the bottom and right paddings as the top and left)" runtime/cuda/cudnn_graph.h "
p='runtime/cuda/cudnn_graph.h'; s=open(p).read()
old='conv->set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, geo.pre, 2);'
assert old in s; s=s.replace(old, 'conv->set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, geo.post, 2);',1)
old='conv->set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, geo.post, 2);'
assert old in s; s=s.replace(old, 'conv->set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, geo.pre, 2);',1); open(p,'w').write(s)"
run "the filter gradient's operands bound to each other's tensors (x and dy exchanged in the variant pack)" runtime/cuda/conv_cudnn.cpp "
p='runtime/cuda/conv_cudnn.cpp'; s=open(p).read()
old=': std::vector<int64_t>{1, 3, 2};'
assert old in s; s=s.replace(old, ': std::vector<int64_t>{3, 1, 2};',1); open(p,'w').write(s)"
(cd build && ninja -j2 carve-gpu-emu-kernels_fused_test carve-gpu-emu-kernels_basic_test > /dev/null 2>&1)
git status --short | head
