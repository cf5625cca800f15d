//===- cudnn_emu_test.cpp - the cuDNN backend emulation against references --===//
//
// ctest gpu-emu-cudnn (tests/gpu-emu/README.md, "cuDNN"). Graphs built
// through the backend API only, as runtime code builds them (matmuls,
// flash attention, 2-D convolutions on each engine that takes them), run by
// cudnn_emu.cpp on the emulated device and compared with float64
// references; then what the emulation must refuse: at Finalize (a status and
// a last-error string), in the heuristics (no configuration), and at
// Execute (the process ends; checked in a forked child). One `ok` or `FAIL`
// line per check; the exit status is the number of failures.
//
//===----------------------------------------------------------------------===//

#include "cudnn_emu.h"

#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

int gFailures = 0;

void check(bool ok, const std::string &name, const std::string &detail = "") {
  if (ok) {
    std::printf("ok   %s\n", name.c_str());
  } else {
    ++gFailures;
    std::printf("FAIL %s%s%s\n", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  }
  std::fflush(stdout);
}

std::string lastError() {
  char buf[2048] = {};
  cudnnGetLastErrorString(buf, sizeof buf);
  return buf;
}

using Dims = std::vector<int64_t>;

Dims rowMajor(const Dims &d) {
  Dims s(d.size(), 1);
  for (size_t i = d.size(); i-- > 1;)
    s[i - 1] = s[i] * d[i];
  return s;
}

/// Builds one graph through the backend API and owns its descriptors. The
/// first call that fails is kept in `error` (with cuDNN's last-error string);
/// the calls after it go on and fail too.
class Graph {
public:
  ~Graph() {
    for (cudnnBackendDescriptor_t d : owned)
      cudnnBackendDestroyDescriptor(d);
  }

  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t t) {
    cudnnBackendDescriptor_t d = nullptr;
    note(cudnnBackendCreateDescriptor(t, &d), "cudnnBackendCreateDescriptor");
    if (d)
      owned.push_back(d);
    return d;
  }
  cudnnStatus_t set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t n,
                    cudnnBackendAttributeType_t t, int64_t count, const void *v) {
    return note(cudnnBackendSetAttribute(d, n, t, count, v), "cudnnBackendSetAttribute");
  }
  cudnnStatus_t setDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t n,
                        cudnnBackendDescriptor_t v) {
    return set(d, n, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
  }
  cudnnStatus_t finalize(cudnnBackendDescriptor_t d) {
    return note(cudnnBackendFinalize(d), "cudnnBackendFinalize");
  }

  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims &dims,
                                  const Dims &strides, bool isVirtual = false,
                                  bool byValue = false) {
    cudnnBackendDescriptor_t d = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.size(), dims.data());
    set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.size(), strides.data());
    set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &isVirtual);
    set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byValue);
    finalize(d);
    return d;
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, const Dims &dims) {
    return tensor(nextVirtual++, type, dims, rowMajor(dims), true);
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0)
      set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    finalize(pw);
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    setDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    setDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b)
      setDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t)
      setDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    setDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    finalize(op);
    ops.push_back(op);
  }
  /// The operation's Finalize status.
  cudnnStatus_t matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                       cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    finalize(mm);
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    setDesc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    setDesc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    setDesc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    setDesc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    const cudnnStatus_t s = finalize(op);
    ops.push_back(op);
    return s;
  }
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t r = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    finalize(r);
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    setDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    setDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    setDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
    finalize(op);
    ops.push_back(op);
  }

  /// The operation graph's Finalize status.
  cudnnStatus_t build(cudnnHandle_t h) {
    graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.size(),
        ops.data());
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    return finalize(graph);
  }
  /// How many configurations heuristic A finds (the count query, then the
  /// results into descriptors created here); all are kept in `configs`,
  /// the first also in `config`.
  int64_t heuristics() {
    cudnnBackendDescriptor_t heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    setDesc(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    finalize(heur);
    int64_t count = -1;
    note(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
         "the heuristics' count");
    heuristicsError = lastError();
    if (count <= 0)
      return count;
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count; ++i)
      cfgs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    int64_t got = -1;
    note(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfgs.data()),
         "the heuristics' results");
    config = cfgs[0];
    configs = cfgs;
    return got;
  }
  /// The engine of configuration `cfg`, read as a caller reads it: copied
  /// into an ENGINE descriptor created here, then its global index and its
  /// numerical notes (the count query first).
  struct Engine {
    int64_t index = -1;
    std::vector<cudnnBackendNumericalNote_t> notes;
  };
  Engine engineOf(cudnnBackendDescriptor_t cfg) {
    Engine e;
    cudnnBackendDescriptor_t engine = make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    int64_t n = -1;
    note(cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                  1, &n, &engine),
         "the configuration's engine");
    note(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                  &e.index),
         "the engine's global index");
    int64_t count = -1;
    note(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                  CUDNN_TYPE_NUMERICAL_NOTE, 0, &count, nullptr),
         "the engine's note count");
    e.notes.resize(std::max<int64_t>(count, 0) + 2); // room to spare: the count must bound it
    note(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                  CUDNN_TYPE_NUMERICAL_NOTE, e.notes.size(), &n, e.notes.data()),
         "the engine's notes");
    e.notes.resize(n == count ? n : 0);
    if (n != count && error.empty())
      error = "the engine's notes: " + std::to_string(n) + " given, " + std::to_string(count) +
              " counted";
    return e;
  }
  /// The execution plan's Finalize status (its workspace size in `workspace`).
  cudnnStatus_t makePlan(cudnnHandle_t h) {
    plan = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    setDesc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config);
    const cudnnStatus_t s = cudnnBackendFinalize(plan);
    if (s == CUDNN_STATUS_SUCCESS)
      note(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                    CUDNN_TYPE_INT64, 1, nullptr, &workspace),
           "the plan's workspace size");
    return s;
  }
  /// cudnnBackendExecute's status, through a variant pack of these pointers.
  cudnnStatus_t execute(cudnnHandle_t h, std::vector<int64_t> uids, std::vector<void *> ptrs,
                        void *ws) {
    cudnnBackendDescriptor_t pack = make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.size(), uids.data());
    set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.size(), ptrs.data());
    set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    finalize(pack);
    return note(cudnnBackendExecute(h, plan, pack), "cudnnBackendExecute");
  }

  std::string error;           // the first failing call, with cuDNN's words
  std::string heuristicsError; // the last error after the heuristics ran
  std::vector<cudnnBackendDescriptor_t> ops, configs;
  cudnnBackendDescriptor_t graph = nullptr, config = nullptr, plan = nullptr;
  int64_t workspace = -1;

private:
  cudnnStatus_t note(cudnnStatus_t s, const char *what) {
    if (s != CUDNN_STATUS_SUCCESS && error.empty())
      error = std::string(what) + ": " + cudnnGetErrorString(s) + " (" + lastError() + ")";
    return s;
  }

  std::vector<cudnnBackendDescriptor_t> owned;
  int64_t nextVirtual = 1000;
};

// ---- Data ---------------------------------------------------------------------------

/// Deterministic values in [-1, 1).
struct Random {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  float next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((s >> 40) & 0xffffff) / 8388608.0f - 1.0f;
  }
};

std::vector<__nv_bfloat16> randomBf16(size_t n, Random &r) {
  std::vector<__nv_bfloat16> v(n);
  for (auto &x : v)
    x = __float2bfloat16(r.next());
  return v;
}

template <typename T> T *toDevice(const std::vector<T> &v) {
  void *p = nullptr;
  cudaMalloc(&p, v.size() * sizeof(T));
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T *>(p);
}
template <typename T> std::vector<T> fromDevice(const T *p, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}
void *deviceBytes(size_t n) {
  void *p = nullptr;
  cudaMalloc(&p, n);
  cudaMemset(p, 0xFF, n);
  return p;
}

/// Runs `body` in a forked child; whether it ended with a non-zero status
/// and its stderr contains every one of `expect` (the child's stderr goes
/// to `out`).
bool endsTheProcess(const std::function<void()> &body, const std::vector<std::string> &expect,
                    std::string &out) {
  int fds[2];
  if (pipe(fds))
    return false;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], 2);
    body();
    std::fprintf(stderr, "the call returned\n");
    std::fflush(stderr);
    _exit(0);
  }
  close(fds[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0)
    out.append(buf, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!out.empty() && out.back() == '\n')
    out.pop_back();
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 0)
    return false;
  for (const std::string &e : expect)
    if (out.find(e) == std::string::npos)
      return false;
  return true;
}

// ---- (1) A batched matmul with a transposed B ---------------------------------------

