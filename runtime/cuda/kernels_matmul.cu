//===- kernels_matmul.cu - matmul through cuBLAS and cuBLASLt -------------===//
//
// gpu.h's matmul, matmul16, matmul16_to16, matmul16_bias and
// matmul16_to16_bgrad: one cuBLAS GEMM
// (the batch folded into M where B is shared, else strided batches) on fp32
// inputs (TF32 tensor cores under the plan field tf32) or on bf16/fp16 ones
// (rounded into scratch, or read as stored), fp32 accumulation; the bias
// and bias-gradient epilogues through cuBLASLt, one plan per shape. Each mirrors the CPU
// kernel of the same name in runtime/src/kernels_linalg.cpp: same shape
// checks and messages.
//
//===----------------------------------------------------------------------===//

#include "kernel_util.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>

namespace carve::gpu {

namespace {

//===--- Matmul ------------------------------------------------------------===//

template <class H> __global__ void roundKernel(const float *x, H *y, int64_t n);

template <>
__global__ void roundKernel<__nv_bfloat16>(const float *x, __nv_bfloat16 *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = __float2bfloat16_rn(x[i]);
}

template <> __global__ void roundKernel<__half>(const float *x, __half *y, int64_t n) {
  CARVE_GRID_LOOP(i, n) y[i] = __float2half_rn(x[i]);
}

/// An operand as cuBLAS reads it: fp32, or rounded to bf16 / fp16 in scratch.
struct Operand {
  const char *p;
  int elemBytes;
};

Operand roundedOperand(const float *x, int64_t n, int slot, Precision p) {
  if (p == Precision::F32)
    return {reinterpret_cast<const char *>(x), 4};
  void *buf = workspace(sizeof(uint16_t) * static_cast<size_t>(n), slot);
  if (p == Precision::BF16)
    CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), roundKernel)
  (x, static_cast<__nv_bfloat16 *>(buf), n);
  else CARVE_KERNEL(blocksFor(n), kThreads, 0, stream(), roundKernel)(x, static_cast<__half *>(buf),
                                                                      n);
  checkLaunch("matmul (input rounding)");
  return {static_cast<const char *>(buf), 2};
}

int gemmInt(int64_t v, const char *what) {
  if (v > INT_MAX)
    fatal("matmul: %s %lld exceeds cuBLAS's int range", what, (long long)v);
  return static_cast<int>(v);
}

/// `count` row-major GEMMs C_i = op(A_i) op(B_i) (+ C_i) with A_i at
/// a + i * strideA elements, and so on. cuBLAS is column-major: a row-major
/// matrix is its transpose, so it computes C^T = op(B)^T op(A)^T.
/// `c16`: C is stored in the precision's 16-bit format (cuBLAS rounds the fp32
/// accumulators to it), otherwise f32.
void gemmBatch(bool ta, bool tb, int64_t m, int64_t n, int64_t k, Operand a, int64_t lda,
               int64_t strideA, Operand b, int64_t ldb, int64_t strideB, float beta, void *c,
               int64_t strideC, int64_t count, Precision p, bool c16 = false) {
  const cudaDataType_t type = p == Precision::BF16  ? CUDA_R_16BF
                              : p == Precision::F16 ? CUDA_R_16F
                                                    : CUDA_R_32F;
  const cudaDataType_t ctype = c16 ? type : CUDA_R_32F;
  const int64_t cBytes = c16 ? 2 : 4;
  const cublasOperation_t opA = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opB = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int im = gemmInt(m, "M"), in = gemmInt(n, "N"), ik = gemmInt(k, "K");
  const int ilda = gemmInt(lda, "the leading dimension of A");
  const int ildb = gemmInt(ldb, "the leading dimension of B");
  const float alpha = 1.0f;
  // Batches beyond the grid's y/z limit of some cuBLAS kernels go in pieces.
  constexpr int64_t kMaxBatch = 65535;
  // Plan field tf32: fp32 inputs through TF32 tensor cores.
  const bool viaTf32 = type == CUDA_R_32F && tf32();
  const cublasComputeType_t compute = viaTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const char *what = type == CUDA_R_16BF  ? "cuBLAS GEMM, bf16 inputs"
                     : type == CUDA_R_16F ? "cuBLAS GEMM, fp16 inputs"
                     : viaTf32            ? "cuBLAS GEMM, fp32 through TF32"
                                          : "cuBLAS GEMM, fp32";
  if (KernelTimer::byShape())
    what = KernelTimer::intern(std::string(what) + ", " + (ta ? "T" : "N") + (tb ? "T" : "N") +
                               " m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
                               std::to_string(k) + " x " + std::to_string(count));
  KernelTimer timer(what, stream());
  for (int64_t i0 = 0; i0 < count; i0 += kMaxBatch) {
    const int64_t nb = std::min(kMaxBatch, count - i0);
    const char *pa = a.p + i0 * strideA * a.elemBytes;
    const char *pb = b.p + i0 * strideB * b.elemBytes;
    char *pc = static_cast<char *>(c) + i0 * strideC * cBytes;
    if (nb == 1) {
      CARVE_CUBLAS_CHECK(cublasGemmEx(cublas(), opB, opA, in, im, ik, &alpha, pb, type, ildb, pa,
                                      type, ilda, &beta, pc, ctype, in, compute,
                                      CUBLAS_GEMM_DEFAULT));
    } else {
      CARVE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          cublas(), opB, opA, in, im, ik, &alpha, pb, type, ildb, strideB, pa, type, ilda, strideA,
          &beta, pc, ctype, in, strideC, static_cast<int>(nb), compute, CUBLAS_GEMM_DEFAULT));
    }
  }
}

} // namespace

