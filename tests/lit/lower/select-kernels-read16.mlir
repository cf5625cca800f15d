// Tests carve-select-kernels' 16-bit reads (CUDA, bf16 plans): a matmul whose
// operand, as read (through a folded transpose), is an f32 view of a bf16
// tensor (a cast from the plan's format) runs as `matmul16`, carve.read16
// marking that operand; so does a weight gradient computed as a transposed
// product; so does an operand that is a reshape of a view (the same memory).
// A view nothing else reads (directly or through reshapes) is no call
// (`none`); one that another
// op reads in f32 stays a conversion (`fromBf16`). For a view of another
// 16-bit format than the plan's, and on the CPU target, nothing changes.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-select-kernels)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=fp16}, carve-select-kernels)' | FileCheck %s --check-prefix=KEEP
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu precision=bf16}, carve-select-kernels)' | FileCheck %s --check-prefix=KEEP

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[WV:.+]] = carve.cast %arg1 {carve.kernel = "none"} : tensor<8x8xbf16> -> tensor<8x8xf32>
// CHECK: %[[WT:.+]] = carve.transpose %[[WV]] {carve.fold = "operand", carve.kernel = "none", perm = array<i64: 1, 0>}
// CHECK: carve.matmul %arg0, %[[WT]] {carve.kernel = "matmul16", carve.read16 = array<i1: false, true>}
// CHECK: %[[XV:.+]] = carve.cast %arg2 {carve.kernel = "fromBf16"} : tensor<32x8xbf16> -> tensor<32x8xf32>
// CHECK: %[[P:.+]] = carve.matmul %[[XV]], %arg3 {carve.kernel = "none"}
// CHECK: carve.transpose %[[P]] {carve.fold = "product", carve.kernel = "matmul16", carve.read16 = array<i1: true, false>, perm = array<i64: 1, 0>}
// CHECK: carve.gelu %[[XV]] {carve.kernel = "unary"}
// CHECK: %[[RV:.+]] = carve.cast %arg4 {carve.kernel = "none"} : tensor<32x8xbf16> -> tensor<32x8xf32>
// CHECK: %[[RR:.+]] = carve.reshape %[[RV]] {carve.kernel = "none"}
// CHECK: carve.matmul %[[RR]], %[[WT]] {carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// CHECK: return

// KEEP-LABEL: func.func @train_step(
// KEEP-NOT: matmul16
// KEEP-NOT: read16
// KEEP: return

func.func @train_step(%x: tensor<32x8xf32> {carve.input = "x"},
                      %w: tensor<8x8xbf16> {carve.param = "w", carve.trainable},
                      %saved: tensor<32x8xbf16> {carve.input = "saved"},
                      %dy: tensor<8x8xf32> {carve.input = "dy"},
                      %saved2: tensor<32x8xbf16> {carve.input = "saved2"})
    -> (tensor<32x8xf32>, tensor<8x32xf32>, tensor<32x8xf32>, tensor<4x8x8xf32>) {
  %wv = carve.cast %w : tensor<8x8xbf16> -> tensor<8x8xf32>
  %wt = carve.transpose %wv {carve.fold = "operand", perm = array<i64: 1, 0>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %y = carve.matmul %x, %wt : (tensor<32x8xf32>, tensor<8x8xf32>) -> tensor<32x8xf32>
  %xv = carve.cast %saved : tensor<32x8xbf16> -> tensor<32x8xf32>
  %p = carve.matmul %xv, %dy : (tensor<32x8xf32>, tensor<8x8xf32>) -> tensor<32x8xf32>
  %pt = carve.transpose %p {carve.fold = "product", perm = array<i64: 1, 0>} : tensor<32x8xf32> -> tensor<8x32xf32>
  %g = carve.gelu %xv : tensor<32x8xf32>
  %rv = carve.cast %saved2 : tensor<32x8xbf16> -> tensor<32x8xf32>
  %rr = carve.reshape %rv : tensor<32x8xf32> -> tensor<4x8x8xf32>
  %y2 = carve.matmul %rr, %wt : (tensor<4x8x8xf32>, tensor<8x8xf32>) -> tensor<4x8x8xf32>
  return %y, %pt, %g, %y2 : tensor<32x8xf32>, tensor<8x32xf32>, tensor<32x8xf32>, tensor<4x8x8xf32>
}
