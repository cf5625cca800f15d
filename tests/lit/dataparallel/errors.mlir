// Functions carve-data-parallel refuses, each with one message at the
// gradient's op (its ONNX node and position) or the function.
// RUN: not carve-opt %s --split-input-file --carve-data-parallel 2>&1 | FileCheck %s

// A result after the loss that is no gradient.
// CHECK: model.onnx:4:0: error: result 1 of @train_step is not a gradient (carve.grad_of)
func.func @train_step(%x: tensor<4x6xf32> {carve.input = "x"},
                      %w: tensor<6x8xf32> {carve.param = "w", carve.trainable},
                      %seed: tensor<f32> {carve.loss_seed})
    -> (tensor<f32> {carve.output = "loss"}, tensor<4x8xf32>) {
  %p = carve.matmul %x, %w : (tensor<4x6xf32>, tensor<6x8xf32>) -> tensor<4x8xf32> loc("mm"("model.onnx":3:0))
  %y = carve.exp %p : tensor<4x8xf32> loc("act"("model.onnx":4:0))
  %l = carve.reduce_sum %y {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("loss"("model.onnx":5:0))
  return %l, %y : tensor<f32>, tensor<4x8xf32>
}

// -----

// A gradient of a parameter no argument holds.
// CHECK: model.onnx:4:0: error: gradient of unknown parameter 'v'
func.func @train_step(%x: tensor<4x6xf32> {carve.input = "x"},
                      %w: tensor<6x8xf32> {carve.param = "w", carve.trainable},
                      %seed: tensor<f32> {carve.loss_seed})
    -> (tensor<f32> {carve.output = "loss"}, tensor<4x8xf32> {carve.grad_of = "v"}) {
  %p = carve.matmul %x, %w : (tensor<4x6xf32>, tensor<6x8xf32>) -> tensor<4x8xf32> loc("mm"("model.onnx":3:0))
  %y = carve.exp %p : tensor<4x8xf32> loc("act"("model.onnx":4:0))
  %l = carve.reduce_sum %y {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("loss"("model.onnx":5:0))
  return %l, %y : tensor<f32>, tensor<4x8xf32>
}

// -----

// A gradient that is not f32.
// CHECK: model.onnx:3:0: error: the gradient of parameter 'w' is not float32, bfloat16 or float16
func.func @train_step(%x: tensor<4x6xf64> {carve.input = "x"},
                      %w: tensor<6x8xf64> {carve.param = "w", carve.trainable},
                      %seed: tensor<f32> {carve.loss_seed})
    -> (tensor<f32> {carve.output = "loss"}, tensor<6x8xf64> {carve.grad_of = "w"}) {
  %g = carve.exp %w : tensor<6x8xf64> loc("g"("model.onnx":3:0))
  return %seed, %g : tensor<f32>, tensor<6x8xf64>
}

// -----

// @train_step must return the loss first.
// CHECK: error: @train_step returns nothing (the loss comes first)
func.func @train_step(%x: tensor<4x6xf32> {carve.input = "x"}) {
  return
}