/// C [2, 4, 5, 7] = A [2, 4, 5, 16] B^T, B stored [2, 2, 7, 16] row-major
/// and described as [2, 2, 16, 7] through swapped strides, its head
/// dimension shared by pairs of A's (grouped-query attention's mapping:
/// C's head i reads B's head i / 2).
void testMatmul(cudnnHandle_t h) {
  const int64_t batch = 2, heads = 4, kvHeads = 2, m = 5, n = 7, k = 16;
  Random rnd;
  std::vector<__nv_bfloat16> a = randomBf16(batch * heads * m * k, rnd);
  std::vector<__nv_bfloat16> b = randomBf16(batch * kvHeads * n * k, rnd);
  auto *da = toDevice(a), *db = toDevice(b);
  auto *dc = static_cast<float *>(deviceBytes(batch * heads * m * n * sizeof(float)));

  for (cudnnDataType_t ct : {CUDNN_DATA_FLOAT, CUDNN_DATA_BFLOAT16}) {
    const std::string name = std::string("matmul bf16 [2,4,5,16] x B^T [2,2,16,7] (grouped) -> ") +
                             (ct == CUDNN_DATA_FLOAT ? "f32" : "bf16");
    Graph g;
    Dims bs = rowMajor({batch, kvHeads, n, k});
    auto ta =
        g.tensor(1, CUDNN_DATA_BFLOAT16, {batch, heads, m, k}, rowMajor({batch, heads, m, k}));
    auto tb =
        g.tensor(2, CUDNN_DATA_BFLOAT16, {batch, kvHeads, k, n}, {bs[0], bs[1], bs[3], bs[2]});
    auto tc = g.tensor(3, ct, {batch, heads, m, n}, rowMajor({batch, heads, m, n}));
    g.matmul(ta, tb, tc);
    g.build(h);
    const int64_t count = g.heuristics();
    g.makePlan(h);
    // A 16-bit C is accumulated in fp32 in the workspace, an fp32 one in place.
    const int64_t wantWs =
        ct == CUDNN_DATA_FLOAT ? 0 : (batch * heads * m * n * 4 + 255) / 256 * 256;
    void *ws = g.workspace > 0 ? deviceBytes(g.workspace) : nullptr;
    const int64_t before = carve_emu_cudnn_executions();
    g.execute(h, {1, 2, 3}, {da, db, dc}, ws);
    cudaDeviceSynchronize();
    if (!g.error.empty() || count != 1) {
      check(false, name, g.error.empty() ? "heuristics found " + std::to_string(count) : g.error);
      continue;
    }
    check(g.workspace == wantWs, name + ": workspace",
          std::to_string(g.workspace) + " bytes, expected " + std::to_string(wantWs));
    check(carve_emu_cudnn_executions() == before + 1, name + ": one execution counted");
    // Tolerance: bf16 products are exact in float; 16 float additions err
    // by at most 16 * 2^-24 * sum |a b| (and a bf16 C by 2^-8 |c| more).
    int bad = 0;
    std::string first;
    std::vector<float> cf;
    std::vector<__nv_bfloat16> cb;
    if (ct == CUDNN_DATA_FLOAT)
      cf = fromDevice(dc, batch * heads * m * n);
    else
      cb = fromDevice(reinterpret_cast<__nv_bfloat16 *>(dc), batch * heads * m * n);
    for (int64_t z = 0; z < batch; ++z)
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double ref = 0, mag = 0;
            for (int64_t q = 0; q < k; ++q) {
              const double x = __bfloat162float(a[((z * heads + hh) * m + i) * k + q]);
              const double y = __bfloat162float(b[((z * kvHeads + hh / 2) * n + j) * k + q]);
              ref += x * y;
              mag += std::fabs(x * y);
            }
            const int64_t at = ((z * heads + hh) * m + i) * n + j;
            const double got = ct == CUDNN_DATA_FLOAT ? cf[at] : __bfloat162float(cb[at]);
            const double tol = k * std::ldexp(mag, -24) +
                               (ct == CUDNN_DATA_FLOAT ? 0 : std::ldexp(std::fabs(ref), -8) * 1.01);
            if (!(std::fabs(got - ref) <= tol) && bad++ == 0) {
              char buf[200];
              std::snprintf(buf, sizeof buf, "C[%lld,%lld,%lld,%lld] is %.9g, reference %.9g",
                            (long long)z, (long long)hh, (long long)i, (long long)j, got, ref);
              first = buf;
            }
          }
    check(bad == 0, name + ": against float64",
          first + (bad > 1 ? " and " + std::to_string(bad - 1) + " more" : ""));
    if (ws)
      cudaFree(ws);
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
}

// ---- (2) Causal attention as the flash-attention forward graph ---------------------

enum AttnUid : int64_t { kQ = 1, kK, kV, kO, kStats, kScale, kNegInf };

/// The forward graph of cudnn-frontend's CompositeSDPANode for a causal
/// top-left mask: S = Q K^T * scale; row >= col ? S : -inf; softmax through
/// max, subtract, exp, sum, divide into a bf16 virtual P; O = P V; Stats =
/// max + log(sum).
void buildAttention(Graph &g, int64_t b, int64_t hds, int64_t t, int64_t d) {
  const Dims sd{b, hds, t, t}, rd{b, hds, t, 1}, qd{b, hds, t, d};
  const Dims ks = rowMajor(qd);
  auto q = g.tensor(kQ, CUDNN_DATA_BFLOAT16, qd, rowMajor(qd));
  auto kt = g.tensor(kK, CUDNN_DATA_BFLOAT16, {b, hds, d, t}, {ks[0], ks[1], ks[3], ks[2]});
  auto v = g.tensor(kV, CUDNN_DATA_BFLOAT16, qd, rowMajor(qd));
  auto o = g.tensor(kO, CUDNN_DATA_BFLOAT16, qd, rowMajor(qd));
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, rd, rowMajor(rd));
  auto scale = g.scalar(kScale), negInf = g.scalar(kNegInf);
  auto s = g.virt(CUDNN_DATA_FLOAT, sd);
  g.matmul(q, kt, s);
  auto scaled = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, scale, nullptr, scaled);
  auto row = g.virt(CUDNN_DATA_INT32, sd), col = g.virt(CUDNN_DATA_INT32, sd);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scaled, nullptr, nullptr, row, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, scaled, nullptr, nullptr, col, 3);
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, sd);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  auto masked = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scaled, negInf, keep, masked);
  auto mx = g.virt(CUDNN_DATA_FLOAT, rd);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, mx);
  auto sub = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, masked, mx, nullptr, sub);
  auto e = g.virt(CUDNN_DATA_FLOAT, sd);
  g.pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, sub, nullptr, nullptr, e);
  auto z = g.virt(CUDNN_DATA_FLOAT, rd);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  auto logZ = g.virt(CUDNN_DATA_FLOAT, rd);
  g.pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, z, nullptr, nullptr, logZ);
  g.pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, mx, logZ, nullptr, stats);
  auto p = g.virt(CUDNN_DATA_BFLOAT16, sd);
  g.pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, z, nullptr, p);
  g.matmul(p, v, o);
}

void testAttention(cudnnHandle_t h) {
  const int64_t b = 1, hds = 2, t = 24, d = 16;
  const std::string name = "causal attention bf16 [1,2,24,16]";
  Random rnd;
  const size_t n = b * hds * t * d, rows = b * hds * t;
  std::vector<__nv_bfloat16> q = randomBf16(n, rnd), k = randomBf16(n, rnd), v = randomBf16(n, rnd);
  auto *dq = toDevice(q), *dk = toDevice(k), *dv = toDevice(v);
  auto *dO = static_cast<__nv_bfloat16 *>(deviceBytes(n * 2));
  auto *dStats = static_cast<float *>(deviceBytes(rows * 4));
  float scale = 0.25f, negInf = -std::numeric_limits<float>::infinity();

  Graph g;
  buildAttention(g, b, hds, t, d);
  g.build(h);
  const int64_t count = g.heuristics();
  g.makePlan(h);
  void *ws = g.workspace > 0 ? deviceBytes(g.workspace) : nullptr;
  const std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kNegInf};
  g.execute(h, uids, {dq, dk, dv, dO, dStats, &scale, &negInf}, ws);
  cudaDeviceSynchronize();
  check(g.error.empty() && count == 1, name + ": builds, plans and runs",
        g.error.empty() ? "heuristics found " + std::to_string(count) : g.error);
  if (!g.error.empty() || count != 1)
    return;
  check(g.workspace == (int64_t(n) * 4 + 255) / 256 * 256, name + ": workspace (fp32 O)",
        std::to_string(g.workspace) + " bytes");
  std::vector<__nv_bfloat16> o = fromDevice(dO, n);
  std::vector<float> stats = fromDevice(dStats, rows);

  // Tolerance. With |q|, |k| <= 1 and d = 16, each score's float sum errs by
  // at most 16 * 2^-24 * 16 (products of bf16 values are exact in float),
  // 1.5e-5, times the scale 0.25; exp, the sum over at most 24 keys and the
  // division add a few float roundings: P is within 1e-5 relative of the
  // exact softmax before it is rounded to bf16, which adds at most 2^-8
  // relative (8 significant bits, to nearest). O = sum_j P_j V_j, summed in
  // float (24 terms, negligible), then rounded to bf16 (2^-8 |O| more):
  //   |O - O_ref| <= 2^-8 * 1.01 * sum_j P_j |V_j| + 2^-8 * 1.01 * |O_ref|.
  // Stats = max + log(sum) in float: the score error above plus a few float
  // roundings of log: 5e-5 absolute is ample, and it is far below the bf16
  // error of P, so a Stats computed from the rounded P would not pass.
  int badO = 0, badStats = 0, maskLeaks = 0;
  std::string firstO, firstStats;
  for (int64_t z = 0; z < b * hds; ++z)
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> sc(t);
      double mx = -INFINITY;
      for (int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (int64_t c = 0; c < d; ++c)
          s += double(__bfloat162float(q[(z * t + i) * d + c])) *
               __bfloat162float(k[(z * t + j) * d + c]);
        sc[j] = s * scale;
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j <= i; ++j)
        sum += std::exp(sc[j] - mx);
      const double refStats = mx + std::log(sum);
      const double gotStats = stats[z * t + i];
      if (!(std::fabs(gotStats - refStats) <= 5e-5) && badStats++ == 0)
        firstStats = "row " + std::to_string(z * t + i) + ": " + std::to_string(gotStats) +
                     ", reference " + std::to_string(refStats);
      for (int64_t c = 0; c < d; ++c) {
        double ref = 0, mag = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const double pj = std::exp(sc[j] - mx) / sum;
          const double vj = __bfloat162float(v[(z * t + j) * d + c]);
          ref += pj * vj;
          mag += pj * std::fabs(vj);
        }
        const double got = __bfloat162float(o[(z * t + i) * d + c]);
        const double tol = std::ldexp(1.01, -8) * (mag + std::fabs(ref));
        if (!(std::fabs(got - ref) <= tol) && badO++ == 0) {
          char buf[200];
          std::snprintf(buf, sizeof buf, "O[%lld,%lld,%lld] is %.9g, reference %.9g (tol %.3g)",
                        (long long)z, (long long)i, (long long)c, got, ref, tol);
          firstO = buf;
        }
      }
      // Row 0 sees only key 0: O is V's row 0 times P = 1 (exact in bf16).
      if (i == 0)
        for (int64_t c = 0; c < d; ++c)
          maskLeaks += __bfloat162float(o[(z * t) * d + c]) != __bfloat162float(v[(z * t) * d + c]);
    }
  check(badO == 0, name + ": O against float64",
        firstO + (badO > 1 ? " and " + std::to_string(badO - 1) + " more" : ""));
  check(badStats == 0, name + ": Stats (max + log sum) against float64",
        firstStats + (badStats > 1 ? " and " + std::to_string(badStats - 1) + " more" : ""));
  check(maskLeaks == 0, name + ": row 0 attends to key 0 only",
        std::to_string(maskLeaks) + " elements differ from V's row 0");

  // The same call captured into a CUDA graph: nothing runs until the graph
  // is launched, the by-value scale is the one the call saw, and every
  // launch counts as an execution.
  cudaStream_t s;
  cudaStreamCreate(&s);
  cudnnSetStream(h, s);
  auto *dO2 = static_cast<__nv_bfloat16 *>(deviceBytes(n * 2));
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  const int64_t before = carve_emu_cudnn_executions();
  g.execute(h, uids, {dq, dk, dv, dO2, dStats, &scale, &negInf}, ws);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(s, &graph);
  scale = 99.0f;
  const bool notRun = carve_emu_cudnn_executions() == before;
  cudaGraphExec_t exec = nullptr;
  cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphLaunch(exec, s);
  cudaGraphLaunch(exec, s);
  cudaStreamSynchronize(s);
  const std::vector<__nv_bfloat16> o2 = fromDevice(dO2, n);
  check(g.error.empty() && notRun && carve_emu_cudnn_executions() == before + 2 &&
            std::memcmp(o.data(), o2.data(), n * 2) == 0,
        name + ": captured into a CUDA graph, launched twice, bitwise the eager O",
        g.error.empty() ? (notRun ? "" : "the captured call ran at capture") : g.error);
  cudnnSetStream(h, nullptr);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);

  // (3) Execute's strictness, each in a child that must end naming the call.
  std::string out;
  scale = 0.25f;
  bool ok = endsTheProcess(
      [&] {
        g.execute(h, {kQ, kK, kV, kO, kStats, kScale}, {dq, dk, dv, dO, dStats, &scale}, ws);
      },
      {"cudnnBackendExecute", "does not bind UID 7"}, out);
  check(ok, "execute: a variant pack without UID 7 (the -inf scalar) ends the process", out);
  out.clear();
  std::vector<float> hostStats(rows);
  ok = endsTheProcess(
      [&] {
        g.execute(h, uids, {dq, dk, dv, dO, hostStats.data(), &scale, &negInf}, ws);
      },
      {"cudnnBackendExecute", "UID 5", "not inside one device allocation"}, out);
  check(ok, "execute: host memory for a device tensor ends the process", out);
  out.clear();
  ok = endsTheProcess(
      [&] {
        g.execute(h, uids, {dq, dk, dv, dO, dStats, &scale, &negInf}, nullptr);
      },
      {"cudnnBackendExecute", "needs a workspace"}, out);
  check(ok, "execute: no workspace for a plan that needs one ends the process", out);
  out.clear();
  ok = endsTheProcess(
      [&] {
        g.execute(h, uids, {dq, dk, dv, dq, dStats, &scale, &negInf}, ws);
      },
      {"cudnnBackendExecute", "UID 1 and UID 4 share memory"}, out);
  check(ok, "execute: O written over Q ends the process", out);

  if (ws)
    cudaFree(ws);
  for (void *p : {(void *)dq, (void *)dk, (void *)dv, (void *)dO, (void *)dO2, (void *)dStats})
    cudaFree(p);
}

