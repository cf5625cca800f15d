// Tests carve-save-attention-stats: on the CUDA target an attention whose
// gradient follows in the same function keeps its row log-sum-exp
// (carve.attention_stats, f32 [..., Tq]) and the gradient reads it and the
// forward's output (carve.attention_grad_stats) instead of running the
// forward again; the mask and attributes carry over, and carve-select-kernels
// then chooses the CUDA entries. A gradient of other inputs, a forward
// rounded to 16 bits as written, the CPU target and a recompute plan keep
// carve.attention / carve.attention_grad.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-save-attention-stats, carve-select-kernels)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu}, carve-save-attention-stats)' | FileCheck %s --check-prefix=KEEP
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda recompute=selective}, carve-save-attention-stats)' | FileCheck %s --check-prefix=KEEP

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[O:.+]], %[[LSE:.+]] = carve.attention_stats %[[Q:.+]], %[[K:.+]], %[[V:[^ ]+]] mask %[[M:[^ ]+]] {carve.kernel = "attention_stats", carve.kernel_why = "the plan computes attention in fp32", causal = true, scale = 2.500000e-01 : f32} : {{.*}} -> (tensor<2x4x8x16xf32>, tensor<2x4x8xf32>)
// CHECK: %[[R:.+]] = carve.attention %[[Q]], %[[K]], %[[V]] {carve.kernel = "attention", carve.round16, scale = 5.000000e-01 : f32}
// CHECK: carve.attention_grad_stats %[[Q]], %[[K]], %[[V]], %[[O]], %[[LSE]], %{{.+}} mask %[[M]] {carve.kernel = "attention_grad_stats", carve.kernel_why = "the plan computes attention in fp32", causal = true, scale = 2.500000e-01 : f32}
// CHECK: carve.attention_grad %[[V]], %[[K]], %[[Q]], %{{.+}} {carve.kernel = "attention_grad", scale = 2.500000e-01 : f32}
// CHECK: carve.attention_grad %[[Q]], %[[K]], %[[V]], %{{.+}} {carve.kernel = "attention_grad", scale = 5.000000e-01 : f32}
// CHECK-NOT: carve.attention_grad_stats
// CHECK: return

// KEEP-LABEL: func.func @train_step(
// KEEP-NOT: _stats
// KEEP: return

func.func @train_step(%q: tensor<2x4x8x16xf32> {carve.input = "q"},
                      %k: tensor<2x4x8x16xf32> {carve.input = "k"},
                      %v: tensor<2x4x8x16xf32> {carve.input = "v"},
                      %m: tensor<2x1x1x8xf32> {carve.input = "m"},
                      %dy: tensor<2x4x8x16xf32> {carve.input = "dy"})
    -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>,
        tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) {
  %o = carve.attention %q, %k, %v mask %m {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x1x1x8xf32>) -> tensor<2x4x8x16xf32>
  %r = carve.attention %q, %k, %v {carve.round16, scale = 0.5 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> tensor<2x4x8x16xf32>
  %dq, %dk, %dv = carve.attention_grad %q, %k, %v, %dy mask %m {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x1x1x8xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %eq, %ek, %ev = carve.attention_grad %v, %k, %q, %dy {scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %fq, %fk, %fv = carve.attention_grad %q, %k, %v, %dy {scale = 0.5 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  return %o, %r, %dq, %dk, %eq, %fq : tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>
}
