//===- comm_nccl_test.cu - the NCCL communicator on one GPU ---------------===//
//
// One rank, so every collective's answer is its input: what this checks is
// the plumbing the multi-GPU runs rely on. Start-up over the two bootstraps a
// single process can have (makeSelfCommunicator, and the TCP world with
// WORLD_SIZE=1), blocking and non-blocking NCCL communicators, every
// operation on device memory with its ordering against the compute stream
// (inputs written and results read by the compute stream, never synchronized
// by hand in between), host pointers staged through the device, in-place
// all-gather, unequal reduce-scatter counts, sends to itself matched by tag,
// splits, empty operations and one large all-reduce (over 2^31 bytes); and
// gpu::graphStep, the CUDA graph capture of a step's kernels and collectives
// (train --cuda-graph), against the same body run as it is.
//
//===----------------------------------------------------------------------===//

#include "carve/rt/comm.h"
#include "carve/rt/gpu.h"
#include "harness.h"

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace g = carve::gpu;
using carve::rt::CommType;
using carve::rt::Communicator;
using carve::rt::ReduceOp;
using gputest::checks;
using gputest::failures;

namespace {

cudaStream_t compute() { return static_cast<cudaStream_t>(g::computeStream()); }

void expect(bool ok, const std::string &what) {
  ++checks();
  if (!ok) {
    ++failures();
    std::printf("FAIL %s\n", what.c_str());
  }
}

/// Device buffers written and read on the compute stream (harness.h).
template <class T> T *deviceCopy(const std::vector<T> &h) {
  return gputest::deviceCopy(h, compute());
}
template <class T> std::vector<T> readBack(const T *p, size_t n) {
  return gputest::readBack(p, n, compute());
}

template <class T> std::vector<T> iota(size_t n, T start) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>(start + static_cast<T>(i % 100));
  return v;
}

