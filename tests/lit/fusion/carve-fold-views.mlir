// Tests carve-fold-views (CUDA target): a slice whose every reader, through
// reshapes, is a transpose that can read it as a strided view of the
// slice's source (q, k and v split from the QKV projection, reshaped to
// heads and transposed) is marked carve.fold = "view"; carve-select-kernels
// then makes it no call and runs its transposes as transpose_view. A slice
// also read by an add, a slice whose reshape merges dimensions the slice
// made non-contiguous (no strides describe it), a slice with a step and a
// transpose of it whose last dimension is strided (still a view), and a
// slice read by a folded transpose are handled as the rules say. On the CPU
// target nothing is marked.
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-fold-views)' | FileCheck %s
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda}, carve-fold-views, carve-select-kernels)' | FileCheck %s --check-prefix=SEL
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cpu}, carve-fold-views)' | FileCheck %s --check-prefix=CPU
// RUN: carve-opt %s -pass-pipeline='builtin.module(carve-set-plan{target=cuda precision=bf16}, carve-fold-views, carve-select-kernels)' | FileCheck %s --check-prefix=ATT
//
// Under bf16 on CUDA the attention gradient runs on cuDNN: the transposes of
// its dq, dk and dv to [b, t, h, d] are marked "producer" (cuDNN writes
// them there) and run as no call, where each gradient is read by its
// transpose alone and none is rounded as written; under fp32 (carve's
// kernel), or where one gradient has another reader, or a transpose is
// rounded, nothing is marked. A transpose of dy to [b, h, t, d] read by
// such a gradient alone is marked "consumer" (cuDNN reads it in place).

// CHECK-LABEL: func.func @train_step(
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 8>
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 16>
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 24>
// CHECK: %[[ADDED:.+]] = carve.slice %arg0 {ends = array<i64: 2, 4, 8>, starts = array<i64: 0, 0, 0>
// CHECK-NEXT: carve.add %[[ADDED]]
// CHECK: %[[MERGED:.+]] = carve.slice %arg0 {ends = array<i64: 2, 4, 8>, starts = array<i64: 0, 0, 0>
// CHECK-NEXT: carve.reshape %[[MERGED]] {{.*}} -> tensor<2x32xf32>
// CHECK: carve.slice %arg0 {carve.fold = "view", ends = array<i64: 2, 4, 24>, starts = array<i64: 0, 0, 1>, steps = array<i64: 1, 1, 2>}
// CHECK: %[[OPERAND:.+]] = carve.slice %arg1 {ends = array<i64: 8, 8>
// CHECK-NOT: "producer"
// CHECK: return

// ATT-LABEL: func.func @train_step(
// ATT: %[[DQ:.+]], %[[DK:.+]], %[[DV:.+]] = carve.attention_grad_stats %arg3, %arg4, %arg5, %arg6, %arg7, %arg8 {carve.kernel = "attention_grad_stats_cudnn"
// ATT-NEXT: carve.transpose %[[DQ]] {carve.fold = "producer", carve.kernel = "none", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.transpose %[[DK]] {carve.fold = "producer", carve.kernel = "none", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.transpose %[[DV]] {carve.fold = "producer", carve.kernel = "none", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: %[[EQ:.+]], %[[EK:.+]], %[[EV:.+]] = carve.attention_grad_stats
// ATT-NEXT: carve.transpose %[[EQ]] {carve.kernel = "transpose", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.transpose %[[EK]] {carve.kernel = "transpose", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.transpose %[[EV]] {carve.kernel = "transpose", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.add %[[EK]]
// ATT-NEXT: %[[RQ:.+]], %[[RK:.+]], %[[RV:.+]] = carve.attention_grad_stats
// ATT-NEXT: carve.transpose %[[RQ]] {carve.kernel = "transpose", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.transpose %[[RK]] {carve.kernel = "transpose", carve.round16, perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.transpose %[[RV]] {carve.kernel = "transpose", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: %[[DYT:.+]] = carve.transpose %arg9 {carve.fold = "consumer", carve.kernel = "none", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.attention_grad_stats %arg3, %arg4, %arg5, %arg6, %arg7, %[[DYT]] {carve.kernel = "attention_grad_stats_cudnn"
// ATT: %[[DYK:.+]] = carve.transpose %arg9 {carve.kernel = "transpose", perm = array<i64: 0, 2, 1, 3>}
// ATT-NEXT: carve.attention_grad_stats %arg3, %arg4, %arg5, %arg6, %arg7, %[[DYK]] {carve.kernel = "attention_grad_stats_cudnn"
// ATT: return

