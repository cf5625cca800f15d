//===- roofline.cu - the GPU's measured GEMM rate and memory bandwidth ----===//
//
// The physical limits a training step on this GPU is measured against (the
// roofline of docs/performance.md): cuBLAS GEMM throughput in bf16, fp32 and
// TF32, and device memory bandwidth, beside the datasheet peaks when the GPU
// is one we know. Run by hand or by bench/gpt2_cuda.py, not a test:
//
//     build/bin/carve-bench-roofline [-w WARMUP] [-n ITERS] [--json FILE]
//         [--calibration FILE]
//
// --calibration also sweeps bf16 GEMMs of 8192 x 8192 x k for k = 64 ... 8192
// (the smallest side, what the planner's GEMM efficiency table is indexed by)
// and writes the planner's calibration table (docs/planner.md, "Step time"):
// {"gemm_efficiency": [[k, TFLOP/s / bf16 peak], ...], "memory_efficiency":
// the best copy's GB/s / peak}, for `carve plan --calibration FILE`. It needs
// the device's datasheet peaks (a GPU the table below knows).
//
// Laid out like nccl-tests: warm-up calls are separate from the timed ones,
// one row per size, and every row counts the wrong elements of what it timed
// (the GEMMs against a float64 reference computed on the device, the copies
// against the pattern they copied). Exit status: 0 when every row is right,
// 1 when some row has wrong elements or a CUDA call failed, 2 on bad flags,
// 77 when there is no GPU (the "skipped" status of CTest and automake).
//
//===----------------------------------------------------------------------===//

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

//===--- Errors -----------------------------------------------------------===//

[[noreturn]] void die(const std::string &what) {
  std::fprintf(stderr, "roofline: error: %s\n", what.c_str());
  std::exit(1);
}

void check(cudaError_t e, const char *call, int line) {
  if (e != cudaSuccess)
    die(std::string(call) + " (roofline.cu:" + std::to_string(line) + "): " + cudaGetErrorName(e) +
        ": " + cudaGetErrorString(e));
}

void check(cublasStatus_t s, const char *call, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    die(std::string(call) + " (roofline.cu:" + std::to_string(line) +
        "): " + cublasGetStatusName(s) + ": " + cublasGetStatusString(s));
}

#define CHECK(call) check((call), #call, __LINE__)
#define CHECK_LAUNCH(what) check(cudaGetLastError(), what, __LINE__)

//===--- Device helpers ---------------------------------------------------===//

/// A well-mixed 32-bit hash (lowbias32), so that inputs look random to the
/// hardware (data-dependent power draw changes tensor-core clocks) while the
/// reference can recompute them from the index alone.
__host__ __device__ inline uint32_t mix(uint64_t x) {
  uint32_t h = static_cast<uint32_t>(x) ^ static_cast<uint32_t>(x >> 32) * 0x9E3779B9u;
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

/// Uniform in [-1, 1), 24 random bits.
__device__ inline float uniform(uint64_t i, uint32_t seed) {
  return static_cast<float>(mix(i * 0x100000001B3ull + seed) >> 8) * (1.0f / 8388608.0f) - 1.0f;
}

__device__ inline void store(float *p, float v) { *p = v; }
__device__ inline void store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ inline double load(const float *p) { return *p; }
__device__ inline double load(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

/// Grid size for a grid-stride loop over `n` items: enough blocks to fill the
/// device several times, never more than the items need.
unsigned gridFor(int64_t n, int threads, int sms) {
  int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 32LL * sms)));
}

template <typename T> __global__ void fillUniform(T *p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store(p + i, uniform(static_cast<uint64_t>(i), seed));
}

template <typename T> __global__ void fillConstant(T *p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store(p + i, v);
}

/// Adds this block's count to `*total` with one atomic. Every thread of the
/// block calls it; the block is a whole number of warps.
__device__ void addCount(unsigned long long *total, unsigned mine) {
  for (int s = 16; s > 0; s /= 2)
    mine += __shfl_down_sync(0xffffffffu, mine, s);
  __shared__ unsigned warpSums[32];
  int threads = blockDim.x * blockDim.y;
  int tid = threadIdx.y * blockDim.x + threadIdx.x;
  if (tid % 32 == 0)
    warpSums[tid / 32] = mine;
  __syncthreads();
  if (tid == 0) {
    unsigned long long sum = 0;
    for (int w = 0; w < (threads + 31) / 32; ++w)
      sum += warpSums[w];
    if (sum)
      atomicAdd(total, sum);
  }
}

