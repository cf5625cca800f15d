// Tests carve-fold-transposes' scatter-products (the CPU target's
// matmul_gather_grad): the second convolution's input gradient, W^T dY
// reshaped to the windows and scattered into the image by gather_grad, is
// marked "scatter" (the matmul and the reshape between get no buffer); the
// first convolution's input is no parameter, so it has no input gradient.
// Without the option nothing is marked.
// RUN: carve-opt %s -pass-pipeline='builtin.module(func.func(carve-lower-convolutions), carve-autodiff, carve-fold-transposes{scatter-products=true})' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(func.func(carve-lower-convolutions), carve-autodiff, carve-fold-transposes)' | FileCheck %s --check-prefix=OFF

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[WT:.+]] = carve.transpose %{{.+}} {carve.fold = "operand", perm = array<i64: 1, 0>} : tensor<8x36xf32> -> tensor<36x8xf32>
// CHECK: %[[P:.+]] = carve.matmul %[[WT]], %{{.+}} : (tensor<36x8xf32>, tensor<2x8x16xf32>) -> tensor<2x36x16xf32>
// CHECK: %[[R:.+]] = carve.reshape %[[P]] : tensor<2x36x16xf32> -> tensor<2x4x9x16xf32>
// CHECK: carve.gather_grad %[[R]], %{{.+}} {axis = 2 : i64, carve.fold = "scatter"} : (tensor<2x4x9x16xf32>, tensor<9x16xi64>) -> tensor<2x4x17xf32>
// CHECK-NOT: carve.gather_grad
// CHECK: return
// OFF-NOT: "scatter"

func.func @forward(%x: tensor<2x3x4x4xf32> {carve.input = "x"},
                   %w1: tensor<4x3x3x3xf32> {carve.param = "w1", carve.trainable},
                   %w2: tensor<8x4x3x3xf32> {carve.param = "w2", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.conv2d %x, %w1 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x3x4x4xf32>, tensor<4x3x3x3xf32>) -> tensor<2x4x4x4xf32> loc("/conv1/Conv")
  %y = carve.conv2d %h, %w2 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x4x4x4xf32>, tensor<8x4x3x3xf32>) -> tensor<2x8x4x4xf32> loc("/conv2/Conv")
  %l = carve.reduce_sum %y {axes = array<i64: 0, 1, 2, 3>, keep_dims = false} : tensor<2x8x4x4xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
