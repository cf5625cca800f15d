//===- harness.h - checks of CUDA kernels against float64 CPU references --===//
//
// Each GPU kernel test makes random inputs on the host, runs the kernel on
// the device into outputs poisoned with NaN (so an element the kernel never
// writes fails), runs the CPU kernel on the same inputs in float64
// (kernels.h is instantiated for double), and compares element by element:
// |gpu - ref| <= atol + rtol * |ref|. Tolerances are per check and stated at
// the call, from fp32 arithmetic (about 1e-6 relative per operation, growing
// with the reduction length) or from the bf16/fp16 input rounding under test.
//
// A test binary exits 0 when every check passed, 1 when one failed (each
// failure names the check, the element and both values), and 77 (ctest's
// "skipped") with a line saying so when no CUDA device is visible.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TESTS_GPU_HARNESS_H
#define CARVE_TESTS_GPU_HARNESS_H

#include "carve/rt/kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace gputest {

inline int &failures() {
  static int n = 0;
  return n;
}
inline int &checks() {
  static int n = 0;
  return n;
}

#define GT_CUDA(call)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

/// Exits 77 with a message when no device is visible; selects device 0.
inline void requireDevice(const char *binary) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("%s: SKIPPED: no CUDA device visible (%s); these GPU tests did not run\n", binary,
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    std::exit(77);
  }
  GT_CUDA(cudaSetDevice(0));
  cudaDeviceProp p{};
  GT_CUDA(cudaGetDeviceProperties(&p, 0));
  std::printf("%s: device 0: %s (sm_%d%d)\n", binary, p.name, p.major, p.minor);
}

/// A device buffer of n elements of T.
template <class T> struct DevBuf {
  T *p = nullptr;
  int64_t n = 0;
  explicit DevBuf(int64_t count) : n(count) {
    GT_CUDA(cudaMalloc(&p, std::max<int64_t>(count, 1) * sizeof(T)));
  }
  DevBuf(const std::vector<T> &h) : DevBuf((int64_t)h.size()) { upload(h); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
  // Uploads and poisoning run on the legacy stream, which the runtime's
  // non-blocking compute stream does not wait for: both wait for the device.
  void upload(const std::vector<T> &h) {
    GT_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    GT_CUDA(cudaDeviceSynchronize());
  }
  /// Fills every byte with 0xFF: NaN for floats, -1 for integers.
  void poison() {
    GT_CUDA(cudaMemset(p, 0xFF, std::max<int64_t>(n, 1) * sizeof(T)));
    GT_CUDA(cudaDeviceSynchronize());
  }
  std::vector<T> download() const {
    GT_CUDA(cudaDeviceSynchronize());
    std::vector<T> h(n);
    GT_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

inline void sync() { GT_CUDA(cudaDeviceSynchronize()); }

/// A device buffer written from `h` on stream `s`, not waited for (the
/// communicator tests order it against their collectives by the stream).
template <class T> T *deviceCopy(const std::vector<T> &h, cudaStream_t s) {
  T *p = nullptr;
  GT_CUDA(cudaMalloc(&p, std::max<size_t>(h.size(), 1) * sizeof(T)));
  GT_CUDA(cudaMemcpyAsync(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  return p;
}

/// `n` elements of `p` read back on stream `s`, then waited for.
template <class T> std::vector<T> readBack(const T *p, size_t n, cudaStream_t s) {
  std::vector<T> h(n);
  GT_CUDA(cudaMemcpyAsync(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, s));
  GT_CUDA(cudaStreamSynchronize(s));
  return h;
}

// The uploads and poisoning above run on the legacy default stream, which the
// runtime's non-blocking compute stream does not wait for: kernel tests make
// every buffer through these, which wait for the device before a kernel may
// read it.
template <class T> std::unique_ptr<DevBuf<T>> up(const std::vector<T> &h) {
  auto b = std::make_unique<DevBuf<T>>(h);
  sync();
  return b;
}
template <class T> std::unique_ptr<DevBuf<T>> poisoned(int64_t n) {
  auto b = std::make_unique<DevBuf<T>>(n);
  b->poison();
  sync();
  return b;
}

/// "[2,3,4]" for messages.
inline std::string str(const carve::rt::Dims &d) {
  std::string s = "[";
  for (int i = 0; i < d.rank; ++i)
    s += (i ? "," : "") + std::to_string(d.d[i]);
  return s + "]";
}

inline std::mt19937_64 &rng() {
  static std::mt19937_64 g(12345);
  return g;
}
inline std::vector<float> randn(int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float &x : v)
    x = d(rng());
  return v;
}
inline std::vector<float> uniform(int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float &x : v)
    x = d(rng());
  return v;
}
inline std::vector<int64_t> randint(int64_t n, int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int64_t> d(lo, hi - 1);
  std::vector<int64_t> v(n);
  for (int64_t &x : v)
    x = d(rng());
  return v;
}
inline std::vector<double> toDouble(const std::vector<float> &v) {
  return std::vector<double>(v.begin(), v.end());
}

/// Compares a device result with a float64 reference; reports the first
/// failing element and the worst error.
inline bool expectClose(const std::string &what, const std::vector<float> &got,
                        const std::vector<double> &ref, double rtol, double atol) {
  ++checks();
  if (got.size() != ref.size()) {
    std::printf("FAIL %s: %zu elements, expected %zu\n", what.c_str(), got.size(), ref.size());
    ++failures();
    return false;
  }
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double g = got[i], r = ref[i];
    bool bothInf = std::isinf(g) && std::isinf(r) && (g > 0) == (r > 0);
    double err = bothInf ? 0 : std::fabs(g - r);
    if (!(err <= atol + rtol * std::fabs(r))) { // NaN fails too
      std::printf("FAIL %s: element %zu is %.9g, reference %.9g (|err| %.3g > %.3g + %.3g*|ref|)\n",
                  what.c_str(), i, g, r, err, atol, rtol);
      ++failures();
      return false;
    }
    worst = std::max(worst, err / (atol + rtol * std::fabs(r)));
  }
  std::printf("ok   %s (%zu elements, worst error %.2f of the tolerance)\n", what.c_str(),
              got.size(), worst);
  return true;
}

/// expectClose where NaN in both the result and the reference is a match
/// (NaN-propagating kernels; a mean over no element).
inline bool expectCloseNan(const std::string &what, std::vector<float> got,
                           std::vector<double> ref, double rtol, double atol) {
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i)
    if (std::isnan(got[i]) && std::isnan(ref[i]))
      got[i] = 0, ref[i] = 0;
  return expectClose(what, got, ref, rtol, atol);
}

/// Exact comparison (data movement, integer kernels).
template <class T>
bool expectEqual(const std::string &what, const std::vector<T> &got, const std::vector<T> &ref) {
  ++checks();
  if (got.size() != ref.size()) {
    std::printf("FAIL %s: %zu elements, expected %zu\n", what.c_str(), got.size(), ref.size());
    ++failures();
    return false;
  }
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0) {
      std::printf("FAIL %s: element %zu differs from the reference\n", what.c_str(), i);
      ++failures();
      return false;
    }
  std::printf("ok   %s (%zu elements, exact)\n", what.c_str(), got.size());
  return true;
}

/// The binary's exit code: 0 if every check passed.
inline int finish(const char *binary) {
  std::printf("%s: %d check(s), %d failed\n", binary, checks(), failures());
  return failures() == 0 && checks() > 0 ? 0 : 1;
}

} // namespace gputest

#endif // CARVE_TESTS_GPU_HARNESS_H
