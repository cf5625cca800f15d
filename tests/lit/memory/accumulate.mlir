// Tests carve-plan-memory on an add carve-fold-views marked "accumulate"
// (CUDA target): the layer norm gradient writes the add's result, so the
// result lives from the gradient on. It shares no byte with the gradient's
// dy (read last by the gradient, at 256) nor with the gradient's bias
// gradient, which nothing reads (the forward has no bias) but the gradient
// writes beside the sum (at 384): every result is live where it is written,
// read or not. The input gradient itself gets no memory (-1). (Offsets of
// the largest-first placement, which packs this function tighter than first
// fit: 704 bytes.)
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1 target=cuda" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-fold-views --carve-plan-memory | FileCheck %s

// CHECK-LABEL: func.func @train_step(
// CHECK: carve.unary_grad
// CHECK: %[[DY:.+]] = carve.matmul %{{.+}}, %{{.+}} {carve.arena_offset = array<i64: 256>}
// CHECK: carve.layer_norm_grad %{{.+}}, %[[DY]] scale %{{.+}} {axis = 1 : i64, carve.arena_offset = array<i64: -1, -1, 384>
// CHECK-NEXT: carve.add %{{.+}}, %input_grad {carve.arena_offset = array<i64: 128>, carve.fold = "accumulate"}
// CHECK: return

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<8x8xf32> {carve.param = "fc1.weight", carve.trainable},
                   %w2: tensor<8x8xf32> {carve.param = "fc2.weight", carve.trainable},
                   %g: tensor<8xf32> {carve.param = "ln.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %a = carve.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc1/MatMul")
  %n = carve.layer_norm %a scale %g {axis = 1 : i64, epsilon = 1.000000e-05 : f32} : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32> loc("/ln/LayerNormalization")
  %e = carve.matmul %n, %w2 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc2/MatMul")
  %s = carve.add %a, %e : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/res/Add")
  %t = carve.tanh %s : tensor<4x8xf32> loc("/act/Tanh")
  %r = carve.reshape %t : tensor<4x8xf32> -> tensor<32xf32> loc("/out/Reshape")
  %l = carve.reduce_sum %r {axes = array<i64: 0>, keep_dims = false} : tensor<32xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