// ---- (2b) The flash-attention backward graph ----------------------------------------

enum GradUid : int64_t {
  gQ = 1,
  gKT,
  gVT,
  gO,
  gDO,
  gStats,
  gDQ,
  gDK,
  gDV,
  gSoftmaxSum,
  gDQAccum,
  gScale,
  gOne,
  gNegInf
};

/// The backward graph of cudnn-frontend's CompositeSDPABackwardNode (no
/// dropout, causal, dQ accumulated in an fp32 tensor): D = rowsum(dO * O);
/// P = exp(S * scale - Stats), masked; dV = P^T dO, P^T a bf16 reshape of P
/// whose strides transpose it; dS = P * (dO V^T - D) * scale (fp32); dK =
/// dS^T Q likewise; dQaccum = dS K (dS an fp32 operand, K a reshape of K^T);
/// dQ = dQaccum.
void buildAttentionBackward(Graph &g, int64_t b, int64_t hds, int64_t t, int64_t d) {
  const Dims sd{b, hds, t, t}, rd{b, hds, t, 1}, qd{b, hds, t, d}, sdT{b, hds, t, t};
  const Dims qs = rowMajor(qd), transposed{hds * t * t, t * t, 1, t};
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  auto q = g.tensor(gQ, bf16, qd, qs);
  auto kt = g.tensor(gKT, bf16, {b, hds, d, t}, {qs[0], qs[1], qs[3], qs[2]});
  auto vt = g.tensor(gVT, bf16, {b, hds, d, t}, {qs[0], qs[1], qs[3], qs[2]});
  auto o = g.tensor(gO, bf16, qd, qs), dO = g.tensor(gDO, bf16, qd, qs);
  auto stats = g.tensor(gStats, f32, rd, rowMajor(rd));
  auto dQ = g.tensor(gDQ, bf16, qd, qs), dK = g.tensor(gDK, bf16, qd, qs);
  auto dV = g.tensor(gDV, bf16, qd, qs);
  auto softmaxSum = g.tensor(gSoftmaxSum, f32, rd, rowMajor(rd));
  auto dQAccum = g.tensor(gDQAccum, f32, qd, qs);
  auto scale = g.scalar(gScale), one = g.scalar(gOne), negInf = g.scalar(gNegInf);
  auto dOO = g.virt(f32, qd), rowDot = g.virt(f32, rd);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, dO, o, nullptr, dOO);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dOO, rowDot);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, rowDot, one, nullptr, softmaxSum);
  auto s = g.virt(f32, sd), scaled = g.virt(f32, sd), sub = g.virt(f32, sd);
  g.matmul(q, kt, s);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, s, scale, nullptr, scaled);
  g.pointwise(CUDNN_POINTWISE_SUB, f32, scaled, stats, nullptr, sub);
  auto row = g.virt(CUDNN_DATA_INT32, sd), col = g.virt(CUDNN_DATA_INT32, sd);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, f32, sub, nullptr, nullptr, row, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, f32, sub, nullptr, nullptr, col, 3);
  auto keep = g.virt(CUDNN_DATA_BOOLEAN, sd), masked = g.virt(f32, sd), p = g.virt(f32, sd);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, f32, sub, negInf, keep, masked);
  g.pointwise(CUDNN_POINTWISE_EXP, f32, masked, nullptr, nullptr, p);
  auto reshape = [&](cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t r = g.make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    g.setDesc(r, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    g.setDesc(r, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    g.finalize(r);
    g.ops.push_back(r);
  };
  auto pT = g.tensor(2001, bf16, sdT, transposed, true);
  reshape(p, pT);
  g.matmul(pT, dO, dV);
  auto dP = g.virt(f32, sd), dPSub = g.virt(f32, sd), dSRaw = g.virt(f32, sd), dS = g.virt(f32, sd);
  g.matmul(dO, vt, dP);
  g.pointwise(CUDNN_POINTWISE_SUB, f32, dP, softmaxSum, nullptr, dPSub);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, dPSub, p, nullptr, dSRaw);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, dSRaw, scale, nullptr, dS);
  auto dST = g.tensor(2002, bf16, sdT, transposed, true);
  reshape(dS, dST);
  g.matmul(dST, q, dK);
  auto k = g.tensor(2003, bf16, qd, qs, true);
  reshape(kt, k);
  g.matmul(dS, k, dQAccum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, f32, dQAccum, nullptr, nullptr, dQ);
}