// SEL-LABEL: func.func @train_step(
// SEL-COUNT-3: carve.slice %arg0 {carve.fold = "view", carve.kernel = "none"
// SEL-COUNT-3: carve.transpose %{{.+}} {carve.kernel = "transpose_view", perm = array<i64: 0, 2, 1, 3>}
// SEL: carve.slice %arg0 {carve.kernel = "slice"
// SEL: carve.transpose %{{.+}} {carve.kernel = "transpose", perm = array<i64: 1, 0, 2>}
// SEL: carve.slice %arg0 {carve.kernel = "slice"
// SEL: carve.transpose %{{.+}} {carve.kernel = "transpose", perm = array<i64: 1, 0>}
// SEL: carve.slice %arg0 {carve.fold = "view", carve.kernel = "none"
// SEL: carve.transpose %{{.+}} {carve.kernel = "transpose_view", perm = array<i64: 2, 0, 1>}
// SEL: carve.slice %arg1 {carve.kernel = "slice"
// SEL: return

// CPU-LABEL: func.func @train_step(
// CPU-NOT: carve.fold = "{{view|producer}}"
// CPU-NOT: transpose_view
// CPU: return

func.func @train_step(%qkv: tensor<2x4x24xf32> {carve.input = "qkv"},
                      %w: tensor<8x8xf32> {carve.input = "w"},
                      %x: tensor<2x4x8xf32> {carve.input = "x"},
                      %aq: tensor<2x4x8x16xf32> {carve.input = "aq"},
                      %ak: tensor<2x4x8x16xf32> {carve.input = "ak"},
                      %av: tensor<2x4x8x16xf32> {carve.input = "av"},
                      %ao: tensor<2x4x8x16xf32> {carve.input = "ao"},
                      %alse: tensor<2x4x8xf32> {carve.input = "alse"},
                      %ady: tensor<2x4x8x16xf32> {carve.input = "ady"},
                      %adyt: tensor<2x8x4x16xf32> {carve.input = "adyt"})
    -> (tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x4x8xf32>,
        tensor<4x2x8xf32>, tensor<32x2xf32>, tensor<12x2x4xf32>, tensor<2x4x8xf32>,
        tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>,
        tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x4x8x16xf32>,
        tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>,
        tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) {
  // q, k, v: each reshaped to 2 heads of 4 and transposed to [b, h, t, d].
  %q = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %k = carve.slice %qkv {starts = array<i64: 0, 0, 8>, ends = array<i64: 2, 4, 16>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %v = carve.slice %qkv {starts = array<i64: 0, 0, 16>, ends = array<i64: 2, 4, 24>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %qr = carve.reshape %q : tensor<2x4x8xf32> -> tensor<2x4x2x4xf32>
  %kr = carve.reshape %k : tensor<2x4x8xf32> -> tensor<2x4x2x4xf32>
  %vr = carve.reshape %v : tensor<2x4x8xf32> -> tensor<2x4x2x4xf32>
  %qt = carve.transpose %qr {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x2x4xf32> -> tensor<2x2x4x4xf32>
  %kt = carve.transpose %kr {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x2x4xf32> -> tensor<2x2x4x4xf32>
  %vt = carve.transpose %vr {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x2x4xf32> -> tensor<2x2x4x4xf32>
  // Read by an add too: copied.
  %a = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %s = carve.add %a, %x : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %at = carve.transpose %a {perm = array<i64: 1, 0, 2>} : tensor<2x4x8xf32> -> tensor<4x2x8xf32>
  // Tokens and features merged: not a view of the slice's source.
  %m = carve.slice %qkv {starts = array<i64: 0, 0, 0>, ends = array<i64: 2, 4, 8>, steps = array<i64: 1, 1, 1>} : tensor<2x4x24xf32> -> tensor<2x4x8xf32>
  %mr = carve.reshape %m : tensor<2x4x8xf32> -> tensor<2x32xf32>
  %mt = carve.transpose %mr {perm = array<i64: 1, 0>} : tensor<2x32xf32> -> tensor<32x2xf32>
  // Every other feature: a view with no contiguous dimension.
  %e = carve.slice %qkv {starts = array<i64: 0, 0, 1>, ends = array<i64: 2, 4, 24>, steps = array<i64: 1, 1, 2>} : tensor<2x4x24xf32> -> tensor<2x4x12xf32>
  %et = carve.transpose %e {perm = array<i64: 2, 0, 1>} : tensor<2x4x12xf32> -> tensor<12x2x4xf32>
  // Read by a matmul (through a folded transpose): copied.
  %o = carve.slice %w {starts = array<i64: 0, 0>, ends = array<i64: 8, 8>, steps = array<i64: 1, 1>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %ot = carve.transpose %o {carve.fold = "operand", perm = array<i64: 1, 0>} : tensor<8x8xf32> -> tensor<8x8xf32>
  %p = carve.matmul %x, %ot : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32>
  // An attention gradient whose dq, dk, dv are each read by their transpose
  // alone: written there by cuDNN.
  %dq, %dk, %dv = carve.attention_grad_stats %aq, %ak, %av, %ao, %alse, %ady {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %tq = carve.transpose %dq {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %tk = carve.transpose %dk {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %tv = carve.transpose %dv {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  // dk read by an add too: none folded.
  %eq, %ek, %ev = carve.attention_grad_stats %aq, %ak, %av, %ao, %alse, %ady {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %uq = carve.transpose %eq {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %uk = carve.transpose %ek {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %uv = carve.transpose %ev {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %ekk = carve.add %ek, %ak : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> tensor<2x4x8x16xf32>
  // dk's transpose rounded as written: none folded.
  %rq, %rk, %rv = carve.attention_grad_stats %aq, %ak, %av, %ao, %alse, %ady {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %wq = carve.transpose %rq {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %wk = carve.transpose %rk {carve.round16, perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  %wv = carve.transpose %rv {perm = array<i64: 0, 2, 1, 3>} : tensor<2x4x8x16xf32> -> tensor<2x8x4x16xf32>
  // dy transposed from [b, t, h, d] for it alone: read in place by cuDNN.
  %dyt = carve.transpose %adyt {perm = array<i64: 0, 2, 1, 3>} : tensor<2x8x4x16xf32> -> tensor<2x4x8x16xf32>
  %xq, %xk, %xv = carve.attention_grad_stats %aq, %ak, %av, %ao, %alse, %dyt {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %xs = carve.add %xq, %xk : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> tensor<2x4x8x16xf32>
  %xt = carve.add %xs, %xv : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> tensor<2x4x8x16xf32>
  // Its transpose returned too: copied.
  %dyk = carve.transpose %adyt {perm = array<i64: 0, 2, 1, 3>} : tensor<2x8x4x16xf32> -> tensor<2x4x8x16xf32>
  %yq, %yk, %yv = carve.attention_grad_stats %aq, %ak, %av, %ao, %alse, %dyk {causal = true, scale = 0.25 : f32} : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8xf32>, tensor<2x4x8x16xf32>) -> (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>)
  %ys = carve.add %yq, %yk : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> tensor<2x4x8x16xf32>
  %yt = carve.add %ys, %yv : (tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>) -> tensor<2x4x8x16xf32>
  return %qt, %kt, %vt, %s, %at, %mt, %et, %p, %tq, %tk, %tv, %uq, %uk, %uv, %ekk, %wq, %wk, %wv,
         %xt, %yt, %dyk
      : tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x2x4x4xf32>, tensor<2x4x8xf32>,
        tensor<4x2x8xf32>, tensor<32x2xf32>, tensor<12x2x4xf32>, tensor<2x4x8xf32>,
        tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>,
        tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x4x8x16xf32>,
        tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>, tensor<2x8x4x16xf32>,
        tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>, tensor<2x4x8x16xf32>
}
