// Tests carve-expert-parallel's refusals under a plan with ep = 2: each is
// one diagnostic, at the op it names (without a model location the node is
// the op's name), prefixed by the plan field "ep".
// RUN: carve-opt %s -split-input-file -verify-diagnostics -pass-pipeline='builtin.module(carve-set-plan{dp=2 ep=2}, carve-expert-parallel)'
// An ep rank outside [0, ep) is refused before the model is read.
// RUN: not carve-opt %s -split-input-file -pass-pipeline='builtin.module(carve-set-plan{dp=2 ep=2}, carve-expert-parallel{ep-rank=2})' 2>&1 | FileCheck %s --check-prefix=RANK

// RANK: error: carve-expert-parallel: ep-rank 2 is outside [0, 2)

// Tests that a layer of 3 experts, which ep = 2 does not divide, is refused
// at its first expert's gather.
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %m0: tensor<4xi1> {carve.input = "m0"},
                   %m1: tensor<4xi1> {carve.input = "m1"},
                   %m2: tensor<4xi1> {carve.input = "m2"},
                   %w0: tensor<8x6xf32> {carve.param = "experts.0.w", carve.trainable},
                   %w1: tensor<8x6xf32> {carve.param = "experts.1.w", carve.trainable},
                   %w2: tensor<8x6xf32> {carve.param = "experts.2.w", carve.trainable})
    -> (tensor<4x6xf32> {carve.output = "y"}) {
  %p0 = carve.nonzero %m0 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i0 = carve.reshape %p0 : tensor<1x4xi64> -> tensor<4xi64>
  // expected-error @+1 {{plan: "ep": the mixture-of-experts layer at node 'carve.gather' has 3 experts, which do not divide by ep = 2}}
  %r0 = carve.gather %x, %i0 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o0 = carve.matmul %r0, %w0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %p1 = carve.nonzero %m1 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i1 = carve.reshape %p1 : tensor<1x4xi64> -> tensor<4xi64>
  %r1 = carve.gather %x, %i1 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o1 = carve.matmul %r1, %w1 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %p2 = carve.nonzero %m2 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i2 = carve.reshape %p2 : tensor<1x4xi64> -> tensor<4xi64>
  %r2 = carve.gather %x, %i2 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o2 = carve.matmul %r2, %w2 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %s = carve.add %o0, %o1 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  %y = carve.add %s, %o2 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  return %y : tensor<4x6xf32>
}

// -----

// Tests that ep on a model without a routed layer (no gather by carve.nonzero's
// positions) is refused: there is nothing to split.
// expected-error @+1 {{plan: "ep" is 2, but the model has no routed mixture-of-experts layer}}
module {
  func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                     %w: tensor<8x6xf32> {carve.param = "w", carve.trainable})
      -> (tensor<4x6xf32> {carve.output = "y"}) {
    %y = carve.matmul %x, %w : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
    return %y : tensor<4x6xf32>
  }
}

// -----

// Tests that an expert's parameter read outside the expert (here by a second
// matmul on the whole input) is refused: it could not live on one ep rank.
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %m0: tensor<4xi1> {carve.input = "m0"},
                   %m1: tensor<4xi1> {carve.input = "m1"},
                   %w0: tensor<8x6xf32> {carve.param = "experts.0.w", carve.trainable},
                   %w1: tensor<8x6xf32> {carve.param = "experts.1.w", carve.trainable})
    -> (tensor<4x6xf32> {carve.output = "y"}) {
  %p0 = carve.nonzero %m0 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i0 = carve.reshape %p0 : tensor<1x4xi64> -> tensor<4xi64>
  // expected-error @+1 {{plan: "ep": node 'carve.gather': parameter 'experts.0.w' of this expert is also used outside it}}
  %r0 = carve.gather %x, %i0 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o0 = carve.matmul %r0, %w0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %p1 = carve.nonzero %m1 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i1 = carve.reshape %p1 : tensor<1x4xi64> -> tensor<4xi64>
  %r1 = carve.gather %x, %i1 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o1 = carve.matmul %r1, %w1 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %d = carve.matmul %x, %w0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %s = carve.add %o0, %o1 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  %y = carve.add %s, %d : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  return %y : tensor<4x6xf32>
}

// -----