//===--- GEMM reference ---------------------------------------------------===//

constexpr int kTile = 32;
constexpr int kRowsPerThread = kTile / 8;

/// Counts the elements of the column-major C (m x n) = A (m x k) * B (k x n)
/// that differ from a float64 product of the same stored inputs by more than
///   outRound * |exact| + accRound * sum_k |a_ik b_kj|,
/// the rounding of the output plus a bound on the accumulation's (and, for
/// TF32, the input conversion's) error. NaN counts as wrong. Blocks of 32 x 8
/// threads, each block one 32 x 32 tile of C; tiles beyond gridDim.y in n are
/// reached by striding, since gridDim.y is at most 65535.
template <typename T, typename TC>
__global__ void countWrongGemm(const T *a, const T *b, const TC *c, int64_t m, int64_t n, int64_t k,
                               double outRound, double accRound, unsigned long long *wrong) {
  __shared__ double as[kTile][kTile + 1]; // [k][i]
  __shared__ double bs[kTile][kTile + 1]; // [k][j]
  int tx = threadIdx.x, ty = threadIdx.y;
  int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  int64_t tilesN = (n + kTile - 1) / kTile;
  unsigned mine = 0;
  for (int64_t tj = blockIdx.y; tj < tilesN; tj += gridDim.y) {
    int64_t j0 = tj * kTile;
    double acc[kRowsPerThread] = {}, mag[kRowsPerThread] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kTile) {
      for (int r = 0; r < kRowsPerThread; ++r) {
        int kk = ty + 8 * r;
        int64_t i = i0 + tx, kA = k0 + kk;
        as[kk][tx] = (i < m && kA < k) ? load(a + i + kA * m) : 0.0;
        // B's tile is read with threadIdx.x along k, so that loads coalesce.
        int64_t j = j0 + ty + 8 * r, kB = k0 + tx;
        bs[tx][ty + 8 * r] = (j < n && kB < k) ? load(b + kB + j * k) : 0.0;
      }
      __syncthreads();
      for (int kk = 0; kk < kTile; ++kk) {
        double av = as[kk][tx];
        for (int r = 0; r < kRowsPerThread; ++r) {
          double p = av * bs[kk][ty + 8 * r];
          acc[r] += p;
          mag[r] += fabs(p);
        }
      }
      __syncthreads();
    }
    for (int r = 0; r < kRowsPerThread; ++r) {
      int64_t i = i0 + tx, j = j0 + ty + 8 * r;
      if (i >= m || j >= n)
        continue;
      double got = load(c + i + j * m);
      double tol = outRound * fabs(acc[r]) + accRound * mag[r];
      if (!(fabs(got - acc[r]) <= tol))
        ++mine;
    }
  }
  addCount(wrong, mine);
}

//===--- Memory bandwidth -------------------------------------------------===//

/// The 32-bit word at index i of the copied buffer.
__device__ inline uint32_t pattern(int64_t i) { return mix(static_cast<uint64_t>(i) + 12345); }

__global__ void fillPattern(uint32_t *p, int64_t words) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = pattern(i);
}

/// 16-byte loads and stores, grid-stride, four loads in flight per thread
/// before their stores (the memory system needs several megabytes in flight
/// to reach its bandwidth); the bytes beyond the last whole 16 go one at a
/// time (cudaMalloc's alignment covers the vector part).
__global__ void copyVectorized(const uint8_t *__restrict__ src, uint8_t *__restrict__ dst,
                               int64_t bytes) {
  int64_t vecs = bytes / 16;
  const int4 *s = reinterpret_cast<const int4 *>(src);
  int4 *d = reinterpret_cast<int4 *>(dst);
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t i = first;
  for (; i + 3 * stride < vecs; i += 4 * stride) {
    int4 v0 = s[i], v1 = s[i + stride], v2 = s[i + 2 * stride], v3 = s[i + 3 * stride];
    d[i] = v0;
    d[i + stride] = v1;
    d[i + 2 * stride] = v2;
    d[i + 3 * stride] = v3;
  }
  for (; i < vecs; i += stride)
    d[i] = s[i];
  for (int64_t i = vecs * 16 + first; i < bytes; i += stride)
    dst[i] = src[i];
}

