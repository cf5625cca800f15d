// Tests the optimizer's tail ops (CarveOptimizerOps.td): they parse, verify
// and print back; and their verifiers reject what PyTorch's optimizers and
// the tail's references do not allow, each with a precise message.
// RUN: carve-opt %s -split-input-file -verify-diagnostics | FileCheck %s

// CHECK-LABEL: func.func @tail
// CHECK: carve.unscale_gradients %arg2, %arg3 {slots = array<i64: 1, 0>} : tensor<4x8xf32>, tensor<8xf32>
// CHECK: %[[N:.+]] = carve.grad_norm %arg2, %arg3 {slots = array<i64: 1, 0>, tp_split = array<i1: true, false>} : (tensor<4x8xf32>, tensor<8xf32>) -> f64
// CHECK: %[[C:.+]] = carve.clip_coefficient %[[N]] {max_norm = 1.000000e+00 : f64}
// CHECK: carve.scale_gradients %[[C]], %arg2, %arg3 {slots = array<i64: 1, 0>} : tensor<4x8xf32>, tensor<8xf32>
// CHECK: %[[LR:.+]] = carve.learning_rate {decay_steps = 100 : i64, lr = 1.000000e-03 : f64, min_lr_ratio = 1.000000e-01 : f64, warmup_steps = 10 : i64}
// CHECK: carve.adamw %arg0, %arg2, %[[LR]] {beta1 = 9.000000e-01 : f64, beta2 = 0.99899999999999999 : f64, eps = 1.000000e-08 : f64, weight_decay = 0.000000e+00 : f64} : tensor<4x8xf32>, tensor<4x8xf32>
// CHECK: carve.sgd %arg1, %arg3, %[[LR]] {dampening = 0.000000e+00 : f64, momentum = 9.000000e-01 : f64, nesterov = true, weight_decay = 0.000000e+00 : f64} : tensor<8xf32>, tensor<8xf32>
// CHECK: carve.zero_gather %arg0, %arg1 : tensor<4x8xf32>, tensor<8xf32>
func.func @tail(%w: tensor<4x8xf32>, %b: tensor<8xf32>, %dw: tensor<4x8xf32>, %db: tensor<8xf32>) {
  carve.unscale_gradients %dw, %db {slots = array<i64: 1, 0>} : tensor<4x8xf32>, tensor<8xf32>
  %n = carve.grad_norm %dw, %db {slots = array<i64: 1, 0>, tp_split = array<i1: true, false>} : (tensor<4x8xf32>, tensor<8xf32>) -> f64
  %c = carve.clip_coefficient %n {max_norm = 1.0 : f64}
  carve.scale_gradients %c, %dw, %db {slots = array<i64: 1, 0>} : tensor<4x8xf32>, tensor<8xf32>
  %lr = carve.learning_rate {lr = 1.0e-3 : f64, warmup_steps = 10 : i64, decay_steps = 100 : i64, min_lr_ratio = 0.1 : f64}
  carve.adamw %w, %dw, %lr {beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 1.0e-8 : f64, weight_decay = 0.0 : f64} : tensor<4x8xf32>, tensor<4x8xf32>
  carve.sgd %b, %db, %lr {momentum = 0.9 : f64, dampening = 0.0 : f64, weight_decay = 0.0 : f64, nesterov = true} : tensor<8xf32>, tensor<8xf32>
  carve.zero_gather %w, %b : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----

func.func @slots_count(%dw: tensor<4x8xf32>, %db: tensor<8xf32>) {
  // expected-error @+1 {{lists 1 slots for 2 gradients}}
  carve.unscale_gradients %dw, %db {slots = array<i64: 0>} : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----

func.func @slot_twice(%dw: tensor<4x8xf32>, %db: tensor<8xf32>) {
  %n = carve.grad_norm %dw, %db {slots = array<i64: 0, 1>, tp_split = array<i1: false, false>} : (tensor<4x8xf32>, tensor<8xf32>) -> f64
  %c = carve.clip_coefficient %n {max_norm = 1.0 : f64}
  // expected-error @+1 {{lists slot 1 twice}}
  carve.scale_gradients %c, %dw, %db {slots = array<i64: 1, 1>} : tensor<4x8xf32>, tensor<8xf32>
  return
}

// -----

func.func @tp_split_count(%dw: tensor<4x8xf32>) {
  // expected-error @+1 {{tp_split has 2 entries for 1 gradients}}
  %n = carve.grad_norm %dw {slots = array<i64: 0>, tp_split = array<i1: false, true>} : (tensor<4x8xf32>) -> f64
  return
}

// -----

func.func @max_norm(%n: f64) {
  // expected-error @+1 {{max_norm must be 0 (no clipping) or positive, got -1}}
  %c = carve.clip_coefficient %n {max_norm = -1.0 : f64}
  return
}

// -----

func.func @schedule() {
  // expected-error @+1 {{min_lr_ratio = 1.5 must be in [0, 1]}}
  %lr = carve.learning_rate {lr = 1.0e-3 : f64, warmup_steps = 0 : i64, decay_steps = 10 : i64, min_lr_ratio = 1.5 : f64}
  return
}

// -----

// An update writes a parameter: a value computed in the function is none.
func.func @not_an_argument(%w: tensor<8xf32>, %dw: tensor<8xf32>, %lr: f64) {
  %v = carve.exp %w : tensor<8xf32>
  // expected-error @+1 {{updates a value that is not an argument of the function}}
  carve.adamw %v, %dw, %lr {beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 1.0e-8 : f64, weight_decay = 0.0 : f64} : tensor<8xf32>, tensor<8xf32>
  return
}

// -----

func.func @grad_type(%w: tensor<8xf32>, %dw: tensor<4x2xf32>, %lr: f64) {
  // expected-error @+1 {{gradient type 'tensor<4x2xf32>' is neither f32 nor the format of the parameter's 'tensor<8xf32>'}}
  carve.sgd %w, %dw, %lr {momentum = 0.0 : f64, dampening = 0.0 : f64, weight_decay = 0.0 : f64, nesterov = false} : tensor<8xf32>, tensor<4x2xf32>
  return
}

// -----

func.func @eps(%w: tensor<8xf32>, %dw: tensor<8xf32>, %lr: f64) {
  // expected-error @+1 {{eps must be positive, got 0}}
  carve.adamw %w, %dw, %lr {beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 0.0 : f64, weight_decay = 0.0 : f64} : tensor<8xf32>, tensor<8xf32>
  return
}

// -----

func.func @gather_twice(%w: tensor<8xf32>) {
  // expected-error @+1 {{gathers argument 0 twice}}
  carve.zero_gather %w, %w : tensor<8xf32>, tensor<8xf32>
  return
}