// Tests that experts of one layer giving results of different shapes are
// refused at the first expert unlike the first.
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %m0: tensor<4xi1> {carve.input = "m0"},
                   %m1: tensor<4xi1> {carve.input = "m1"},
                   %w0: tensor<8x6xf32> {carve.param = "experts.0.w", carve.trainable},
                   %w1: tensor<8x5xf32> {carve.param = "experts.1.w", carve.trainable})
    -> (tensor<4x6xf32> {carve.output = "y0"}, tensor<4x5xf32> {carve.output = "y1"}) {
  %p0 = carve.nonzero %m0 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i0 = carve.reshape %p0 : tensor<1x4xi64> -> tensor<4xi64>
  %r0 = carve.gather %x, %i0 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o0 = carve.matmul %r0, %w0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %p1 = carve.nonzero %m1 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i1 = carve.reshape %p1 : tensor<1x4xi64> -> tensor<4xi64>
  // expected-error @+1 {{plan: "ep": node 'carve.gather': the experts of one layer must take and give tensors of one shape (2 experts gather from the same tensor)}}
  %r1 = carve.gather %x, %i1 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o1 = carve.matmul %r1, %w1 : (tensor<4x8xf32>, tensor<8x5xf32>) -> tensor<4x5xf32>
  %a = carve.relu %o0 : tensor<4x6xf32>
  %b = carve.relu %o1 : tensor<4x5xf32>
  return %a, %b : tensor<4x6xf32>, tensor<4x5xf32>
}

// -----

// Tests that an op of an expert that mixes its rows (a sum over the routed
// tokens) is refused at that op: the rows could not be computed apart on the
// expert's rank.
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %m0: tensor<4xi1> {carve.input = "m0"},
                   %m1: tensor<4xi1> {carve.input = "m1"},
                   %w0: tensor<8x6xf32> {carve.param = "experts.0.w", carve.trainable},
                   %w1: tensor<8x6xf32> {carve.param = "experts.1.w", carve.trainable})
    -> (tensor<6xf32> {carve.output = "y"}) {
  %p0 = carve.nonzero %m0 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i0 = carve.reshape %p0 : tensor<1x4xi64> -> tensor<4xi64>
  %r0 = carve.gather %x, %i0 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o0 = carve.matmul %r0, %w0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  // expected-error @+1 {{plan: "ep": node 'carve.reduce_sum': carve splits the experts of a routed mixture of experts over ep ranks, and this op of an expert does not keep the expert's rows (tokens) apart}}
  %t0 = carve.reduce_sum %o0 {axes = array<i64: 0>, keep_dims = false} : tensor<4x6xf32> -> tensor<6xf32>
  %p1 = carve.nonzero %m1 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i1 = carve.reshape %p1 : tensor<1x4xi64> -> tensor<4xi64>
  %r1 = carve.gather %x, %i1 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o1 = carve.matmul %r1, %w1 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %t1 = carve.reduce_sum %o1 {axes = array<i64: 0>, keep_dims = false} : tensor<4x6xf32> -> tensor<6xf32>
  %y = carve.add %t0, %t1 : (tensor<6xf32>, tensor<6xf32>) -> tensor<6xf32>
  return %y : tensor<6xf32>
}

// -----

// Tests that an expert with two values read outside it is refused at the op
// of the second: the combine sends one result back per expert.
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %m0: tensor<4xi1> {carve.input = "m0"},
                   %m1: tensor<4xi1> {carve.input = "m1"},
                   %w0: tensor<8x6xf32> {carve.param = "experts.0.w", carve.trainable},
                   %w1: tensor<8x6xf32> {carve.param = "experts.1.w", carve.trainable})
    -> (tensor<4x6xf32> {carve.output = "y"}, tensor<4x6xf32> {carve.output = "h"}) {
  %p0 = carve.nonzero %m0 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i0 = carve.reshape %p0 : tensor<1x4xi64> -> tensor<4xi64>
  %r0 = carve.gather %x, %i0 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %h0 = carve.matmul %r0, %w0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  // expected-error @+1 {{plan: "ep": node 'carve.relu': an expert of a routed mixture of experts has more than one result; carve-expert-parallel sends one back per expert}}
  %o0 = carve.relu %h0 : tensor<4x6xf32>
  %p1 = carve.nonzero %m1 : (tensor<4xi1>) -> tensor<1x4xi64>
  %i1 = carve.reshape %p1 : tensor<1x4xi64> -> tensor<4xi64>
  %r1 = carve.gather %x, %i1 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32>
  %o1 = carve.matmul %r1, %w1 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
  %y = carve.add %o0, %o1 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
  return %y, %h0 : tensor<4x6xf32>, tensor<4x6xf32>
}
