// Tests carve-split-stages on a two-layer model whose embedding is tied to
// its output projection: the stages are cut at the layer boundary, the
// activation travels up and its gradient down over "pp", the tied weight is
// an argument of both stages and each returns its own part of the gradient
// (carve.shared_grad), and each stage records what it holds.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="pp=2 micro-batches=2" --carve-split-stages | FileCheck %s
// Micro-batches without pp: one stage, the whole step, nothing sent.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="micro-batches=4" --carve-split-stages | FileCheck %s --check-prefix=ONE
// An explicit cut where the plan says.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="pp=2 micro-batches=2 cuts=/h.1/*" --carve-split-stages | FileCheck %s --check-prefix=CUT
// More stages than layers, and a cut that names no op, are errors.
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="pp=8 micro-batches=8" --carve-split-stages 2>&1 | FileCheck %s --check-prefix=TOOMANY
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="pp=2 virtual-stages=2 micro-batches=2 schedule=interleaved" --carve-split-stages 2>&1 | FileCheck %s --check-prefix=INTERLEAVED
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="pp=2 micro-batches=2 cuts=/nowhere/*" --carve-split-stages 2>&1 | FileCheck %s --check-prefix=NOCUT

// CHECK: dist.mesh @mesh {axes = ["pp", "dp", "tp"], shape = array<i64: 2, 1, 1>}
// CHECK-NOT: func.func @train_step
// CHECK-LABEL: func.func @stage0(
// CHECK-SAME: {carve.param = "wte.weight", carve.trainable}
// CHECK-SAME: {carve.param = "h.0.w", carve.trainable}
// CHECK-NOT: carve.param = "h.1.w"
// CHECK-SAME: -> (tensor<16x8xf32> {carve.grad_of = "wte.weight", carve.shared_grad}, tensor<8x8xf32> {carve.grad_of = "h.0.w"})
// CHECK-SAME: carve.num_stages = 2 : i64, carve.stage = 0 : i64
// CHECK-SAME: carve.stage_summary = {{{.*}}first = "/wte/Gather"{{.*}}last = "/h.0/Add"{{.*}}layers = 1 : i64
// CHECK: carve.gather
// CHECK: %[[ACT:.+]] = carve.add
// CHECK: dist.send %[[ACT]] {axis = "pp", carve.to_stage = 1 : i64
// CHECK: %[[DACT:.+]] = dist.recv {axis = "pp", carve.from_stage = 1 : i64, carve.phase = "backward"
// CHECK: carve.gather_grad
// CHECK: return

// CHECK-LABEL: func.func @stage1(
// CHECK-SAME: {carve.param = "wte.weight", carve.trainable}
// CHECK-SAME: {carve.param = "h.1.w", carve.trainable}
// CHECK-SAME: {carve.loss_seed}
// CHECK-SAME: -> (tensor<f32> {carve.loss}, tensor<16x8xf32> {carve.grad_of = "wte.weight", carve.shared_grad}, tensor<8x8xf32> {carve.grad_of = "h.1.w"})
// CHECK-SAME: carve.stage = 1 : i64
// CHECK-SAME: first = "/h.1/MatMul"{{.*}}last = "/loss"
// CHECK: %[[IN:.+]] = dist.recv {axis = "pp", carve.from_stage = 0 : i64
// CHECK: carve.matmul %[[IN]]
// CHECK: carve.cross_entropy
// CHECK: dist.send {{.*}}carve.to_stage = 0 : i64

// ONE: dist.mesh @mesh {axes = ["pp", "dp", "tp"], shape = array<i64: 1, 1, 1>}
// ONE-LABEL: func.func @stage0(
// ONE-SAME: -> (tensor<f32> {carve.loss}, tensor<16x8xf32> {carve.grad_of = "wte.weight"}, tensor<8x8xf32> {carve.grad_of = "h.0.w"}, tensor<8x8xf32> {carve.grad_of = "h.1.w"})
// ONE-SAME: carve.num_stages = 1 : i64
// ONE-NOT: dist.send
// ONE-NOT: dist.recv
// ONE-NOT: func.func @stage1

// CUT-LABEL: func.func @stage0(
// CUT-SAME: last = "/h.0/Add"
// CUT-LABEL: func.func @stage1(
// CUT-SAME: first = "/h.1/MatMul"

// TOOMANY: error: plan: pp=8 needs 8 pipeline stages but the model has only 2 layers ('h.0' .. 'h.1')
// INTERLEAVED: error: plan: pp=2 x virtual_stages=2 needs 4 pipeline stages but the model has only 2 layers
// NOCUT: error: plan: cut point '/nowhere/*' names no forward op of the model

func.func @forward(%ids: tensor<2x4xi64> {carve.input = "ids"},
                   %tgt: tensor<2x4xi64> {carve.input = "targets"},
                   %wte: tensor<16x8xf32> {carve.param = "wte.weight", carve.trainable},
                   %w0: tensor<8x8xf32> {carve.param = "h.0.w", carve.trainable},
                   %w1: tensor<8x8xf32> {carve.param = "h.1.w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %e = carve.gather %wte, %ids {axis = 0 : i64} : (tensor<16x8xf32>, tensor<2x4xi64>) -> tensor<2x4x8xf32> loc("/wte/Gather")
  %m0 = carve.matmul %e, %w0 : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32> loc("/h.0/MatMul")
  %a0 = carve.add %e, %m0 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/h.0/Add")
  %m1 = carve.matmul %a0, %w1 : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32> loc("/h.1/MatMul")
  %a1 = carve.add %a0, %m1 : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32> loc("/h.1/Add")
  %wt = carve.transpose %wte {perm = array<i64: 1, 0>} : tensor<16x8xf32> -> tensor<8x16xf32> loc("/lm_head/Transpose")
  %lg = carve.matmul %a1, %wt : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32> loc("/lm_head/MatMul")
  %fl = carve.reshape %lg : tensor<2x4x16xf32> -> tensor<8x16xf32> loc("/Reshape")
  %t = carve.reshape %tgt : tensor<2x4xi64> -> tensor<8xi64> loc("/Reshape_1")
  %loss = carve.cross_entropy %fl, %t {ignore_index = -100 : i64} : (tensor<8x16xf32>, tensor<8xi64>) -> tensor<f32> loc("/loss")
  return %loss : tensor<f32>
}
