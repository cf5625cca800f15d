// Tests carve-plan-memory on a two-layer net with a fused pair of adds and
// two parameters whose gradients are one value: activations share memory
// when the earlier one is dead, a reshape and a fused group's interior get
// no buffer, and under ZeRO the gradients and gathered parameters are
// activations too.
//
// 1 rank: the gradients live in the gradient region (no offset here).
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=first-fit" | FileCheck %s --check-prefix=R1
// ZeRO-2: the whole gradients are activations until their bucket is waited
// for, the copied one (shift.b's) in a buffer of its own. The persistent
// tensors are the parameters padded to dp chunks, each rank's gradient
// chunks and one momentum tensor per chunk (SGD with momentum).
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=2 optimizer-state=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=first-fit" | FileCheck %s --check-prefix=Z2
// ZeRO-3: each gathered parameter has a buffer per pass.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=4 zero=3" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=first-fit" | FileCheck %s --check-prefix=Z3
// A stage: a gradient is read until it is accumulated, right after the op
// that finishes it. What forward keeps for backward (fc1's product and its
// exp, read by backward, and the loss) lies in the micro-batch's slot [0,
// 320); the rest is scratch, after it, which the rank's calls share. The
// rank's arena starts with the inputs of both micro-batches.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 micro-batches=2" --carve-split-stages --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=first-fit" | FileCheck %s --check-prefix=STAGE
// A ZeRO-3 stage: each micro-batch's gradients are read by their bucket's
// reduce-scatter until its wait (after the last op, 17), which writes each
// one's chunk into a staging buffer (copies) added to the chunk in the
// gradient region; parameters are chunks gathered per pass.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=3 micro-batches=2" --carve-split-stages --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=first-fit" | FileCheck %s --check-prefix=STZ3
// Two stages: stage 0's sent activation is kept in its slot (the send may
// still read it after forward); stage 1's received activation (read by its
// backward) is kept, and the gradient its backward sends back goes to the
// send part [192, 320), after the slot, before the scratch.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="pp=2 micro-batches=2" --carve-split-stages --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=first-fit" | FileCheck %s --check-prefix=PP2
// The checks above are first fit's offsets (placement=first-fit). By
// default the pass places both ways and keeps the smaller region: ZeRO-2's
// 1088 bytes by first fit are 960 placed largest first; at 1 rank both give
// 512, and first fit's offsets stay.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=2 optimizer-state=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory | FileCheck %s --check-prefix=BEST
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=2 zero=2 optimizer-state=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory="placement=largest-first" | FileCheck %s --check-prefix=BEST
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory | FileCheck %s --check-prefix=R1
// RUN: not carve-opt %s --carve-autodiff --carve-set-plan="dp=1" --carve-data-parallel --carve-plan-memory="placement=best-fit" 2>&1 | FileCheck %s --check-prefix=BADPLACE
// Without carve-data-parallel's records the pass refuses the function.
// RUN: not carve-opt %s --carve-autodiff --carve-plan-memory 2>&1 | FileCheck %s --check-prefix=NODP

