// Tests carve-fold-transposes on a Linear layer (y = x W^T) and its
// gradients: W^T feeds only a matmul and becomes its flag ("operand"); the
// weight gradient (x^T dy)^T is written transposed by its matmul
// ("product"), as is the transpose of y; a transpose read by an elementwise
// op or a reduction stays, as does one that does not swap the last two
// dimensions; @forward is left alone.
// RUN: carve-opt %s --carve-autodiff --carve-fold-transposes | FileCheck %s

// CHECK-LABEL: func.func @forward(
// CHECK-NOT: carve.fold
// CHECK-LABEL: func.func @train_step(
// CHECK: %[[WT:.+]] = carve.transpose %arg1 {carve.fold = "operand", perm = array<i64: 1, 0>}
// CHECK: %[[Y:.+]] = carve.matmul %arg0, %[[WT]]
// CHECK: carve.transpose %[[Y]] {carve.fold = "product", perm = array<i64: 1, 0>}
// CHECK: carve.exp
// CHECK: carve.transpose %{{.+}} {perm = array<i64: 1, 0>} : tensor<6x4xf32> -> tensor<4x6xf32>
// CHECK: carve.transpose %{{.+}} {perm = array<i64: 1, 0, 2>} : tensor<4x6x2xf32> -> tensor<6x4x2xf32>
// CHECK: carve.reduce_sum
// The backward: the transposes into the weight-gradient matmul fold into
// its flags, the matmul's product is written transposed.
// CHECK: %[[DY:.+]] = carve.transpose %{{.+}} {carve.fold = "operand", perm = array<i64: 1, 0>} : tensor<6x4xf32> -> tensor<4x6xf32>
// CHECK: %[[XT:.+]] = carve.transpose %arg0 {carve.fold = "operand", perm = array<i64: 1, 0>}
// CHECK: %[[DW:.+]] = carve.matmul %[[XT]], %[[DY]]
// CHECK: %[[G:.+]] = carve.transpose %[[DW]] {carve.fold = "product", perm = array<i64: 1, 0>} : tensor<8x6xf32> -> tensor<6x8xf32>
// CHECK: return %{{.+}}, %[[G]]

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w: tensor<6x8xf32> {carve.param = "w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %wt = carve.transpose %w {perm = array<i64: 1, 0>} : tensor<6x8xf32> -> tensor<8x6xf32> loc("/fc/Transpose")
  %y = carve.matmul %x, %wt : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32> loc("/fc/MatMul")
  %yt = carve.transpose %y {perm = array<i64: 1, 0>} : tensor<4x6xf32> -> tensor<6x4xf32> loc("/out/Transpose")
  %e = carve.exp %yt : tensor<6x4xf32> loc("/out/Exp")
  %et = carve.transpose %e {perm = array<i64: 1, 0>} : tensor<6x4xf32> -> tensor<4x6xf32> loc("/out/Transpose_1")
  %r = carve.reshape %et : tensor<4x6xf32> -> tensor<4x6x1xf32> loc("/out/Reshape")
  %b = carve.expand %r : tensor<4x6x1xf32> -> tensor<4x6x2xf32> loc("/out/Expand")
  %p = carve.transpose %b {perm = array<i64: 1, 0, 2>} : tensor<4x6x2xf32> -> tensor<6x4x2xf32> loc("/out/Transpose_2")
  %l = carve.reduce_sum %p {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<6x4x2xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
