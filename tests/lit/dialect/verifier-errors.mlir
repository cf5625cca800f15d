// Tests that the carve verifiers reject ill-typed ops with a precise message.
// RUN: carve-opt %s -split-input-file -verify-diagnostics

// Tests that elementwise operands must broadcast.
func.func @add_no_broadcast(%a: tensor<2x3xf32>, %b: tensor<4x5xf32>) -> tensor<4x5xf32> {
  // expected-error @+1 {{shapes [2, 3] and [4, 5] do not broadcast}}
  %0 = carve.add %a, %b : (tensor<2x3xf32>, tensor<4x5xf32>) -> tensor<4x5xf32>
  return %0 : tensor<4x5xf32>
}

// -----

// Tests that the declared result shape must be the broadcast shape.
func.func @add_wrong_result(%a: tensor<2x3xf32>, %b: tensor<3xf32>) -> tensor<2x2xf32> {
  // expected-error @+1 {{result shape [2, 2] should be [2, 3]}}
  %0 = carve.add %a, %b : (tensor<2x3xf32>, tensor<3xf32>) -> tensor<2x2xf32>
  return %0 : tensor<2x2xf32>
}

// -----

// Tests that operand element types must agree.
func.func @mixed_types(%a: tensor<3xf32>, %b: tensor<3xf16>) -> tensor<3xf32> {
  // expected-error @+1 {{element types differ: 'f32' vs 'f16'}}
  %0 = carve.mul %a, %b : (tensor<3xf32>, tensor<3xf16>) -> tensor<3xf32>
  return %0 : tensor<3xf32>
}

// -----

// Tests that comparisons produce i1.
func.func @compare_not_i1(%a: tensor<3xf32>) -> tensor<3xf32> {
  // expected-error @+1 {{comparison result must be i1}}
  %0 = carve.less %a, %a : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>
  return %0 : tensor<3xf32>
}

// -----

// Tests that dynamic shapes are rejected.
func.func @dynamic(%a: tensor<?x3xf32>) -> tensor<?x3xf32> {
  // expected-error @+1 {{has a dynamic shape}}
  %0 = carve.relu %a : tensor<?x3xf32>
  return %0 : tensor<?x3xf32>
}

// -----

// Tests that float-only math rejects integers.
func.func @exp_int(%a: tensor<3xi64>) -> tensor<3xi64> {
  // expected-error @+1 {{needs a floating-point element type}}
  %0 = carve.exp %a : tensor<3xi64>
  return %0 : tensor<3xi64>
}

// -----

// Tests that matmul contraction dimensions must agree.
func.func @matmul_k(%a: tensor<2x3xf32>, %b: tensor<4x5xf32>) -> tensor<2x5xf32> {
  // expected-error @+1 {{contraction dimensions differ: [2, 3] x [4, 5]}}
  %0 = carve.matmul %a, %b : (tensor<2x3xf32>, tensor<4x5xf32>) -> tensor<2x5xf32>
  return %0 : tensor<2x5xf32>
}

// -----

// Tests that reshape keeps the element count.
func.func @reshape_count(%a: tensor<2x3xf32>) -> tensor<7xf32> {
  // expected-error @+1 {{element counts differ}}
  %0 = carve.reshape %a : tensor<2x3xf32> -> tensor<7xf32>
  return %0 : tensor<7xf32>
}

// -----

// Tests that transpose needs a permutation.
func.func @transpose_perm(%a: tensor<2x3xf32>) -> tensor<3x2xf32> {
  // expected-error @+1 {{is not a permutation}}
  %0 = carve.transpose %a {perm = array<i64: 1, 1>} : tensor<2x3xf32> -> tensor<3x2xf32>
  return %0 : tensor<3x2xf32>
}

// -----

// Tests that slices stay in bounds.
func.func @slice_bounds(%a: tensor<4xf32>) -> tensor<2xf32> {
  // expected-error @+1 {{slice bounds [3, 5) do not fit dimension 0 of size 4}}
  %0 = carve.slice %a {starts = array<i64: 3>, ends = array<i64: 5>, steps = array<i64: 1>} : tensor<4xf32> -> tensor<2xf32>
  return %0 : tensor<2xf32>
}

// -----

// Tests that reduction axes are sorted and in range.
func.func @reduce_axes(%a: tensor<4x8xf32>) -> tensor<4x1xf32> {
  // expected-error @+1 {{axis 2 is out of range for rank 2}}
  %0 = carve.reduce_sum %a {axes = array<i64: 2>} : tensor<4x8xf32> -> tensor<4x1xf32>
  return %0 : tensor<4x1xf32>
}

// -----

