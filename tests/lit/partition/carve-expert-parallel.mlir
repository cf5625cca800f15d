// Tests carve-expert-parallel on one routed mixture-of-experts layer of 4
// experts (each: rows = gather(x, positions from carve.nonzero), then
// matmul by its transposed weight and relu), as the importer writes Mixtral's
// loop over experts, under dp = 2, ep = 2. On each ep rank the pass stacks
// every expert's rows, dispatches them with carve.expert_all_to_all, runs
// the rank's 2 experts on the rows of both ranks, sends the results back by
// the reverse all-to-all and hands each expert's slice of it to the ops that
// read the expert's result. Rank r keeps experts [2r, 2r + 2): their weights
// carry carve.expert, the other two leave the function with their
// transposes. The routing weight's gather by the same positions reads no
// parameter: it is not an expert and stays as it was.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{dp=2 ep=2}, carve-expert-parallel{ep-rank=0})' | FileCheck %s --check-prefixes=CHECK,RANK0
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{dp=2 ep=2}, carve-expert-parallel{ep-rank=1})' | FileCheck %s --check-prefixes=CHECK,RANK1
// Without ep (ep = 1) the pass only records the ep rank: the function is
// unchanged.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{dp=2}, carve-expert-parallel)' | FileCheck %s --check-prefix=NOEP

// RANK0: module attributes {carve.ep_rank = 0 : i64
// RANK1: module attributes {carve.ep_rank = 1 : i64
// CHECK-LABEL: func.func @forward(
// CHECK-SAME: %[[X:[^:]+]]: tensor<4x8xf32> {carve.input = "x"}, %[[M0:[^:]+]]: tensor<4xi1> {carve.input = "m0"}, %[[M1:[^:]+]]: tensor<4xi1> {carve.input = "m1"}, %[[M2:[^:]+]]: tensor<4xi1> {carve.input = "m2"}, %[[M3:[^:]+]]: tensor<4xi1> {carve.input = "m3"}, %[[GATE:[^:]+]]: tensor<4x1xf32> {carve.input = "gate"},
// RANK0-SAME: %[[WA:[^:]+]]: tensor<6x8xf32> {carve.expert, carve.param = "experts.0.w", carve.trainable}, %[[WB:[^:]+]]: tensor<6x8xf32> {carve.expert, carve.param = "experts.1.w", carve.trainable}) ->
// RANK1-SAME: %[[WA:[^:]+]]: tensor<6x8xf32> {carve.expert, carve.param = "experts.2.w", carve.trainable}, %[[WB:[^:]+]]: tensor<6x8xf32> {carve.expert, carve.param = "experts.3.w", carve.trainable}) ->

// Every expert's rows, kept or not, and the kept experts' weights.
// CHECK-DAG: %[[NZ0:.+]] = carve.nonzero %[[M0]]
// CHECK-DAG: %[[POS0:.+]] = carve.reshape %[[NZ0]] : tensor<1x4xi64> -> tensor<4xi64>
// CHECK-DAG: %[[ROWS0:.+]] = carve.gather %[[X]], %[[POS0]] {axis = 0 : i64}
// CHECK-DAG: %[[NZ1:.+]] = carve.nonzero %[[M1]]
// CHECK-DAG: %[[POS1:.+]] = carve.reshape %[[NZ1]] : tensor<1x4xi64> -> tensor<4xi64>
// CHECK-DAG: %[[ROWS1:.+]] = carve.gather %[[X]], %[[POS1]] {axis = 0 : i64}
// CHECK-DAG: %[[NZ2:.+]] = carve.nonzero %[[M2]]
// CHECK-DAG: %[[POS2:.+]] = carve.reshape %[[NZ2]] : tensor<1x4xi64> -> tensor<4xi64>
// CHECK-DAG: %[[ROWS2:.+]] = carve.gather %[[X]], %[[POS2]] {axis = 0 : i64}
// CHECK-DAG: %[[NZ3:.+]] = carve.nonzero %[[M3]]
// CHECK-DAG: %[[POS3:.+]] = carve.reshape %[[NZ3]] : tensor<1x4xi64> -> tensor<4xi64>
// CHECK-DAG: %[[ROWS3:.+]] = carve.gather %[[X]], %[[POS3]] {axis = 0 : i64}
// CHECK-DAG: %[[GATEW:.+]] = carve.gather %[[GATE]], %[[POS0]] {axis = 0 : i64}
// CHECK-DAG: %[[TA:.+]] = carve.transpose %[[WA]]
// CHECK-DAG: %[[TB:.+]] = carve.transpose %[[WB]]

