// Tests carve-data-parallel on a two-layer net with a folded weight
// transpose, a fused bias and activation, and two parameters whose gradients
// are one value (the second is copied into its slot after the last op).
//
// 1 rank: the gradients in the order backward finishes them, one bucket that
// reduces nothing, no ZeRO.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel | FileCheck %s --check-prefix=R1
// dp=2 with 256-byte buckets: consecutive gradients up to 256 bytes each
// (each counted in 64-byte arena units), all-reduced.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel=bucket-bytes=256 | FileCheck %s --check-prefix=DP
// ZeRO-2: reduce-scatter, bucket k waited for when bucket k+1 is ready, the
// last after the last op; chunks of ceil(n / dp) elements.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=2" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel=bucket-bytes=256 | FileCheck %s --check-prefix=Z2
// ZeRO-3: each parameter gathered from its first to its last read in
// forward and in backward, reads counted where they run.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=4 zero=3" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel | FileCheck %s --check-prefix=Z3
// Micro-batches: a stage accumulates every gradient, so each is copied.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 micro-batches=2" --carve-split-stages --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel | FileCheck %s --check-prefix=STAGE
// ZeRO-3 in a stage: per micro-batch, reduce-scatter buckets waited for as
// in @train_step (bucket k when k+1 is ready, the last after the last op),
// and gathers per pass.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=3 micro-batches=2" --carve-split-stages --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel=bucket-bytes=256 | FileCheck %s --check-prefix=STZ3
// Errors.
// RUN: not carve-opt %s --carve-autodiff --carve-data-parallel=bucket-bytes=0 2>&1 | FileCheck %s --check-prefix=BUCKET

// The order: fc2.weight's gradient (op 13) before fc1.bias's (op 15, a
// reshape of it: ready with the reduction), fc1.weight's last (op 19, the
// transposed product); shift.a's at op 10, shift.b's the same value: copied.
// R1-LABEL: func.func @train_step(
// R1-NOT: carve.zero
// R1-SAME: carve.buckets = [{bytes = 512 : i64, first = 0 : i64, last = 4 : i64, ready = 22 : i64, reduce = "none"}]
// R1-SAME: carve.gradients = [{copy = false, param = 5 : i64, ready = 10 : i64, result = 4 : i64}, {copy = false, param = 3 : i64, ready = 15 : i64, result = 3 : i64}, {copy = false, param = 2 : i64, ready = 17 : i64, result = 2 : i64}, {copy = false, param = 1 : i64, ready = 21 : i64, result = 1 : i64}, {copy = true, param = 6 : i64, ready = 22 : i64, result = 5 : i64}]
// R1: %[[DY:.+]] = carve.expand
// R1: return {{.*}}, %[[DY]], %[[DY]] :

// DP-LABEL: func.func @train_step(
// DP-SAME: carve.buckets = [{bytes = 256 : i64, first = 0 : i64, last = 2 : i64, ready = 17 : i64, reduce = "all_reduce"}, {bytes = 256 : i64, first = 3 : i64, last = 4 : i64, ready = 22 : i64, reduce = "all_reduce"}]
// DP-NOT: wait_at

// Z2-LABEL: func.func @train_step(
// Z2-SAME: {carve.param = "fc1.weight", carve.trainable, carve.zero_chunk = 24 : i64}
// Z2-SAME: {carve.param = "fc1.bias", carve.trainable, carve.zero_chunk = 3 : i64}
// Z2-SAME: {carve.param = "fc2.weight", carve.trainable, carve.zero_chunk = 9 : i64}
// Z2-SAME: {carve.buffer = "scale"}
// Z2-SAME: carve.buckets = [{bytes = 256 : i64, first = 0 : i64, last = 2 : i64, ready = 17 : i64, reduce = "reduce_scatter", wait_at = 22 : i64}, {bytes = 256 : i64, first = 3 : i64, last = 4 : i64, ready = 22 : i64, reduce = "reduce_scatter", wait_at = 22 : i64}]
// Z2-NOT: carve.zero3_gather