// Tests that layer_norm's scale has the normalized shape.
func.func @ln_scale(%x: tensor<4x8xf32>, %g: tensor<4xf32>) -> tensor<4x8xf32> {
  // expected-error @+1 {{scale shape [4] should be [8]}}
  %0 = carve.layer_norm %x scale %g {axis = 1 : i64, epsilon = 1.0e-5 : f32} : (tensor<4x8xf32>, tensor<4xf32>) -> tensor<4x8xf32>
  return %0 : tensor<4x8xf32>
}

// -----

// Tests that attention's mask broadcasts to the scores.
func.func @attention_mask(%q: tensor<2x4x8xf32>, %m: tensor<2x5x4xf32>) -> tensor<2x4x8xf32> {
  // expected-error @+1 {{mask shape [2, 5, 4] does not broadcast to the scores [2, 4, 4]}}
  %0 = carve.attention %q, %q, %q mask %m {scale = 1.0 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x5x4xf32>) -> tensor<2x4x8xf32>
  return %0 : tensor<2x4x8xf32>
}

// -----

// Tests that attention_stats' row statistics are f32 rows of the result.
func.func @attention_stats_lse(%q: tensor<2x4x8xf32>) -> tensor<2x8xf32> {
  // expected-error @+1 {{lse has type 'tensor<2x8xf32>', expected f32 [2, 4]}}
  %0, %1 = carve.attention_stats %q, %q, %q {scale = 1.0 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> (tensor<2x4x8xf32>, tensor<2x8xf32>)
  return %1 : tensor<2x8xf32>
}

// -----

// Tests that attention_grad_stats reads an output of the attention's shape.
func.func @attention_grad_stats_output(%q: tensor<2x4x8xf32>, %o: tensor<2x4x4xf32>, %l: tensor<2x4xf32>) -> tensor<2x4x8xf32> {
  // expected-error @+1 {{grad and output must have the attention's output shape [2, 4, 8]}}
  %0, %1, %2 = carve.attention_grad_stats %q, %q, %q, %o, %l, %q {scale = 1.0 : f32} : (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x4xf32>, tensor<2x4xf32>, tensor<2x4x8xf32>) -> (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x8xf32>)
  return %0 : tensor<2x4x8xf32>
}

// -----

// Tests that gelu's approximation is one PyTorch knows.
func.func @gelu_approx(%x: tensor<4xf32>) -> tensor<4xf32> {
  // expected-error @+1 {{approximate must be "none" or "tanh", got "fast"}}
  %0 = carve.gelu %x {approximate = "fast"} : tensor<4xf32>
  return %0 : tensor<4xf32>
}

// -----

// Tests that conv2d channels agree with the weight.
func.func @conv_channels(%x: tensor<1x4x8x8xf32>, %w: tensor<8x3x3x3xf32>) -> tensor<1x8x6x6xf32> {
  // expected-error @+1 {{input has 4 channels but the weight expects 3}}
  %0 = carve.conv2d %x, %w {strides = array<i64: 1, 1>, pads = array<i64: 0, 0, 0, 0>, dilations = array<i64: 1, 1>, group = 1 : i64} : (tensor<1x4x8x8xf32>, tensor<8x3x3x3xf32>) -> tensor<1x8x6x6xf32>
  return %0 : tensor<1x8x6x6xf32>
}

// -----

// Tests that cross-entropy targets match the logits.
func.func @ce_targets(%l: tensor<8x10xf32>, %t: tensor<4xi64>) -> tensor<f32> {
  // expected-error @+1 {{targets [4] do not match logits [8, 10]}}
  %0 = carve.cross_entropy %l, %t : (tensor<8x10xf32>, tensor<4xi64>) -> tensor<f32>
  return %0 : tensor<f32>
}

// -----

// Tests that cross-entropy targets are integer class indices.
func.func @ce_float_targets(%l: tensor<8x10xf32>, %t: tensor<8xf32>) -> tensor<f32> {
  // expected-error @+1 {{targets must be i32 or i64 class indices}}
  %0 = carve.cross_entropy %l, %t : (tensor<8x10xf32>, tensor<8xf32>) -> tensor<f32>
  return %0 : tensor<f32>
}

// -----

// Tests that batch_norm statistics are per channel.
func.func @bn_channels(%x: tensor<2x4x3x3xf32>, %c: tensor<3xf32>) -> tensor<2x4x3x3xf32> {
  // expected-error @+1 {{per-channel tensors must have shape [4]}}
  %y, %m, %v = carve.batch_norm %x, %c, %c, %c, %c {epsilon = 1.0e-5 : f32, momentum = 0.9 : f32, training = true} : (tensor<2x4x3x3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) -> (tensor<2x4x3x3xf32>, tensor<3xf32>, tensor<3xf32>)
  return %y : tensor<2x4x3x3xf32>
}