void checkOperations(Communicator &c, const std::string &label) {
  // All-reduce of every type, device memory, waited for by the compute stream.
  {
    auto f = iota<float>(1000, 1.5f);
    float *d = deviceCopy(f);
    c.wait(c.allReduceAsync(d, 1000, CommType::F32, ReduceOp::Sum));
    expect(readBack(d, 1000) == f, label + ": all-reduce f32 on the device");
    auto l = iota<int64_t>(17, int64_t(1) << 40);
    int64_t *dl = deviceCopy(l);
    c.allReduce(dl, 17, CommType::I64, ReduceOp::Max);
    expect(readBack(dl, 17) == l, label + ": all-reduce i64 max");
    auto u = iota<uint8_t>(33, 3);
    uint8_t *du = deviceCopy(u);
    c.allReduce(du, 33, CommType::U8, ReduceOp::Sum);
    expect(readBack(du, 33) == u, label + ": all-reduce u8");
    auto i32 = iota<int32_t>(5, -7);
    int32_t *di = deviceCopy(i32);
    c.allReduce(di, 5, CommType::I32, ReduceOp::Sum);
    expect(readBack(di, 5) == i32, label + ": all-reduce i32");
    cudaFree(d);
    cudaFree(dl);
    cudaFree(du);
    cudaFree(di);
  }

  // Host scalars (the loss, norm partial sums) are staged; several in flight.
  {
    double loss = 2.25, norm[2] = {3.5, -1.0};
    float f = 0.125f;
    auto h1 = c.allReduceAsync(&loss, 1, CommType::F64, ReduceOp::Sum);
    auto h2 = c.allReduceAsync(norm, 2, CommType::F64, ReduceOp::Sum);
    auto h3 = c.allReduceAsync(&f, 1, CommType::F32, ReduceOp::Max);
    c.wait(h3);
    c.wait(h1);
    c.wait(h2);
    expect(loss == 2.25 && norm[0] == 3.5 && norm[1] == -1.0 && f == 0.125f,
           label + ": all-reduce of host scalars");
    std::vector<float> big = iota<float>(100000, 0.5f), want = big;
    c.allReduce(big.data(), static_cast<int64_t>(big.size()), CommType::F32, ReduceOp::Sum);
    expect(big == want, label + ": all-reduce of a host array larger than the staging buffers");
  }

  // All-gather: device out of place, device in place, host.
  {
    auto s = iota<float>(64, 4.0f);
    float *ds = deviceCopy(s), *dr = nullptr;
    GT_CUDA(cudaMalloc(&dr, 64 * sizeof(float)));
    c.allGather(ds, dr, 64, CommType::F32);
    expect(readBack(dr, 64) == s, label + ": all-gather");
    c.allGather(ds, ds, 64, CommType::F32);
    expect(readBack(ds, 64) == s, label + ": all-gather in place");
    std::vector<int64_t> hs{7, 8}, hr(2, 0);
    c.allGather(hs.data(), hr.data(), 2, CommType::I64);
    expect(hr == hs, label + ": all-gather of host memory");
    cudaFree(ds);
    cudaFree(dr);
  }

  // Reduce-scatter, all-to-all.
  {
    auto s = iota<float>(40, 1.0f);
    float *ds = deviceCopy(s), *dr = nullptr;
    GT_CUDA(cudaMalloc(&dr, 40 * sizeof(float)));
    const int64_t counts[1] = {40};
    c.reduceScatter(ds, dr, counts, CommType::F32, ReduceOp::Sum);
    expect(readBack(dr, 40) == s, label + ": reduce-scatter");
    c.allToAll(ds, dr, 40, CommType::F32);
    expect(readBack(dr, 40) == s, label + ": all-to-all");
    std::vector<float> hr(40, 0);
    c.reduceScatter(s.data(), hr.data(), counts, CommType::F32, ReduceOp::Sum);
    expect(hr == s, label + ": reduce-scatter of host memory");
    cudaFree(ds);
    cudaFree(dr);
  }

  // Sends to itself, matched by tag, receives posted first and last.
  {
    auto a = iota<int32_t>(10, 100), b = iota<int32_t>(10, 200);
    int32_t *da = deviceCopy(a), *db = deviceCopy(b), *ra = nullptr, *rb = nullptr;
    GT_CUDA(cudaMalloc(&ra, 10 * sizeof(int32_t)));
    GT_CUDA(cudaMalloc(&rb, 10 * sizeof(int32_t)));
    auto hrb = c.recvAsync(rb, 40, 0, 2);
    auto hsa = c.sendAsync(da, 40, 0, 1);
    auto hsb = c.sendAsync(db, 40, 0, 2);
    auto hra = c.recvAsync(ra, 40, 0, 1);
    c.wait(hsa);
    c.wait(hrb);
    c.wait(hra);
    c.wait(hsb);
    expect(readBack(ra, 10) == a && readBack(rb, 10) == b, label + ": send to itself by tag");
    cudaFree(da);
    cudaFree(db);
    cudaFree(ra);
    cudaFree(rb);
  }

  // Broadcast (device and host), barrier, empty operations.
  {
    auto s = iota<uint8_t>(77, 9);
    uint8_t *d = deviceCopy(s);
    c.broadcast(d, 77, 0);
    expect(readBack(d, 77) == s, label + ": broadcast");
    char text[8] = "carve";
    c.broadcast(text, sizeof text, 0);
    expect(std::string(text) == "carve", label + ": broadcast of host memory");
    c.barrier();
    expect(c.allReduceAsync(d, 0, CommType::F32, ReduceOp::Sum).id < 0 &&
               c.allGatherAsync(d, d, 0, CommType::F32).id < 0 &&
               c.sendAsync(d, 0, 0, 0).id < 0,
           label + ": empty operations are complete at once");
    cudaFree(d);
  }
  expect(c.worldRanks() == std::vector<int>{0} && c.rank() == 0 && c.size() == 1,
         label + ": one rank, world rank 0");
}

std::unique_ptr<Communicator> makeNccl(Communicator &bootstrap, const std::string &label) {
  std::string error;
  std::unique_ptr<Communicator> c = g::makeNcclCommunicator(bootstrap, error);
  expect(c != nullptr, label + ": makeNcclCommunicator" + (error.empty() ? "" : ": " + error));
  return c;
}

/// graphStep's body: what a generated forwardBackward does in small (kernels
/// on the compute stream, a collective on its own stream, waited for by the
/// compute stream), on the arena [x (n floats), y (n floats)].
Communicator *graphComm = nullptr;
constexpr int64_t kGraphN = 1000;
void graphBody(carve::rt::StepContext &ctx) {
  float *x = reinterpret_cast<float *>(ctx.arena), *y = x + kGraphN;
  g::scaleInPlace(x, kGraphN, 2.0f);
  graphComm->wait(graphComm->allReduceAsync(x, kGraphN, CommType::F32, ReduceOp::Sum));
  g::addInPlace(x, y, kGraphN);
}

