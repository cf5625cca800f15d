// Tests the one-line errors of carve-autodiff on functions it cannot
// differentiate, with the default options and with a loss name that no output
// has.
// RUN: not carve-opt %s -split-input-file --carve-autodiff 2>&1 | FileCheck %s
// RUN: not carve-opt %s -split-input-file --carve-autodiff='loss=nosuch' 2>&1 | FileCheck %s --check-prefix=NOSUCH

// Tests that a function with two outputs needs the loss to be named.
// CHECK: error: the model has 2 outputs (loss, logits); choose the loss with --loss NAME
// NOSUCH: error: --loss nosuch: the model has no output of that name (it has: loss, logits)
func.func @forward(%x: tensor<4xf32> {carve.param = "x", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}, tensor<4xf32> {carve.output = "logits"}) {
  %s = carve.reduce_sum %x {axes = array<i64: 0>, keep_dims = false} : tensor<4xf32> -> tensor<f32>
  return %s, %x : tensor<f32>, tensor<4xf32>
}

// -----

// Tests that the loss must be a scalar.
// CHECK: error: the loss 'loss' must be a float scalar, but it is tensor<4xf32>
// NOSUCH: error: --loss nosuch: the model has no output of that name (it has: loss)
func.func @forward(%x: tensor<4xf32> {carve.param = "x", carve.trainable})
    -> (tensor<4xf32> {carve.output = "loss"}) {
  %y = carve.exp %x : tensor<4xf32>
  return %y : tensor<4xf32>
}

// -----

// Tests that the loss must be a float.
// CHECK: error: the loss 'loss' must be a float scalar, but it is tensor<i64>
func.func @forward(%t: tensor<i64> {carve.input = "t"}) -> (tensor<i64> {carve.output = "loss"}) {
  return %t : tensor<i64>
}

// -----

// Tests that an op without a gradient rule between a parameter and the loss is
// named with its ONNX node.
// CHECK: model.onnx:7:0: error: no gradient rule for 'carve.max_pool2d' (node 'MaxPool_0'), which lies between a trainable parameter and the loss; freeze the parameters before it with --frozen
func.func @forward(%x: tensor<1x1x4x4xf32> {carve.input = "x"},
                   %w: tensor<1x1x4x4xf32> {carve.param = "w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.mul %x, %w : (tensor<1x1x4x4xf32>, tensor<1x1x4x4xf32>) -> tensor<1x1x4x4xf32>
  %y = carve.max_pool2d %h {kernel = array<i64: 2, 2>, pads = array<i64: 0, 0, 0, 0>,
                            strides = array<i64: 2, 2>}
         : tensor<1x1x4x4xf32> -> tensor<1x1x2x2xf32> loc("MaxPool_0"("model.onnx":7:0))
  %l = carve.reduce_sum %y {axes = array<i64: 0, 1, 2, 3>, keep_dims = false}
         : tensor<1x1x2x2xf32> -> tensor<f32>
  return %l : tensor<f32>
}

// -----

// Tests that the function to differentiate must exist.
// CHECK: error: the module has no function @forward
func.func @model(%x: tensor<f32>) -> tensor<f32> {
  return %x : tensor<f32>
}