//===--- Linear algebra ----------------------------------------------------===//

namespace {

/// matmul's body: a and b are f32 (rounded into scratch under a 16-bit
/// precision) or, with a16 / b16, already in the precision's 16-bit format.
void matmulAny(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
               bool transB, void *y, Dims ys, bool accumulate, bool y16 = false) {
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
  if (ar < 2 || br < 2 || yr != std::max(ar, br))
    fatal("matmul: operands of rank %d and %d with a result of rank %d (both ranks must be "
          ">= 2 and the result's their maximum)",
          ar, br, yr);
  const int64_t m = transA ? as.d[ar - 1] : as.d[ar - 2];
  const int64_t k = transA ? as.d[ar - 2] : as.d[ar - 1];
  const int64_t kb = transB ? bs.d[br - 1] : bs.d[br - 2];
  const int64_t n = transB ? bs.d[br - 2] : bs.d[br - 1];
  if (k != kb || ys.d[yr - 2] != m || ys.d[yr - 1] != n)
    fatal("matmul: [%lld x %lld] @ [%lld x %lld] does not give [%lld x %lld]", (long long)m,
          (long long)k, (long long)kb, (long long)n, (long long)ys.d[yr - 2],
          (long long)ys.d[yr - 1]);
  const Dims batch(ys.d, yr - 2), aBatch(as.d, ar - 2), bBatch(bs.d, br - 2);
  const Dims in[2] = {aBatch, bBatch};
  const Nest<2> nest = broadcastNest<2>("matmul", in, batch);
  const int64_t nb = batch.numel();
  if (m == 0 || n == 0 || nb == 0)
    return;
  if (k == 0) {
    if (y16) // zero is all-zero bits in bf16 and fp16
      CARVE_CUDA_CHECK(cudaMemsetAsync(y, 0, sizeof(uint16_t) * nb * m * n, stream()));
    else if (!accumulate)
      fill(static_cast<float *>(y), nb * m * n, 0.0f);
    return;
  }
  const Precision p = precision();
  if ((a16 || b16 || y16) && p == Precision::F32)
    fatal("matmul16: a 16-bit operand or result under the fp32 precision");
  if (y16 && accumulate)
    fatal("matmul16_to16: a 16-bit result cannot accumulate");
  const int64_t yBytes = y16 ? 2 : 4;
  const Operand oa = a16 ? Operand{static_cast<const char *>(a), 2}
                         : roundedOperand(static_cast<const float *>(a), as.numel(), kWsBasic0, p);
  const Operand ob = b16 ? Operand{static_cast<const char *>(b), 2}
                         : roundedOperand(static_cast<const float *>(b), bs.numel(), kWsBasic1, p);
  const float beta = accumulate ? 1.0f : 0.0f;
  const int64_t lda = as.d[ar - 1], ldb = bs.d[br - 1];
  const int64_t aMat = m * k, bMat = k * n, yMat = m * n;
  // One GEMM when B is shared by every batch matrix and A's batch rows are
  // contiguous: the batch folds into M.
  if (bBatch.numel() == 1 && !transA && aBatch.numel() == nb && nb * m <= INT_MAX) {
    gemmBatch(false, transB, nb * m, n, k, oa, lda, 0, ob, ldb, 0, beta, y, 0, 1, p, y16);
    return;
  }
  if (nest.rank <= 1) {
    // One stride per operand (0 for a shared one): a strided batch.
    const int64_t sa = nest.inner(0) * aMat, sb = nest.inner(1) * bMat;
    gemmBatch(transA, transB, m, n, k, oa, lda, sa, ob, ldb, sb, beta, y, yMat, nb, p, y16);
    return;
  }
  // Batch dimensions that do not merge: a strided batch along the innermost
  // one for each index of the others.
  const int last = nest.rank - 1;
  const int64_t inner = nest.d[last], outer = nb / inner;
  for (int64_t o = 0; o < outer; ++o) {
    int64_t offA = 0, offB = 0, rem = o;
    for (int i = last - 1; i >= 0; --i) {
      const int64_t ii = rem % nest.d[i];
      rem /= nest.d[i];
      offA += ii * nest.st[0][i];
      offB += ii * nest.st[1][i];
    }
    const Operand pa = {oa.p + offA * aMat * oa.elemBytes, oa.elemBytes};
    const Operand pb = {ob.p + offB * bMat * ob.elemBytes, ob.elemBytes};
    gemmBatch(transA, transB, m, n, k, pa, lda, nest.st[0][last] * aMat, pb, ldb,
              nest.st[1][last] * bMat, beta, static_cast<char *>(y) + o * inner * yMat * yBytes,
              yMat, inner, p, y16);
  }
}

} // namespace

