// Tests carve-select-kernels' rules 3d and 3f (CUDA target, bf16/fp16 plans): a
// 16-bit copy right after the op that writes its input, where that op is
// marked carve.round16, runs as roundCopyBf16 (roundCopyF16): one kernel
// rounds the input in place and writes the copy, and the op is marked
// carve.round16_in_copy (the emitter prints no rounding after it). Copies of
// a fused chain's rounded outputs right after the chain's root are written by
// the chain's kernel (carve.copy_in_fused, no call; rule 3f). A copy
// that is not right after its writer and the copy of a fused chain's
// member (the chain rounds it) stay toBf16; so do
// copies in another format than the plan's (fp16 plan: carve.round16 rounds
// to fp16), and on the CPU target nothing changes.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-select-kernels)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=fp16}, carve-select-kernels)' | FileCheck %s --check-prefix=F16
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu precision=bf16}, carve-select-kernels)' | FileCheck %s --check-prefix=CPU

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[A:.+]] = carve.exp %arg0 {carve.kernel = "unary", carve.round16, carve.round16_in_copy}
// CHECK-NEXT: carve.cast %[[A]] {carve.kernel = "roundCopyBf16"} : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT: %[[B:.+]] = carve.tanh %arg0 {carve.kernel = "unary", carve.round16}
// CHECK-NEXT: carve.sin %[[B]]
// CHECK-NEXT: carve.cast %[[B]] {carve.kernel = "toBf16"}
// CHECK-NEXT: %[[F:.+]] = carve.add {{.*}}carve.fusion_group = 0 : i64, carve.kernel = "fused", carve.round16}
// CHECK-NEXT: carve.cast %[[F]] {carve.kernel = "toBf16"}
// CHECK: %[[H:.+]] = carve.sub {{.*}}carve.fusion_group = 1 : i64, carve.kernel = "fused", carve.round16}
// CHECK-NEXT: %[[K:.+]] = carve.mul %[[H]], {{.*}}carve.fusion_group = 1 : i64, carve.kernel = "fused", carve.round16}
// CHECK-NEXT: carve.cast %[[K]] {carve.copy_in_fused, carve.kernel = "none"}
// CHECK-NEXT: carve.cast %[[H]] {carve.copy_in_fused, carve.kernel = "none"}
// CHECK: return

// F16-LABEL: func.func @train_step(
// F16-NOT: roundCopy
// F16-NOT: round16_in_copy
// F16-NOT: copy_in_fused
// F16: return

// CPU-LABEL: func.func @train_step(
// CPU-NOT: roundCopy
// CPU-NOT: round16_in_copy
// CPU-NOT: copy_in_fused
// CPU: return

func.func @train_step(%x: tensor<4x8xf32> {carve.input = "x"})
    -> (tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>,
        tensor<4x8xbf16>, tensor<4x8xbf16>) {
  %a = carve.exp %x {carve.round16} : tensor<4x8xf32>
  %a16 = carve.cast %a : tensor<4x8xf32> -> tensor<4x8xbf16>
  %b = carve.tanh %x {carve.round16} : tensor<4x8xf32>
  %s = carve.sin %b : tensor<4x8xf32>
  %b16 = carve.cast %b : tensor<4x8xf32> -> tensor<4x8xbf16>
  %f = carve.add %x, %x {carve.fusion_group = 0 : i64, carve.round16} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %f16 = carve.cast %f : tensor<4x8xf32> -> tensor<4x8xbf16>
  %g = carve.mul %f, %x {carve.fusion_group = 0 : i64} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %h = carve.sub %x, %x {carve.fusion_group = 1 : i64, carve.round16} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %k = carve.mul %h, %x {carve.fusion_group = 1 : i64, carve.round16} : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
  %k16 = carve.cast %k : tensor<4x8xf32> -> tensor<4x8xbf16>
  %h16 = carve.cast %h : tensor<4x8xf32> -> tensor<4x8xbf16>
  return %a16, %s, %b16, %f16, %g, %k16, %h16 : tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xbf16>
}