/// Runs graphBody through graphStep for 4 steps, the host writing new x
/// before each (as train_main copies each step's inputs): with the graph on,
/// step 0 runs as is, step 1 is captured and launched, steps 2-3 replay; the
/// results must be 2x + y (one rank: the all-reduce is the identity) every
/// time, whichever way they ran.
void checkGraphStep(Communicator &c, bool graph) {
  const std::string label = graph ? "graphStep with --cuda-graph" : "graphStep without it";
  graphComm = &c;
  float *arena = nullptr;
  GT_CUDA(cudaMalloc(&arena, 2 * kGraphN * sizeof(float)));
  std::vector<float> y = iota<float>(kGraphN, 0.5f);
  GT_CUDA(cudaMemcpyAsync(arena + kGraphN, y.data(), kGraphN * sizeof(float),
                          cudaMemcpyHostToDevice, compute()));
  carve::rt::StepContext ctx;
  ctx.arena = reinterpret_cast<char *>(arena);
  ctx.cudaGraph = graph;
  int64_t nodes = 0;
  for (int step = 0; step < 4; ++step) {
    std::vector<float> x = iota<float>(kGraphN, static_cast<float>(10 * step));
    GT_CUDA(cudaMemcpyAsync(arena, x.data(), kGraphN * sizeof(float), cudaMemcpyHostToDevice,
                            compute()));
    GT_CUDA(cudaStreamSynchronize(compute())); // x lives on the host stack
    ctx.step = step;
    g::graphStep(ctx, graphBody);
    std::vector<float> got = readBack(arena, kGraphN);
    int bad = 0;
    for (int64_t i = 0; i < kGraphN; ++i)
      bad += got[i] != 2.0f * x[i] + y[i];
    expect(bad == 0, label + ": step " + std::to_string(step) + ": " + std::to_string(bad) +
                         " wrong elements of 2x + y");
    if (!graph || step == 0)
      expect(ctx.graphNodes == 0, label + ": step " + std::to_string(step) +
                                      ": no graph expected, got " +
                                      std::to_string(ctx.graphNodes) + " nodes");
    else if (step == 1)
      // The two kernels, and the all-reduce where it has work: NCCL skips an
      // in-place all-reduce over one rank, which then adds no node (seen on
      // an H200).
      expect((nodes = ctx.graphNodes) >= (c.size() > 1 ? 3 : 2),
             label + ": a graph of at least " +
                 (c.size() > 1 ? "3 nodes (2 kernels and the "
                                 "all-reduce)"
                               : "2 nodes (the 2 kernels)") +
                 ", got " + std::to_string(ctx.graphNodes));
    else
      expect(ctx.graphNodes == nodes, label + ": the same graph replayed");
  }
  cudaFree(arena);
}

} // namespace

int main() {
  gputest::requireDevice("carve-gpu-comm_nccl_test");
  std::string err;
  if (!g::kCudaTarget.open(0, 0, 1, int64_t(1) << 20, err)) {
    std::printf("FAIL kCudaTarget.open: %s\n", err.c_str());
    return 1;
  }
  carve::rt::setCollectiveTimeout(120);

  {
    std::unique_ptr<Communicator> self = carve::rt::makeSelfCommunicator();
    std::unique_ptr<Communicator> c = makeNccl(*self, "self bootstrap");
    if (c) {
      checkOperations(*c, "world");
      checkGraphStep(*c, false);
      // graphStep keeps one graph per process: the captured run last.
      checkGraphStep(*c, true);
      std::unique_ptr<Communicator> sub = c->split(0, 5);
      sub->setName("dp");
      checkOperations(*sub, "split");
      // Over 2^31 bytes: NCCL's counts are size_t, ours int64.
      const int64_t n = (int64_t(1) << 29) + 3;
      float *d = nullptr;
      if (cudaMalloc(&d, n * sizeof(float)) == cudaSuccess) {
        GT_CUDA(cudaMemsetAsync(d, 0, n * sizeof(float), compute()));
        c->allReduce(d, n, CommType::F32, ReduceOp::Sum);
        float last = -1;
        GT_CUDA(cudaMemcpyAsync(&last, d + n - 1, sizeof last, cudaMemcpyDeviceToHost, compute()));
        GT_CUDA(cudaStreamSynchronize(compute()));
        expect(last == 0.0f, "all-reduce of 2^29 + 3 floats");
        cudaFree(d);
      } else {
        cudaGetLastError();
        std::printf("note: no room for the 2 GiB all-reduce; skipped\n");
      }
    }
  }

  {
    setenv("CARVE_NCCL_BLOCKING", "1", 1);
    std::unique_ptr<Communicator> self = carve::rt::makeSelfCommunicator();
    std::unique_ptr<Communicator> c = makeNccl(*self, "blocking");
    if (c)
      checkOperations(*c, "blocking");
    unsetenv("CARVE_NCCL_BLOCKING");
  }

  {
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
    std::unique_ptr<Communicator> world = carve::rt::makeEnvWorld(err);
    expect(world != nullptr, "TCP world of one rank: " + err);
    if (world) {
      std::unique_ptr<Communicator> c = makeNccl(*world, "TCP bootstrap");
      if (c)
        checkOperations(*c, "over the TCP world");
    }
  }

  if (!g::kCudaTarget.synchronize(err))
    expect(false, "device synchronize at the end: " + err);
  g::kCudaTarget.close();
  std::printf("%d checks, %d failed\n", checks(), failures());
  return failures() == 0 ? 0 : 1;
}