void matmul(const float *a, Dims as, bool transA, const float *b, Dims bs, bool transB, float *y,
            Dims ys, bool accumulate) {
  matmulAny(a, false, as, transA, b, false, bs, transB, y, ys, accumulate);
}

void matmul16(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
              bool transB, float *y, Dims ys) {
  matmulAny(a, a16, as, transA, b, b16, bs, transB, y, ys, false);
}

void matmul16_to16(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
                   bool transB, void *y, Dims ys) {
  matmulAny(a, a16, as, transA, b, b16, bs, transB, y, ys, false, true);
}

namespace {

/// One GEMM shape with cuBLASLt's BIAS epilogue: its descriptors and the
/// algorithm its heuristic picked, built on first use and kept (null desc:
/// cuBLASLt offered none, and the call computes the bias itself).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::string refused;
};

/// (M, n, k, transB, type, epilogue): the row-major product [M, k] x op(B)
/// -> [M, n] with cuBLASLt's BIAS or DGELU epilogue.
using LtKey = std::tuple<int64_t, int64_t, int64_t, bool, int, uint32_t>;

/// The algorithm cuBLASLt's heuristic picks for `p`'s descriptors within
/// cuBLAS's workspace; "" on success, else why none (`p`'s descriptors are
/// destroyed and its desc null).
std::string pickLtAlgo(LtPlan &p) {
  cublasLtMatmulPreference_t pref = nullptr;
  size_t wsBytes = 0;
  blasWorkspace(wsBytes);
  const uint64_t maxWs = wsBytes;
  CARVE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CARVE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &maxWs, sizeof maxWs));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublasLt(), p.desc, p.a, p.b, p.d, p.d,
                                                           pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && returned >= 1 && result.state == CUBLAS_STATUS_SUCCESS) {
    p.algo = result.algo;
    return "";
  }
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.d);
  cublasLtMatmulDescDestroy(p.desc);
  p.desc = nullptr;
  return st != CUBLAS_STATUS_SUCCESS ? std::string("no heuristic: ") + cublasGetStatusString(st)
                                     : "no algorithm for this shape";
}

int64_t gBiasEpilogueCalls = 0, gBiasGeluEpilogueCalls = 0, gDgeluEpilogueCalls = 0;

std::map<LtKey, LtPlan> &ltPlans() {
  static std::map<LtKey, LtPlan> plans;
  return plans;
}