__global__ void countWrongPattern(const uint32_t *p, int64_t words, unsigned long long *wrong) {
  unsigned mine = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    mine += p[i] != pattern(i);
  addCount(wrong, mine);
}

//===--- Host side --------------------------------------------------------===//

struct Options {
  int warmup = 10;
  int iters = 50;
  std::string json;
  std::string calibration;
};

/// Datasheet peaks (dense, no sparsity), in TFLOP/s and TB/s; 0 = unknown.
struct Peaks {
  const char *source = nullptr;
  double bf16 = 0, tf32 = 0, fp32 = 0, tbps = 0;
};

bool contains(const std::string &s, const char *what) {
  std::string a = s, b = what;
  for (char &ch : a)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (char &ch : b)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return a.find(b) != std::string::npos;
}

Peaks datasheetPeaks(const std::string &name) {
  // NVIDIA's datasheets, at boost clock; "with sparsity" figures halved.
  if (contains(name, "H200"))
    return {"H200 SXM datasheet", 989, 494, 67, 4.8};
  if (contains(name, "H100") && contains(name, "NVL"))
    return {"H100 NVL datasheet", 835, 418, 60, 3.9};
  if (contains(name, "H100") && contains(name, "PCIe"))
    return {"H100 PCIe datasheet", 756, 378, 51, 2.0};
  if (contains(name, "H100"))
    return {"H100 SXM datasheet", 989, 494, 67, 3.35};
  if (contains(name, "A100") && contains(name, "40GB"))
    return {"A100 40GB datasheet", 312, 156, 19.5, 1.555};
  if (contains(name, "A100") && contains(name, "PCIe"))
    return {"A100 80GB PCIe datasheet", 312, 156, 19.5, 1.935};
  if (contains(name, "A100"))
    return {"A100 80GB SXM datasheet", 312, 156, 19.5, 2.039};
  return {};
}

struct Device {
  int index = 0;
  std::string name;
  int sms = 0;
  int major = 0, minor = 0;
  double memGiB = 0;
  double clockTbps = 0; // 2 x memory clock x bus width, when reported
  Peaks peaks;
};

struct GemmRow {
  std::string type;
  int64_t m = 0, n = 0, k = 0;
  double us = 0, tflops = 0;
  unsigned long long wrong = 0;
  std::string skipped;
};

struct CopyRow {
  std::string method;
  int64_t bytes = 0;
  double us = 0, gbps = 0;
  unsigned long long wrong = 0;
  std::string skipped;
};

/// The three GEMM flavours: storage type and cuBLAS compute type.
struct GemmKind {
  const char *name;
  cudaDataType_t type;
  cublasComputeType_t compute;
  double Peaks::*peak;
};

const GemmKind kKinds[] = {
    {"bf16", CUDA_R_16BF, CUBLAS_COMPUTE_32F, &Peaks::bf16},
    {"tf32", CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32, &Peaks::tf32},
    {"fp32", CUDA_R_32F, CUBLAS_COMPUTE_32F, &Peaks::fp32},
};

struct Shape {
  int64_t m, n, k;
  const char *what;
};

// GPT-2 small at batch 8 x T 1024 = 8192 tokens, width 768: the training
// step's GEMMs (forward; the backward's have the same three sizes permuted).
const Shape kShapes[] = {
    {4096, 4096, 4096, "square"},        {8192, 8192, 8192, "square"},
    {8192, 2304, 768, "GPT-2 qkv"},      {8192, 768, 768, "GPT-2 attn proj"},
    {8192, 3072, 768, "GPT-2 mlp fc"},   {8192, 768, 3072, "GPT-2 mlp proj"},
    {8192, 50304, 768, "GPT-2 lm head"},
};