// Dispatch: the rows of all 4 experts as [1, E, N, H], re-split so that
// this rank gets its 2 experts' rows from both ranks, [ep, E/ep, N, H].
// CHECK: %[[SLAB0:.+]] = carve.reshape %[[ROWS0]] : tensor<4x8xf32> -> tensor<1x1x4x8xf32>
// CHECK: %[[SLAB1:.+]] = carve.reshape %[[ROWS1]] : tensor<4x8xf32> -> tensor<1x1x4x8xf32>
// CHECK: %[[SLAB2:.+]] = carve.reshape %[[ROWS2]] : tensor<4x8xf32> -> tensor<1x1x4x8xf32>
// CHECK: %[[SLAB3:.+]] = carve.reshape %[[ROWS3]] : tensor<4x8xf32> -> tensor<1x1x4x8xf32>
// CHECK: %[[STACKED:.+]] = carve.concat %[[SLAB0]], %[[SLAB1]], %[[SLAB2]], %[[SLAB3]] {axis = 1 : i64} : ({{.+}}) -> tensor<1x4x4x8xf32>
// CHECK: %[[MINE:.+]] = carve.expert_all_to_all %[[STACKED]] {dst_dim = 1 : i64, ranks = 2 : i64, src_dim = 0 : i64} : (tensor<1x4x4x8xf32>) -> tensor<2x2x4x8xf32>

// Each kept expert on the rows of both ranks: [ep * N, H].
// CHECK: %[[PARTA:.+]] = carve.slice %[[MINE]] {ends = array<i64: 2, 1, 4, 8>, starts = array<i64: 0, 0, 0, 0>, steps = array<i64: 1, 1, 1, 1>} : tensor<2x2x4x8xf32> -> tensor<2x1x4x8xf32>
// CHECK: %[[INA:.+]] = carve.reshape %[[PARTA]] : tensor<2x1x4x8xf32> -> tensor<8x8xf32>
// CHECK: %[[MMA:.+]] = carve.matmul %[[INA]], %[[TA]] : (tensor<8x8xf32>, tensor<8x6xf32>) -> tensor<8x6xf32>
// CHECK: %[[OUTA:.+]] = carve.relu %[[MMA]] : tensor<8x6xf32>
// CHECK: %[[RESA:.+]] = carve.reshape %[[OUTA]] : tensor<8x6xf32> -> tensor<1x1x8x6xf32>
// CHECK: %[[PARTB:.+]] = carve.slice %[[MINE]] {ends = array<i64: 2, 2, 4, 8>, starts = array<i64: 0, 1, 0, 0>, steps = array<i64: 1, 1, 1, 1>} : tensor<2x2x4x8xf32> -> tensor<2x1x4x8xf32>
// CHECK: %[[INB:.+]] = carve.reshape %[[PARTB]] : tensor<2x1x4x8xf32> -> tensor<8x8xf32>
// CHECK: %[[MMB:.+]] = carve.matmul %[[INB]], %[[TB]] : (tensor<8x8xf32>, tensor<8x6xf32>) -> tensor<8x6xf32>
// CHECK: %[[OUTB:.+]] = carve.relu %[[MMB]] : tensor<8x6xf32>
// CHECK: %[[RESB:.+]] = carve.reshape %[[OUTB]] : tensor<8x6xf32> -> tensor<1x1x8x6xf32>