/// The plan of `key`, built on first use; null where cuBLASLt refuses it
/// (said once on stderr).
const LtPlan *ltPlanFor(const LtKey &key, cudaDataType_t type) {
  auto it = ltPlans().find(key);
  if (it != ltPlans().end())
    return it->second.desc ? &it->second : nullptr;
  LtPlan &p = ltPlans()[key];
  const auto [M, n, k, tb, t, epilogue] = key;
  (void)t;
  const bool dgelu = epilogue == CUBLASLT_EPILOGUE_DGELU;
  const bool gelu = epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  auto refuse = [&](const std::string &why) -> const LtPlan * {
    p.refused = why;
    p.desc = nullptr;
    std::fprintf(stderr,
                 dgelu  ? "carve: matmul16_dgelu [%lld x %lld] x [%lld x %lld]: cuBLASLt's DGELU "
                          "epilogue refused (%s); GELU's gradient is a kernel of its own\n"
                 : gelu ? "carve: matmul16_bias_gelu [%lld x %lld] x [%lld x %lld]: cuBLASLt's "
                          "GELU_AUX_BIAS epilogue refused (%s); the bias and GELU are a kernel "
                          "of their own\n"
                        : "carve: matmul16_bias [%lld x %lld] x [%lld x %lld]: cuBLASLt's bias "
                          "epilogue refused (%s); the bias is added by a kernel of its own\n",
                 (long long)M, (long long)k, (long long)k, (long long)n, why.c_str());
    return nullptr;
  };
  if (capturing())
    return refuse("its plan would be built while the step is captured");
  cublasStatus_t st = cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS)
    return refuse(std::string("cublasLtMatmulDescCreate: ") + cublasGetStatusString(st));
  // Column-major: D^T [n, M] = op(B)^T [n, k] x A^T [k, M].
  const int32_t opA = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opB = CUBLAS_OP_N;
  const int32_t biasType = type;
  CARVE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof opA));
  CARVE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof opB));
  CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                    &epilogue, sizeof epilogue));
  if (dgelu || gelu) {
    // GELU's input (the auxiliary matrix, read by DGELU, written by
    // GELU_AUX_BIAS) in D's layout: ld n, D's type.
    const int64_t auxLd = n;
    CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                      &auxLd, sizeof auxLd));
  }
  if (!dgelu)
    CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                      &biasType, sizeof biasType));
  const int64_t ldb = tb ? k : n;
  CARVE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, type, tb ? k : n, tb ? n : k, ldb));
  CARVE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, type, k, M, k));
  CARVE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, type, n, M, n));
  const std::string why = pickLtAlgo(p);
  return why.empty() ? &p : refuse(why);
}

/// y16[r, c] = bias16[c] + y[r, c] rounded to the precision's format: the
/// bias where cuBLASLt does not add it (binary16's add, the same bits).
__global__ void biasRoundKernel(const float *y, In16 bias, int64_t rows, int64_t n, Out16 out) {
  CARVE_GRID_LOOP(i, rows * n) store(out, i, bias[i % n] + y[i]);
}

/// pre16 = bias16 + y and y16 = GELU (tanh form) of that f32 sum, each
/// rounded once: cuBLASLt's GELU_AUX_BIAS where it does not run.
__global__ void biasGeluRoundKernel(const float *y, In16 bias, int64_t rows, int64_t n, Out16 pre,
                                    Out16 out) {
  CARVE_GRID_LOOP(i, rows * n) {
    const float v = bias[i % n] + y[i];
    store(pre, i, v);
    store(out, i, carve::rt::ew::unary<Unary::GeluTanh>(v));
  }
}

} // namespace