class Bench {
public:
  Bench(const Options &opts, const Device &dev) : opts(opts), dev(dev) {
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaMalloc(&wrong, sizeof(unsigned long long)));
    CHECK(cublasCreate(&blas));
    CHECK(cublasSetStream(blas, stream));
    // Split-K partial sums stay in fp32 rather than the bf16 output type, so
    // that the error bound below holds; no TF32 unless a row asks for it.
    CHECK(cublasSetMathMode(
        blas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                        CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    // The workspace PyTorch gives cuBLAS on Hopper; without one cuBLAS may
    // pick slower kernels for split-K shapes.
    CHECK(cudaMalloc(&workspace, kWorkspaceBytes));
    CHECK(cublasSetWorkspace(blas, workspace, kWorkspaceBytes));
  }
  ~Bench() {
    cublasDestroy(blas);
    cudaFree(workspace);
    cudaFree(wrong);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }

  GemmRow gemm(const GemmKind &kind, const Shape &s);
  /// Fails unless fp32 GEMMs really run in fp32: 1 + 2^-16 survives fp32 but
  /// rounds to 1 in TF32 and bf16. Returns the wrong elements.
  unsigned long long fp32Probe();
  CopyRow copy(bool kernel, int64_t bytes);

private:
  static constexpr size_t kWorkspaceBytes = 32u << 20;

  void gemmCall(const GemmKind &kind, const Shape &s, const void *a, const void *b, void *c);
  unsigned long long takeCount();
  /// Milliseconds per call of `fn` over opts.iters calls after opts.warmup.
  template <typename F> double time(F fn);
  bool fits(size_t bytes, std::string &why);

  const Options &opts;
  const Device &dev;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  unsigned long long *wrong = nullptr;
  cublasHandle_t blas = nullptr;
  void *workspace = nullptr;
};

template <typename F> double Bench::time(F fn) {
  for (int i = 0; i < opts.warmup; ++i)
    fn();
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < opts.iters; ++i)
    fn();
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  return ms / opts.iters;
}

unsigned long long Bench::takeCount() {
  unsigned long long n = 0;
  CHECK(cudaMemcpyAsync(&n, wrong, sizeof n, cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  return n;
}

bool Bench::fits(size_t bytes, std::string &why) {
  size_t free = 0, total = 0;
  CHECK(cudaMemGetInfo(&free, &total));
  // Headroom for cuBLAS's own allocations and fragmentation.
  if (bytes + (size_t(256) << 20) <= free)
    return true;
  char buf[128];
  std::snprintf(buf, sizeof buf, "needs %.2f GiB, %.2f GiB free", bytes / 1073741824.0,
                free / 1073741824.0);
  why = buf;
  return false;
}

void Bench::gemmCall(const GemmKind &kind, const Shape &s, const void *a, const void *b, void *c) {
  const float alpha = 1.0f, beta = 0.0f;
  CHECK(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(s.m), static_cast<int>(s.n),
                     static_cast<int>(s.k), &alpha, a, kind.type, static_cast<int>(s.m), b,
                     kind.type, static_cast<int>(s.k), &beta, c, kind.type, static_cast<int>(s.m),
                     kind.compute, CUBLAS_GEMM_DEFAULT));
}

GemmRow Bench::gemm(const GemmKind &kind, const Shape &s) {
  GemmRow row;
  row.type = kind.name;
  row.m = s.m;
  row.n = s.n;
  row.k = s.k;
  size_t elem = kind.type == CUDA_R_16BF ? 2 : 4;
  size_t bytes = elem * static_cast<size_t>(s.m * s.k + s.k * s.n + s.m * s.n);
  if (!fits(bytes, row.skipped))
    return row;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  CHECK(cudaMalloc(&a, elem * s.m * s.k));
  CHECK(cudaMalloc(&b, elem * s.k * s.n));
  CHECK(cudaMalloc(&c, elem * s.m * s.n));
  const int threads = 256;
  if (kind.type == CUDA_R_16BF) {
    using T = __nv_bfloat16;
    fillUniform<<<gridFor(s.m * s.k, threads, dev.sms), threads, 0, stream>>>(static_cast<T *>(a),
                                                                              s.m * s.k, 1u);
    fillUniform<<<gridFor(s.k * s.n, threads, dev.sms), threads, 0, stream>>>(static_cast<T *>(b),
                                                                              s.k * s.n, 2u);
    fillConstant<<<gridFor(s.m * s.n, threads, dev.sms), threads, 0, stream>>>(static_cast<T *>(c),
                                                                               s.m * s.n, NAN);
  } else {
    fillUniform<<<gridFor(s.m * s.k, threads, dev.sms), threads, 0, stream>>>(
        static_cast<float *>(a), s.m * s.k, 1u);
    fillUniform<<<gridFor(s.k * s.n, threads, dev.sms), threads, 0, stream>>>(
        static_cast<float *>(b), s.k * s.n, 2u);
    fillConstant<<<gridFor(s.m * s.n, threads, dev.sms), threads, 0, stream>>>(
        static_cast<float *>(c), s.m * s.n, NAN);
  }
  CHECK_LAUNCH("fill");

  double ms = time([&] { gemmCall(kind, s, a, b, c); });
  row.us = ms * 1e3;
  row.tflops = 2.0 * s.m * s.n * s.k / (ms * 1e-3) / 1e12;

  // Error bounds, worst case so that a right result never fails: fp32
  // accumulation is off by at most k units of 2^-23 (tensor cores truncate
  // rather than round) of sum |a b|, doubled for the alignment of products
  // inside a tensor-core block; a bf16 output adds half an ulp (2^-8
  // relative); TF32 rounds each input to 10 mantissa bits, 2^-10 each even
  // when truncated, so 2^-9 on every product.
  double acc = static_cast<double>(s.k) * std::ldexp(1.0, -22);
  double outRound = kind.type == CUDA_R_16BF ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  if (kind.compute == CUBLAS_COMPUTE_32F_FAST_TF32)
    acc += std::ldexp(1.0, -9);
  CHECK(cudaMemsetAsync(wrong, 0, sizeof(unsigned long long), stream));
  dim3 block(kTile, 8);
  dim3 grid(static_cast<unsigned>((s.m + kTile - 1) / kTile),
            static_cast<unsigned>(std::min<int64_t>((s.n + kTile - 1) / kTile, 65535)));
  if (kind.type == CUDA_R_16BF) {
    using T = __nv_bfloat16;
    countWrongGemm<<<grid, block, 0, stream>>>(static_cast<const T *>(a), static_cast<const T *>(b),
                                               static_cast<const T *>(c), s.m, s.n, s.k, outRound,
                                               acc, wrong);
  } else {
    countWrongGemm<<<grid, block, 0, stream>>>(
        static_cast<const float *>(a), static_cast<const float *>(b), static_cast<const float *>(c),
        s.m, s.n, s.k, outRound, acc, wrong);
  }
  CHECK_LAUNCH("countWrongGemm");
  row.wrong = takeCount();
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(c));
  return row;
}

