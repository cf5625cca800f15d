// Tests ZeRO-3 prefetch (carve.plan's zero3_prefetch_layers) in
// carve-data-parallel and carve-plan-memory on two numbered layers: h.0
// (matmul, then a fused bias add, exp and residual add whose reads run at
// the group's root, op 3) and h.1 (a transposed weight read by its matmul's
// flag, op 5, and by the input gradient's matmul in backward, op 12). With k = 1
// the layer after h.0 starts its gather where h.0's first read runs; the
// record gains [forward, backward] start ops, and the memory plan keeps each
// gathered buffer from where its gather starts, so h.1.w's buffer no longer
// shares bytes with h.0's (without prefetch every gathered buffer is live
// only at its one reader, and all of them share offset 0).
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=3 zero3-prefetch-layers=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory | FileCheck %s --check-prefix=K1
// Without prefetch: four entries, each gather where it is first read.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=3" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory | FileCheck %s --check-prefix=K0
// A negative field, and the field without ZeRO-3.
// RUN: not carve-opt %s --carve-set-plan="dp=2 zero=3 zero3-prefetch-layers=-1" 2>&1 | FileCheck %s --check-prefix=NEG
// RUN: not carve-opt %s --carve-set-plan="dp=2 zero=2 zero3-prefetch-layers=1" 2>&1 | FileCheck %s --check-prefix=NOTZ3

// K1-LABEL: func.func @train_step(
// K1-SAME: {carve.param = "h.0.w", {{.*}}carve.zero3_gather = array<i64: 0, 0, -1, -1, 0, -1>, carve.zero3_gather_offsets = array<i64: 0, -1>
// K1-SAME: {carve.param = "h.0.b", {{.*}}carve.zero3_gather = array<i64: 3, 3, -1, -1, 0, -1>, carve.zero3_gather_offsets = array<i64: 256, -1>
// K1-SAME: {carve.param = "h.1.w", {{.*}}carve.zero3_gather = array<i64: 5, 5, 12, 12, 0, 12>, carve.zero3_gather_offsets = array<i64: 320, 704>

// K0-LABEL: func.func @train_step(
// K0-SAME: {carve.param = "h.0.w", {{.*}}carve.zero3_gather = array<i64: 0, 0, -1, -1>, carve.zero3_gather_offsets = array<i64: 0, -1>
// K0-SAME: {carve.param = "h.0.b", {{.*}}carve.zero3_gather = array<i64: 3, 3, -1, -1>, carve.zero3_gather_offsets = array<i64: 0, -1>
// K0-SAME: {carve.param = "h.1.w", {{.*}}carve.zero3_gather = array<i64: 5, 5, 12, 12>, carve.zero3_gather_offsets = array<i64: 0, 0>

// NEG: 'carve.plan' field 'zero3_prefetch_layers' must be an integer >= 0
// NOTZ3: 'carve.plan' field 'zero3_prefetch_layers' needs zero = 3

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w0: tensor<8x8xf32> {carve.param = "h.0.w", carve.trainable},
                   %b0: tensor<8xf32> {carve.param = "h.0.b", carve.trainable},
                   %w1: tensor<8x8xf32> {carve.param = "h.1.w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %m0 = carve.matmul %x, %w0 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/h.0/MatMul")
  %c0 = carve.add %m0, %b0 : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32> loc("/h.0/Add")
  %a0 = carve.exp %c0 : tensor<4x8xf32> loc("/h.0/Exp")
  %r0 = carve.add %x, %a0 : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/h.0/Add_1")
  %w1t = carve.transpose %w1 {perm = array<i64: 1, 0>} : tensor<8x8xf32> -> tensor<8x8xf32> loc("/h.1/Transpose")
  %m1 = carve.matmul %r0, %w1t : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/h.1/MatMul")
  %a1 = carve.exp %m1 : tensor<4x8xf32> loc("/h.1/Exp")
  %r1 = carve.add %r0, %a1 : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/h.1/Add")
  %l = carve.reduce_sum %r1 {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