namespace {

/// matmul16_bias's, matmul16_bias_gelu's and matmul16_dgelu's library
/// path: the product of [rows, k] by op(b) (A not transposed, B shared: the
/// batch folds into one GEMM) through cuBLASLt with `epilogue`, its pointer
/// attribute `ptrAttr` set to `ptr` (the bias, or GELU's input) and, where
/// `aux` is not null, EPILOGUE_AUX_POINTER to it (GELU_AUX_BIAS's
/// pre-activation), rounded into y16. False where it cannot run so (the
/// caller computes it otherwise); `extra`: the caller's own condition (rows
/// a multiple of 8 for an auxiliary matrix); `whatBf16`, `whatF16`: the
/// call's name in the GPU profile.
bool ltEpilogueMatmul(uint32_t epilogue, cublasLtMatmulDescAttributes_t ptrAttr, const void *ptr,
                      void *aux, const char *whatBf16, const char *whatF16, const void *a, bool a16,
                      Dims as, bool transA, const void *b, bool b16, Dims bs, bool transB,
                      uint16_t *y16, Dims ys, bool extra, int64_t &calls) {
  const Precision p = precision();
  const int ar = as.rank, br = bs.rank, yr = ys.rank;
  const int64_t n = ys.d[yr - 1], rows = ys.numel() / std::max<int64_t>(n, 1);
  const int64_t k = transA ? as.d[ar - 2] : as.d[ar - 1];
  const Dims aBatch(as.d, ar - 2), bBatch(bs.d, br - 2);
  const int64_t M = transA ? 0 : aBatch.numel() * as.d[ar - 2];
  const cudaDataType_t type = p == Precision::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  auto aligned = [](const void *q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool oneGemm = extra && !transA && bBatch.numel() == 1 && M == rows && k > 0 &&
                       M <= INT_MAX && n <= INT_MAX && k <= INT_MAX && aligned(ptr) &&
                       aligned(y16) && aligned(aux);
  const LtPlan *plan =
      oneGemm ? ltPlanFor(LtKey{M, n, k, transB, (int)type, epilogue}, type) : nullptr;
  if (!plan)
    return false;
  const Operand oa = a16 ? Operand{static_cast<const char *>(a), 2}
                         : roundedOperand(static_cast<const float *>(a), as.numel(), kWsBasic0, p);
  const Operand ob = b16 ? Operand{static_cast<const char *>(b), 2}
                         : roundedOperand(static_cast<const float *>(b), bs.numel(), kWsBasic1, p);
  if (!aligned(oa.p) || !aligned(ob.p))
    return false;
  CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, ptrAttr, &ptr, sizeof ptr));
  if (aux)
    CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
  const float alpha = 1.0f, beta = 0.0f;
  size_t wsBytes = 0;
  void *ws = blasWorkspace(wsBytes);
  const char *what = type == CUDA_R_16BF ? whatBf16 : whatF16;
  if (KernelTimer::byShape())
    what = KernelTimer::intern(std::string(what) + ", N" + (transB ? "T" : "N") + " m " +
                               std::to_string(M) + " n " + std::to_string(n) + " k " +
                               std::to_string(k) + " x 1");
  KernelTimer timer(what, stream());
  CARVE_CUBLAS_CHECK(cublasLtMatmul(cublasLt(), plan->desc, &alpha, ob.p, plan->a, oa.p, plan->b,
                                    &beta, y16, plan->d, y16, plan->d, &plan->algo, ws, wsBytes,
                                    stream()));
  ++calls;
  return true;
}

/// The operands' ranks as matmul16_bias and matmul16_dgelu take them.
void checkEpilogueRanks(const char *op, Dims as, Dims bs, Dims ys) {
  if (precision() == Precision::F32)
    fatal("%s: 16-bit inputs and results under the fp32 precision", op);
  if (as.rank < 2 || bs.rank < 2 || ys.rank != std::max(as.rank, bs.rank))
    fatal("%s: operands of rank %d and %d with a result of rank %d", op, as.rank, bs.rank, ys.rank);
}

} // namespace

int64_t matmulBiasEpilogueCalls() { return gBiasEpilogueCalls; }

void matmul16_bias(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
                   bool transB, const void *bias16, uint16_t *y16, Dims ys) {
  checkEpilogueRanks("matmul16_bias", as, bs, ys);
  if (ys.numel() == 0)
    return;
  if (ltEpilogueMatmul(CUBLASLT_EPILOGUE_BIAS, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias16, nullptr,
                       "cuBLAS GEMM, bf16 inputs, cuBLASLt bias epilogue",
                       "cuBLAS GEMM, fp16 inputs, cuBLASLt bias epilogue", a, a16, as, transA, b,
                       b16, bs, transB, y16, ys, true, gBiasEpilogueCalls))
    return;
  // The product in f32 scratch, then the bias added and rounded.
  const int64_t n = ys.d[ys.rank - 1], rows = ys.numel() / std::max<int64_t>(n, 1);
  auto *prod = static_cast<float *>(workspace(sizeof(float) * ys.numel(), kWsBasic2));
  matmulAny(a, a16, as, transA, b, b16, bs, transB, prod, ys, false);
  const int fmt = format16For("matmul16_bias");
  CARVE_KERNEL(blocksFor(ys.numel()), kThreads, 0, stream(), biasRoundKernel)
  (prod, in16("matmul16_bias", bias16, true), rows, n, Out16{nullptr, y16, fmt, false});
  checkLaunch("matmul16_bias (bias)");
}

