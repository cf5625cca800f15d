//===- cuda_emu.h - the CUDA target's kernels as host C++, for tests ------===//
//
// Force-included (-include) into every source of the emulated build of
// runtime/cuda and tests/gpu (CARVE_CUDA_EMULATION; tests only, never in a
// user's program). With it the kernels compile as ordinary C++ and a launch,
// CARVE_KERNEL(grid, block, shared, stream, kernel)(args...) (carve/rt/gpu.h),
// runs every thread of every block on the CPU (emu.cpp):
//
// - The threads of a block are fibers (emu.cpp) on one OS thread, run one
//   at a time: `__syncthreads` parks a thread until every thread of its block
//   is parked at the same `__syncthreads`, and fails naming the kernel, the
//   block and both sites when they park at different ones or when a thread
//   returns while others wait. `__shfl_xor_sync` exchanges values among the
//   32 lanes of a warp the same way (every lane in the mask must take part).
// - `__shared__` variables are `static thread_local`: one instance per OS
//   thread, which runs one block at a time, so every thread of a block sees
//   the same one. Blocks run one after another, the last first (a GPU
//   promises no order; code that relies on the launch order sees it
//   reversed), so atomics are plain read-modify-writes.
// - threadIdx, blockIdx, blockDim and gridDim are the running fiber's.
// - The __f*_rn intrinsics are the plain IEEE operations (the emulated build
//   compiles with -ffp-contract=off, so nothing is fused behind them).
//
// The bf16 and fp16 types and conversions are the toolkit's own headers,
// compiled for the host.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TESTS_GPU_EMU_CUDA_EMU_H
#define CARVE_TESTS_GPU_EMU_CUDA_EMU_H

#ifdef __cplusplus

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#ifndef CARVE_CUDA_EMULATION
#define CARVE_CUDA_EMULATION 1
#endif

namespace carve_emu {

/// The emulated thread now running: its coordinates in the launch.
struct ThreadCoords {
  uint3 threadIdx;
  uint3 blockIdx;
  dim3 blockDim;
  dim3 gridDim;
};
ThreadCoords &coords();

/// __syncthreads at `site` ("file:line").
void syncThreads(const char *site);
/// One step of a warp exchange: lane `lane` of the running warp offers
/// `value` and receives lane `from`'s (every lane of `mask` takes part).
uint64_t warpExchange(unsigned mask, uint64_t value, int from, const char *site);
/// A fault inside a kernel: one line naming the kernel, block, thread and
/// the cause, then the process ends (as a device error would end the step).
[[noreturn]] void kernelFault(const char *fmt, ...);

/// One launch as emu.cpp receives it.
struct LaunchInfo {
  const char *kernel;
  dim3 grid, block;
  size_t sharedBytes;
  cudaStream_t stream;
};
/// Checks `info` as a device would, then runs body(ctx) for every thread of
/// the grid (or records the launch into the graph its stream is capturing).
void runGrid(const LaunchInfo &info, void (*body)(void *), void *ctx, void (*copy)(void *, void **),
             void (*destroy)(void *));
/// CARVE_GPU_PROFILE's timer (carve::gpu::KernelTimer, set by the runtime
/// when profiling is on): called around every launch that is not captured,
/// as the real CARVE_KERNEL brackets its launches; null otherwise.
extern int (*launchTimerStart)(const char *kernel, void *stream);
extern void (*launchTimerStop)(int slot);
/// Fails, naming the kernel and the argument, when `p` is not null and not
/// inside a live device allocation.
void checkDevicePointer(const char *kernel, int argument, const void *p);

/// CARVE_KERNEL's object: the launch configuration and a callable that calls
/// the kernel (deducing its template arguments from the arguments, as a
/// launch does). Its call operator copies the arguments (a launch passes them
/// by value), checks that every pointer among them is device memory, and runs
/// the grid: each thread calls the kernel on its own copy of the parameters.
template <class F> struct Launcher {
  LaunchInfo info;
  F fn;
  Launcher(const char *name, dim3 grid, dim3 block, size_t shared, cudaStream_t stream, F f)
      : info{name, grid, block, shared, stream}, fn(f) {}
  template <class... A> struct Call {
    F fn;
    std::tuple<std::decay_t<A>...> args;
  };
  template <class... A> void operator()(A &&...a) {
    using C = Call<A...>;
    C *call = new C{fn, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)};
    checkArguments(call->args, std::index_sequence_for<A...>{});
    runGrid(
        info, [](void *c) { std::apply(static_cast<C *>(c)->fn, static_cast<C *>(c)->args); }, call,
        [](void *c, void **out) { *out = new C(*static_cast<C *>(c)); },
        [](void *c) { delete static_cast<C *>(c); });
  }

private:
  template <class Tuple, size_t... I>
  void checkArguments(const Tuple &t, std::index_sequence<I...>) {
    (checkOne(static_cast<int>(I), std::get<I>(t)), ...);
  }
  template <class T> void checkOne(int i, const T &v) {
    if constexpr (std::is_pointer_v<T>)
      checkDevicePointer(info.kernel, i, static_cast<const void *>(v));
  }
};

