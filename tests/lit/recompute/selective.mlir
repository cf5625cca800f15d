// Tests carve-recompute's selective recomputation on attention written out
// op by op (scores = q k^T, scaled, softmax, weighted sum of v): the softmax
// output, which the gradients of the softmax and of the weighted sum read,
// is recomputed from q and k in backward; the weighted sum's output (the
// next op's input) is kept. A carve.attention op keeps no scores, so a model
// written with one has nothing to recompute.
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="recompute=selective" --carve-fuse-elementwise --carve-fold-transposes --carve-recompute | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[QP:.+]] = carve.matmul %arg0, %arg3
// CHECK: %[[P:.+]] = carve.softmax
// CHECK: carve.matmul %[[P]], %arg2
// CHECK: %[[SR:.+]] = carve.matmul %[[QP]], %arg1 {carve.recomputed}
// CHECK-NEXT: %[[XR:.+]] = carve.mul %[[SR]], %{{.+}} {carve.recomputed}
// CHECK-NEXT: %[[PR:.+]] = carve.softmax %[[XR]] {{{.*}}carve.recomputed
// CHECK-NOT: carve.softmax_grad {{.*}}%[[P]]
// CHECK: carve.softmax_grad %[[PR]]
// CHECK: return

func.func @forward(%q: tensor<2x4x8xf32> {carve.input = "q"},
                   %kt: tensor<2x8x4xf32> {carve.input = "kt"},
                   %v: tensor<2x4x8xf32> {carve.param = "h.0.attn.v", carve.trainable},
                   %wq: tensor<8x8xf32> {carve.param = "h.0.attn.wq", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %qp = carve.matmul %q, %wq : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32> loc("/h.0/attn/q/MatMul")
  %s = carve.matmul %qp, %kt : (tensor<2x4x8xf32>, tensor<2x8x4xf32>) -> tensor<2x4x4xf32> loc("/h.0/attn/MatMul")
  %c = carve.constant dense<0.353553385> : tensor<f32> loc("/h.0/attn/Constant")
  %x = carve.mul %s, %c : (tensor<2x4x4xf32>, tensor<f32>) -> tensor<2x4x4xf32> loc("/h.0/attn/Mul")
  %p = carve.softmax %x {axis = 2 : i64} : tensor<2x4x4xf32> loc("/h.0/attn/Softmax")
  %o = carve.matmul %p, %v : (tensor<2x4x4xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/h.0/attn/MatMul_1")
  %e = carve.exp %o : tensor<2x4x8xf32> loc("/h.0/Exp")
  %l = carve.reduce_sum %e {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<2x4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