void testAttentionBackward(cudnnHandle_t h) {
  const int64_t b = 1, hds = 2, t = 24, d = 16;
  const std::string name = "causal attention backward bf16 [1,2,24,16]";
  const size_t n = b * hds * t * d, rows = b * hds * t;
  const float scale = 0.25f, one = 1.0f, negInf = -std::numeric_limits<float>::infinity();
  Random rnd;
  for (int i = 0; i < 1000; ++i)
    rnd.next();
  std::vector<__nv_bfloat16> q = randomBf16(n, rnd), k = randomBf16(n, rnd), v = randomBf16(n, rnd);
  std::vector<__nv_bfloat16> dO = randomBf16(n, rnd), o(n);
  auto f = [](__nv_bfloat16 x) { return double(__bfloat162float(x)); };
  // The forward's O (rounded to bf16) and Stats (to float), in float64.
  std::vector<float> stats(rows);
  std::vector<double> sc(rows * t, 0.0);
  for (size_t r = 0; r < rows; ++r) {
    const size_t z = r / t, i = r % t;
    double mx = -INFINITY, sum = 0;
    for (size_t j = 0; j <= i; ++j) {
      double x = 0;
      for (int64_t c = 0; c < d; ++c)
        x += f(q[r * d + c]) * f(k[(z * t + j) * d + c]);
      sc[r * t + j] = x * scale;
      mx = std::max(mx, x * scale);
    }
    for (size_t j = 0; j <= i; ++j)
      sum += std::exp(sc[r * t + j] - mx);
    stats[r] = static_cast<float>(mx + std::log(sum));
    for (int64_t c = 0; c < d; ++c) {
      double acc = 0;
      for (size_t j = 0; j <= i; ++j)
        acc += std::exp(sc[r * t + j] - mx) / sum * f(v[(z * t + j) * d + c]);
      o[r * d + c] = __double2bfloat16(acc);
    }
  }
  auto *dq = toDevice(q), *dk = toDevice(k), *dv = toDevice(v), *ddO = toDevice(dO),
       *dOut = toDevice(o);
  float *dStats = toDevice(stats);
  auto *gq = static_cast<__nv_bfloat16 *>(deviceBytes(n * 2));
  auto *gk = static_cast<__nv_bfloat16 *>(deviceBytes(n * 2));
  auto *gv = static_cast<__nv_bfloat16 *>(deviceBytes(n * 2));
  auto *sum = static_cast<float *>(deviceBytes(rows * 4)),
       *acc = static_cast<float *>(deviceBytes(n * 4));

  Graph g;
  buildAttentionBackward(g, b, hds, t, d);
  g.build(h);
  const int64_t count = g.heuristics();
  g.makePlan(h);
  void *ws = g.workspace > 0 ? deviceBytes(g.workspace) : nullptr;
  g.execute(
      h,
      {gQ, gKT, gVT, gO, gDO, gStats, gDQ, gDK, gDV, gSoftmaxSum, gDQAccum, gScale, gOne, gNegInf},
      {dq, dk, dv, dOut, ddO, dStats, gq, gk, gv, sum, acc, (void *)&scale, (void *)&one,
       (void *)&negInf},
      ws);
  cudaDeviceSynchronize();
  check(g.error.empty() && count == 1, name + ": builds, plans and runs",
        g.error.empty() ? "heuristics found " + std::to_string(count) : g.error);
  if (!g.error.empty() || count != 1)
    return;
  const std::vector<__nv_bfloat16> rq = fromDevice(gq, n), rk = fromDevice(gk, n),
                                   rv = fromDevice(gv, n);
  const std::vector<float> rsum = fromDevice(sum, rows), racc = fromDevice(acc, n);

  // The reference, in float64 from the same bf16 inputs and float Stats:
  // P_ij = exp(S_ij scale - Stats_i) (j <= i), D_i = sum_c dO_ic O_ic,
  // dS_ij = P_ij (sum_c dO_ic V_jc - D_i) scale, dV = P^T dO, dK = dS^T Q,
  // dQ = dS K. Tolerances: the emulation computes P and dS in float (S to
  // 16 * 2^-24 * 16 * 0.25 absolute, so P to 1e-5 relative; dS to
  // E_ij = 1e-5 * scale * P_ij * (sum_c |dO_ic V_jc| + sum_c |dO_ic O_ic|),
  // the bounds of its two terms), then multiplies bf16 roundings of P^T
  // and dS (2^-8 relative each) and rounds each 16-bit result (2^-8 |x|):
  //   dV: 2^-8 * 1.01 * (sum_i P_ij |dO_ic| + |dV|)
  //   dK: sum_i (2^-8 * 1.01 |dS_ij| + 1.01 E_ij) |Q_ic| + 2^-8 * 1.01 |dK|
  //   dQ: the same over j with |K_jc| (dQaccum: without the last term)
  //   D (softmaxSum): 16 float additions of exact products, 16 * 2^-24 * sum|dO O|.
  const double u = std::ldexp(1.0, -8) * 1.01;
  std::vector<double> P(rows * t, 0.0), dS(rows * t, 0.0), E(rows * t, 0.0), D(rows), B(rows);
  for (size_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < d; ++c) {
      D[r] += f(dO[r * d + c]) * f(o[r * d + c]);
      B[r] += std::fabs(f(dO[r * d + c]) * f(o[r * d + c]));
    }
    const size_t z = r / t, i = r % t;
    for (size_t j = 0; j <= i; ++j) {
      P[r * t + j] = std::exp(sc[r * t + j] - double(stats[r]));
      double dp = 0, a = 0;
      for (int64_t c = 0; c < d; ++c) {
        dp += f(dO[r * d + c]) * f(v[(z * t + j) * d + c]);
        a += std::fabs(f(dO[r * d + c]) * f(v[(z * t + j) * d + c]));
      }
      dS[r * t + j] = P[r * t + j] * (dp - D[r]) * scale;
      E[r * t + j] = 1e-5 * scale * P[r * t + j] * (a + B[r]);
    }
  }
  int bad[5] = {0, 0, 0, 0, 0};
  std::string first[5];
  auto expect = [&](int which, double got, double ref, double tol, const char *what, size_t at) {
    if (!(std::fabs(got - ref) <= tol) && bad[which]++ == 0) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "%s[%zu] is %.9g, reference %.9g (tol %.3g)", what, at, got,
                    ref, tol);
      first[which] = buf;
    }
  };
  for (size_t z = 0; z < size_t(b * hds); ++z)
    for (int64_t x = 0; x < t; ++x)
      for (int64_t c = 0; c < d; ++c) {
        const size_t at = (z * t + x) * d + c;
        // x as the key j: dV, dK.
        double refV = 0, magV = 0, refK = 0, tolK = 0;
        for (int64_t i = x; i < t; ++i) {
          const size_t pi = (z * t + i) * t + x;
          refV += P[pi] * f(dO[(z * t + i) * d + c]);
          magV += P[pi] * std::fabs(f(dO[(z * t + i) * d + c]));
          refK += dS[pi] * f(q[(z * t + i) * d + c]);
          tolK += (u * std::fabs(dS[pi]) + 1.01 * E[pi]) * std::fabs(f(q[(z * t + i) * d + c]));
        }
        expect(0, f(rv[at]), refV, u * (magV + std::fabs(refV)), "dV", at);
        expect(1, f(rk[at]), refK, tolK + u * std::fabs(refK), "dK", at);
        // x as the query i: dQ, dQaccum.
        double refQ = 0, tolQ = 0;
        for (int64_t j = 0; j <= x; ++j) {
          const size_t pi = (z * t + x) * t + j;
          refQ += dS[pi] * f(k[(z * t + j) * d + c]);
          tolQ += (u * std::fabs(dS[pi]) + 1.01 * E[pi]) * std::fabs(f(k[(z * t + j) * d + c]));
        }
        expect(2, f(rq[at]), refQ, tolQ + u * std::fabs(refQ), "dQ", at);
        expect(3, racc[at], refQ, tolQ, "dQaccum", at);
      }
  for (size_t r = 0; r < rows; ++r)
    expect(4, rsum[r], D[r], 16 * std::ldexp(B[r], -24) * 1.01, "softmaxSum", r);
  const char *names[5] = {"dV", "dK", "dQ", "dQaccum (fp32)", "softmaxSum = rowsum(dO * O)"};
  for (int i = 0; i < 5; ++i)
    check(bad[i] == 0, name + ": " + names[i] + " against float64",
          first[i] + (bad[i] > 1 ? " and " + std::to_string(bad[i] - 1) + " more" : ""));
  if (ws)
    cudaFree(ws);
  for (void *p : {(void *)dq, (void *)dk, (void *)dv, (void *)ddO, (void *)dOut, (void *)dStats,
                  (void *)gq, (void *)gk, (void *)gv, (void *)sum, (void *)acc})
    cudaFree(p);
}

// ---- (2c) Rounding and reshapes, without matmuls ------------------------------------

/// x (f32) -> a virtual bf16 tensor -> y (f32): y is x rounded to bf16,
/// to nearest, ties to even. Then reshapes: a transpose through permuted
/// strides reads the same memory (y[i][j] = x[j][i]); a reshape out of a
/// tensor with gaps (strides {4, 1} over [2, 3]) takes the elements in
/// row-major order.
void testRoundingAndReshape(cudnnHandle_t h) {
  {
    // 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between bf16 neighbours (ulp
    // 2^-7 at 1): ties to even give 1 and 1 + 2^-6. The others are plain.
    const std::vector<float> x{1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -1.0f - 0x1p-8f, 0.1f,
                               3.14159265f,    -2.71828183f,       65504.0f,        1e-20f};
    std::vector<float> want;
    for (float v : x)
      want.push_back(__bfloat162float(__float2bfloat16_rn(v)));
    Graph g;
    const Dims d{1, 8};
    auto tx = g.tensor(1, CUDNN_DATA_FLOAT, d, rowMajor(d));
    auto mid = g.virt(CUDNN_DATA_BFLOAT16, d);
    auto ty = g.tensor(2, CUDNN_DATA_FLOAT, d, rowMajor(d));
    g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, tx, nullptr, nullptr, mid);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, mid, nullptr, nullptr, ty);
    g.build(h);
    const int64_t count = g.heuristics();
    g.makePlan(h);
    float *dx = toDevice(x), *dy = static_cast<float *>(deviceBytes(8 * 4));
    g.execute(h, {1, 2}, {dx, dy}, nullptr);
    const std::vector<float> y = fromDevice(dy, 8);
    check(g.error.empty() && count == 1 && g.workspace == 0 && y == want && y[0] == 1.0f &&
              y[1] == 1.0f + 0x1p-6f,
          "a virtual bf16 tensor rounds to nearest even (no matmul: the generic engine)",
          g.error.empty() ? "y[0] " + std::to_string(y[0]) + ", y[1] " + std::to_string(y[1])
                          : g.error);
    cudaFree(dx);
    cudaFree(dy);
  }
  {
    const std::vector<float> x{0, 1, 2, -1, 3, 4, 5, -1}; // [2, 3] with strides {4, 1}
    Graph g;
    auto tx = g.tensor(1, CUDNN_DATA_FLOAT, {2, 3}, {3, 1});
    // The transpose: [3, 2] over x's memory.
    auto view = g.tensor(1001, CUDNN_DATA_FLOAT, {3, 2}, {1, 3}, true);
    auto out = g.tensor(2, CUDNN_DATA_FLOAT, {3, 2}, rowMajor({3, 2}));
    cudnnBackendDescriptor_t r = g.make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    g.setDesc(r, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, tx);
    g.setDesc(r, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, view);
    g.finalize(r);
    g.ops.push_back(r);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, view, nullptr, nullptr, out);
    // The gapped one: [2, 3] with strides {4, 1} to [6].
    auto gapped = g.tensor(3, CUDNN_DATA_FLOAT, {2, 3}, {4, 1});
    auto flat = g.tensor(1002, CUDNN_DATA_FLOAT, {6}, {1}, true);
    auto out2 = g.tensor(4, CUDNN_DATA_FLOAT, {6}, {1});
    cudnnBackendDescriptor_t r2 = g.make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    g.setDesc(r2, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, gapped);
    g.setDesc(r2, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, flat);
    g.finalize(r2);
    g.ops.push_back(r2);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, flat, nullptr, nullptr, out2);
    g.build(h);
    g.heuristics();
    g.makePlan(h);
    const std::vector<float> dense{0, 1, 2, 3, 4, 5};
    float *dx = toDevice(dense), *dg = toDevice(x);
    float *dOut = static_cast<float *>(deviceBytes(6 * 4)),
          *dOut2 = static_cast<float *>(deviceBytes(6 * 4));
    g.execute(h, {1, 2, 3, 4}, {dx, dOut, dg, dOut2}, nullptr);
    const std::vector<float> t = fromDevice(dOut, 6), f = fromDevice(dOut2, 6);
    check(g.error.empty() && t == std::vector<float>{0, 3, 1, 4, 2, 5},
          "reshape: [2,3] to [3,2] with strides {1,3} is the transpose (the same memory)", g.error);
    check(g.error.empty() && f == dense,
          "reshape: [2,3] with strides {4,1} to [6] takes the elements in row-major order",
          g.error);
    for (float *p : {dx, dg, dOut, dOut2})
      cudaFree(p);
  }
}

// ---- (3) What Finalize and the heuristics refuse ------------------------------------

