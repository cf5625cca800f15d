// Tests carve-fuse-elementwise: the forward chain bias-add, GELU, residual
// add, exp is one kernel (group 0), its intermediates that backward reads
// stay outputs; the backward chain of unary gradients is another (group 1),
// never merged with the forward one; a matmul, a reduction and a broadcast
// are never members; @forward is left alone.
// RUN: carve-opt %s --carve-autodiff --carve-fuse-elementwise | FileCheck %s

// CHECK-LABEL: func.func @forward(
// CHECK-NOT: carve.fusion_group
// CHECK-LABEL: func.func @train_step(
// CHECK: carve.matmul
// CHECK-NOT: carve.fusion_group
// CHECK-SAME: -> tensor<4x8xf32>
// CHECK: %[[BIAS:.+]] = carve.add {{.*}}{carve.fusion_group = 0 : i64}
// CHECK: carve.gelu %[[BIAS]] {carve.fusion_group = 0 : i64}
// CHECK: %[[RES:.+]] = carve.add {{.*}}{carve.fusion_group = 0 : i64}
// CHECK: carve.exp %[[RES]] {carve.fusion_group = 0 : i64}
// CHECK: carve.reduce_sum
// CHECK-NOT: carve.fusion_group
// CHECK-SAME: -> tensor<f32>
// CHECK: carve.expand
// CHECK-NOT: carve.fusion_group
// CHECK-SAME: -> tensor<4x8xf32>
// CHECK: carve.unary_grad %[[RES]], {{.*}}carve.fusion_group = 1 : i64, fn = "exp"
// CHECK: carve.unary_grad %[[BIAS]], {{.*}}carve.fusion_group = 1 : i64, fn = "gelu"
// CHECK-NOT: carve.fusion_group
// CHECK: return

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w: tensor<8x8xf32> {carve.param = "w", carve.trainable},
                   %b: tensor<8xf32> {carve.param = "b", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc/MatMul")
  %a = carve.add %h, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32> loc("/fc/Add")
  %g = carve.gelu %a {approximate = "none"} : tensor<4x8xf32> loc("/act/Gelu")
  %r = carve.add %g, %x : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/res/Add")
  %e = carve.exp %r : tensor<4x8xf32> loc("/Exp")
  %s = carve.reduce_sum %e {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %s : tensor<f32>
}