unsigned long long Bench::fp32Probe() {
  const Shape s{256, 256, 256, "probe"};
  const GemmKind &kind = kKinds[2];
  float *a = nullptr, *b = nullptr, *c = nullptr;
  CHECK(cudaMalloc(&a, sizeof(float) * s.m * s.k));
  CHECK(cudaMalloc(&b, sizeof(float) * s.k * s.n));
  CHECK(cudaMalloc(&c, sizeof(float) * s.m * s.n));
  float one = 1.0f + std::ldexp(1.0f, -16);
  fillConstant<<<gridFor(s.m * s.k, 256, dev.sms), 256, 0, stream>>>(a, s.m * s.k, one);
  fillConstant<<<gridFor(s.k * s.n, 256, dev.sms), 256, 0, stream>>>(b, s.k * s.n, 1.0f);
  CHECK_LAUNCH("fill");
  gemmCall(kind, s, a, b, c);
  std::vector<float> host(static_cast<size_t>(s.m * s.n));
  CHECK(
      cudaMemcpyAsync(host.data(), c, sizeof(float) * host.size(), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  // 256 (1 + 2^-16) = 256 + 2^-8 is exact in fp32 (its ulp at 256 is 2^-15).
  const float want = 256.0f + std::ldexp(1.0f, -8);
  unsigned long long bad = 0;
  for (float v : host)
    bad += v != want;
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  CHECK(cudaFree(c));
  return bad;
}

CopyRow Bench::copy(bool kernel, int64_t bytes) {
  CopyRow row;
  row.method = kernel ? "copy kernel (16 B vectors)" : "cudaMemcpy D2D";
  row.bytes = bytes;
  if (!fits(2 * static_cast<size_t>(bytes), row.skipped))
    return row;
  uint8_t *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  int64_t words = bytes / 4;
  fillPattern<<<gridFor(words, 256, dev.sms), 256, 0, stream>>>(reinterpret_cast<uint32_t *>(src),
                                                                words);
  CHECK_LAUNCH("fillPattern");
  CHECK(cudaMemsetAsync(dst, 0xff, bytes, stream));
  // Two resident blocks of 1024 threads per SM cover the memory system's
  // latency with 16-byte accesses; more blocks only stride further.
  const int threads = 1024;
  unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(2LL * dev.sms, (bytes / 16 + threads - 1) / threads)));
  double ms = time([&] {
    if (kernel) {
      copyVectorized<<<blocks, threads, 0, stream>>>(src, dst, bytes);
      CHECK_LAUNCH("copyVectorized");
    } else {
      CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    }
  });
  row.us = ms * 1e3;
  // Every byte is read once and written once.
  row.gbps = 2.0 * bytes / (ms * 1e-3) / 1e9;
  CHECK(cudaMemsetAsync(wrong, 0, sizeof(unsigned long long), stream));
  countWrongPattern<<<gridFor(words, 256, dev.sms), 256, 0, stream>>>(
      reinterpret_cast<const uint32_t *>(dst), words, wrong);
  CHECK_LAUNCH("countWrongPattern");
  row.wrong = takeCount();
  CHECK(cudaFree(src));
  CHECK(cudaFree(dst));
  return row;
}