void testRefusals(cudnnHandle_t h) {
  {
    Graph g;
    auto x = g.tensor(1, CUDNN_DATA_FLOAT, {1, 4, 8}, rowMajor({1, 4, 8}));
    auto y = g.tensor(1, CUDNN_DATA_FLOAT, {1, 4, 1}, rowMajor({1, 4, 1}));
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, x, y);
    const cudnnStatus_t s = g.build(h);
    check(s == CUDNN_STATUS_BAD_PARAM && g.error.find("UID 1") != std::string::npos,
          "finalize: two tensors with UID 1 in one graph are CUDNN_STATUS_BAD_PARAM", g.error);
  }
  {
    Graph g;
    auto a = g.tensor(1, CUDNN_DATA_BFLOAT16, {1, 4, 16}, rowMajor({1, 4, 16}));
    auto b = g.tensor(2, CUDNN_DATA_BFLOAT16, {1, 12, 8}, rowMajor({1, 12, 8}));
    auto c = g.tensor(3, CUDNN_DATA_FLOAT, {1, 4, 8}, rowMajor({1, 4, 8}));
    const cudnnStatus_t s = g.matmul(a, b, c);
    check(s == CUDNN_STATUS_BAD_PARAM && g.error.find("K is 16") != std::string::npos,
          "finalize: a matmul [1,4,16] x [1,12,8] is CUDNN_STATUS_BAD_PARAM", g.error);
  }
  {
    Graph g;
    auto t = g.make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int32_t dims[3] = {1, 2, 3};
    const cudnnStatus_t s =
        cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT32, 3, dims);
    const std::string e = lastError();
    check(s == CUDNN_STATUS_BAD_PARAM && e.find("CUDNN_TYPE_INT64") != std::string::npos,
          "set: CUDNN_ATTR_TENSOR_DIMENSIONS as CUDNN_TYPE_INT32 is CUDNN_STATUS_BAD_PARAM", e);
    auto done = g.tensor(5, CUDNN_DATA_FLOAT, {2}, {1});
    const int64_t uid = 6;
    const cudnnStatus_t s2 =
        cudnnBackendSetAttribute(done, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    check(s2 == CUDNN_STATUS_BAD_PARAM && lastError().find("finalized") != std::string::npos,
          "set: an attribute of a finalized tensor is CUDNN_STATUS_BAD_PARAM", lastError());
    cudnnBackendDescriptor_t norm = nullptr;
    const cudnnStatus_t s3 =
        cudnnBackendCreateDescriptor(CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR, &norm);
    check(s3 == CUDNN_STATUS_NOT_SUPPORTED &&
              lastError().find("CUDNN_BACKEND_OPERATION_NORM_FORWARD_DESCRIPTOR") !=
                  std::string::npos,
          "create: a normalization descriptor is CUDNN_STATUS_NOT_SUPPORTED, named", lastError());
  }
  auto matmulGraph = [&](Graph &g, cudnnDataType_t type, int64_t k) {
    auto a = g.tensor(1, type, {1, 8, k}, rowMajor({1, 8, k}));
    auto b = g.tensor(2, type, {1, k, 8}, rowMajor({1, k, 8}));
    auto c = g.tensor(3, CUDNN_DATA_FLOAT, {1, 8, 8}, rowMajor({1, 8, 8}));
    g.matmul(a, b, c);
    g.build(h);
    return g.heuristics();
  };
  {
    Graph g;
    const int64_t n = matmulGraph(g, CUDNN_DATA_FLOAT, 16);
    check(g.error.empty() && n == 0 &&
              g.heuristicsError.find("HALF or BFLOAT16") != std::string::npos,
          "heuristics: an fp32 matmul graph has no engine", g.error + g.heuristicsError);
  }
  {
    Graph g;
    const int64_t n = matmulGraph(g, CUDNN_DATA_BFLOAT16, 12);
    check(g.error.empty() && n == 0 && g.heuristicsError.find("K = 12") != std::string::npos,
          "heuristics: head dimension 12 has no engine", g.error + g.heuristicsError);
  }
  {
    Graph g;
    const int64_t n = matmulGraph(g, CUDNN_DATA_BFLOAT16, 16);
    check(g.error.empty() && n == 1, "heuristics: head dimension 16 has an engine", g.error);
  }
  {
    setenv("CARVE_EMU_CUDNN", "unsupported", 1);
    Graph g;
    const int64_t n = matmulGraph(g, CUDNN_DATA_BFLOAT16, 16);
    check(g.error.empty() && n == 0, "heuristics: CARVE_EMU_CUDNN=unsupported finds no engine",
          g.error);
    setenv("CARVE_EMU_CUDNN", "plan-fails", 1);
    Graph g2;
    const int64_t n2 = matmulGraph(g2, CUDNN_DATA_BFLOAT16, 16);
    const cudnnStatus_t s = g2.makePlan(h);
    check(n2 == 1 && s == CUDNN_STATUS_NOT_SUPPORTED,
          "plan: CARVE_EMU_CUDNN=plan-fails fails the plan's Finalize", lastError());
    unsetenv("CARVE_EMU_CUDNN");
  }
}

// ---- (4) Convolutions ---------------------------------------------------------------

/// A 2-D convolution: X [n, c, h, w], W [o, c / groups, kh, kw], Y from
/// cuDNN's formula (floor division).
struct ConvShape {
  const char *name;
  int64_t n, c, h, w, o, kh, kw, groups;
  int64_t stride[2], pre[2], post[2], dilation[2];

  Dims x() const { return {n, c, h, w}; }
  Dims filter() const { return {o, c / groups, kh, kw}; }
  Dims y() const {
    return {n, o, (h + pre[0] + post[0] - dilation[0] * (kh - 1) - 1) / stride[0] + 1,
            (w + pre[1] + post[1] - dilation[1] * (kw - 1) - 1) / stride[1] + 1};
  }
};

const ConvShape kConvShapes[] = {
    {"(a) 3x3 stride 1 pad 1", 2, 4, 8, 8, 6, 3, 3, 1, {1, 1}, {1, 1}, {1, 1}, {1, 1}},
    {"(b) 3x3 stride 2 pad pre 1 post 0", 2, 4, 9, 8, 4, 3, 3, 1, {2, 2}, {1, 1}, {0, 0}, {1, 1}},
    {"(c) 3x3 dilation 2 pad 2", 1, 3, 10, 9, 4, 3, 3, 1, {1, 1}, {2, 2}, {2, 2}, {2, 2}},
    {"(d) 3x3 groups 2", 2, 4, 6, 6, 6, 3, 3, 2, {1, 1}, {1, 1}, {1, 1}, {1, 1}},
    {"(e) 3x3 depthwise x2 (groups 4)", 2, 4, 7, 7, 8, 3, 3, 4, {1, 1}, {1, 1}, {1, 1}, {1, 1}},
    {"(f) 1x1 stride 2", 2, 6, 8, 8, 4, 1, 1, 1, {2, 2}, {0, 0}, {0, 0}, {1, 1}},
    {"(g) 7x7 stride 2 pad 3", 2, 3, 16, 16, 4, 7, 7, 1, {2, 2}, {3, 3}, {3, 3}, {1, 1}},
};

enum class ConvDir { Forward, BackwardData, BackwardFilter };
const ConvDir kConvDirs[] = {ConvDir::Forward, ConvDir::BackwardData, ConvDir::BackwardFilter};

const char *dirName(ConvDir d) {
  return d == ConvDir::Forward        ? "forward"
         : d == ConvDir::BackwardData ? "backward data"
                                      : "backward filter";
}

/// A convolution descriptor's attributes (an empty `pre`: left unset).
struct ConvParams {
  int64_t spatialDims = 2;
  Dims stride{1, 1}, pre{0, 0}, post{0, 0}, dilation{1, 1};
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  cudnnDataType_t comp = CUDNN_DATA_FLOAT;
};
/// The descriptor, set as runtime code sets it and finalized (the status in
/// `status`).
cudnnBackendDescriptor_t convDesc(Graph &g, const ConvParams &p, cudnnStatus_t *status = nullptr) {
  cudnnBackendDescriptor_t c = g.make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  g.set(c, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &p.comp);
  g.set(c, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &p.mode);
  g.set(c, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &p.spatialDims);
  g.set(c, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, p.dilation.size(),
        p.dilation.data());
  g.set(c, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, p.stride.size(),
        p.stride.data());
  if (!p.pre.empty())
    g.set(c, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, p.pre.size(), p.pre.data());
  g.set(c, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, p.post.size(), p.post.data());
  const cudnnStatus_t s = g.finalize(c);
  if (status)
    *status = s;
  return c;
}
ConvParams paramsOf(const ConvShape &s, cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION) {
  ConvParams p;
  p.stride = {s.stride[0], s.stride[1]};
  p.pre = {s.pre[0], s.pre[1]};
  p.post = {s.post[0], s.post[1]};
  p.dilation = {s.dilation[0], s.dilation[1]};
  p.mode = mode;
  return p;
}

/// The convolution operation of direction `dir` over the tensors in the
/// forward's roles (x: X or DX, w: W or DW, y: Y or DY), alpha and beta set
/// as CUDNN_TYPE_FLOAT (as carve does) or CUDNN_TYPE_DOUBLE; its Finalize
/// status.
cudnnStatus_t convOp(Graph &g, ConvDir dir, cudnnBackendDescriptor_t conv,
                     cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t w,
                     cudnnBackendDescriptor_t y, double alpha = 1, double beta = 0,
                     bool asDouble = false) {
  struct Names {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t alpha, beta, conv, w, x, y;
  };
  static const Names names[] = {
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY},
  };
  const Names &n = names[static_cast<int>(dir)];
  cudnnBackendDescriptor_t op = g.make(n.type);
  const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
  if (asDouble) {
    g.set(op, n.alpha, CUDNN_TYPE_DOUBLE, 1, &alpha);
    g.set(op, n.beta, CUDNN_TYPE_DOUBLE, 1, &beta);
  } else {
    g.set(op, n.alpha, CUDNN_TYPE_FLOAT, 1, &alpha32);
    g.set(op, n.beta, CUDNN_TYPE_FLOAT, 1, &beta32);
  }
  g.setDesc(op, n.conv, conv);
  g.setDesc(op, n.w, w);
  g.setDesc(op, n.x, x);
  g.setDesc(op, n.y, y);
  const cudnnStatus_t s = g.finalize(op);
  g.ops.push_back(op);
  return s;
}

/// NHWC strides for [N, C, H, W] dims (the filter's: [O, kh, kw, C/g]).
Dims channelsLast(const Dims &d) { return {d[1] * d[2] * d[3], 1, d[3] * d[1], d[1]}; }

int64_t elementSize(cudnnDataType_t t) { return t == CUDNN_DATA_FLOAT ? 4 : 2; }

/// The offset of row-major element l of a 4-D tensor.
int64_t offset4(const Dims &dims, const Dims &strides, int64_t l) {
  int64_t o = 0;
  for (int i = 3; i >= 0; --i) {
    o += (l % dims[i]) * strides[i];
    l /= dims[i];
  }
  return o;
}
int64_t extent4(const Dims &dims, const Dims &strides) {
  int64_t e = 1;
  for (int i = 0; i < 4; ++i)
    e += (dims[i] - 1) * strides[i];
  return e;
}

