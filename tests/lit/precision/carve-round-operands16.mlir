// Tests carve-round-operands16 (CUDA target, bf16/fp16 plans): an f32 value
// that two cuBLAS matmuls read (%a, one through a reshape; the input %b, read
// by all six) is rounded once, by a cast to the plan's format before the
// first; a value whose 16-bit copy
// (carve-pack-activations') follows its matmul reader has the copy moved
// before it; a value one matmul reads, and a view of a 16-bit tensor, are
// left alone. The copy of a value its writer rounds (carve.round16, %r)
// moves right after the writer (where carve-select-kernels' rule 3d has it
// do the rounding). carve-select-kernels then runs those matmuls as matmul16 with
// carve.read16 on the operand (round-operands16-backward.mlir: and
// carve-plan-memory keeps the 16-bit tensor alive until its last reader).
// Under fp32 and on the CPU target nothing changes.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-round-operands16)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=fp16}, carve-round-operands16)' | FileCheck %s --check-prefix=F16
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-round-operands16, carve-select-kernels)' | FileCheck %s --check-prefix=SELECT
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu precision=bf16}, carve-round-operands16)' | FileCheck %s --check-prefix=KEEP
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-round-operands16)' | FileCheck %s --check-prefix=KEEP

// CHECK-LABEL: func.func @train_step(
// CHECK: %[[A:.+]] = carve.exp %arg0
// CHECK-NEXT: %[[A16:.+]] = carve.cast %[[A]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT: carve.cast %arg1 : tensor<8x8xf32> -> tensor<8x8xbf16>
// CHECK-NEXT: carve.matmul %[[A]], %arg1
// CHECK-NEXT: carve.reshape %[[A]]
// CHECK-NEXT: carve.matmul
// CHECK-NEXT: %[[C:.+]] = carve.tanh %arg0
// CHECK-NEXT: %[[C16:.+]] = carve.cast %[[C]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT: carve.matmul %[[C]], %arg1
// CHECK-NEXT: %[[D:.+]] = carve.sin %arg0
// CHECK-NEXT: carve.matmul %[[D]], %arg1
// CHECK-NEXT: %[[V:.+]] = carve.cast %arg2 : tensor<4x8xbf16> -> tensor<4x8xf32>
// CHECK-NEXT: carve.matmul %[[V]], %arg1
// CHECK-NEXT: carve.matmul %[[V]], %arg1
// CHECK-NEXT: %[[R:.+]] = carve.cos %arg0 {carve.round16}
// CHECK-NEXT: carve.cast %[[R]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// CHECK-NEXT: carve.sin %[[R]]
// CHECK-NEXT: return

// F16-LABEL: func.func @train_step(
// F16: carve.cast {{.*}} : tensor<4x8xf32> -> tensor<4x8xf16>
// F16-NEXT: carve.cast {{.*}} : tensor<8x8xf32> -> tensor<8x8xf16>
// F16-NOT: carve.cast {{.*}} -> tensor<4x8xf16>
// F16: return

// SELECT-LABEL: func.func @train_step(
// SELECT: %[[A:.+]] = carve.exp %arg0
// SELECT: carve.cast %[[A]] {carve.kernel = "toBf16"}
// SELECT: carve.matmul %[[A]], %arg1 {carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// SELECT: carve.matmul {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// SELECT: carve.matmul %{{.*}}, %arg1 {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// SELECT: carve.sin
// SELECT: carve.matmul %{{.*}}, %arg1 {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: false, true>}
// SELECT: carve.cast %arg2 {{.*}}carve.kernel = "none"
// SELECT: carve.matmul {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}
// SELECT: carve.matmul {{.*}}carve.kernel = "matmul16", carve.read16 = array<i1: true, true>}

// KEEP-LABEL: func.func @train_step(
// KEEP: carve.exp
// KEEP-NEXT: carve.matmul
// KEEP: carve.matmul
// KEEP-NEXT: carve.tanh
// KEEP-NEXT: carve.matmul
// KEEP-NEXT: carve.cast
// KEEP: return

func.func @train_step(%x: tensor<4x8xf32> {carve.input = "x"},
                      %b: tensor<8x8xf32> {carve.input = "b"},
                      %saved: tensor<4x8xbf16> {carve.input = "saved"})
    -> (tensor<4x8xf32>, tensor<2x2x8xf32>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xf32>,
        tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xbf16>) {
  %a = carve.exp %x : tensor<4x8xf32> loc("exp")
  %y1 = carve.matmul %a, %b : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("first")
  %ra = carve.reshape %a : tensor<4x8xf32> -> tensor<2x2x8xf32> loc("reshape")
  %y2 = carve.matmul %ra, %b : (tensor<2x2x8xf32>, tensor<8x8xf32>) -> tensor<2x2x8xf32> loc("second")
  %c = carve.tanh %x : tensor<4x8xf32> loc("tanh")
  %y3 = carve.matmul %c, %b : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("third")
  %c16 = carve.cast %c : tensor<4x8xf32> -> tensor<4x8xbf16> loc("tanh (16-bit copy)")
  %d = carve.sin %x : tensor<4x8xf32> loc("sin")
  %y4 = carve.matmul %d, %b : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("fourth")
  %v = carve.cast %saved : tensor<4x8xbf16> -> tensor<4x8xf32> loc("view")
  %y5 = carve.matmul %v, %b : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("fifth")
  %y6 = carve.matmul %v, %b : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32> loc("sixth")
  %r = carve.cos %x {carve.round16} : tensor<4x8xf32> loc("cos")
  %s = carve.sin %r : tensor<4x8xf32> loc("sin2")
  %r16 = carve.cast %r : tensor<4x8xf32> -> tensor<4x8xbf16> loc("cos (16-bit copy)")
  return %y1, %y2, %y3, %c16, %y4, %y5, %y6, %s, %r16 : tensor<4x8xf32>, tensor<2x2x8xf32>, tensor<4x8xf32>, tensor<4x8xbf16>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xbf16>
}
