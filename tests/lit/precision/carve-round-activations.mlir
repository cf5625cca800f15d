// Tests carve-round-activations, and carve-pack-activations after it, on two layers
// (h.0: matmul, bias add, exp, residual add; h.1: transposed weight, matmul,
// exp, residual add) and an attention with an additive mask.
//
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations | FileCheck %s --check-prefix=ROUND
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations --carve-pack-activations | FileCheck %s --check-prefix=PACK
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=fp16" --carve-round-activations --carve-pack-activations | FileCheck %s --check-prefix=F16
// Recomputation clones carry the mark and read the 16-bit copies' f32 casts.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 recompute=full" --carve-round-activations --carve-recompute --carve-pack-activations | FileCheck %s --check-prefix=RECOMP
// Pipeline: a received value that the sender rounded is marked.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 pp=2 micro-batches=2" --carve-round-activations --carve-split-stages --carve-pack-activations | FileCheck %s --check-prefix=STAGES
// fp32: nothing changes.
// RUN: carve-opt %s --carve-autodiff --carve-round-activations --carve-pack-activations | FileCheck %s --check-prefix=FP32

// Marked: the forward values backward reads that depend on the batch: exp's
// input, the residual stream, the matmul whose exp backward reads. Not
// marked: what backward does not read (the first matmul, exp's output), the
// transposed weight (parameters only), the attention mask (operand 3) and
// the reshape (its source is marked: it shares the memory).
// ROUND-LABEL: func.func @train_step(
// ROUND: %[[M0:.+]] = carve.matmul %arg0, %arg2 : (
// ROUND-NEXT: carve.add %[[M0]], %arg3 {carve.round16}
// ROUND-NEXT: carve.exp %{{.+}} : tensor
// ROUND-NEXT: carve.add %arg0, %{{.+}} {carve.round16}
// ROUND-NEXT: carve.transpose %arg4 {perm = array<i64: 1, 0>} : tensor
// ROUND-NEXT: carve.matmul %{{.+}}, %{{.+}} {carve.round16}
// ROUND-NEXT: carve.exp %{{.+}} : tensor
// ROUND-NEXT: carve.add %{{.+}}, %{{.+}} {carve.round16}
// ROUND-NEXT: carve.reshape %{{.+}} : tensor<4x8xf32> -> tensor<1x4x8xf32>
// ROUND-NEXT: carve.mul %arg1, %arg1 : (
// ROUND-NOT: carve.round16
// ROUND: return

// A 16-bit copy after the last forward reader; back to f32 just before the
// first backward reader, which reads that (through a reshape cloned there).
// PACK-LABEL: func.func @train_step(
// PACK: %[[C:.+]] = carve.add %{{.+}}, %arg3 {carve.round16}
// PACK-NEXT: carve.exp %[[C]]
// PACK-NEXT: %[[CH:.+]] = carve.cast %[[C]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// PACK: carve.matmul %{{.+}}, %{{.+}} {carve.round16}
// PACK: %[[R1:.+]] = carve.add %{{.+}}, %{{.+}} {carve.round16}
// PACK: carve.attention
// PACK-NEXT: %[[R1H:.+]] = carve.cast %[[R1]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// PACK: %[[R1B:.+]] = carve.cast %[[R1H]] : tensor<4x8xbf16> -> tensor<4x8xf32>
// PACK-NEXT: %[[Q:.+]] = carve.reshape %[[R1B]] : tensor<4x8xf32> -> tensor<1x4x8xf32>
// PACK-NEXT: carve.attention_grad %[[Q]], %[[Q]], %[[Q]]
// PACK: %[[CB:.+]] = carve.cast %[[CH]] : tensor<4x8xbf16> -> tensor<4x8xf32>
// PACK-NEXT: carve.unary_grad %[[CB]], %{{.+}} {fn = "exp"}
// PACK: return

// F16-LABEL: func.func @train_step(
// F16: carve.cast %{{.+}} : tensor<4x8xf32> -> tensor<4x8xf16>
// F16: carve.cast %{{.+}} : tensor<4x8xf16> -> tensor<4x8xf32>

// Full recomputation keeps each layer's input, in 16 bits; the clones carry
// the mark (they round what they write as the originals did).
// RECOMP-LABEL: func.func @train_step(
// RECOMP: %[[IN:.+]] = carve.add %arg0, %{{.+}} {carve.round16}
// RECOMP: carve.cast %[[IN]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// RECOMP: %[[INB:.+]] = carve.cast %{{.+}} : tensor<4x8xbf16> -> tensor<4x8xf32>
// RECOMP-NEXT: carve.matmul %[[INB]], %{{.+}} {carve.recomputed, carve.round16}

// Stage 0 sends the residual stream it rounded as a bf16 copy; stage 1
// receives 16 bits, casts them to f32 for forward (marked: rounded), and
// backward casts the received buffer itself again (no second copy).
// STAGES-LABEL: func.func @stage0(
// STAGES: %[[S:.+]] = carve.add %arg0, %{{.+}} {carve.round16}
// STAGES-NEXT: %[[SH:.+]] = carve.cast %[[S]] : tensor<4x8xf32> -> tensor<4x8xbf16>
// STAGES-NEXT: dist.send %[[SH]] {{.*}} : tensor<4x8xbf16>
// STAGES-LABEL: func.func @stage1(
// STAGES: %[[R:.+]] = dist.recv {{.*}} : tensor<4x8xbf16>
// STAGES-NEXT: %[[RF:.+]] = carve.cast %[[R]] {carve.round16} : tensor<4x8xbf16> -> tensor<4x8xf32>
// STAGES-NEXT: carve.transpose
// STAGES-NEXT: carve.matmul %[[RF]]
// STAGES-NOT: carve.cast %[[RF]] :
// STAGES: carve.cast %[[R]] : tensor<4x8xbf16> -> tensor<4x8xf32>
// STAGES: dist.send %{{.+}} : tensor<4x8xf32>

// FP32-NOT: carve.round16
// FP32-NOT: bf16

func.func @forward(%x: tensor<4x8xf32> {carve.input = "x"},
                   %mask: tensor<4x4xf32> {carve.input = "mask"},
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
  %q = carve.reshape %r1 : tensor<4x8xf32> -> tensor<1x4x8xf32> loc("/h.1/Reshape")
  %mm = carve.mul %mask, %mask : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32> loc("/h.1/Mul")
  %mk = carve.reshape %mm : tensor<4x4xf32> -> tensor<1x4x4xf32> loc("/h.1/Reshape_1")
  %o = carve.attention %q, %q, %q mask %mk {scale = 0.5 : f32} : (tensor<1x4x8xf32>, tensor<1x4x8xf32>, tensor<1x4x8xf32>, tensor<1x4x4xf32>) -> tensor<1x4x8xf32> loc("/h.1/Attention")
  %l = carve.reduce_sum %o {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<1x4x8xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
