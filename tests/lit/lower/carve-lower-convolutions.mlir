// Tests carve-lower-convolutions: conv2d (ungrouped, grouped, depthwise) and
// max_pool2d become the windows' gather (a constant [taps, pixels] index; where
// windows reach into the padding, the image gets one element of the padding
// value concatenated after it, which those taps read), and a GEMM with the
// weight as stored and the result NCHW (no transpose; where there are fewer
// pixels than output channels, one GEMM over all samples' pixels with
// transposes around it), a per-group matmul, a
// product summed over the taps, or a reduce_max.
// RUN: carve-opt %s -split-input-file -verify-diagnostics -pass-pipeline='builtin.module(func.func(carve-lower-convolutions))' | FileCheck %s

// A 3x3 convolution with padding 1 and a bias: [8, 27] x [4, 27, 16], the
// weight shared by the 4 samples.
// CHECK-LABEL: func.func @conv
// CHECK-NOT: carve.conv2d
// CHECK: carve.reshape %{{.*}} : tensor<4x3x4x4xf32> -> tensor<4x3x16xf32>
// CHECK: carve.constant dense<0.000000e+00> : tensor<4x3x1xf32>
// CHECK: carve.concat {{.*}} {axis = 2 : i64} : (tensor<4x3x16xf32>, tensor<4x3x1xf32>) -> tensor<4x3x17xf32>
// CHECK: carve.constant dense<{{.*}}> : tensor<9x16xi64>
// CHECK: carve.gather {{.*}} {axis = 2 : i64} : (tensor<4x3x17xf32>, tensor<9x16xi64>) -> tensor<4x3x9x16xf32>
// CHECK-NOT: carve.where
// CHECK-NOT: carve.transpose
// CHECK: carve.matmul {{.*}} : (tensor<8x27xf32>, tensor<4x27x16xf32>) -> tensor<4x8x16xf32>
// CHECK-NOT: carve.transpose
// CHECK: carve.add {{.*}} -> tensor<4x8x4x4xf32>
func.func @conv(%x: tensor<4x3x4x4xf32>, %w: tensor<8x3x3x3xf32>, %b: tensor<8xf32>) -> tensor<4x8x4x4xf32> {
  %y = carve.conv2d %x, %w bias %b {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<4x3x4x4xf32>, tensor<8x3x3x3xf32>, tensor<8xf32>) -> tensor<4x8x4x4xf32>
  return %y : tensor<4x8x4x4xf32>
}

// -----

// Fewer pixels (2x2) than output channels (8): one GEMM over both samples'
// pixels, [2*4, 27] x [27, 8], the windows gathered pixel-major and
// transposed to it, the result transposed back to NCHW.
// CHECK-LABEL: func.func @deep
// CHECK: carve.gather {{.*}} {axis = 2 : i64} : (tensor<2x3x5xf32>, tensor<4x9xi64>) -> tensor<2x3x4x9xf32>
// CHECK: carve.transpose {{.*}} {perm = array<i64: 0, 2, 1, 3>} : tensor<2x3x4x9xf32> -> tensor<2x4x3x9xf32>
// CHECK: carve.matmul {{.*}} : (tensor<8x27xf32>, tensor<27x8xf32>) -> tensor<8x8xf32>
// CHECK: carve.transpose {{.*}} {perm = array<i64: 0, 2, 1>} : tensor<2x4x8xf32> -> tensor<2x8x4xf32>
func.func @deep(%x: tensor<2x3x2x2xf32>, %w: tensor<8x3x3x3xf32>) -> tensor<2x8x2x2xf32> {
  %y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 1 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<2x3x2x2xf32>, tensor<8x3x3x3xf32>) -> tensor<2x8x2x2xf32>
  return %y : tensor<2x8x2x2xf32>
}

// -----

// Two groups of 2 input and 3 output channels, no padding (no concat).
// CHECK-LABEL: func.func @grouped
// CHECK-NOT: carve.concat
// CHECK-NOT: carve.transpose
// CHECK: carve.matmul {{.*}} : (tensor<2x3x18xf32>, tensor<1x2x18x4xf32>) -> tensor<1x2x3x4xf32>
// CHECK-NOT: carve.transpose
func.func @grouped(%x: tensor<1x4x4x4xf32>, %w: tensor<6x2x3x3xf32>) -> tensor<1x6x2x2xf32> {
  %y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 2 : i64, pads = array<i64: 0, 0, 0, 0>, strides = array<i64: 1, 1>} : (tensor<1x4x4x4xf32>, tensor<6x2x3x3xf32>) -> tensor<1x6x2x2xf32>
  return %y : tensor<1x6x2x2xf32>
}

// -----

// Depthwise: one output channel per group, a product summed over the taps.
// CHECK-LABEL: func.func @depthwise
// CHECK-NOT: carve.matmul
// CHECK: carve.mul {{.*}} : (tensor<1x3x1x9x16xf32>, tensor<3x1x9x1xf32>) -> tensor<1x3x1x9x16xf32>
// CHECK: carve.reduce_sum {{.*}} {axes = array<i64: 2, 3>, keep_dims = false}
func.func @depthwise(%x: tensor<1x3x4x4xf32>, %w: tensor<3x1x3x3xf32>) -> tensor<1x3x4x4xf32> {
  %y = carve.conv2d %x, %w {dilations = array<i64: 1, 1>, group = 3 : i64, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 1, 1>} : (tensor<1x3x4x4xf32>, tensor<3x1x3x3xf32>) -> tensor<1x3x4x4xf32>
  return %y : tensor<1x3x4x4xf32>
}

