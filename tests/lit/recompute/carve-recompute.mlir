// Tests carve-recompute on two numbered layers (h.0: matmul, bias add, exp,
// residual add, the last three one fused kernel; h.1: transposed weight,
// matmul, exp, residual add). Under full recomputation a layer keeps only
// its inputs: the values only backward reads are computed again just before
// their first backward reader, by clones marked carve.recomputed, and the
// backward ops read the clones. A clone runs the kernel its original ran: a
// fused group is cloned whole under a new group number.
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="recompute=full" --carve-fuse-elementwise --carve-fold-transposes --carve-recompute | FileCheck %s --check-prefix=FULL
// A layer glob: h.1 only.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="recompute=full recompute-layers=h.1" --carve-fuse-elementwise --carve-fold-transposes --carve-recompute | FileCheck %s --check-prefix=GLOB
// Pipeline stages: each stage recomputes its own layer in its backward part.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="pp=2 micro-batches=2 recompute=full" --carve-split-stages --carve-fuse-elementwise --carve-fold-transposes --carve-recompute | FileCheck %s --check-prefix=STAGES
// recompute=none (the default): nothing changes.
// RUN: carve-opt %s --carve-autodiff --carve-recompute | FileCheck %s --check-prefix=NONE
// A glob that names no layer, and layers without full recomputation.
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="recompute=full recompute-layers=x.*" --carve-recompute 2>&1 | FileCheck %s --check-prefix=NOLAYER
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="recompute=selective recompute-layers=h.1" --carve-recompute 2>&1 | FileCheck %s --check-prefix=NOTFULL

// FULL-LABEL: func.func @train_step(
// FULL: %[[M0:.+]] = carve.matmul %arg0, %arg1 :
// FULL: carve.add %[[M0]], %arg2 {carve.fusion_group = 0 : i64}
// FULL: %[[R0:.+]] = carve.add %arg0, %{{.+}} {carve.fusion_group = 0 : i64}
// FULL: %[[T1:.+]] = carve.transpose %arg3
// FULL: carve.matmul %[[R0]], %[[T1]] :
// FULL: %[[SEED:.+]] = carve.expand
// h.1 again: the transpose (folded into the matmul's flag) and the matmul
// whose product exp's gradient reads; the input gradient reads the weight
// itself (carve-fold-transposes removed the transpose of the transpose).
// FULL-NEXT: %[[T1R:.+]] = carve.transpose %arg3 {carve.fold = "operand", carve.recomputed
// FULL-NEXT: %[[M1R:.+]] = carve.matmul %[[R0]], %[[T1R]] {carve.recomputed}
// FULL-NEXT: %[[D1:.+]] = carve.unary_grad %[[M1R]], %[[SEED]] {fn = "exp"}
// FULL-NEXT: carve.matmul %[[D1]], %arg3 :
// h.0 again, before its exp's gradient: the matmul and the fused group whole,
// as group 3 (the backward part has groups 1 and 2).
// FULL: %[[M0R:.+]] = carve.matmul %arg0, %arg1 {carve.recomputed}
// FULL-NEXT: %[[C0R:.+]] = carve.add %[[M0R]], %arg2 {carve.fusion_group = 3 : i64, carve.recomputed}
// FULL-NEXT: carve.exp %[[C0R]] {carve.fusion_group = 3 : i64, carve.recomputed}
// FULL-NEXT: carve.add %arg0, %{{.+}} {carve.fusion_group = 3 : i64, carve.recomputed}
// FULL-NEXT: carve.unary_grad %[[C0R]], %{{.+}} {carve.fusion_group = 2 : i64, fn = "exp"}
// FULL-NOT: carve.recomputed
// FULL: return

// GLOB-LABEL: func.func @train_step(
// GLOB: carve.matmul {{.*}}{carve.recomputed}
// GLOB-NEXT: carve.unary_grad
// GLOB-NOT: carve.recomputed
// GLOB: return

// STAGES-LABEL: func.func @stage0(
// STAGES: %[[M0R:.+]] = carve.matmul %arg0, %arg1 {carve.recomputed}
// STAGES: %[[C0R:.+]] = carve.add %[[M0R]], %arg2 {{{.*}}carve.recomputed}
// STAGES: carve.unary_grad %[[C0R]]
// STAGES-LABEL: func.func @stage1(
// STAGES: %[[T1R:.+]] = carve.transpose %arg1 {carve.fold = "operand", carve.recomputed
// STAGES-NEXT: %[[M1R:.+]] = carve.matmul %{{.+}}, %[[T1R]] {carve.recomputed}
// STAGES-NEXT: carve.unary_grad %[[M1R]]

// NONE-NOT: carve.recomputed

// NOLAYER: error: carve-recompute: recompute_layers 'x.*' names no layer of the model (its layers: h.0 .. h.1)
// NOTFULL: error: 'carve.plan' field 'recompute_layers' needs recompute = "full"

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