int64_t matmulBiasGeluEpilogueCalls() { return gBiasGeluEpilogueCalls; }

void matmul16_bias_gelu(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16,
                        Dims bs, bool transB, const void *bias16, uint16_t *pre16, uint16_t *y16,
                        Dims ys) {
  checkEpilogueRanks("matmul16_bias_gelu", as, bs, ys);
  if (ys.numel() == 0)
    return;
  const int64_t n = ys.d[ys.rank - 1], rows = ys.numel() / std::max<int64_t>(n, 1);
  // The pre-activation with rows of n, a multiple of 8 (EPILOGUE_AUX_LD).
  if (ltEpilogueMatmul(CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias16,
                       pre16, "cuBLAS GEMM, bf16 inputs, cuBLASLt GELU_AUX_BIAS epilogue",
                       "cuBLAS GEMM, fp16 inputs, cuBLASLt GELU_AUX_BIAS epilogue", a, a16, as,
                       transA, b, b16, bs, transB, y16, ys, n % 8 == 0, gBiasGeluEpilogueCalls))
    return;
  // The product in f32 scratch, then the bias added and GELU applied to the
  // f32 sum, both rounded (what the epilogue computes).
  auto *prod = static_cast<float *>(workspace(sizeof(float) * ys.numel(), kWsBasic2));
  matmulAny(a, a16, as, transA, b, b16, bs, transB, prod, ys, false);
  const int fmt = format16For("matmul16_bias_gelu");
  CARVE_KERNEL(blocksFor(ys.numel()), kThreads, 0, stream(), biasGeluRoundKernel)
  (prod, in16("matmul16_bias_gelu", bias16, true), rows, n, Out16{nullptr, pre16, fmt, false},
   Out16{nullptr, y16, fmt, false});
  checkLaunch("matmul16_bias_gelu (bias, GELU)");
}

int64_t matmulDgeluEpilogueCalls() { return gDgeluEpilogueCalls; }

void matmul16_dgelu(const void *a, bool a16, Dims as, bool transA, const void *b, bool b16, Dims bs,
                    bool transB, const void *x16, uint16_t *y16, Dims ys) {
  checkEpilogueRanks("matmul16_dgelu", as, bs, ys);
  if (ys.numel() == 0)
    return;
  // GELU's input with rows of n, a multiple of 8 (cuBLASLt's EPILOGUE_AUX_LD).
  if (ltEpilogueMatmul(CUBLASLT_EPILOGUE_DGELU, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, x16,
                       nullptr, "cuBLAS GEMM, bf16 inputs, cuBLASLt DGELU epilogue",
                       "cuBLAS GEMM, fp16 inputs, cuBLASLt DGELU epilogue", a, a16, as, transA, b,
                       b16, bs, transB, y16, ys, ys.d[ys.rank - 1] % 8 == 0, gDgeluEpilogueCalls))
    return;
  // The product in f32 scratch, then GELU's gradient written in 16 bits
  // (unary_grad16, as the program without the epilogue computes it).
  auto *prod = static_cast<float *>(workspace(sizeof(float) * ys.numel(), kWsBasic2));
  matmulAny(a, a16, as, transA, b, b16, bs, transB, prod, ys, false);
  unary_grad16(Unary::GeluTanh, x16, true, prod, nullptr, y16, false, ys.numel());
}