// Combine: the results as [ep, E/ep, N, H'], sent back to the ranks whose
// rows they are, [1, E, N, H']; expert e's result is slice e.
// CHECK: %[[BYRANKA:.+]] = carve.reshape %[[RESA]] : tensor<1x1x8x6xf32> -> tensor<2x1x4x6xf32>
// CHECK: %[[BYRANKB:.+]] = carve.reshape %[[RESB]] : tensor<1x1x8x6xf32> -> tensor<2x1x4x6xf32>
// CHECK: %[[RESULTS:.+]] = carve.concat %[[BYRANKA]], %[[BYRANKB]] {axis = 1 : i64} : ({{.+}}) -> tensor<2x2x4x6xf32>
// CHECK: %[[BACK:.+]] = carve.expert_all_to_all %[[RESULTS]] {dst_dim = 0 : i64, ranks = 2 : i64, src_dim = 1 : i64} : (tensor<2x2x4x6xf32>) -> tensor<1x4x4x6xf32>
// CHECK: %[[PIECE0:.+]] = carve.slice %[[BACK]] {ends = array<i64: 1, 1, 4, 6>, starts = array<i64: 0, 0, 0, 0>, steps = array<i64: 1, 1, 1, 1>} : tensor<1x4x4x6xf32> -> tensor<1x1x4x6xf32>
// CHECK: %[[OUT0:.+]] = carve.reshape %[[PIECE0]] : tensor<1x1x4x6xf32> -> tensor<4x6xf32>
// CHECK: %[[PIECE1:.+]] = carve.slice %[[BACK]] {ends = array<i64: 1, 2, 4, 6>, starts = array<i64: 0, 1, 0, 0>, steps = array<i64: 1, 1, 1, 1>} : tensor<1x4x4x6xf32> -> tensor<1x1x4x6xf32>
// CHECK: %[[OUT1:.+]] = carve.reshape %[[PIECE1]] : tensor<1x1x4x6xf32> -> tensor<4x6xf32>
// CHECK: %[[PIECE2:.+]] = carve.slice %[[BACK]] {ends = array<i64: 1, 3, 4, 6>, starts = array<i64: 0, 2, 0, 0>, steps = array<i64: 1, 1, 1, 1>} : tensor<1x4x4x6xf32> -> tensor<1x1x4x6xf32>
// CHECK: %[[OUT2:.+]] = carve.reshape %[[PIECE2]] : tensor<1x1x4x6xf32> -> tensor<4x6xf32>
// CHECK: %[[PIECE3:.+]] = carve.slice %[[BACK]] {ends = array<i64: 1, 4, 4, 6>, starts = array<i64: 0, 3, 0, 0>, steps = array<i64: 1, 1, 1, 1>} : tensor<1x4x4x6xf32> -> tensor<1x1x4x6xf32>
// CHECK: %[[OUT3:.+]] = carve.reshape %[[PIECE3]] : tensor<1x1x4x6xf32> -> tensor<4x6xf32>

// What read the experts' results now reads their slices; the original
// experts are gone.
// CHECK-NOT: carve.matmul
// CHECK-NOT: carve.relu
// CHECK: %[[Y0:.+]] = carve.mul %[[OUT0]], %[[GATEW]]
// CHECK: %[[S01:.+]] = carve.add %[[Y0]], %[[OUT1]]
// CHECK: %[[S012:.+]] = carve.add %[[S01]], %[[OUT2]]
// CHECK: %[[Y:.+]] = carve.add %[[S012]], %[[OUT3]]
// CHECK-NOT: carve.
// CHECK: return %[[Y]]