//===--- Output -----------------------------------------------------------===//

std::string jsonString(const std::string &s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\')
      out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20)
      continue;
    out += ch;
  }
  return out + "\"";
}

std::string percent(double value, double peak) {
  if (peak <= 0 || value <= 0)
    return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100 * value / peak);
  return buf;
}

void writeJson(const std::string &path, const Device &dev, const Options &opts,
               const std::vector<GemmRow> &gemms, unsigned long long probeWrong,
               const std::vector<CopyRow> &copies) {
  FILE *f = std::fopen(path.c_str(), "w");
  if (!f)
    die("--json " + path + ": " + std::strerror(errno));
  std::fprintf(f, "{\n  \"device\": %s,\n  \"sm\": \"%d.%d\",\n  \"sms\": %d,\n",
               jsonString(dev.name).c_str(), dev.major, dev.minor, dev.sms);
  std::fprintf(f, "  \"memory_gib\": %.2f,\n  \"warmup\": %d,\n  \"iters\": %d,\n", dev.memGiB,
               opts.warmup, opts.iters);
  std::fprintf(f,
               "  \"peaks\": {\"source\": %s, \"bf16_tflops\": %g, \"tf32_tflops\": %g, "
               "\"fp32_tflops\": %g, \"memory_tbps\": %g, \"memory_tbps_from_clock\": %.3f},\n",
               jsonString(dev.peaks.source ? dev.peaks.source : "unknown").c_str(), dev.peaks.bf16,
               dev.peaks.tf32, dev.peaks.fp32, dev.peaks.tbps, dev.clockTbps);
  std::fprintf(f, "  \"gemm\": [");
  for (size_t i = 0; i < gemms.size(); ++i) {
    const GemmRow &r = gemms[i];
    std::fprintf(f,
                 "%s\n    {\"type\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, "
                 "\"time_us\": %.3f, \"tflops\": %.3f, \"wrong\": %llu, \"skipped\": %s}",
                 i ? "," : "", r.type.c_str(), static_cast<long long>(r.m),
                 static_cast<long long>(r.n), static_cast<long long>(r.k), r.us, r.tflops, r.wrong,
                 r.skipped.empty() ? "null" : jsonString(r.skipped).c_str());
  }
  std::fprintf(f, "\n  ],\n  \"fp32_probe_wrong\": %llu,\n  \"bandwidth\": [", probeWrong);
  for (size_t i = 0; i < copies.size(); ++i) {
    const CopyRow &r = copies[i];
    std::fprintf(f,
                 "%s\n    {\"method\": %s, \"bytes\": %lld, \"time_us\": %.3f, "
                 "\"gb_per_s\": %.3f, \"wrong\": %llu, \"skipped\": %s}",
                 i ? "," : "", jsonString(r.method).c_str(), static_cast<long long>(r.bytes), r.us,
                 r.gbps, r.wrong, r.skipped.empty() ? "null" : jsonString(r.skipped).c_str());
  }
  std::fprintf(f, "\n  ]\n}\n");
  if (std::fclose(f) != 0)
    die("--json " + path + ": write failed");
}

