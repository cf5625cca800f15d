// Tests carve-optimizer on a two-layer net: the step's tail after backward,
// its gradients named by their carve.gradients slot (the order backward
// finishes them: fc2.bias, fc2.weight, fc1.weight), one update per
// parameter.
//
// 1 rank, AdamW with PyTorch's defaults: the norm, the rate, the updates.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-optimizer | FileCheck %s --check-prefix=R1
// ZeRO-2 over dp = 2 in fp16 with clipped, scheduled SGD (Nesterov
// momentum: one state tensor, as carve.plan's optimizer_state says): the
// loss scale divided out first, the clip, then the chunks gathered.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=2 precision=fp16 optimizer-state=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-optimizer="kind=sgd momentum=0.9 nesterov=true clip-grad-norm=1.0 warmup-steps=10 decay-steps=100 min-lr-ratio=0.1" | FileCheck %s --check-prefix=Z2
// tp = 2: the split weights' norm terms are summed over tp, the replicated
// bias counted once.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="tp=2" --carve-partition --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-optimizer="weight-decay=0.1" | FileCheck %s --check-prefix=TP
// The ops print and parse back unchanged.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=1" --carve-data-parallel --carve-plan-memory --carve-optimizer="clip-grad-norm=0.5" | carve-opt | FileCheck %s --check-prefix=ROUNDTRIP

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<8x8xf32> {carve.param = "fc1.weight", carve.trainable},
                   %w2: tensor<8x8xf32> {carve.param = "fc2.weight", carve.trainable},
                   %b: tensor<8xf32> {carve.param = "fc2.bias", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc1/MatMul")
  %a = carve.exp %h : tensor<4x8xf32> loc("/act/Exp")
  %y = carve.matmul %a, %w2 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc2/MatMul")
  %yb = carve.add %y, %b : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32> loc("/fc2/Add")
  %l = carve.reduce_sum %yb {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}

// R1-LABEL: func.func @train_step(
// R1-SAME: carve.gradients = [{copy = false, param = 3 : i64, ready = 7 : i64, result = 3 : i64}, {copy = false, param = 2 : i64, ready = 12 : i64, result = 2 : i64}, {copy = false, param = 1 : i64, ready = 15 : i64, result = 1 : i64}]
// R1-NOT: carve.unscale_gradients
// R1: %[[NORM:.+]] = carve.grad_norm %[[DB:.+]], %[[DW2:.+]], %[[DW1:.+]] {slots = array<i64: 0, 1, 2>, tp_split = array<i1: false, false, false>} : (tensor<8xf32>, tensor<8x8xf32>, tensor<8x8xf32>) -> f64
// Every tail clips: max_norm 0 (none) unless compiled with clipping; a run's
// train --clip replaces it.
// R1-NEXT: %[[CLIP0:.+]] = carve.clip_coefficient %[[NORM]] {max_norm = 0.000000e+00 : f64}
// R1-NEXT: carve.scale_gradients %[[CLIP0]], %[[DB]], %[[DW2]], %[[DW1]] {slots = array<i64: 0, 1, 2>}
// R1-NEXT: %[[LR:.+]] = carve.learning_rate {decay_steps = 0 : i64, lr = 1.000000e-03 : f64, min_lr_ratio = 0.000000e+00 : f64, warmup_steps = 0 : i64}
// R1-NEXT: carve.adamw %arg3, %[[DB]], %[[LR]] {beta1 = 9.000000e-01 : f64, beta2 = 0.99899999999999999 : f64, eps = 1.000000e-08 : f64, weight_decay = 1.000000e-02 : f64} : tensor<8xf32>, tensor<8xf32>
// R1-NEXT: carve.adamw %arg2, %[[DW2]], %[[LR]]
// R1-NEXT: carve.adamw %arg1, %[[DW1]], %[[LR]]
// R1-NOT: carve.zero_gather
// R1-NEXT: return %{{.+}}, %[[DW1]], %[[DW2]], %[[DB]]

// Z2-LABEL: func.func @train_step(
// Z2-SAME: carve.zero_chunk = 32 : i64
// Z2: carve.unscale_gradients %[[DB:.+]], %[[DW2:.+]], %[[DW1:.+]] {slots = array<i64: 0, 1, 2>} : tensor<8xf32>, tensor<8x8xf32>, tensor<8x8xf32>
// Z2-NEXT: %[[NORM:.+]] = carve.grad_norm %[[DB]], %[[DW2]], %[[DW1]] {slots = array<i64: 0, 1, 2>, tp_split = array<i1: false, false, false>}
// Z2-NEXT: %[[CLIP:.+]] = carve.clip_coefficient %[[NORM]] {max_norm = 1.000000e+00 : f64}
// Z2-NEXT: carve.scale_gradients %[[CLIP]], %[[DB]], %[[DW2]], %[[DW1]] {slots = array<i64: 0, 1, 2>}
// Z2-NEXT: %[[LR:.+]] = carve.learning_rate {decay_steps = 100 : i64, lr = 1.000000e-03 : f64, min_lr_ratio = 1.000000e-01 : f64, warmup_steps = 10 : i64}
// Z2-NEXT: carve.sgd %arg3, %[[DB]], %[[LR]] {dampening = 0.000000e+00 : f64, momentum = 9.000000e-01 : f64, nesterov = true, weight_decay = 0.000000e+00 : f64} : tensor<8xf32>, tensor<8xf32>
// Z2-NEXT: carve.sgd %arg2, %[[DW2]], %[[LR]]
// Z2-NEXT: carve.sgd %arg1, %[[DW1]], %[[LR]]
// Z2-NEXT: carve.zero_gather %arg3, %arg2, %arg1 : tensor<8xf32>, tensor<8x8xf32>, tensor<8x8xf32>
// Z2-NEXT: return

// TP-LABEL: func.func @train_step(
// TP: carve.grad_norm {{.*}} {slots = array<i64: 0, 1, 2>, tp_split = array<i1: false, true, true>} : (tensor<8xf32>, tensor<4x8xf32>, tensor<8x4xf32>) -> f64
// TP: carve.adamw %arg3, {{.*}}weight_decay = 1.000000e-01 : f64} : tensor<8xf32>, tensor<8xf32>
// TP-NEXT: carve.adamw %arg2, {{.*}} : tensor<4x8xf32>, tensor<4x8xf32>
// TP-NEXT: carve.adamw %arg1, {{.*}} : tensor<8x4xf32>, tensor<8x4xf32>
// TP-NOT: carve.zero_gather

// ROUNDTRIP: carve.grad_norm
// ROUNDTRIP-NEXT: carve.clip_coefficient {{.*}} {max_norm = 5.000000e-01 : f64}
// ROUNDTRIP-NEXT: carve.scale_gradients
// ROUNDTRIP-NEXT: carve.learning_rate
// ROUNDTRIP-COUNT-3: carve.adamw
// ROUNDTRIP-NEXT: carve.zero_gather %arg3, %arg2, %arg1
