// What carve-optimizer refuses, each with one message.
//
// An optimizer that keeps another number of state tensors than the memory
// plan laid out (carve.plan's optimizer_state: 2 for AdamW).
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-data-parallel --carve-plan-memory --carve-optimizer="kind=sgd" 2>&1 | FileCheck %s --check-prefix=STATE
// STATE: error: carve-optimizer: SGD(lr=0.001, momentum=0, dampening=0, weight_decay=0, nesterov=False) keeps 0 state tensor(s) per parameter; carve.plan's optimizer_state laid out 2
// An unknown optimizer.
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-data-parallel --carve-plan-memory --carve-optimizer="kind=adam" 2>&1 | FileCheck %s --check-prefix=KIND
// KIND: error: carve-optimizer: unknown optimizer 'adam' (known: adamw, sgd)
// Hyperparameters PyTorch refuses, named by the op's verifier.
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-data-parallel --carve-plan-memory --carve-optimizer="beta2=1.0" 2>&1 | FileCheck %s --check-prefix=BETA
// BETA: error: 'carve.adamw' op beta2 = 1 must be in [0, 1)
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1 optimizer-state=1" --carve-data-parallel --carve-plan-memory --carve-optimizer="kind=sgd momentum=0.9 dampening=0.1 nesterov=true" 2>&1 | FileCheck %s --check-prefix=NESTEROV
// NESTEROV: error: 'carve.sgd' op Nesterov momentum requires a momentum and zero dampening (as in PyTorch)
// Without carve-data-parallel's gradient order there is nothing to update.
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-optimizer 2>&1 | FileCheck %s --check-prefix=NOGRADS
// NOGRADS: error: carve-optimizer: @train_step has no carve.gradients (run carve-data-parallel first)
// A second run would update every parameter twice.
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-optimizer 2>&1 | FileCheck %s --check-prefix=TWICE
// TWICE: error: carve-optimizer: @train_step already ends with an optimizer update ('carve.grad_norm')
// TWICE-NOT: error:

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w: tensor<8x8xf32> {carve.param = "fc.weight", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc/MatMul")
  %l = carve.reduce_sum %h {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