/// The planner's calibration table from a bf16 sweep over the smallest
/// GEMM side and the copies measured above; false when a row was wrong.
bool writeCalibration(const std::string &path, Bench &bench, const Device &dev,
                      const std::vector<CopyRow> &copies) {
  if (dev.peaks.bf16 <= 0 || dev.peaks.tbps <= 0)
    die("--calibration " + path + ": no datasheet peaks for '" + dev.name +
        "': the table is a fraction of peak");
  std::printf("#\n# calibration sweep: bf16 8192 x 8192 x k\n");
  std::string table;
  bool ok = true;
  for (int64_t k = 64; k <= 8192; k *= 2) {
    GemmRow r = bench.gemm(kKinds[0], Shape{8192, 8192, k, "calibration"});
    if (!r.skipped.empty())
      die("--calibration: the k = " + std::to_string(k) + " row was skipped: " + r.skipped);
    std::printf("  bf16 %7d %7d %7lld  %-16s %12.1f %10.1f %8s %8llu\n", 8192, 8192,
                static_cast<long long>(k), "calibration", r.us, r.tflops,
                percent(r.tflops, dev.peaks.bf16).c_str(), r.wrong);
    ok &= r.wrong == 0;
    char point[64];
    std::snprintf(point, sizeof point, "%s[%lld, %.3f]", table.empty() ? "" : ", ",
                  static_cast<long long>(k), std::min(1.0, r.tflops / dev.peaks.bf16));
    table += point;
  }
  double best = 0;
  for (const CopyRow &c : copies)
    if (c.skipped.empty() && c.wrong == 0)
      best = std::max(best, c.gbps);
  if (best <= 0)
    die("--calibration: no copy row measured the memory bandwidth");
  FILE *f = std::fopen(path.c_str(), "w");
  if (!f)
    die("--calibration " + path + ": " + std::strerror(errno));
  std::fprintf(f, "{\"gemm_efficiency\": [%s],\n \"memory_efficiency\": %.3f}\n", table.c_str(),
               std::min(1.0, best / (dev.peaks.tbps * 1e3)));
  if (std::fclose(f) != 0)
    die("--calibration " + path + ": write failed");
  std::printf("# calibration table for carve plan written to %s\n", path.c_str());
  return ok;
}

[[noreturn]] void usage(const std::string &why) {
  std::fprintf(stderr,
               "roofline: %s\nusage: carve-bench-roofline [-w|--warmup N] [-n|--iters N] "
               "[--json FILE] [--calibration FILE]\n",
               why.c_str());
  std::exit(2);
}

Options parseArgs(int argc, char **argv) {
  Options opts;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc)
        usage(arg + " needs a value");
      return argv[++i];
    };
    auto count = [&](int lo) {
      std::string v = value();
      char *end = nullptr;
      long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || n < lo || n > 100000)
        usage(arg + " needs an integer >= " + std::to_string(lo) + ", not '" + v + "'");
      return static_cast<int>(n);
    };
    if (arg == "-w" || arg == "--warmup")
      opts.warmup = count(0);
    else if (arg == "-n" || arg == "--iters")
      opts.iters = count(1);
    else if (arg == "--json")
      opts.json = value();
    else if (arg == "--calibration")
      opts.calibration = value();
    else if (arg == "-h" || arg == "--help")
      usage("the GPU's GEMM rate and memory bandwidth");
    else
      usage("unknown argument '" + arg + "'");
  }
  return opts;
}

} // namespace