// -----

// Max pooling: -inf in the padding (the taps outside the 5x5 image read
// element 25; a row per tap: tap (0, 0) of the 3x3 output pixels, then tap
// (0, 1)), the maximum over the taps.
// CHECK-LABEL: func.func @maxpool
// CHECK-NOT: carve.max_pool2d
// CHECK: carve.constant dense<0xFF800000> : tensor<2x4x1xf32>
// CHECK: carve.concat {{.*}} -> tensor<2x4x26xf32>
// CHECK: carve.constant dense<{{\[\[}}25, 25, 25, 25, 6, 8, 25, 16, 18], [25, 25, 25, 5, 7, 9, 15, 17, 19]
// CHECK: carve.reduce_max {{.*}} {axes = array<i64: 2>, keep_dims = false} : tensor<2x4x9x9xf32> -> tensor<2x4x9xf32>
func.func @maxpool(%x: tensor<2x4x5x5xf32>) -> tensor<2x4x3x3xf32> {
  %y = carve.max_pool2d %x {kernel = array<i64: 3, 3>, pads = array<i64: 1, 1, 1, 1>, strides = array<i64: 2, 2>} : tensor<2x4x5x5xf32> -> tensor<2x4x3x3xf32>
  return %y : tensor<2x4x3x3xf32>
}

// -----

// Batch norm in training mode: the batch's statistics, the running ones in an
// evaluation (eval_select), and both running statistics assigned their update.
// CHECK-LABEL: func.func @batch_norm
// CHECK-NOT: carve.batch_norm
// CHECK: carve.reduce_mean %arg0 {axes = array<i64: 0, 2, 3>} : tensor<2x3x4x4xf32> -> tensor<1x3x1x1xf32>
// CHECK: carve.eval_select
// CHECK: carve.eval_select
// CHECK: carve.rsqrt
// CHECK: carve.assign %{{.*}}, %arg3 : tensor<3xf32>
// CHECK: carve.assign %{{.*}}, %arg4 : tensor<3xf32>
func.func @batch_norm(%x: tensor<2x3x4x4xf32>, %g: tensor<3xf32>, %b: tensor<3xf32>,
                      %rm: tensor<3xf32> {carve.buffer = "bn.running_mean"},
                      %rv: tensor<3xf32> {carve.buffer = "bn.running_var"}) -> tensor<2x3x4x4xf32> {
  %y, %m, %v = carve.batch_norm %x, %g, %b, %rm, %rv {epsilon = 1.0e-5 : f32, momentum = 0.9 : f32, training = true} : (tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) -> (tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>)
  return %y : tensor<2x3x4x4xf32>
}

// -----

// Running statistics that are no buffers cannot be updated: an error naming the op.
func.func @not_buffers(%x: tensor<2x3x4x4xf32>, %g: tensor<3xf32>, %b: tensor<3xf32>,
                       %rm: tensor<3xf32>, %rv: tensor<3xf32>) -> tensor<2x3x4x4xf32> {
  // expected-error @+1 {{carve.batch_norm: its running statistics are not buffers of the model}}
  %y, %m, %v = carve.batch_norm %x, %g, %b, %rm, %rv {epsilon = 1.0e-5 : f32, momentum = 0.9 : f32, training = true} : (tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) -> (tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>)
  return %y : tensor<2x3x4x4xf32>
}

// -----

// sync_batch_norm under dp = 2: each statistic is this replica's sum, summed
// over the replicas (carve.replica_sum) and divided by both replicas' count
// (2 x 32 values per channel); the mean first, then the squares about it.
// The running variance's unbiased factor counts both: 0.1 * 64 / 63.
// CHECK-LABEL: func.func @sync_batch_norm
// CHECK-NOT: carve.reduce_mean
// CHECK: %[[S:.*]] = carve.reduce_sum %arg0 {axes = array<i64: 0, 2, 3>} : tensor<2x3x4x4xf32> -> tensor<1x3x1x1xf32>
// CHECK: %[[T:.*]] = carve.replica_sum %[[S]] : tensor<1x3x1x1xf32>
// CHECK: %[[N:.*]] = carve.constant dense<6.400000e+01> : tensor<f32>
// CHECK: carve.div %[[T]], %[[N]]
// CHECK: carve.reduce_sum
// CHECK: carve.replica_sum
// CHECK: carve.constant dense<0.101587{{[0-9]*}}> : tensor<f32>
// CHECK-NOT: carve.reduce_mean
module attributes {carve.plan = {dp = 2 : i64, sync_batch_norm}} {
func.func @sync_batch_norm(%x: tensor<2x3x4x4xf32>, %g: tensor<3xf32>, %b: tensor<3xf32>,
                      %rm: tensor<3xf32> {carve.buffer = "bn.running_mean"},
                      %rv: tensor<3xf32> {carve.buffer = "bn.running_var"}) -> tensor<2x3x4x4xf32> {
  %y, %m, %v = carve.batch_norm %x, %g, %b, %rm, %rv {epsilon = 1.0e-5 : f32, momentum = 0.9 : f32, training = true} : (tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) -> (tensor<2x3x4x4xf32>, tensor<3xf32>, tensor<3xf32>)
  return %y : tensor<2x3x4x4xf32>
}
}