namespace {

/// A weight-gradient shape's plan with a bias-gradient epilogue (BGRADA or
/// BGRADB), keyed by (K, R, C, biasOfA, type) of y [R, C] = a^T b.
using LtGradKey = std::tuple<int64_t, int64_t, int64_t, bool, int>;

int64_t gBiasGradEpilogueCalls = 0;

const LtPlan *ltGradPlanFor(const LtGradKey &key, cudaDataType_t type) {
  static std::map<LtGradKey, LtPlan> plans;
  auto it = plans.find(key);
  if (it != plans.end())
    return it->second.desc ? &it->second : nullptr;
  LtPlan &p = plans[key];
  const auto [K, R, C, biasOfA, t] = key;
  (void)t;
  auto refuse = [&](const std::string &why) -> const LtPlan * {
    p.desc = nullptr;
    std::fprintf(stderr,
                 "carve: matmul16_to16_bgrad [%lld x %lld]^T x [%lld x %lld]: cuBLASLt's bias "
                 "gradient epilogue refused (%s); the bias gradient is a reduction of its own\n",
                 (long long)K, (long long)R, (long long)K, (long long)C, why.c_str());
    return nullptr;
  };
  if (capturing())
    return refuse("its plan would be built while the step is captured");
  cublasStatus_t st = cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS)
    return refuse(std::string("cublasLtMatmulDescCreate: ") + cublasGetStatusString(st));
  // Column-major: D [C, R] = y^T = b^T [C, K] x a [K, R]: cuBLAS's A is b
  // (stored [C, K], not transposed), its B is a (stored [R, K], transposed).
  // a's columns are D's columns (BGRADB: over k of B), b's are D's rows
  // (BGRADA: over k of A).
  const int32_t opA = CUBLAS_OP_N, opB = CUBLAS_OP_T;
  const uint32_t epilogue = biasOfA ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_BGRADA;
  const int32_t biasType = type;
  CARVE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof opA));
  CARVE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof opB));
  CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                    &epilogue, sizeof epilogue));
  CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                    &biasType, sizeof biasType));
  CARVE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, type, C, K, C));
  CARVE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, type, R, K, R));
  CARVE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, type, C, R, C));
  const std::string why = pickLtAlgo(p);
  return why.empty() ? &p : refuse(why);
}

} // namespace

int64_t matmulBiasGradEpilogueCalls() { return gBiasGradEpilogueCalls; }

void matmul16_to16_bgrad(const void *a, Dims as, const void *b, Dims bs, bool biasOfA,
                         uint16_t *y16, Dims ys, uint16_t *bgrad16) {
  const char *op = "matmul16_to16_bgrad";
  const Precision p = precision();
  if (p == Precision::F32)
    fatal("%s: 16-bit operands and results under the fp32 precision", op);
  if (as.rank != 2 || bs.rank != 2 || ys.rank != 2 || as.d[0] != bs.d[0] || ys.d[0] != as.d[1] ||
      ys.d[1] != bs.d[1])
    fatal("%s: a [%lld x %lld] and b [%lld x %lld] (rank %d, %d) do not make y [%lld x %lld] = "
          "a^T b",
          op, (long long)as.d[0], (long long)as.d[1], (long long)bs.d[0], (long long)bs.d[1],
          as.rank, bs.rank, (long long)ys.d[0], (long long)ys.d[1]);
  const int64_t K = as.d[0], R = as.d[1], C = bs.d[1];
  if (R == 0 || C == 0)
    return;
  const cudaDataType_t type = p == Precision::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  auto aligned = [](const void *q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool fits = K > 0 && K <= INT_MAX && R <= INT_MAX && C <= INT_MAX && aligned(a) &&
                    aligned(b) && aligned(y16) && aligned(bgrad16);
  const LtPlan *plan = fits ? ltGradPlanFor(LtGradKey{K, R, C, biasOfA, (int)type}, type) : nullptr;
  if (plan) {
    CARVE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &bgrad16, sizeof bgrad16));
    const float alpha = 1.0f, beta = 0.0f;
    size_t wsBytes = 0;
    void *ws = blasWorkspace(wsBytes);
    const char *what = type == CUDA_R_16BF
                           ? "cuBLAS GEMM, bf16 inputs, cuBLASLt bias-gradient epilogue"
                           : "cuBLAS GEMM, fp16 inputs, cuBLASLt bias-gradient epilogue";
    if (KernelTimer::byShape())
      what = KernelTimer::intern(std::string(what) + ", NT m " + std::to_string(C) + " n " +
                                 std::to_string(R) + " k " + std::to_string(K) + " x 1");
    KernelTimer timer(what, stream());
    CARVE_CUBLAS_CHECK(cublasLtMatmul(cublasLt(), plan->desc, &alpha, b, plan->a, a, plan->b, &beta,
                                      y16, plan->d, y16, plan->d, &plan->algo, ws, wsBytes,
                                      stream()));
    ++gBiasGradEpilogueCalls;
    return;
  }
  // The product, then the 16-bit operand's column sums.
  matmul16_to16(a, true, as, true, b, true, bs, false, y16, ys);
  reduce16(Reduce::Sum, biasOfA ? a : b, true, biasOfA ? as : bs, 0x1u, nullptr, bgrad16);
}

} // namespace carve::gpu