int main(int argc, char **argv) {
  Options opts = parseArgs(argc, argv);

  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::printf("roofline: no CUDA device (%s): nothing measured\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0");
    return 77;
  }

  Device dev;
  CHECK(cudaGetDevice(&dev.index));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev.index));
  dev.name = prop.name;
  dev.sms = prop.multiProcessorCount;
  dev.major = prop.major;
  dev.minor = prop.minor;
  dev.memGiB = prop.totalGlobalMem / 1073741824.0;
  int memKHz = 0, busBits = 0;
  if (cudaDeviceGetAttribute(&memKHz, cudaDevAttrMemoryClockRate, dev.index) == cudaSuccess &&
      cudaDeviceGetAttribute(&busBits, cudaDevAttrGlobalMemoryBusWidth, dev.index) == cudaSuccess)
    dev.clockTbps = 2.0 * memKHz * 1e3 * (busBits / 8.0) / 1e12;
  cudaGetLastError(); // an unsupported attribute is not an error here
  dev.peaks = datasheetPeaks(dev.name);

  std::printf("# carve-bench-roofline: device %d: %s, sm_%d%d, %d SMs, %.1f GiB\n", dev.index,
              dev.name.c_str(), dev.major, dev.minor, dev.sms, dev.memGiB);
  if (dev.peaks.source)
    std::printf("# peaks (%s, dense): bf16 %g TFLOP/s, tf32 %g TFLOP/s, fp32 %g TFLOP/s, "
                "memory %g TB/s\n",
                dev.peaks.source, dev.peaks.bf16, dev.peaks.tf32, dev.peaks.fp32, dev.peaks.tbps);
  else
    std::printf("# peaks: not known for this device (percent columns show '-')\n");
  if (dev.clockTbps > 0)
    std::printf("# memory clock x bus width: %.2f TB/s\n", dev.clockTbps);
  std::printf("# warm-up %d, timed %d calls per row (mean); cuBLAS %d, CUDA runtime %d\n",
              opts.warmup, opts.iters, CUBLAS_VERSION, CUDART_VERSION);

  Bench bench(opts, dev);
  bool failed = false;

  std::printf("#\n# GEMM, cublasGemmEx, column-major C = A B, alpha 1, beta 0; "
              "FLOPs = 2 m n k\n");
  std::printf("# %-5s %7s %7s %7s  %-16s %12s %10s %8s %8s\n", "type", "m", "n", "k", "shape",
              "time (us)", "TFLOP/s", "% peak", "#wrong");
  std::vector<GemmRow> gemms;
  for (const GemmKind &kind : kKinds) {
    for (const Shape &s : kShapes) {
      GemmRow r = bench.gemm(kind, s);
      if (!r.skipped.empty()) {
        std::printf("  %-5s %7lld %7lld %7lld  %-16s skipped: %s\n", r.type.c_str(),
                    static_cast<long long>(r.m), static_cast<long long>(r.n),
                    static_cast<long long>(r.k), s.what, r.skipped.c_str());
      } else {
        std::printf("  %-5s %7lld %7lld %7lld  %-16s %12.1f %10.1f %8s %8llu\n", r.type.c_str(),
                    static_cast<long long>(r.m), static_cast<long long>(r.n),
                    static_cast<long long>(r.k), s.what, r.us, r.tflops,
                    percent(r.tflops, dev.peaks.*kind.peak).c_str(), r.wrong);
      }
      std::fflush(stdout);
      failed |= r.wrong != 0;
      gemms.push_back(r);
    }
  }
  unsigned long long probeWrong = bench.fp32Probe();
  std::printf("# fp32 probe (256^3 of 1 + 2^-16, wrong if rounded to TF32 or bf16): "
              "%llu wrong\n",
              probeWrong);
  failed |= probeWrong != 0;

  std::printf("#\n# Device memory bandwidth = 2 x bytes / time (each byte read once and "
              "written once)\n");
  std::printf("# %-27s %14s %12s %10s %8s %8s\n", "method", "bytes", "time (us)", "GB/s", "% peak",
              "#wrong");
  std::vector<CopyRow> copies;
  const int64_t sizes[] = {int64_t(64) << 20, int64_t(256) << 20, int64_t(1) << 30,
                           int64_t(4) << 30};
  for (bool kernel : {true, false}) {
    for (int64_t bytes : sizes) {
      CopyRow r = bench.copy(kernel, bytes);
      if (!r.skipped.empty())
        std::printf("  %-27s %14lld skipped: %s\n", r.method.c_str(),
                    static_cast<long long>(r.bytes), r.skipped.c_str());
      else
        std::printf("  %-27s %14lld %12.1f %10.1f %8s %8llu\n", r.method.c_str(),
                    static_cast<long long>(r.bytes), r.us, r.gbps,
                    percent(r.gbps, dev.peaks.tbps * 1e3).c_str(), r.wrong);
      std::fflush(stdout);
      failed |= r.wrong != 0;
      copies.push_back(r);
    }
  }

  if (!opts.json.empty())
    writeJson(opts.json, dev, opts, gemms, probeWrong, copies);
  if (!opts.calibration.empty())
    failed |= !writeCalibration(opts.calibration, bench, dev, copies);
  if (failed) {
    std::printf("# FAILED: some rows computed wrong data (see #wrong)\n");
    return 1;
  }
  std::printf("# all rows correct\n");
  return 0;
}
