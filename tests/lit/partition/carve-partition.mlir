// One small @train_step per layout transition: the partitioner inserts the
// collective that the producer's and the consumer's layouts call for.
// Per-op splits are forced with carve-set-plan's ops=NODE=DIM overrides (a plan's
// "ops" field). Matmul's annotation is "a b+, b+ c -> a c".

// RUN: carve-opt %s --carve-set-plan="tp=2 ops=mm=b" --carve-partition | FileCheck %s --check-prefix=ALLREDUCE
// RUN: carve-opt %s --carve-set-plan="tp=2 ops=mm=b,act=a" --carve-partition | FileCheck %s --check-prefix=SCATTER
// Of the entries matching a node the most specific decides it, in either order:
// "*" matches both ops but decides only act.
// RUN: carve-opt %s --carve-set-plan="tp=2 ops=*=a,mm=b" --carve-partition | FileCheck %s --check-prefix=SCATTER
// RUN: carve-opt %s --carve-set-plan="tp=2 ops=mm=b,*=a" --carve-partition | FileCheck %s --check-prefix=SCATTER
// RUN: carve-opt %s --carve-set-plan="tp=2 ops=mm=a,act=b" --carve-partition | FileCheck %s --check-prefix=ALLTOALL
// RUN: carve-opt %s --carve-set-plan="tp=2" --carve-partition | FileCheck %s --check-prefix=DEFAULT

// Contraction split: the weight is stored split by rows, the replicated input
// is cut locally (no communication) and the partial sums are all-reduced for
// the replicated result.
// ALLREDUCE: dist.mesh @mesh {axes = ["dp", "tp"], shape = array<i64: 1, 2>}
// ALLREDUCE-LABEL: func.func @train_step
// ALLREDUCE-SAME: tensor<3x8xf32> {carve.param = "w", carve.trainable, dist.layout = {dp = #dist.sbp<R>, tp = #dist.sbp<S 0>}}
// ALLREDUCE: %[[X:.*]] = dist.local_split %arg0 {axis = "tp", dim = 1 : i64{{.*}}groups = 1 : i64{{.*}}} : tensor<4x6xf32> -> tensor<4x3xf32>
// ALLREDUCE: %[[P:.*]] = carve.matmul %[[X]], %arg1 {{.*}}dist.choice = "tp: b", dist.layout = [#dist.sbp<P sum>]{{.*}} -> tensor<4x8xf32>
// ALLREDUCE: %[[R:.*]] = dist.all_reduce %[[P]] {axis = "tp", {{.*}}reduction = "sum"} : tensor<4x8xf32> -> tensor<4x8xf32>
// ALLREDUCE: %[[Y:.*]] = carve.relu %[[R]] {{.*}}dist.choice = "tp: replicate"
// ALLREDUCE: return %[[Y]]

// Partial sums consumed split by rows: one reduce-scatter, then the split
// result gathered for the replicated function result.
// SCATTER: %[[P:.*]] = carve.matmul {{.*}}dist.layout = [#dist.sbp<P sum>]
// SCATTER: %[[S:.*]] = dist.reduce_scatter %[[P]] {axis = "tp", dim = 0 : i64, {{.*}}groups = 1 : i64, {{.*}}reduction = "sum"} : tensor<4x8xf32> -> tensor<2x8xf32>
// SCATTER: %[[Y:.*]] = carve.relu %[[S]] {{.*}}dist.choice = "tp: a", dist.layout = [#dist.sbp<S 0>]{{.*}} : tensor<2x8xf32>
// SCATTER: %[[G:.*]] = dist.all_gather %[[Y]] {axis = "tp", dim = 0 : i64, {{.*}}groups = 1 : i64{{.*}}} : tensor<2x8xf32> -> tensor<4x8xf32>
// SCATTER: return %[[G]]
// SCATTER-NOT: dist.all_reduce

// Rows split, then columns: an all-to-all re-splits.
// ALLTOALL: %[[P:.*]] = carve.matmul {{.*}}dist.choice = "tp: a", dist.layout = [#dist.sbp<S 0>]{{.*}} -> tensor<2x8xf32>
// ALLTOALL-NOT: dist.all_gather
// ALLTOALL: %[[T:.*]] = dist.all_to_all %[[P]] {axis = "tp", dist.layout = [#dist.sbp<S 1>], dst_dim = 1 : i64, dst_groups = 1 : i64, {{.*}}src_dim = 0 : i64, src_groups = 1 : i64} : tensor<2x8xf32> -> tensor<4x4xf32>
// ALLTOALL: carve.relu %[[T]] {{.*}}dist.choice = "tp: b"

// Without overrides the default rules split the parameter's output
// dimension (column parallel): no communication until the result.
// DEFAULT: carve.matmul {{.*}}dist.choice = "tp: c"
// DEFAULT: dist.all_gather {{.*}}dim = 1 : i64
func.func @train_step(%x: tensor<4x6xf32> {carve.input = "x"},
                      %w: tensor<6x8xf32> {carve.param = "w", carve.trainable}) -> (tensor<4x8xf32> {carve.output = "y"}) {
  %p = carve.matmul %x, %w : (tensor<4x6xf32>, tensor<6x8xf32>) -> tensor<4x8xf32> loc("mm")
  %y = carve.relu %p : tensor<4x8xf32> loc("act")
  return %y : tensor<4x8xf32>
}