// NOEP: module attributes {carve.ep_rank = 0 : i64
// NOEP-LABEL: func.func @forward(
// NOEP-SAME: {carve.param = "experts.0.w", carve.trainable}
// NOEP-SAME: {carve.param = "experts.1.w", carve.trainable}
// NOEP-SAME: {carve.param = "experts.2.w", carve.trainable}
// NOEP-SAME: {carve.param = "experts.3.w", carve.trainable}
// NOEP-NOT: carve.expert
// NOEP-COUNT-4: carve.matmul %{{.+}} : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32>
// NOEP: return
func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %m0: tensor<4xi1> {carve.input = "m0"},
                   %m1: tensor<4xi1> {carve.input = "m1"},
                   %m2: tensor<4xi1> {carve.input = "m2"},
                   %m3: tensor<4xi1> {carve.input = "m3"},
                   %g: tensor<4x1xf32> {carve.input = "gate"},
                   %w0: tensor<6x8xf32> {carve.param = "experts.0.w", carve.trainable},
                   %w1: tensor<6x8xf32> {carve.param = "experts.1.w", carve.trainable},
                   %w2: tensor<6x8xf32> {carve.param = "experts.2.w", carve.trainable},
                   %w3: tensor<6x8xf32> {carve.param = "experts.3.w", carve.trainable})
    -> (tensor<4x6xf32> {carve.output = "y"}) {
  %p0 = carve.nonzero %m0 : (tensor<4xi1>) -> tensor<1x4xi64> loc("/moe/NonZero")
  %i0 = carve.reshape %p0 : tensor<1x4xi64> -> tensor<4xi64> loc("/moe/Squeeze")
  %r0 = carve.gather %x, %i0 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32> loc("/moe/experts.0/Gather")
  %t0 = carve.transpose %w0 {perm = array<i64: 1, 0>} : tensor<6x8xf32> -> tensor<8x6xf32> loc("/moe/experts.0/Transpose")
  %h0 = carve.matmul %r0, %t0 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32> loc("/moe/experts.0/MatMul")
  %o0 = carve.relu %h0 : tensor<4x6xf32> loc("/moe/experts.0/Relu")
  %gw0 = carve.gather %g, %i0 {axis = 0 : i64} : (tensor<4x1xf32>, tensor<4xi64>) -> tensor<4x1xf32> loc("/moe/Gather_w0")
  %y0 = carve.mul %o0, %gw0 : (tensor<4x6xf32>, tensor<4x1xf32>) -> tensor<4x6xf32> loc("/moe/Mul_0")
  %p1 = carve.nonzero %m1 : (tensor<4xi1>) -> tensor<1x4xi64> loc("/moe/NonZero_1")
  %i1 = carve.reshape %p1 : tensor<1x4xi64> -> tensor<4xi64> loc("/moe/Squeeze_1")
  %r1 = carve.gather %x, %i1 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32> loc("/moe/experts.1/Gather")
  %t1 = carve.transpose %w1 {perm = array<i64: 1, 0>} : tensor<6x8xf32> -> tensor<8x6xf32> loc("/moe/experts.1/Transpose")
  %h1 = carve.matmul %r1, %t1 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32> loc("/moe/experts.1/MatMul")
  %o1 = carve.relu %h1 : tensor<4x6xf32> loc("/moe/experts.1/Relu")
  %p2 = carve.nonzero %m2 : (tensor<4xi1>) -> tensor<1x4xi64> loc("/moe/NonZero_2")
  %i2 = carve.reshape %p2 : tensor<1x4xi64> -> tensor<4xi64> loc("/moe/Squeeze_2")
  %r2 = carve.gather %x, %i2 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32> loc("/moe/experts.2/Gather")
  %t2 = carve.transpose %w2 {perm = array<i64: 1, 0>} : tensor<6x8xf32> -> tensor<8x6xf32> loc("/moe/experts.2/Transpose")
  %h2 = carve.matmul %r2, %t2 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32> loc("/moe/experts.2/MatMul")
  %o2 = carve.relu %h2 : tensor<4x6xf32> loc("/moe/experts.2/Relu")
  %p3 = carve.nonzero %m3 : (tensor<4xi1>) -> tensor<1x4xi64> loc("/moe/NonZero_3")
  %i3 = carve.reshape %p3 : tensor<1x4xi64> -> tensor<4xi64> loc("/moe/Squeeze_3")
  %r3 = carve.gather %x, %i3 {axis = 0 : i64} : (tensor<4x8xf32>, tensor<4xi64>) -> tensor<4x8xf32> loc("/moe/experts.3/Gather")
  %t3 = carve.transpose %w3 {perm = array<i64: 1, 0>} : tensor<6x8xf32> -> tensor<8x6xf32> loc("/moe/experts.3/Transpose")
  %h3 = carve.matmul %r3, %t3 : (tensor<4x8xf32>, tensor<8x6xf32>) -> tensor<4x6xf32> loc("/moe/experts.3/MatMul")
  %o3 = carve.relu %h3 : tensor<4x6xf32> loc("/moe/experts.3/Relu")
  %s01 = carve.add %y0, %o1 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32> loc("/moe/Add_1")
  %s012 = carve.add %s01, %o2 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32> loc("/moe/Add_2")
  %y = carve.add %s012, %o3 : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32> loc("/moe/Add_3")
  return %y : tensor<4x6xf32>
}
