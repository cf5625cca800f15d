// Tests the CUDA target's convolutions through cuDNN: on a plan with
// target=cuda (convolution = "cudnn", the default) and tp = 1,
// carve-lower-convolutions keeps carve.conv2d whole (no windows' gather, no
// GEMM), its bias moved to an add of [O, 1, 1] after it, while max_pool2d is
// lowered as ever; carve-autodiff gives it conv2d_grad_input (absent where
// the input needs no gradient) and conv2d_grad_weight with the forward's
// attributes, the bias's gradient a reduce_sum over samples and pixels; and
// carve-select-kernels runs the three as `conv2d`, `conv2d_grad_input` and
// `conv2d_grad_weight`. With convolution=carve, with tp=2, and on the CPU
// target they are lowered (im2col).
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, func.func(carve-lower-convolutions))' | FileCheck %s --check-prefix=KEEP
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, func.func(carve-lower-convolutions), carve-autodiff)' | FileCheck %s --check-prefix=GRAD
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, func.func(carve-lower-convolutions), carve-autodiff, carve-select-kernels)' | FileCheck %s --check-prefix=SELECT
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda convolution=carve}, func.func(carve-lower-convolutions))' | FileCheck %s --check-prefix=LOWER
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda tp=2}, func.func(carve-lower-convolutions))' | FileCheck %s --check-prefix=LOWER
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu}, func.func(carve-lower-convolutions))' | FileCheck %s --check-prefix=LOWER

// KEEP-LABEL: func.func @forward(
// KEEP: %[[C1:.+]] = carve.conv2d %arg0, %arg1 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 0, 1, 0>, strides = array<i64: 2, 1>} : (tensor<2x3x8x8xf32>, tensor<4x3x3x3xf32>) -> tensor<2x4x4x6xf32>
// KEEP: %[[B3:.+]] = carve.reshape %arg2 : tensor<4xf32> -> tensor<4x1x1xf32>
// KEEP: carve.add %[[C1]], %[[B3]] : (tensor<2x4x4x6xf32>, tensor<4x1x1xf32>) -> tensor<2x4x4x6xf32>
// KEEP-NOT: carve.max_pool2d
// KEEP: carve.reduce_max
// KEEP: carve.conv2d %{{.*}}, %arg3 {dilations = array<i64: 1, 1>, group = 2 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x4x2x3xf32>, tensor<4x2x3x3xf32>) -> tensor<2x4x2x3xf32>
// KEEP-NOT: carve.gather
// KEEP: return

// GRAD-LABEL: func.func @train_step(
// GRAD: carve.conv2d_grad_input %{{.*}}, %arg3 {dilations = array<i64: 1, 1>, group = 2 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x4x2x3xf32>, tensor<4x2x3x3xf32>) -> tensor<2x4x2x3xf32>
// GRAD: carve.conv2d_grad_weight %{{.*}}, %{{.*}} {dilations = array<i64: 1, 1>, group = 2 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x4x2x3xf32>, tensor<2x4x2x3xf32>) -> tensor<4x2x3x3xf32>
// GRAD: carve.reduce_sum %{{.*}} {axes = array<i64: 0, 2, 3>} : tensor<2x4x4x6xf32> -> tensor<1x4x1x1xf32>
// GRAD-NOT: carve.conv2d_grad_input
// GRAD: carve.conv2d_grad_weight %arg0, %{{.*}} {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 0, 1, 0>, strides = array<i64: 2, 1>} : (tensor<2x3x8x8xf32>, tensor<2x4x4x6xf32>) -> tensor<4x3x3x3xf32>
// GRAD: return

// SELECT-LABEL: func.func @train_step(
// SELECT: carve.conv2d %arg0, %arg1 {carve.kernel = "conv2d"
// SELECT: carve.conv2d %{{.*}}, %arg3 {carve.kernel = "conv2d"
// SELECT: carve.conv2d_grad_input {{.*}} {carve.kernel = "conv2d_grad_input"
// SELECT: carve.conv2d_grad_weight {{.*}} {carve.kernel = "conv2d_grad_weight"
// SELECT: carve.conv2d_grad_weight %arg0, {{.*}} {carve.kernel = "conv2d_grad_weight"

// LOWER-LABEL: func.func @forward(
// LOWER-NOT: carve.conv2d
// LOWER: carve.gather
// LOWER: carve.matmul
// LOWER-NOT: carve.conv2d
// LOWER: return

func.func @forward(%x: tensor<2x3x8x8xf32> {carve.input = "x"},
                   %w1: tensor<4x3x3x3xf32> {carve.param = "w1", carve.trainable},
                   %b1: tensor<4xf32> {carve.param = "b1", carve.trainable},
                   %w2: tensor<4x2x3x3xf32> {carve.param = "w2", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %c1 = carve.conv2d %x, %w1 bias %b1 {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 0, 1, 0>, strides = array<i64: 2, 1>} : (tensor<2x3x8x8xf32>, tensor<4x3x3x3xf32>, tensor<4xf32>) -> tensor<2x4x4x6xf32>
  %p = carve.max_pool2d %c1 {kernel = array<i64: 2, 2>, pads = array<i64: 0, 0, 0, 0>, strides = array<i64: 2, 2>} : tensor<2x4x4x6xf32> -> tensor<2x4x2x3xf32>
  %c2 = carve.conv2d %p, %w2 {dilations = array<i64: 1, 1>, group = 2 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x4x2x3xf32>, tensor<4x2x3x3xf32>) -> tensor<2x4x2x3xf32>
  %l = carve.reduce_sum %c2 {axes = array<i64: 0, 1, 2, 3>, keep_dims = false} : tensor<2x4x2x3xf32> -> tensor<f32>
  return %l : tensor<f32>
}