// Persistent: parameters from 0 in argument order, the gradient slots in
// the order backward finishes them, AdamW's two tensors per gradient, then
// the input and the loss seed; activations from 3264.
// R1-LABEL: func.func @train_step(
// R1-SAME: {carve.input = "x", carve.persistent_offset = 3072 : i64}
// R1-SAME: {carve.param = "fc1.weight", carve.persistent_offset = 0 : i64, carve.trainable}
// R1-SAME: {carve.param = "fc2.weight", carve.persistent_offset = 256 : i64, carve.trainable}
// R1-SAME: {carve.param = "shift.a", carve.persistent_offset = 512 : i64, carve.trainable}
// R1-SAME: {carve.param = "shift.b", carve.persistent_offset = 640 : i64, carve.trainable}
// R1-SAME: {carve.loss_seed, carve.persistent_offset = 3200 : i64}
// R1-SAME: carve.activation_plan = {bytes = 512 : i64, copies = array<i64: -1, -1, -1, -1>, unplanned = 832 : i64}
// R1-SAME: carve.persistent_plan = {begin = 0 : i64, end = 3264 : i64, grads = array<i64: 768, 896, 1152, 1408>, grads_end = 1536 : i64, masters = array<i64: -1, -1, -1, -1>, params_end = 768 : i64, state_end = 3072 : i64, states = array<i64: 1536, 1664, 1792, 2048, 2304, 2560, 2816, 2944>}
// R1: %[[H:.+]] = carve.matmul %arg0, %arg1 {carve.arena_offset = array<i64: 0>}
// R1: %[[A:.+]] = carve.exp %[[H]] {carve.arena_offset = array<i64: 128>}
// R1: %[[Y:.+]] = carve.matmul %[[A]], %arg2 {carve.arena_offset = array<i64: 256>}
// The fused adds: the interior result has no buffer, the root's is new.
// R1: carve.add %[[Y]], %arg3 {carve.fusion_group = 0 : i64}
// R1: %[[YD:.+]] = carve.add {{.*}}{carve.arena_offset = array<i64: 384>, carve.fusion_group = 0 : i64}
// R1: %[[R:.+]] = carve.reshape %[[YD]]
// The loss takes fc2's output's bytes: fc2's output is dead after the adds.
// R1: carve.reduce_sum %[[R]] {axes = array<i64: 0>, carve.arena_offset = array<i64: 256>
// R1: carve.expand
// R1-NOT: carve.arena_offset
// R1-SAME: -> tensor<32xf32>
// R1: carve.matmul {{.*}}{carve.arena_offset = array<i64: 320>}
// The exp's gradient takes the exp's bytes (its last reader, the weight
// gradient's matmul through a folded transpose, ran before).
// R1: carve.unary_grad %[[H]], {{.*}}{carve.arena_offset = array<i64: 128>, fn = "exp"}
// R1: %[[DW1:.+]] = carve.matmul
// R1-NOT: carve.arena_offset
// R1-SAME: -> tensor<8x8xf32>
// R1: return {{.*}}%[[DW1]]

// Z2-LABEL: func.func @train_step(
// Z2-SAME: {carve.param = "fc1.weight", carve.persistent_offset = 0 : i64, carve.trainable, carve.zero_chunk = 32 : i64}
// Z2-SAME: {carve.param = "fc2.weight", carve.persistent_offset = 256 : i64, carve.trainable, carve.zero_chunk = 32 : i64}
// Z2-SAME: carve.activation_plan = {bytes = 1088 : i64, copies = array<i64: -1, -1, -1, 0>, unplanned = 1600 : i64}
// Z2-SAME: carve.persistent_plan = {begin = 0 : i64, end = 1728 : i64, grads = array<i64: 768, 832, 960, 1088>, grads_end = 1152 : i64, masters = array<i64: -1, -1, -1, -1>, params_end = 768 : i64, state_end = 1536 : i64, states = array<i64: 1152, -1, 1216, -1, 1344, -1, 1472, -1>}
// Z2: carve.expand {{.*}}{carve.arena_offset = array<i64: 320>}
// Z2: carve.matmul {{.*}}{carve.arena_offset = array<i64: 576>} : (tensor<8x4xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
// Z2: carve.matmul {{.*}}{carve.arena_offset = array<i64: 832>} : (tensor<8x4xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>

// Each rank keeps its chunk of each parameter only: 16 elements, 64 bytes.
// Z3-LABEL: func.func @train_step(
// Z3-SAME: {carve.param = "fc1.weight", carve.persistent_offset = 0 : i64, carve.trainable, carve.zero3_gather = array<i64: 0, 0, -1, -1>, carve.zero3_gather_offsets = array<i64: 0, -1>, carve.zero_chunk = 16 : i64}
// Z3-SAME: {carve.param = "fc2.weight", carve.persistent_offset = 64 : i64, carve.trainable, carve.zero3_gather = array<i64: 2, 2, 11, 11>, carve.zero3_gather_offsets = array<i64: 384, 512>, carve.zero_chunk = 16 : i64}
// Z3-SAME: carve.activation_plan = {bytes = 1024 : i64, copies = array<i64: -1, -1, -1, 0>, unplanned = 2624 : i64}
// fc1.weight's gathered buffer is dead after op 0: the exp takes its bytes.
// Z3: carve.matmul %arg0, %arg1 {carve.arena_offset = array<i64: 256>}
// Z3-NEXT: carve.exp {{.*}}{carve.arena_offset = array<i64: 0>}