/// Values v (row-major over dims, each representable in t) stored through
/// strides as t.
std::vector<unsigned char> pack(const std::vector<double> &v, const Dims &dims, const Dims &strides,
                                cudnnDataType_t t) {
  const int64_t size = elementSize(t);
  std::vector<unsigned char> out(extent4(dims, strides) * size, 0xFF);
  for (size_t l = 0; l < v.size(); ++l) {
    unsigned char *p = out.data() + offset4(dims, strides, l) * size;
    if (t == CUDNN_DATA_FLOAT) {
      const float f = static_cast<float>(v[l]);
      std::memcpy(p, &f, 4);
    } else if (t == CUDNN_DATA_BFLOAT16) {
      const __nv_bfloat16 b = __float2bfloat16(static_cast<float>(v[l]));
      std::memcpy(p, &b, 2);
    } else {
      const __half b = __float2half(static_cast<float>(v[l]));
      std::memcpy(p, &b, 2);
    }
  }
  return out;
}
std::vector<double> unpack(const std::vector<unsigned char> &bytes, const Dims &dims,
                           const Dims &strides, cudnnDataType_t t) {
  const int64_t size = elementSize(t), count = dims[0] * dims[1] * dims[2] * dims[3];
  std::vector<double> v(count);
  for (int64_t l = 0; l < count; ++l) {
    const unsigned char *p = bytes.data() + offset4(dims, strides, l) * size;
    if (t == CUDNN_DATA_FLOAT) {
      float f;
      std::memcpy(&f, p, 4);
      v[l] = f;
    } else if (t == CUDNN_DATA_BFLOAT16) {
      __nv_bfloat16 b;
      std::memcpy(&b, p, 2);
      v[l] = __bfloat162float(b);
    } else {
      __half b;
      std::memcpy(&b, p, 2);
      v[l] = __half2float(b);
    }
  }
  return v;
}

/// Random X, W and DY in [-1, 1), representable in `t` (fp32 values carry
/// 24 significant bits, so rounding them to TF32 changes them).
struct ConvData {
  std::vector<double> x, w, dy;
};
ConvData convData(const ConvShape &s, cudnnDataType_t t, Random &r) {
  auto fill = [&](const Dims &d) {
    std::vector<double> v(d[0] * d[1] * d[2] * d[3]);
    for (double &e : v) {
      const float f = r.next();
      e = t == CUDNN_DATA_FLOAT ? f : __bfloat162float(__float2bfloat16(f));
    }
    return v;
  };
  return {fill(s.x()), fill(s.filter()), fill(s.y())};
}

/// The float64 reference of all three directions, enumerating every valid
/// tap (n, o, i, j, c, a, b) once -- the other way round from the
/// emulation's per-output sums: y += x w, dx += dy w, dw += dy x. Besides
/// each sum: the sum of its terms' magnitudes and how many terms it has.
struct ConvRef {
  std::vector<double> out[3], mag[3];
  std::vector<int64_t> terms[3];
};
ConvRef convReference(const ConvShape &s, const ConvData &d, bool flip) {
  const Dims xd = s.x(), wd = s.filter(), yd = s.y();
  const int64_t cg = wd[1], og = s.o / s.groups;
  ConvRef r;
  const size_t sizes[3] = {d.dy.size(), d.x.size(), d.w.size()};
  for (int k = 0; k < 3; ++k) {
    r.out[k].assign(sizes[k], 0.0);
    r.mag[k].assign(sizes[k], 0.0);
    r.terms[k].assign(sizes[k], 0);
  }
  auto add = [&](int k, int64_t at, double p) {
    r.out[k][at] += p;
    r.mag[k][at] += std::fabs(p);
    ++r.terms[k][at];
  };
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t o = 0; o < s.o; ++o)
      for (int64_t i = 0; i < yd[2]; ++i)
        for (int64_t j = 0; j < yd[3]; ++j)
          for (int64_t c = 0; c < cg; ++c)
            for (int64_t a = 0; a < s.kh; ++a)
              for (int64_t b = 0; b < s.kw; ++b) {
                const int64_t h = i * s.stride[0] - s.pre[0] + a * s.dilation[0];
                const int64_t v = j * s.stride[1] - s.pre[1] + b * s.dilation[1];
                if (h < 0 || h >= s.h || v < 0 || v >= s.w)
                  continue;
                const int64_t xc = o / og * cg + c;
                const int64_t fa = flip ? s.kh - 1 - a : a, fb = flip ? s.kw - 1 - b : b;
                const int64_t xi = ((n * xd[1] + xc) * xd[2] + h) * xd[3] + v;
                const int64_t wi = ((o * wd[1] + c) * wd[2] + fa) * wd[3] + fb;
                const int64_t yi = ((n * yd[1] + o) * yd[2] + i) * yd[3] + j;
                add(0, yi, d.x[xi] * d.w[wi]);
                add(1, xi, d.dy[yi] * d.w[wi]);
                add(2, wi, d.dy[yi] * d.x[xi]);
              }
  return r;
}

/// Which of the heuristics' configurations to run, by its engine's notes.
enum class Pick {
  Exact,            // no note: what carve takes for fp32
  Tf32,             // DOWN_CONVERT_INPUTS
  Nondeterministic, // NONDETERMINISTIC
  TensorCore16,     // TENSOR_CORE, deterministic: what carve takes for 16-bit
};
const char *pickName(Pick p) {
  switch (p) {
  case Pick::Exact:
    return "exact fp32 engine";
  case Pick::Tf32:
    return "TF32 engine";
  case Pick::Nondeterministic:
    return "nondeterministic engine";
  default:
    return "tensor-core engine";
  }
}
bool has(const std::vector<cudnnBackendNumericalNote_t> &notes, cudnnBackendNumericalNote_t n) {
  return std::find(notes.begin(), notes.end(), n) != notes.end();
}
bool picks(Pick p, const std::vector<cudnnBackendNumericalNote_t> &notes) {
  const bool nondet = has(notes, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC);
  switch (p) {
  case Pick::Exact:
    return notes.empty();
  case Pick::Tf32:
    return has(notes, CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS);
  case Pick::Nondeterministic:
    return nondet;
  default:
    return has(notes, CUDNN_NUMERICAL_NOTE_TENSOR_CORE) && !nondet;
  }
}

/// One convolution run through the backend API.
struct ConvRun {
  std::string error;   // the first failing call, or why no configuration was picked
  std::string engines; // the heuristics' engines in order: "4 (NONDETERMINISTIC), 2 ()"
  int64_t workspace = -1;
  std::vector<double> out; // row-major over the output's dims
};

std::string notesText(const std::vector<cudnnBackendNumericalNote_t> &notes) {
  std::string s;
  for (cudnnBackendNumericalNote_t n : notes)
    s += std::string(s.empty() ? "" : ", ") +
         (n == CUDNN_NUMERICAL_NOTE_TENSOR_CORE           ? "TENSOR_CORE"
          : n == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS ? "DOWN_CONVERT_INPUTS"
          : n == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC    ? "NONDETERMINISTIC"
                                                          : "another note");
  return s;
}

struct ConvOptions {
  bool nhwc = false;
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  double alpha = 1, beta = 0;
  bool doubleScales = false;                    // alpha and beta as CUDNN_TYPE_DOUBLE
  const std::vector<double> *initial = nullptr; // the output before (beta != 0)
};

/// Builds X (UID 1), W (2), Y (3) in `t` and the operation of `dir`, runs
/// heuristic A, plans the first configuration `pick` takes with exactly the
/// workspace it asks for, executes and reads the output back.
ConvRun runConv(cudnnHandle_t h, const ConvShape &s, ConvDir dir, cudnnDataType_t t, Pick pick,
                const ConvData &d, const ConvOptions &opt = {}) {
  ConvRun r;
  Graph g;
  const Dims dims[3] = {s.x(), s.filter(), s.y()};
  Dims strides[3];
  for (int k = 0; k < 3; ++k)
    strides[k] = opt.nhwc ? channelsLast(dims[k]) : rowMajor(dims[k]);
  cudnnBackendDescriptor_t tx = g.tensor(1, t, dims[0], strides[0]);
  cudnnBackendDescriptor_t tw = g.tensor(2, t, dims[1], strides[1]);
  cudnnBackendDescriptor_t ty = g.tensor(3, t, dims[2], strides[2]);
  cudnnBackendDescriptor_t conv = convDesc(g, paramsOf(s, opt.mode));
  convOp(g, dir, conv, tx, tw, ty, opt.alpha, opt.beta, opt.doubleScales);
  g.build(h);
  const int64_t count = g.heuristics();
  cudnnBackendDescriptor_t chosen = nullptr;
  for (int64_t i = 0; i < count; ++i) {
    const Graph::Engine e = g.engineOf(g.configs[i]);
    r.engines += (i ? ", " : "") + std::to_string(e.index) + " (" + notesText(e.notes) + ")";
    if (!chosen && picks(pick, e.notes))
      chosen = g.configs[i];
  }
  if (!g.error.empty() || !chosen) {
    r.error = g.error.empty() ? std::string("no configuration for the ") + pickName(pick) +
                                    " among " + std::to_string(count) + ": " + r.engines +
                                    (count <= 0 ? g.heuristicsError : "")
                              : g.error;
    return r;
  }
  g.config = chosen;
  g.makePlan(h);
  r.workspace = g.workspace;
  // The inputs of `dir`; its output poisoned (NaN) unless beta reads it.
  const std::vector<double> *values[3] = {&d.x, &d.w, &d.dy};
  const int written = dir == ConvDir::Forward ? 2 : dir == ConvDir::BackwardData ? 0 : 1;
  void *buf[3];
  for (int k = 0; k < 3; ++k) {
    const std::vector<double> *v = k == written ? opt.initial : values[k];
    if (v) {
      buf[k] = toDevice(pack(*v, dims[k], strides[k], t));
    } else {
      buf[k] = deviceBytes(extent4(dims[k], strides[k]) * elementSize(t));
    }
  }
  void *ws = g.workspace > 0 ? deviceBytes(g.workspace) : nullptr;
  g.execute(h, {1, 2, 3}, {buf[0], buf[1], buf[2]}, ws);
  cudaDeviceSynchronize();
  r.error = g.error;
  const size_t bytes = extent4(dims[written], strides[written]) * elementSize(t);
  r.out = unpack(fromDevice(static_cast<unsigned char *>(buf[written]), bytes), dims[written],
                 strides[written], t);
  for (void *p : buf)
    cudaFree(p);
  if (ws)
    cudaFree(ws);
  return r;
}

/// |got - ref| <= tol element by element; "" or the first failure and the
/// count.
std::string within(const std::vector<double> &got, const std::vector<double> &ref,
                   const std::function<double(size_t)> &tol) {
  int bad = 0;
  std::string first;
  if (got.size() != ref.size())
    return "size " + std::to_string(got.size()) + ", expected " + std::to_string(ref.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - ref[i]) <= tol(i)) && bad++ == 0) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "element %zu is %.9g, reference %.9g (|err| %.3g > tol %.3g)",
                    i, got[i], ref[i], std::fabs(got[i] - ref[i]), tol(i));
      first = buf;
    }
  return bad ? first + (bad > 1 ? " and " + std::to_string(bad - 1) + " more" : "") : "";
}