template <class T> uint64_t toBits(T v) {
  static_assert(sizeof(T) <= 8, "a warp shuffle of more than 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T> T fromBits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

} // namespace carve_emu

/// The launch of carve/rt/gpu.h (`kernel<<<...>>>(...)` under nvcc), defined
/// here first: the launch runs the grid on the emulation. Custom ops' kernels,
/// which include only custom.h, get it too (carve compile rewrites their
/// `<<<>>>` launches into it under CARVE_CUDA_EMULATION).
#define CARVE_KERNEL(grid, block, shared, strm, ...)                                               \
  ::carve_emu::Launcher(#__VA_ARGS__, grid, block, shared, strm,                                   \
                        [](auto &&...carveArgs) { __VA_ARGS__(carveArgs...); })

// ---- Builtins ----------------------------------------------------------------

#define threadIdx (::carve_emu::coords().threadIdx)
#define blockIdx (::carve_emu::coords().blockIdx)
#define blockDim (::carve_emu::coords().blockDim)
#define gridDim (::carve_emu::coords().gridDim)
#ifdef warpSize
#undef warpSize
#endif
#define warpSize 32

#define CARVE_EMU_STR2(x) #x
#define CARVE_EMU_STR(x) CARVE_EMU_STR2(x)
#define __syncthreads() ::carve_emu::syncThreads(__FILE__ ":" CARVE_EMU_STR(__LINE__))

#ifdef __shared__
#undef __shared__
#endif
#define __shared__ static thread_local
// Managed globals (the generated programs' constant tables) live in one
// section, which emu.cpp counts as device memory (the device reads them).
#ifdef __managed__
#undef __managed__
#endif
#define __managed__ __attribute__((section("carve_emu_managed"), used))
#ifdef __launch_bounds__
#undef __launch_bounds__
#endif
#define __launch_bounds__(...)

/// __shfl_xor_sync: lane l receives lane (l ^ laneMask)'s value within its
/// segment of `width` lanes.
template <class T>
inline T carveEmuShflXor(unsigned mask, T v, int laneMask, int width, const char *site) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    ::carve_emu::kernelFault("__shfl_xor_sync at %s: width %d is not a power of two up to 32", site,
                             width);
  const int lane =
      static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32;
  const int base = lane & ~(width - 1);
  const int from = base + ((lane - base) ^ laneMask) % width;
  return ::carve_emu::fromBits<T>(
      ::carve_emu::warpExchange(mask, ::carve_emu::toBits(v), from, site));
}
#define __shfl_xor_sync(mask, v, laneMask, ...)                                                    \
  carveEmuShflXor(mask, v, laneMask, carveEmuWidth(__VA_ARGS__ + 0),                               \
                  __FILE__ ":" CARVE_EMU_STR(__LINE__))
/// The width argument, 32 when left out (`__VA_ARGS__ + 0` is then 0).
inline int carveEmuWidth(int w) { return w == 0 ? 32 : w; }
/// __syncwarp: every lane of `mask` (the whole warp when left out) arrives
/// before any goes on: a warp exchange of nothing, which every lane of the
/// mask must join (blocks' threads run one at a time, so the writes before
/// it are seen after it).
inline void carveEmuSyncWarp(unsigned mask, const char *site) {
  const int lane =
      static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32;
  (void)::carve_emu::warpExchange(mask, 0, lane, site);
}
#define __syncwarp(...)                                                                            \
  carveEmuSyncWarp((__VA_ARGS__ + 0) ? (__VA_ARGS__ + 0) : 0xffffffffu,                            \
                   __FILE__ ":" CARVE_EMU_STR(__LINE__))

// ---- Atomics (blocks run one at a time on one OS thread) --------------------

/// Every write before it visible to every other block before any write after
/// it: blocks run one after another here, so it holds already.
inline void __threadfence() {}

template <class T> inline T atomicAdd(T *p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long cmp,
                                    unsigned long long v) {
  unsigned long long old = *p;
  if (old == cmp)
    *p = v;
  return old;
}
inline int atomicCAS(int *p, int cmp, int v) {
  int old = *p;
  if (old == cmp)
    *p = v;
  return old;
}

// ---- Arithmetic intrinsics ----------------------------------------------------

inline double __longlong_as_double(long long v) {
  double d;
  std::memcpy(&d, &v, sizeof d);
  return d;
}
inline long long __double_as_longlong(double v) {
  long long b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}
inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, sizeof f);
  return f;
}
inline int __float_as_int(float v) {
  int b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline double rsqrt(double a) { return 1.0 / std::sqrt(a); }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

#endif // __cplusplus
#endif // CARVE_TESTS_GPU_EMU_CUDA_EMU_H
