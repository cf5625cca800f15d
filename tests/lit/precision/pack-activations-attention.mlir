// Tests carve-pack-activations' placement of the 16-bit copies of an
// attention's q, k and v: on the CUDA target under bf16, where the attention
// runs as cuDNN's (carve-save-attention-stats made it attention_stats; no
// mask, head dimension 16), each copy is made just before the call, and
// carve-select-kernels then marks the call to read them (carve.read16); on
// the CPU target, and with --attention carve, the copies follow the call.
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-save-attention-stats --carve-pack-activations | FileCheck %s --check-prefix=CUDA
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda" --carve-round-activations --carve-save-attention-stats --carve-pack-activations --carve-select-kernels | FileCheck %s --check-prefix=SELECT
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16 target=cuda attention=carve" --carve-round-activations --carve-save-attention-stats --carve-pack-activations | FileCheck %s --check-prefix=AFTER
// RUN: carve-opt %s --carve-autodiff --carve-set-plan="precision=bf16" --carve-round-activations --carve-save-attention-stats --carve-pack-activations | FileCheck %s --check-prefix=AFTER

// CUDA-LABEL: func.func @train_step(
// CUDA: %[[Q:.+]] = carve.matmul %arg0, %arg1 {carve.round16}
// CUDA: %[[K:.+]] = carve.matmul %arg0, %arg2 {carve.round16}
// CUDA: %[[V:.+]] = carve.matmul %arg0, %arg3 {carve.round16}
// CUDA-DAG: carve.cast %[[Q]] : tensor<2x8x16xf32> -> tensor<2x8x16xbf16>
// CUDA-DAG: carve.cast %[[K]] : tensor<2x8x16xf32> -> tensor<2x8x16xbf16>
// CUDA-DAG: carve.cast %[[V]] : tensor<2x8x16xf32> -> tensor<2x8x16xbf16>
// CUDA: carve.attention_stats %[[Q]], %[[K]], %[[V]]

// SELECT-LABEL: func.func @train_step(
// SELECT: carve.attention_stats {{.*}}carve.kernel = "attention_stats_cudnn", carve.read16 = array<i1: true, true, true>
// SELECT: carve.attention_grad_stats {{.*}}carve.kernel = "attention_grad_stats_cudnn", carve.read16 = array<i1: true, true, true>

// AFTER-LABEL: func.func @train_step(
// AFTER: %[[Q:.+]] = carve.matmul %arg0, %arg1 {carve.round16}
// AFTER-NOT: carve.cast
// AFTER: carve.attention
// AFTER: carve.cast %[[Q]] : tensor<2x8x16xf32> -> tensor<2x8x16xbf16>

func.func @forward(%x: tensor<2x8x16xf32> {carve.input = "x"},
                   %wq: tensor<16x16xf32> {carve.param = "wq", carve.trainable},
                   %wk: tensor<16x16xf32> {carve.param = "wk", carve.trainable},
                   %wv: tensor<16x16xf32> {carve.param = "wv", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %q = carve.matmul %x, %wq : (tensor<2x8x16xf32>, tensor<16x16xf32>) -> tensor<2x8x16xf32> loc("/q/MatMul")
  %k = carve.matmul %x, %wk : (tensor<2x8x16xf32>, tensor<16x16xf32>) -> tensor<2x8x16xf32> loc("/k/MatMul")
  %v = carve.matmul %x, %wv : (tensor<2x8x16xf32>, tensor<16x16xf32>) -> tensor<2x8x16xf32> loc("/v/MatMul")
  %o = carve.attention %q, %k, %v {causal = true, scale = 0.25 : f32} : (tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32> loc("/attn")
  %l = carve.reduce_sum %o {axes = array<i64: 0, 1, 2>, keep_dims = false} : tensor<2x8x16xf32> -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