// Tolerances, for an output element whose reference is `ref`, with L
// terms of total magnitude M = sum |p|. The emulation sums L float
// products in float: |fl(sum) - sum| <= gamma_L M, gamma_L = L u / (1 - L u),
// u = 2^-24 (products rounded too: the dot-product bound).
// - TF32 engine: each input rounded to 10 explicit mantissa bits, to nearest
//   (2^-11 relative), so each product is off by at most (2^-10 + 2^-22) |p|,
//   and the products of TF32 values are exact in float:
//   (2^-10 + 2^-22) M + gamma_L (1 + 2^-10 + 2^-22) M.
// - bf16 engine: the inputs are the reference's own bf16 values, their
//   products exact in float; the sum (gamma_L M) is then rounded to bf16,
//   2^-8 relative: gamma_L M + 2^-8 (|ref| + gamma_L M).
double gammaOf(int64_t terms) {
  const double lu = std::ldexp(static_cast<double>(terms), -24);
  return lu / (1 - lu);
}
double exactTol(const ConvRef &r, int k, size_t i) { return gammaOf(r.terms[k][i]) * r.mag[k][i]; }
double tf32Tol(const ConvRef &r, int k, size_t i) {
  const double e = std::ldexp(1.0, -10) + std::ldexp(1.0, -22);
  return e * r.mag[k][i] + gammaOf(r.terms[k][i]) * (1 + e) * r.mag[k][i];
}
double bf16Tol(const ConvRef &r, int k, size_t i) {
  const double sum = gammaOf(r.terms[k][i]) * r.mag[k][i];
  return sum + std::ldexp(std::fabs(r.out[k][i]) + sum, -8);
}

/// The reference's index (0 y, 1 dx, 2 dw) of direction `dir`'s output.
int refIndex(ConvDir dir) {
  return dir == ConvDir::Forward ? 0 : dir == ConvDir::BackwardData ? 1 : 2;
}

void testConvolutions(cudnnHandle_t h) {
  Random rnd;
  for (int i = 0; i < 3000; ++i)
    rnd.next();
  for (const ConvShape &s : kConvShapes) {
    const ConvData f32 = convData(s, CUDNN_DATA_FLOAT, rnd),
                   b16 = convData(s, CUDNN_DATA_BFLOAT16, rnd);
    const ConvRef ref32 = convReference(s, f32, false), ref16 = convReference(s, b16, false);
    for (ConvDir dir : kConvDirs) {
      const int k = refIndex(dir);
      const std::string name = std::string("conv ") + s.name + " " + dirName(dir);
      // fp32, the exact engine (carve's choice).
      const ConvRun exact = runConv(h, s, dir, CUDNN_DATA_FLOAT, Pick::Exact, f32);
      check(exact.error.empty() &&
                within(exact.out, ref32.out[k], [&](size_t i) { return exactTol(ref32, k, i); })
                    .empty(),
            name + " fp32, exact fp32 engine: against float64",
            exact.error.empty()
                ? within(exact.out, ref32.out[k], [&](size_t i) { return exactTol(ref32, k, i); })
                : exact.error);
      // fp32, the TF32 engine: within its bound, and not the exact result.
      const ConvRun tf32 = runConv(h, s, dir, CUDNN_DATA_FLOAT, Pick::Tf32, f32);
      const std::string tf32Err =
          tf32.error.empty()
              ? within(tf32.out, ref32.out[k], [&](size_t i) { return tf32Tol(ref32, k, i); })
              : tf32.error;
      check(tf32Err.empty(), name + " fp32, TF32 engine: within the TF32 bound", tf32Err);
      int beyond = 0;
      for (size_t i = 0; i < tf32.out.size() && i < ref32.out[k].size(); ++i)
        beyond += std::fabs(tf32.out[i] - ref32.out[k][i]) > exactTol(ref32, k, i);
      check(tf32.error.empty() && beyond > 0,
            name + " fp32, TF32 engine: rounds its inputs (outside the exact engine's bound)",
            std::to_string(beyond) + " of " + std::to_string(tf32.out.size()) +
                " elements beyond the fp32 bound");
      if (dir == ConvDir::BackwardFilter) {
        const ConvRun nd = runConv(h, s, dir, CUDNN_DATA_FLOAT, Pick::Nondeterministic, f32);
        int differ = 0;
        for (size_t i = 0; i < nd.out.size() && i < exact.out.size(); ++i)
          differ += nd.out[i] != exact.out[i];
        const std::string ndErr =
            nd.error.empty()
                ? within(nd.out, ref32.out[k], [&](size_t i) { return exactTol(ref32, k, i); })
                : nd.error;
        check(ndErr.empty() && differ > 0,
              name + " fp32, nondeterministic engine: within the fp32 bound, other low bits",
              ndErr.empty() ? std::to_string(differ) + " elements differ from the exact engine's"
                            : ndErr);
      }
      // bf16 on the tensor-core engine.
      const ConvRun bf = runConv(h, s, dir, CUDNN_DATA_BFLOAT16, Pick::TensorCore16, b16);
      const std::string bfErr =
          bf.error.empty()
              ? within(bf.out, ref16.out[k], [&](size_t i) { return bf16Tol(ref16, k, i); })
              : bf.error;
      check(bfErr.empty(), name + " bf16, tensor-core engine: within the bf16 bound", bfErr);
    }
  }

  // What the heuristics offer, and the workspaces, on (a).
  const ConvShape &a = kConvShapes[0];
  const ConvData f32 = convData(a, CUDNN_DATA_FLOAT, rnd),
                 b16 = convData(a, CUDNN_DATA_BFLOAT16, rnd);
  {
    const char *want[3][2] = {{"1 (TENSOR_CORE, DOWN_CONVERT_INPUTS), 2 ()", "3 (TENSOR_CORE)"},
                              {"1 (TENSOR_CORE, DOWN_CONVERT_INPUTS), 2 ()", "3 (TENSOR_CORE)"},
                              {"4 (NONDETERMINISTIC), 1 (TENSOR_CORE, DOWN_CONVERT_INPUTS), 2 ()",
                               "4 (NONDETERMINISTIC), 3 (TENSOR_CORE)"}};
    for (ConvDir dir : kConvDirs) {
      const ConvRun r32 = runConv(h, a, dir, CUDNN_DATA_FLOAT, Pick::Exact, f32);
      const ConvRun r16 = runConv(h, a, dir, CUDNN_DATA_BFLOAT16, Pick::TensorCore16, b16);
      const int i = static_cast<int>(dir);
      check(r32.engines == want[i][0] && r16.engines == want[i][1],
            std::string("conv heuristics, ") + dirName(dir) +
                ": engines (global index, notes) in order, fp32 [" + want[i][0] + "], bf16 [" +
                want[i][1] + "]",
            "fp32 [" + r32.engines + "], bf16 [" + r16.engines + "]");
    }
    // Forward on (a): Y [2, 6, 8, 8] is 768 floats (3072 bytes); the TF32
    // engine adds X [2, 4, 8, 8] (2048 bytes) and W [6, 4, 3, 3] (864,
    // 1024 aligned) rounded to TF32.
    const ConvRun e = runConv(h, a, ConvDir::Forward, CUDNN_DATA_FLOAT, Pick::Exact, f32);
    const ConvRun t = runConv(h, a, ConvDir::Forward, CUDNN_DATA_FLOAT, Pick::Tf32, f32);
    check(e.workspace == 3072 && t.workspace == 3072 + 2048 + 1024,
          "conv workspace: exact fp32 engine 3072 bytes (fp32 Y), TF32 engine 6144 (and X, W)",
          std::to_string(e.workspace) + " and " + std::to_string(t.workspace));
  }

  // CUDNN_CONVOLUTION: the filter flipped, in all three directions.
  {
    const ConvRef flipped = convReference(a, f32, true);
    ConvOptions opt;
    opt.mode = CUDNN_CONVOLUTION;
    for (ConvDir dir : kConvDirs) {
      const int k = refIndex(dir);
      const ConvRun r = runConv(h, a, dir, CUDNN_DATA_FLOAT, Pick::Exact, f32, opt);
      const std::string err =
          r.error.empty()
              ? within(r.out, flipped.out[k], [&](size_t i) { return exactTol(flipped, k, i); })
              : r.error;
      check(err.empty(),
            std::string("conv (a) CUDNN_CONVOLUTION (flipped filter) ") + dirName(dir) +
                " fp32: against float64",
            err);
    }
  }

  // NHWC strides (and the filter [O, kh, kw, C/g]) on (b), fp32.
  {
    const ConvShape &b = kConvShapes[1];
    const ConvData d = convData(b, CUDNN_DATA_FLOAT, rnd);
    const ConvRef ref = convReference(b, d, false);
    ConvOptions opt;
    opt.nhwc = true;
    for (ConvDir dir : kConvDirs) {
      const int k = refIndex(dir);
      const ConvRun r = runConv(h, b, dir, CUDNN_DATA_FLOAT, Pick::Exact, d, opt);
      const std::string err =
          r.error.empty() ? within(r.out, ref.out[k], [&](size_t i) { return exactTol(ref, k, i); })
                          : r.error;
      check(err.empty(),
            std::string("conv (b) NHWC strides ") + dirName(dir) + " fp32: against float64", err);
    }
  }

  // alpha and beta (set as doubles): Y = 0.75 conv - 1.5 Y. Besides the
  // sum's gamma_L M (times |alpha|), three float roundings (alpha s, beta y,
  // their sum), each at most u of a magnitude below |alpha| (|ref| +
  // gamma_L M) + |beta y|: 3u < 2^-22 of that, 1.01 for the second-order
  // terms.
  {
    ConvOptions opt;
    opt.alpha = 0.75;
    opt.beta = -1.5;
    opt.doubleScales = true;
    const ConvRef ref = convReference(a, f32, false);
    std::vector<double> before(ref.out[0].size());
    for (double &v : before)
      v = rnd.next();
    opt.initial = &before;
    std::vector<double> want(before.size());
    for (size_t i = 0; i < want.size(); ++i)
      want[i] = 0.75 * ref.out[0][i] - 1.5 * before[i];
    const ConvRun r = runConv(h, a, ConvDir::Forward, CUDNN_DATA_FLOAT, Pick::Exact, f32, opt);
    const std::string err =
        r.error.empty()
            ? within(r.out, want,
                     [&](size_t i) {
                       const double s = exactTol(ref, 0, i);
                       return 1.01 * (0.75 * s + std::ldexp(0.75 * (std::fabs(ref.out[0][i]) + s) +
                                                                1.5 * std::fabs(before[i]),
                                                            -22));
                     })
            : r.error;
    check(err.empty(),
          "conv (a) forward fp32, alpha 0.75 and beta -1.5 (CUDNN_TYPE_DOUBLE): against float64",
          err);
  }
}

// ---- (4b) What the convolutions refuse ----------------------------------------------

