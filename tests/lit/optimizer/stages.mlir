// Tests carve-optimizer on pipeline stages with a tied weight: the embedding
// is used on both stages, each keeps a copy and updates it from its part of
// the gradient (summed over pp before the tail), and the norm counts it once,
// on stage 0.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="pp=2 micro-batches=2" --carve-split-stages --carve-data-parallel --carve-plan-memory --carve-optimizer | FileCheck %s

// CHECK-LABEL: func.func @stage0(
// CHECK-SAME: %arg2: tensor<16x8xf32> {carve.param = "wte.weight"
// CHECK-SAME: %arg3: tensor<8x8xf32> {carve.param = "h.0.w"
// CHECK: %[[NORM:.+]] = carve.grad_norm %[[DW0:.+]], %[[DWTE:.+]] {slots = array<i64: 0, 1>, tp_split = array<i1: false, false>} : (tensor<8x8xf32>, tensor<16x8xf32>) -> f64
// CHECK-NEXT: carve.clip_coefficient %[[NORM]] {max_norm = 0.000000e+00 : f64}
// CHECK-NEXT: carve.scale_gradients
// CHECK-NEXT: %[[LR:.+]] = carve.learning_rate
// CHECK-NEXT: carve.adamw %arg3, %[[DW0]], %[[LR]]
// CHECK-NEXT: carve.adamw %arg2, %[[DWTE]], %[[LR]]
// CHECK-NEXT: return

// Stage 1 lists only h.1.w (slot 1) in the norm, and updates both.
// CHECK-LABEL: func.func @stage1(
// CHECK-SAME: %arg2: tensor<16x8xf32> {carve.param = "wte.weight"
// CHECK-SAME: %arg3: tensor<8x8xf32> {carve.param = "h.1.w"
// CHECK: %[[NORM1:.+]] = carve.grad_norm %[[DW1:.+]] {slots = array<i64: 1>, tp_split = array<i1: false>} : (tensor<8x8xf32>) -> f64
// CHECK-NEXT: carve.clip_coefficient %[[NORM1]]
// CHECK-NEXT: carve.scale_gradients
// CHECK-NEXT: %[[LR1:.+]] = carve.learning_rate
// CHECK-NEXT: carve.adamw %arg2, %{{.+}}, %[[LR1]] {{.*}} : tensor<16x8xf32>, tensor<16x8xf32>
// CHECK-NEXT: carve.adamw %arg3, %[[DW1]], %[[LR1]]
// CHECK-NEXT: return

func.func @forward(%ids: tensor<2x4xi64> {carve.input = "ids"},
                   %tgt: tensor<2x4xi64> {carve.input = "targets"},
                   %wte: tensor<16x8xf32> {carve.param = "wte.weight", carve.trainable},
                   %w0: tensor<8x8xf32> {carve.param = "h.0.w", carve.trainable},
                   %w1: tensor<8x8xf32> {carve.param = "h.1.w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %e = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<16x8xf32>, tensor<2x4xi64>) -> tensor<2x4x8xf32> loc("/wte/Gather")
  %m0 = carve.matmul %e, %w0 : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32> loc("/h.0/MatMul")
  %a0 = carve.add %e, %m0 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/h.0/Add")
  %m1 = carve.matmul %a0, %w1 : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32> loc("/h.1/MatMul")
  %a1 = carve.add %a0, %m1 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/h.1/Add")
  %wt = carve.transpose %wte {perm = array<i64: 1, 0>} : tensor<16x8xf32> -> tensor<8x16xf32> loc("/lm_head/Transpose")
  %lg = carve.matmul %a1, %wt : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32> loc("/lm_head/MatMul")
  %fl = carve.reshape %lg : tensor<2x4x16xf32> -> tensor<8x16xf32> loc("/Reshape")
  %t = carve.reshape %tgt : tensor<2x4xi64> -> tensor<8xi64> loc("/Reshape_1")
  %loss = carve.cross_entropy %fl, %t {ignore_index = -100 : i64} : (tensor<8x16xf32>, tensor<8xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
