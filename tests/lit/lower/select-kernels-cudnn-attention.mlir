// Tests carve-select-kernels' rule 3c (CUDA): attention_stats and
// attention_grad_stats run as cuDNN's fused flash attention
// (`attention_stats_cudnn`, `attention_grad_stats_cudnn`) under a bf16 or
// fp16 plan when the head dimensions are multiples of 8 up to 256 and a
// mask, if any, is an f32 tensor that broadcasts to the scores (BERT's
// [B, 1, 1, T] padding mask, a [T, T] bias: cuDNN's bias); otherwise as
// carve's kernel, with carve.kernel_why saying why: a head dimension of 12,
// d 264, and every call of an fp32 plan. A cuDNN gradient whose q, k or v is an f32
// view of a 16-bit tensor of the plan's format reads that tensor
// (carve.read16, one flag per q, k, v) and a view nothing else reads is no
// call; a bf16 view under an fp16 plan stays a conversion.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-select-kernels)' | FileCheck %s --check-prefixes=CHECK,BF
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=fp16}, carve-select-kernels)' | FileCheck %s --check-prefixes=CHECK,FP
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-select-kernels)' | FileCheck %s --check-prefix=FP32

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[O:.+]], %[[LSE:.+]] = carve.attention_stats %arg0, %arg1, %arg2 {carve.kernel = "attention_stats_cudnn", causal = true, scale = 2.500000e-01 : f32}
// CHECK: carve.attention_stats %arg0, %arg1, %arg2 mask %arg3 {carve.kernel = "attention_stats_cudnn", causal = true
// CHECK: carve.attention_stats %arg0, %arg1, %arg2 mask %arg9 {carve.kernel = "attention_stats_cudnn", scale
// CHECK: carve.attention_stats %arg5, %arg5, %arg5 {carve.kernel = "attention_stats", carve.kernel_why = "head dimensions 12 and 12 (cuDNN takes multiples of 8 up to 256)"
// CHECK: carve.attention_stats %arg6, %arg6, %arg6 {carve.kernel = "attention_stats", carve.kernel_why = "head dimensions 264 and 264 (cuDNN takes multiples of 8 up to 256)"
// CHECK: carve.attention_grad_stats %arg0, %arg1, %arg2, %[[O]], %[[LSE]], %arg4 {carve.kernel = "attention_grad_stats_cudnn", causal = true, scale = 2.500000e-01 : f32}
// BF: %[[QV:.+]] = carve.cast %arg7 {carve.kernel = "none"} : tensor<2x4x8x16xbf16> -> tensor<2x4x8x16xf32>
// BF: %[[KV:.+]] = carve.cast %arg8 {carve.kernel = "fromBf16"} : tensor<2x4x8x16xbf16> -> tensor<2x4x8x16xf32>
// BF: carve.attention_grad_stats %[[QV]], %[[KV]], %arg2, %[[O]], %[[LSE]], %arg4 {carve.kernel = "attention_grad_stats_cudnn", carve.read16 = array<i1: true, true, false>, causal = true
// BF: carve.gelu %[[KV]] {carve.kernel = "unary"}
// FP: carve.cast %arg7 {carve.kernel = "fromBf16"}
// FP: carve.cast %arg8 {carve.kernel = "fromBf16"}
// FP: carve.attention_grad_stats {{.*}} {carve.kernel = "attention_grad_stats_cudnn", causal = true
// CHECK: return

// FP32-LABEL: func.func @train_step(
// FP32-NOT: _cudnn
// FP32: carve.attention_stats %arg0, %arg1, %arg2 {carve.kernel = "attention_stats", carve.kernel_why = "the plan computes attention in fp32"
// FP32: carve.attention_stats %arg0, %arg1, %arg2 mask %arg3 {carve.kernel = "attention_stats", carve.kernel_why = "the plan computes attention in fp32"
// FP32-NOT: _cudnn
// FP32: return

func.func @train_step(%q: tensor<2x4x8x16xf32> {carve.input = "q"},
                      %k: tensor<2x4x8x16xf32> {carve.input = "k"},
                      %v: tensor<2x4x8x16xf32> {carve.input = "v"},
                      %m: tensor<2x1x1x8xf32> {carve.input = "m"},
                      %dy: tensor<2x4x8x16xf32> {carve.input = "dy"},
                      %x12: tensor<3x8x12xf32> {carve.input = "x12"},
                      %x264: tensor<1x8x264xf32> {carve.input = "x264"},
                      %q16: tensor<2x4x8x16xbf16> {carve.input = "q16"},
                      %k16: tensor<2x4x8x16xbf16> {carve.input = "k16"},
                      %bias: tensor<8x8xf32> {carve.input = "bias"})
    -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<3x8x12xf32>, tensor<1x8x264xf32>,
        tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) {
  %o, %lse = carve.attention_stats %q, %k, %v {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8xf32>)
  %om, %lsem = carve.attention_stats %q, %k, %v mask %m {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x1x1x8xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8xf32>)
  %ob, %lseb = carve.attention_stats %q, %k, %v mask %bias {scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<8x8xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8xf32>)
  %o12, %l12 = carve.attention_stats %x12, %x12, %x12 {scale = 0.25 : f32} : (tensor<3x8x12xf32>, tensor<3x8x12xf32>, tensor<3x8x12xf32>) -> (tensor<3x8x12xf32>, tensor<3x8xf32>)
  %o264, %l264 = carve.attention_stats %x264, %x264, %x264 {scale = 0.25 : f32} : (tensor<1x8x264xf32>, tensor<1x8x264xf32>, tensor<1x8x264xf32>) -> (tensor<1x8x264xf32>, tensor<1x8xf32>)
  %dq, %dk, %dv = carve.attention_grad_stats %q, %k, %v, %o, %lse, %dy {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %qv = carve.cast %q16 : tensor<2x4x8x16xbf16> -> tensor<2x4x8x16xf32>
  %kv = carve.cast %k16 : tensor<2x4x8x16xbf16> -> tensor<2x4x8x16xf32>
  %eq, %ek, %ev = carve.attention_grad_stats %qv, %kv, %v, %o, %lse, %dy {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %gk = carve.gelu %kv : tensor<2x4x8x16xf32>
  return %o, %om, %ob, %o12, %o264, %dq, %eq, %gk : tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<3x8x12xf32>, tensor<1x8x264xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>
}