// STAGE-LABEL: func.func @stage0(
// STAGE-SAME: {carve.input = "x", carve.persistent_offset = 0 : i64}
// STAGE-SAME: {carve.param = "fc1.weight", carve.persistent_offset = 256 : i64, carve.trainable}
// STAGE-SAME: {carve.loss_seed, carve.persistent_offset = 3328 : i64}
// STAGE-SAME: carve.activation_plan = {bytes = 832 : i64, copies = array<i64: -1, -1, -1, -1>, sends = 0 : i64, slot = 320 : i64, unplanned = 1472 : i64}
// STAGE-SAME: carve.persistent_plan = {begin = 256 : i64, end = 3392 : i64
// STAGE: carve.matmul %arg0, %arg1 {carve.arena_offset = array<i64: 0>}
// STAGE-NEXT: carve.exp {{.*}}{carve.arena_offset = array<i64: 128>}
// STAGE-NEXT: carve.matmul {{.*}}{carve.arena_offset = array<i64: 320>}
// STAGE: carve.reduce_sum {{.*}}carve.arena_offset = array<i64: 256>
// STAGE: carve.expand {{.*}}{carve.arena_offset = array<i64: 320>}
// STAGE: carve.matmul {{.*}}{carve.arena_offset = array<i64: 448>} : (tensor<8x4xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
// STAGE-NEXT: return

// STZ3-LABEL: func.func @stage0(
// STZ3-SAME: {carve.param = "fc2.weight", carve.persistent_offset = 384 : i64, carve.trainable, carve.zero3_gather = array<i64: 2, 2, 11, 11>, carve.zero3_gather_offsets = array<i64: 320, 448>, carve.zero_chunk = 32 : i64}
// STZ3-SAME: carve.activation_plan = {bytes = 1472 : i64, copies = array<i64: 704, 768, 1216, 1344>, sends = 0 : i64, slot = 320 : i64, unplanned = 2880 : i64}
// STZ3-SAME: carve.buckets = [{bytes = 768 : i64, first = 0 : i64, last = 3 : i64, ready = 16 : i64, reduce = "reduce_scatter", wait_at = 17 : i64}]
// STZ3-SAME: carve.persistent_plan = {begin = 256 : i64, end = 1856 : i64, grads = array<i64: 640, 704, 768, 896>, grads_end = 1024 : i64, masters = array<i64: -1, -1, -1, -1>, params_end = 640 : i64

// PP2-LABEL: func.func @stage0(
// PP2-SAME: carve.activation_plan = {bytes = 768 : i64, copies = array<i64: -1>, sends = 0 : i64, slot = 256 : i64, unplanned = 768 : i64}
// PP2-LABEL: func.func @stage1(
// PP2-SAME: carve.activation_plan = {bytes = 704 : i64, copies = array<i64: -1, -1, -1>, sends = 128 : i64, slot = 192 : i64, unplanned = 960 : i64}
// PP2: dist.recv {{.*}}carve.arena_offset = array<i64: 0>
// PP2: %[[G:.+]] = carve.matmul {{.*}}{carve.arena_offset = array<i64: 192>}
// PP2-NEXT: dist.send %[[G]]

// BEST: carve.activation_plan = {bytes = 960 : i64, copies = array<i64: -1, -1, -1, 640>, unplanned = 1600 : i64}
// BADPLACE: error: carve-plan-memory: placement 'best-fit' is not best, first-fit or largest-first

// NODP: error: @train_step has no carve.gradients (run carve-data-parallel first)

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %w1: tensor<8x8xf32> {carve.param = "fc1.weight", carve.trainable},
                   %w2: tensor<8x8xf32> {carve.param = "fc2.weight", carve.trainable},
                   %c: tensor<4x8xf32> {carve.param = "shift.a", carve.trainable},
                   %d: tensor<4x8xf32> {carve.param = "shift.b", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %h = carve.matmul %x, %w1 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc1/MatMul")
  %a = carve.exp %h : tensor<4x8xf32> loc("/act/Exp")
  %y = carve.matmul %a, %w2 : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("/fc2/MatMul")
  %yc = carve.add %y, %c : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/shift/Add")
  %yd = carve.add %yc, %d : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32> loc("/shift/Add_1")
  %r = carve.reshape %yd : tensor<4x8xf32> -> tensor<32xf32> loc("/out/Reshape")
  %l = carve.reduce_sum %r {axes = array<i64: 0>, keep_dims = false} : tensor<32xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