// fc1.weight is read by the matmul its transpose folds into (op 1), and not
// in backward; fc1.bias by the fused add+tanh at its root (op 3); fc2.weight
// by op 4 and, through a folded transpose, op 13; 18 elements in chunks of 5.
// Z3-LABEL: func.func @train_step(
// Z3-SAME: {carve.param = "fc1.weight", carve.trainable, carve.zero3_gather = array<i64: 1, 1, -1, -1>, carve.zero_chunk = 12 : i64}
// Z3-SAME: {carve.param = "fc1.bias", carve.trainable, carve.zero3_gather = array<i64: 3, 3, -1, -1>, carve.zero_chunk = 2 : i64}
// Z3-SAME: {carve.param = "fc2.weight", carve.trainable, carve.zero3_gather = array<i64: 4, 4, 13, 13>, carve.zero_chunk = 5 : i64}
// Z3-SAME: {carve.buffer = "scale"}
// Z3-SAME: {carve.param = "shift.a", carve.trainable, carve.zero3_gather = array<i64: 7, 7, -1, -1>, carve.zero_chunk = 3 : i64}
// Z3: carve.add {{.*}}carve.fusion_group = 0
// Z3-NEXT: carve.tanh {{.*}}carve.fusion_group = 0
// Z3-NEXT: carve.matmul
// Z3: %{{.+}} = carve.transpose %arg3 {carve.fold = "operand"

// STAGE-LABEL: func.func @stage0(
// STAGE-SAME: carve.buckets = [{bytes = 512 : i64, first = 0 : i64, last = 4 : i64, ready = 21 : i64, reduce = "all_reduce"}]
// STAGE-SAME: carve.gradients = [{copy = true, param = 5 : i64, ready = 10 : i64, result = 4 : i64}, {copy = true, param = 6 : i64, ready = 10 : i64, result = 5 : i64}, {copy = true, param = 3 : i64, ready = 15 : i64, result = 3 : i64}, {copy = true, param = 2 : i64, ready = 18 : i64, result = 2 : i64}, {copy = true, param = 1 : i64, ready = 21 : i64, result = 1 : i64}]

// STZ3-LABEL: func.func @stage0(
// STZ3-SAME: {carve.param = "fc2.weight", carve.trainable, carve.zero3_gather = array<i64: 4, 4, 13, 13>, carve.zero_chunk = 9 : i64}
// STZ3-SAME: carve.buckets = [{bytes = 256 : i64, first = 0 : i64, last = 2 : i64, ready = 15 : i64, reduce = "reduce_scatter", wait_at = 21 : i64}, {bytes = 256 : i64, first = 3 : i64, last = 4 : i64, ready = 21 : i64, reduce = "reduce_scatter", wait_at = 22 : i64}]

// BUCKET: error: carve-data-parallel: bucket-bytes must be positive, not 0

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<6x8xf32> {carve.param = "fc1.weight", carve.trainable},
                   %b1: tensor<6xf32> {carve.param = "fc1.bias", carve.trainable},
                   %w2: tensor<6x3xf32> {carve.param = "fc2.weight", carve.trainable},
                   %s: tensor<3xf32> {carve.buffer = "scale"},
                   %c: tensor<4x3xf32> {carve.param = "shift.a", carve.trainable},
                   %d: tensor<4x3xf32> {carve.param = "shift.b", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %wt = carve.transpose %w1 {perm = array<i64: 1, 0>} : tensor<6x8xf32> -> tensor<8x6xf32> loc("/fc1/Transpose")
  %h = carve.matmul %x, %wt : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32> loc("/fc1/MatMul")
  %hb = carve.add %h, %b1 : (tensor<4x6xf32>, tensor<6xf32>) -> tensor<4x6xf32> loc("/fc1/Add")
  %a = carve.tanh %hb : tensor<4x6xf32> loc("/act/Tanh")
  %y = carve.matmul %a, %w2 : (tensor<4x6xf32>, tensor<6x3xf32>) -> tensor<4x3xf32> loc("/fc2/MatMul")
  %z = carve.mul %y, %s : (tensor<4x3xf32>, tensor<3xf32>) -> tensor<4x3xf32> loc("/scale/Mul")
  %zc = carve.add %z, %c : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32> loc("/shift/Add")
  %zd = carve.add %zc, %d : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32> loc("/shift/Add_1")
  %l = carve.reduce_sum %zd {axes = array<i64: 0, 1>, keep_dims = false} : tensor<4x3xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