void testConvolutionRefusals(cudnnHandle_t h) {
  const ConvShape &a = kConvShapes[0]; // X [2, 4, 8, 8], W [6, 4, 3, 3], Y [2, 6, 8, 8]
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  {
    Graph g;
    auto x = g.tensor(1, f32, a.x(), rowMajor(a.x()));
    auto w = g.tensor(2, f32, a.filter(), rowMajor(a.filter()));
    auto y = g.tensor(3, f32, {2, 6, 7, 8}, rowMajor({2, 6, 7, 8}));
    const cudnnStatus_t s = convOp(g, ConvDir::Forward, convDesc(g, paramsOf(a)), x, w, y);
    check(s == CUDNN_STATUS_BAD_PARAM &&
              g.error.find("CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR") !=
                  std::string::npos &&
              g.error.find("Y's dims [2, 6, 7, 8], expected [2, 6, 8, 8]") != std::string::npos,
          "conv finalize: Y [2,6,7,8] for a 3x3 pad 1 convolution of [2,4,8,8] is "
          "CUDNN_STATUS_BAD_PARAM, naming Y",
          g.error);
  }
  {
    Graph g;
    ConvParams p = paramsOf(a);
    p.pre.clear();
    cudnnStatus_t s;
    convDesc(g, p, &s);
    check(s == CUDNN_STATUS_BAD_PARAM &&
              g.error.find("CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR") != std::string::npos &&
              g.error.find("CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS is required") != std::string::npos,
          "conv finalize: a convolution descriptor without its pre-paddings is "
          "CUDNN_STATUS_BAD_PARAM, naming the attribute",
          g.error);
  }
  {
    Graph g;
    ConvParams p;
    p.spatialDims = 3;
    p.stride = p.dilation = {1, 1, 1};
    p.pre = p.post = {0, 0, 0};
    cudnnStatus_t s;
    convDesc(g, p, &s);
    check(s == CUDNN_STATUS_NOT_SUPPORTED &&
              g.error.find("CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS 3") != std::string::npos,
          "conv finalize: 3 spatial dimensions are CUDNN_STATUS_NOT_SUPPORTED", g.error);
  }
  {
    Graph g;
    ConvParams p = paramsOf(a);
    p.comp = CUDNN_DATA_HALF;
    cudnnStatus_t s;
    convDesc(g, p, &s);
    check(s == CUDNN_STATUS_NOT_SUPPORTED &&
              g.error.find("CUDNN_ATTR_CONVOLUTION_COMP_TYPE CUDNN_DATA_HALF") != std::string::npos,
          "conv finalize: compute type HALF is CUDNN_STATUS_NOT_SUPPORTED here", g.error);
  }
  {
    Graph g;
    ConvParams p = paramsOf(a);
    p.stride = {1, 0};
    cudnnStatus_t s;
    convDesc(g, p, &s);
    check(s == CUDNN_STATUS_BAD_PARAM &&
              g.error.find("CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES [1, 0]") != std::string::npos,
          "conv finalize: a stride of 0 is CUDNN_STATUS_BAD_PARAM", g.error);
  }
  {
    Graph g;
    cudnnBackendDescriptor_t op = g.make(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR);
    const int64_t one = 1;
    const cudnnStatus_t s = cudnnBackendSetAttribute(
        op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_INT64, 1, &one);
    check(s == CUDNN_STATUS_BAD_PARAM &&
              lastError().find("takes CUDNN_TYPE_FLOAT, not CUDNN_TYPE_INT64") != std::string::npos,
          "conv set: ALPHA as CUDNN_TYPE_INT64 is CUDNN_STATUS_BAD_PARAM", lastError());
  }
  {
    Graph g;
    auto x = g.tensor(1, f32, a.x(), rowMajor(a.x()));
    auto w = g.tensor(2, CUDNN_DATA_HALF, a.filter(), rowMajor(a.filter()));
    auto y = g.tensor(3, f32, a.y(), rowMajor(a.y()));
    const cudnnStatus_t s = convOp(g, ConvDir::Forward, convDesc(g, paramsOf(a)), x, w, y);
    check(s == CUDNN_STATUS_BAD_PARAM &&
              g.error.find("X is CUDNN_DATA_FLOAT, W CUDNN_DATA_HALF") != std::string::npos,
          "conv finalize: an fp32 X with a HALF W is CUDNN_STATUS_BAD_PARAM", g.error);
  }
  {
    Graph g;
    auto x = g.tensor(1, f32, {2, 6, 8, 8}, rowMajor({2, 6, 8, 8}));
    auto w = g.tensor(2, f32, {6, 4, 3, 3}, rowMajor({6, 4, 3, 3}));
    auto y = g.tensor(3, f32, a.y(), rowMajor(a.y()));
    const cudnnStatus_t s = convOp(g, ConvDir::Forward, convDesc(g, paramsOf(a)), x, w, y);
    check(s == CUDNN_STATUS_BAD_PARAM && g.error.find("not a multiple") != std::string::npos,
          "conv finalize: 6 channels over a filter of 4 is CUDNN_STATUS_BAD_PARAM", g.error);
  }

  // A graph to run: forward fp32 on (a).
  auto forward = [&](Graph &g) {
    auto x = g.tensor(1, f32, a.x(), rowMajor(a.x()));
    auto w = g.tensor(2, f32, a.filter(), rowMajor(a.filter()));
    auto y = g.tensor(3, f32, a.y(), rowMajor(a.y()));
    convOp(g, ConvDir::Forward, convDesc(g, paramsOf(a)), x, w, y);
    g.build(h);
  };
  {
    Graph g;
    forward(g);
    int64_t engines = -1;
    cudnnBackendGetAttribute(g.graph, CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT,
                             CUDNN_TYPE_INT64, 1, nullptr, &engines);
    // An engine the caller builds by global index.
    auto engine = [&](int64_t index) {
      cudnnBackendDescriptor_t e = g.make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
      g.setDesc(e, CUDNN_ATTR_ENGINE_OPERATION_GRAPH, g.graph);
      g.set(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &index);
      const cudnnStatus_t s = cudnnBackendFinalize(e);
      return std::make_pair(s, lastError());
    };
    const auto [s0, e0] = engine(0);
    const auto [s3, e3] = engine(3);
    const auto [s5, e5] = engine(5);
    check(g.error.empty() && engines == 5 && s0 == CUDNN_STATUS_NOT_SUPPORTED &&
              s3 == CUDNN_STATUS_NOT_SUPPORTED &&
              e3.find("HALF or BFLOAT16") != std::string::npos && s5 == CUDNN_STATUS_BAD_PARAM,
          "conv engines by global index: 5 for the graph; 0 (attention) and 3 (16-bit) refuse an "
          "fp32 convolution, 5 does not exist",
          g.error + " " + std::to_string(engines) + "; " + e0 + "; " + e3 + "; " + e5);
  }
  {
    Graph g;
    auto x = g.tensor(1, f32, a.x(), rowMajor(a.x()));
    auto w = g.tensor(2, f32, a.filter(), rowMajor(a.filter()));
    auto y = g.virt(f32, a.y());
    auto z = g.tensor(3, f32, a.y(), rowMajor(a.y()));
    convOp(g, ConvDir::Forward, convDesc(g, paramsOf(a)), x, w, y);
    g.pointwise(CUDNN_POINTWISE_RELU_FWD, f32, y, nullptr, nullptr, z);
    g.build(h);
    const int64_t n = g.heuristics();
    check(g.error.empty() && n == 0 &&
              g.heuristicsError.find("one convolution and nothing else") != std::string::npos,
          "conv heuristics: a convolution fused with a ReLU has no engine",
          g.error + g.heuristicsError);
  }
  {
    setenv("CARVE_EMU_CUDNN", "unsupported", 1);
    Graph g;
    forward(g);
    const int64_t n = g.heuristics();
    check(g.error.empty() && n == 0, "conv heuristics: CARVE_EMU_CUDNN=unsupported finds no engine",
          g.error);
    setenv("CARVE_EMU_CUDNN", "plan-fails", 1);
    Graph g2;
    forward(g2);
    const int64_t n2 = g2.heuristics();
    const cudnnStatus_t s = g2.makePlan(h);
    check(n2 == 2 && s == CUDNN_STATUS_NOT_SUPPORTED,
          "conv plan: CARVE_EMU_CUDNN=plan-fails fails the plan's Finalize", lastError());
    unsetenv("CARVE_EMU_CUDNN");
  }
  {
    Graph g;
    forward(g);
    g.heuristics();
    g.makePlan(h); // config 0: the TF32 engine
    void *x = deviceBytes(2 * 4 * 8 * 8 * 4), *w = deviceBytes(6 * 4 * 3 * 3 * 4),
         *y = deviceBytes(2 * 6 * 8 * 8 * 4);
    void *ws = deviceBytes(g.workspace), *shortWs = deviceBytes(g.workspace - 256);
    std::string out;
    bool ok = endsTheProcess(
        [&] {
          g.execute(h, {1, 3}, {x, y}, ws);
        },
        {"cudnnBackendExecute", "does not bind UID 2"}, out);
    check(ok, "conv execute: a variant pack without W (UID 2) ends the process", out);
    out.clear();
    ok = endsTheProcess(
        [&] {
          g.execute(h, {1, 2, 3}, {x, w, y}, shortWs);
        },
        {"cudnnBackendExecute", "the workspace", "not inside one device allocation"}, out);
    check(ok, "conv execute: a workspace 256 bytes short ends the process", out);
    out.clear();
    ok = endsTheProcess(
        [&] {
          g.execute(h, {1, 2, 3}, {y, w, y}, ws);
        },
        {"cudnnBackendExecute", "UID 1 and UID 3 share memory"}, out);
    check(ok, "conv execute: Y written over X (one buffer for both) ends the process", out);
    for (void *p : {x, w, y, ws, shortWs})
      cudaFree(p);
  }
}

} // namespace

int main() {
  cudnnHandle_t h = nullptr;
  if (cudnnCreate(&h) != CUDNN_STATUS_SUCCESS) {
    std::printf("FAIL cudnnCreate: %s\n", lastError().c_str());
    return 1;
  }
  check(cudnnGetVersion() == CUDNN_VERSION, "cudnnGetVersion is the header's CUDNN_VERSION");
  testMatmul(h);
  testAttention(h);
  testAttentionBackward(h);
  testRoundingAndReshape(h);
  testRefusals(h);
  testConvolutions(h);
  testConvolutionRefusals(h);
  cudnnDestroy(h);
  std::printf("%s: %d failure%s\n", gFailures ? "FAIL" : "ok", gFailures,
              gFailures == 1 ? "" : "s");
  return gFailures ? 1 : 0;
}
