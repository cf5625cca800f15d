// One function per repeated layer: `carve-translate --carve-to-cpp` on four
// residual layers h.0 ... h.3 that compute the same on other weights. Their
// forwards print once, as layer_h_forward, called once per layer with its row
// of the buffer table; the backwards of h.2 and h.1 are twins too, while
// h.3's (which reads the head's gradient unfused) and h.0's (which computes
// no input gradient) print like no other layer's and stay inline. The values
// a layer writes that the step reads outside the functions are declared after
// its call; the parameters only the functions read are not declared in the
// forward (a function of its own: step and evaluate call it, and the step
// declares again the forward's values its backward reads). The same on the
// CUDA target (gpu:: calls inside the function) and under dp = 2, where the
// gradient bucket's all-reduce stays in the step.
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="dp=1" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=R1
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="target=cuda" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=CUDA
// RUN: carve-opt %s --mlir-print-debuginfo --carve-autodiff --carve-set-plan="dp=2" --carve-fuse-elementwise --carve-fold-transposes --carve-data-parallel --carve-plan-memory --carve-optimizer --carve-select-kernels | carve-translate --carve-to-cpp | FileCheck %s --check-prefix=DP

// R1: struct Fused0 {
// R1-LABEL: // ---- Layers: one function each for the layers that compute the same ----
// R1: /// h.*, forward: the same statements for 4 layers (h.0, h.1, h.2, h.3),
// R1-NEXT: /// each called with its row of layer_h_forward_at: where its buffers are in the arena.
// R1-NEXT: const int64_t layer_h_forward_at[4][6] = {
// R1-NEXT: {{{[0-9, ]+}}},  // h.0
// R1-NEXT: {{{[0-9, ]+}}},  // h.1
// R1-NEXT: {{{[0-9, ]+}}},  // h.2
// R1-NEXT: {{{[0-9, ]+}}},  // h.3
// R1-NEXT: };
// R1-LABEL: void layer_h_forward(StepContext &ctx, const int64_t *at) {
// R1-NEXT: char *const A = ctx.arena;
// R1-NEXT: // What it reads from before the layer.
// R1-NEXT: float *[[IN:in[0-9]+]] = (float *)(A + at[1]);
// R1-NEXT: float *w = (float *)(A + at[2]);
// R1-NEXT: float *b = (float *)(A + at[5]);
// R1: // carve.matmul [8, 16], [16, 16] -> [8, 16]   [/h.*/MatMul]
// R1-NEXT: float *MatMul = (float *)(A + at[0]);
// R1-NEXT: matmul([[IN]], {8, 16}, /*transA=*/false, w, {16, 16}, /*transB=*/false, MatMul, {8, 16});
// R1: fused("Fused0 (add, gelu, add)", Fused0{}, in, shapes, out, {8, 16});
// R1-NEXT: }
// R1-NEXT: }
// R1: /// h.*, backward: the same statements for 2 layers (h.2, h.1),
// R1: const int64_t layer_h_backward_at[2][10] = {
// R1-LABEL: void layer_h_backward(StepContext &ctx, const int64_t *at) {
// R1: matmul(d_Gelu, {8, 16}, /*transA=*/false, w, {16, 16}, /*transB=*/true, d_MatMul_2, {8, 16});
// R1-LABEL: void forward(StepContext &ctx) {
// h.3's weight is read by its inline backward; the other layers' parameters
// only by the functions.
// R1-NOT: h_1_w =
// R1: float *h_3_w = (float *)(A + {{[0-9]+}});  // parameter [16, 16]
// R1-NEXT: float *head_w = (float *)(A + {{[0-9]+}});  // parameter [16, 4]
// R1-NEXT: float *loss_seed
// R1-NEXT: // (7 more that only the layers' functions read: in their tables)
// R1: layer_h_forward(ctx, layer_h_forward_at[0]);  // h.0
// R1-NEXT: float *h_0_Add = (float *)(A + {{[0-9]+}});  // written by h.0
// R1-NEXT: layer_h_forward(ctx, layer_h_forward_at[1]);  // h.1
// R1-NEXT: layer_h_forward(ctx, layer_h_forward_at[2]);  // h.2
// R1-NEXT: float *h_2_Add_1 = (float *)(A + {{[0-9]+}});  // written by h.2
// R1-NEXT: layer_h_forward(ctx, layer_h_forward_at[3]);  // h.3
// R1-NEXT: float *h_3_Add_1 = (float *)(A + {{[0-9]+}});  // written by h.3
// R1: matmul(h_3_Add_1, {8, 16}, /*transA=*/false, head_w, {16, 4}, /*transB=*/false, head_MatMul, {8, 4});
// R1-LABEL: void step(StepContext &ctx) {
// R1: forward(ctx);
// The layers' outputs the inline backward reads, declared again in the step.
// R1: // The forward's values read from here on, where it wrote them.
// R1: float *h_3_Add_1 = (float *)(A + {{[0-9]+}});
// R1: // ---- Backward ----
// h.3's backward, inline: no other layer's prints like it.
// R1: unary_grad(Unary::Gelu, h_3_Add, d_head_MatMul_2, d_h_3_Gelu, 128);
// R1: layer_h_backward(ctx, layer_h_backward_at[0]);  // h.2
// R1-NEXT: layer_h_backward(ctx, layer_h_backward_at[1]);  // h.1
// R1: [backward of /h.0/Gelu]
// R1: static const TailRow tail[9] = {
// R1: // h.1.w
// R1: for (const TailRow &r : tail) {
// R1-NEXT: adamwUpdate(
// R1-LABEL: void evaluate(StepContext &ctx) {
// R1-NEXT: char *const A = ctx.arena;
// R1-NEXT: forward(ctx);
// R1-NOT: layer_h_
// R1: extern const Program program0 = {

// CUDA: // ===== program0.cu =====
// CUDA-LABEL: void layer_h_forward(StepContext &ctx, const int64_t *at) {
// CUDA: gpu::matmul([[IN:in[0-9]+]], {8, 16}, /*transA=*/false, w, {16, 16}, /*transB=*/false, MatMul, {8, 16});
// CUDA: gpu::fused("Fused0 (add, gelu, add)", Fused0{}, in, shapes, out, {8, 16});
// CUDA-LABEL: void forward(StepContext &ctx) {
// CUDA: layer_h_forward(ctx, layer_h_forward_at[0]);  // h.0
// CUDA-LABEL: void forwardBackward(StepContext &ctx) {
// CUDA: forward(ctx);
// CUDA: layer_h_backward(ctx, layer_h_backward_at[1]);  // h.1
// CUDA-LABEL: void step(StepContext &ctx) {
// CUDA: gpu::graphStep(ctx, forwardBackward);

// DP: void layer_h_backward(StepContext &ctx, const int64_t *at) {
// DP-NOT: dpComm
// DP: void step(StepContext &ctx) {
// DP: layer_h_backward(ctx, layer_h_backward_at[1]);  // h.1
// DP: CommHandle bucket0 = ctx.dpComm->allReduceAsync(
// DP: ctx.dpComm->wait(bucket0);

func.func @forward(%x: tensor<8x16xf32> {carve.input = "x"},
                   %t: tensor<8xi64> {carve.input = "y"},
                   %w0: tensor<16x16xf32> {carve.param = "h.0.w", carve.trainable},
                   %b0: tensor<16xf32> {carve.param = "h.0.b", carve.trainable},
                   %w1: tensor<16x16xf32> {carve.param = "h.1.w", carve.trainable},
                   %b1: tensor<16xf32> {carve.param = "h.1.b", carve.trainable},
                   %w2: tensor<16x16xf32> {carve.param = "h.2.w", carve.trainable},
                   %b2: tensor<16xf32> {carve.param = "h.2.b", carve.trainable},
                   %w3: tensor<16x16xf32> {carve.param = "h.3.w", carve.trainable},
                   %b3: tensor<16xf32> {carve.param = "h.3.b", carve.trainable},
                   %wh: tensor<16x4xf32> {carve.param = "head.w", carve.trainable})
    -> (tensor<f32> {carve.output = "loss"}) {
  %m0 = carve.matmul %x, %w0 : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32> loc("/h.0/MatMul")
  %a0 = carve.add %m0, %b0 : (tensor<8x16xf32>, tensor<16xf32>) -> tensor<8x16xf32> loc("/h.0/Add")
  %g0 = carve.gelu %a0 : tensor<8x16xf32> loc("/h.0/Gelu")
  %r0 = carve.add %x, %g0 : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32> loc("/h.0/Add_1")
  %m1 = carve.matmul %r0, %w1 : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32> loc("/h.1/MatMul")
  %a1 = carve.add %m1, %b1 : (tensor<8x16xf32>, tensor<16xf32>) -> tensor<8x16xf32> loc("/h.1/Add")
  %g1 = carve.gelu %a1 : tensor<8x16xf32> loc("/h.1/Gelu")
  %r1 = carve.add %r0, %g1 : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32> loc("/h.1/Add_1")
  %m2 = carve.matmul %r1, %w2 : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32> loc("/h.2/MatMul")
  %a2 = carve.add %m2, %b2 : (tensor<8x16xf32>, tensor<16xf32>) -> tensor<8x16xf32> loc("/h.2/Add")
  %g2 = carve.gelu %a2 : tensor<8x16xf32> loc("/h.2/Gelu")
  %r2 = carve.add %r1, %g2 : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32> loc("/h.2/Add_1")
  %m3 = carve.matmul %r2, %w3 : (tensor<8x16xf32>, tensor<16x16xf32>) -> tensor<8x16xf32> loc("/h.3/MatMul")
  %a3 = carve.add %m3, %b3 : (tensor<8x16xf32>, tensor<16xf32>) -> tensor<8x16xf32> loc("/h.3/Add")
  %g3 = carve.gelu %a3 : tensor<8x16xf32> loc("/h.3/Gelu")
  %r3 = carve.add %r2, %g3 : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<8x16xf32> loc("/h.3/Add_1")
  %mh = carve.matmul %r3, %wh : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32> loc("/head/MatMul")
  %l = carve.cross_entropy %mh, %t : (tensor<8x4xf32>, tensor<8xi64>) -> tensor<f32> loc("/loss")
  return %l : tensor<f32>
}
