//===- conv_cudnn.cpp - 2-D convolutions through cuDNN ---------------------===//
//
// gpu.h's conv2d, conv2d_grad_input and conv2d_grad_weight: each call is one
// cuDNN graph of one convolution operation (forward, backward data or
// backward filter) built through the backend API (cudnn_graph.h) once per
// shape, on the first engine configuration of cuDNN's heuristic A (or, where
// A offers none that passes, of its fallback list) that
//
//   - is deterministic (no CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC: a step
//     gives the same bits every time, and `--cuda-graph` those of eager), and
//   - under fp32 without the plan field tf32, computes in fp32: no
//     TENSOR_CORE or DOWN_CONVERT_INPUTS note (TF32), no WINOGRAD or FFT
//     (their transforms round differently from the direct sum the CPU
//     target's GEMMs compute);
//
// and whose plan finalizes. Tensors are NCHW as the program stores them;
// under bf16/fp16 the call converts both operands to the 16-bit format in
// scratch (the rounding the CPU target's matmul applies to its operands) where
// the program does not give them so already (carve.read16), runs the 16-bit
// graph with f32 accumulation, and widens the 16-bit result.
// Where cuDNN cannot take a call (no engine passes, a tensor not 16-byte
// aligned, CARVE_CUDNN_CONVOLUTION=off, a runtime built without cuDNN)
// carve's direct kernel (kernels_conv.cu) computes the same quantity, and
// the first such call of each shape says why on stderr.
//
//===----------------------------------------------------------------------===//

#include "conv_fallback.h"
#include "internal.h"

#if CARVE_HAVE_CUDNN
#include "cudnn_graph.h"
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace carve::gpu {

namespace {

const char *kindName(ConvKind k) {
  switch (k) {
  case ConvKind::Forward:
    return "conv2d";
  case ConvKind::Data:
    return "conv2d_grad_input";
  case ConvKind::Filter:
    return "conv2d_grad_weight";
  }
  return "conv2d";
}

/// One call's shape: what a cached graph is for.
struct ConvKey {
  ConvKind kind;
  ConvDims d;
  int64_t post[2];
  int prec;
  bool tf32;
  auto tuple() const {
    return std::make_tuple(static_cast<int>(kind), d.n, d.c, d.h, d.w, d.o, d.kh, d.kw, d.ho, d.wo,
                           d.group, d.stride[0], d.stride[1], d.pad[0], d.pad[1], post[0], post[1],
                           d.dil[0], d.dil[1], prec, tf32);
  }
  bool operator<(const ConvKey &o) const { return tuple() < o.tuple(); }
  std::string text() const {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "x [%lld, %lld, %lld, %lld], w [%lld, %lld, %lld, %lld], y [%lld, %lld, %lld, "
                  "%lld], strides %lldx%lld, pads %lld %lld %lld %lld, dilations %lldx%lld%s",
                  (long long)d.n, (long long)d.c, (long long)d.h, (long long)d.w, (long long)d.o,
                  (long long)(d.c / d.group), (long long)d.kh, (long long)d.kw, (long long)d.n,
                  (long long)d.o, (long long)d.ho, (long long)d.wo, (long long)d.stride[0],
                  (long long)d.stride[1], (long long)d.pad[0], (long long)d.pad[1],
                  (long long)post[0], (long long)post[1], (long long)d.dil[0], (long long)d.dil[1],
                  prec == static_cast<int>(Precision::BF16)  ? ", bf16"
                  : prec == static_cast<int>(Precision::F16) ? ", fp16"
                  : tf32                                     ? ", fp32 (tf32)"
                                                             : ", fp32");
    return buf;
  }
};

/// The call's sizes from its tensors, checked: a program whose shapes do not
/// make a convolution is a fatal error naming the call (never a wrong read).
ConvKey keyOf(ConvKind kind, const Dims &xs, const Dims &ws, const Dims &ys,
              const Conv2dGeometry &g) {
  const char *op = kindName(kind);
  if (xs.rank != 4 || ws.rank != 4 || ys.rank != 4)
    rt::fatal("%s: x, w and y must be rank 4 (NCHW, OIHW), got ranks %d, %d, %d", op, xs.rank,
              ws.rank, ys.rank);
  ConvKey k{};
  k.kind = kind;
  ConvDims &d = k.d;
  d.n = xs.d[0], d.c = xs.d[1], d.h = xs.d[2], d.w = xs.d[3];
  d.o = ws.d[0], d.kh = ws.d[2], d.kw = ws.d[3];
  d.ho = ys.d[2], d.wo = ys.d[3], d.group = g.group;
  d.stride[0] = g.strides[0], d.stride[1] = g.strides[1];
  d.pad[0] = g.pads[0], d.pad[1] = g.pads[1];
  k.post[0] = g.pads[2], k.post[1] = g.pads[3];
  d.dil[0] = g.dilations[0], d.dil[1] = g.dilations[1];
  k.prec = static_cast<int>(precision());
  k.tf32 = tf32();
  bool ok = d.group >= 1 && d.c % d.group == 0 && d.o % d.group == 0 && ws.d[1] * d.group == d.c &&
            ys.d[0] == d.n && ys.d[1] == d.o;
  for (int i = 0; i < 2 && ok; ++i) {
    const int64_t in = i ? d.w : d.h, k2 = i ? d.kw : d.kh, out = i ? d.wo : d.ho;
    ok = d.stride[i] >= 1 && d.dil[i] >= 1 && d.pad[i] >= 0 && k.post[i] >= 0 &&
         (in + d.pad[i] + k.post[i] - d.dil[i] * (k2 - 1) - 1) / d.stride[i] + 1 == out;
  }
  if (!ok)
    rt::fatal("%s: shapes that make no convolution: %s, group %lld", op, k.text().c_str(),
              static_cast<long long>(d.group));
  return k;
}

bool disabledByEnvironment() {
  static const bool off = [] {
    const char *e = std::getenv("CARVE_CUDNN_CONVOLUTION");
    return e && std::strcmp(e, "off") == 0;
  }();
  return off;
}

/// A call that carve's kernel takes for `why`, said once per shape.
void sayOnce(const ConvKey &k, const std::string &why) {
  static std::set<ConvKey> said;
  if (said.insert(k).second)
    std::fprintf(stderr, "carve: %s %s: %s; carve's kernel runs\n", kindName(k.kind),
                 k.text().c_str(), why.c_str());
}

int64_t count(const Dims &s) {
  int64_t n = 1;
  for (int i = 0; i < s.rank; ++i)
    n *= s.d[i];
  return n;
}

/// An operand as the call gets it: f32, or the 16-bit tensor of its values.
struct Operand {
  const void *p;
  bool is16;
  int64_t n; // elements
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

void widen(const uint16_t *x, float *y, int64_t n) {
  precision() == Precision::BF16 ? fromBf16(x, y, n) : fromF16(x, y, n);
}

void to16(const float *x, uint16_t *y, int64_t n) {
  precision() == Precision::BF16 ? toBf16(x, y, n) : toF16(x, y, n);
}

/// carve's direct kernel, 16-bit operands widened into scratch first (their
/// values exactly: the kernel's rounding leaves them as they are); a result
/// wanted in 16 bits only computed into scratch, then converted (exactly:
/// the kernel rounded it).
void byCarve(ConvKind kind, Operand a, Operand b, float *c, uint16_t *c16, int64_t nc,
             const ConvKey &k) {
  const size_t na = a.is16 ? align256(a.n * 4) : 0, nb = b.is16 ? align256(b.n * 4) : 0;
  const size_t ncs = c ? 0 : align256(nc * 4);
  char *base = na + nb + ncs ? static_cast<char *>(workspace(na + nb + ncs, kWsConv)) : nullptr;
  if (!c)
    c = reinterpret_cast<float *>(base + na + nb);
  const float *fa = static_cast<const float *>(a.p), *fb = static_cast<const float *>(b.p);
  if (a.is16) {
    widen(static_cast<const uint16_t *>(a.p), reinterpret_cast<float *>(base), a.n);
    fa = reinterpret_cast<float *>(base);
  }
  if (b.is16) {
    widen(static_cast<const uint16_t *>(b.p), reinterpret_cast<float *>(base + na), b.n);
    fb = reinterpret_cast<float *>(base + na);
  }
  conv2dByCarve(kind, fa, fb, c, k.d, k.prec);
  if (c16)
    to16(c, c16, nc);
}

} // namespace

#if !CARVE_HAVE_CUDNN

namespace {
void run(ConvKind kind, Operand a, Operand b, float *c, uint16_t *c16, int64_t nc,
         const ConvKey &k) {
  sayOnce(k, "this runtime was built without cuDNN");
  byCarve(kind, a, b, c, c16, nc, k);
}
} // namespace

void cudnnConvolutionCalls(int64_t &forward, int64_t &data, int64_t &filter) {
  forward = data = filter = 0;
}

#else

namespace {

using namespace dnn;

struct Entry {
  std::unique_ptr<Graph> graph;
  std::string refused;
};

struct ConvState {
  cudnnHandle_t handle = nullptr;
  std::string handleError;
  std::map<ConvKey, Entry> graphs;
  int64_t calls[3] = {0, 0, 0};
};

/// Never destroyed (as attention_cudnn.cpp's: a destructor at exit would run
/// after the CUDA context is gone).
ConvState &convState() {
  static ConvState *s = new ConvState;
  return *s;
}

/// The numerical notes of configuration `cfg`'s engine.
std::vector<cudnnBackendNumericalNote_t> notesOf(cudnnBackendDescriptor_t cfg) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  int64_t n = 0;
  check(cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &n, &engine.d),
        "the configuration's engine");
  std::vector<cudnnBackendNumericalNote_t> notes(CUDNN_NUMERICAL_NOTE_TYPE_COUNT);
  int64_t got = 0;
  check(cudnnBackendGetAttribute(engine.d, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                 CUDNN_TYPE_NUMERICAL_NOTE, static_cast<int64_t>(notes.size()),
                                 &got, notes.data()),
        "the engine's numerical notes");
  notes.resize(static_cast<size_t>(got < 0 ? 0 : got));
  return notes;
}

/// Why configuration `cfg` must not run key `k`'s graph ("": it may).
std::string engineRefusal(cudnnBackendDescriptor_t cfg, const ConvKey &k) {
  const bool fp32 = k.prec == static_cast<int>(Precision::F32);
  for (cudnnBackendNumericalNote_t note : notesOf(cfg)) {
    if (note == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC)
      return "the engines offered are nondeterministic";
    if (fp32 && !k.tf32 &&
        (note == CUDNN_NUMERICAL_NOTE_TENSOR_CORE ||
         note == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS))
      return "the engines offered round fp32 inputs (TF32; the plan field tf32 allows it)";
    if (fp32 && (note == CUDNN_NUMERICAL_NOTE_WINOGRAD || note == CUDNN_NUMERICAL_NOTE_FFT ||
                 note == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4 ||
                 note == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6 ||
                 note == CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13))
      return "the engines offered for fp32 are Winograd or FFT transforms";
  }
  return "";
}

Dims4 nchw(int64_t n, int64_t c, int64_t h, int64_t w) { return {c * h * w, h * w, w, 1}; }

/// The cached graph for `k`, built on first use; null (with the reason said
/// once on stderr) where cuDNN refuses it.
Graph *graphFor(const ConvKey &k) {
  ConvState &st = convState();
  auto it = st.graphs.find(k);
  if (it != st.graphs.end())
    return it->second.graph.get();
  Entry &e = st.graphs[k];
  try {
    if (capturing())
      throw Refused{"its graph would be built while the step is captured (the warm-up step did "
                    "not run this shape)"};
    if (!st.handle && st.handleError.empty()) {
      cudnnStatus_t c = cudnnCreate(&st.handle);
      if (c != CUDNN_STATUS_SUCCESS) {
        st.handle = nullptr;
        st.handleError = std::string("cudnnCreate: ") + cudnnGetErrorString(c);
      }
    }
    if (!st.handle)
      throw Refused{st.handleError};
    const cudnnDataType_t t = k.prec == static_cast<int>(Precision::BF16)  ? CUDNN_DATA_BFLOAT16
                              : k.prec == static_cast<int>(Precision::F16) ? CUDNN_DATA_HALF
                                                                           : CUDNN_DATA_FLOAT;
    auto g = std::make_unique<Graph>(t);
    const ConvDims &d = k.d;
    const Dims4 xd{d.n, d.c, d.h, d.w}, wd{d.o, d.c / d.group, d.kh, d.kw};
    const Dims4 yd{d.n, d.o, d.ho, d.wo};
    const Desc &x = g->input(1, t, xd, nchw(xd[0], xd[1], xd[2], xd[3]));
    const Desc &w = g->input(2, t, wd, nchw(wd[0], wd[1], wd[2], wd[3]));
    const Desc &y = g->input(3, t, yd, nchw(yd[0], yd[1], yd[2], yd[3]));
    Graph::ConvGeometry geo{{d.stride[0], d.stride[1]},
                            {d.pad[0], d.pad[1]},
                            {k.post[0], k.post[1]},
                            {d.dil[0], d.dil[1]}};
    // Forward: uid 1 x, 2 w, 3 y; data: 3 dy, 2 w, 1 dx; filter: 1 x, 3 dy, 2 dw.
    if (k.kind == ConvKind::Forward)
      g->convolution(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, geo, x, w, y);
    else if (k.kind == ConvKind::Data)
      g->convolution(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, geo, y, w, x);
    else
      g->convolution(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, geo, x, y, w);
    g->plan(
        st.handle, [&k](cudnnBackendDescriptor_t cfg) { return engineRefusal(cfg, k); },
        /*fallbackList=*/true);
    e.graph = std::move(g);
  } catch (const Refused &r) {
    e.refused = r.why;
    std::fprintf(stderr, "carve: %s %s: cuDNN refused the convolution (%s); carve's kernel runs\n",
                 kindName(k.kind), k.text().c_str(), r.why.c_str());
  }
  return e.graph.get();
}

bool aligned(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// x, w, y of the graph (uids 1, 2, 3) from the call's a, b, c (nc elements;
/// its 16-bit copy c16 where given, c then possibly null).
void run(ConvKind kind, Operand a, Operand b, float *c, uint16_t *c16, int64_t nc,
         const ConvKey &k) {
  std::string why;
  if (disabledByEnvironment())
    why = "CARVE_CUDNN_CONVOLUTION=off";
  else if (!aligned(a.p) || !aligned(b.p) || !aligned(c) || !aligned(c16))
    why = "a tensor not 16-byte aligned";
  if (!why.empty())
    sayOnce(k, why);
  Graph *g = why.empty() ? graphFor(k) : nullptr;
  if (!g)
    return byCarve(kind, a, b, c, c16, nc, k);
  const bool half = k.prec != static_cast<int>(Precision::F32);
  // Scratch: the 16-bit operands the call converts, the 16-bit result
  // (unless it goes straight into c16), then cuDNN's workspace.
  auto conv16 = [&](const Operand &o) { return half && !o.is16 ? align256(o.n * 2) : 0; };
  char *p = static_cast<char *>(workspace(
      conv16(a) + conv16(b) + (half && !c16 ? align256(nc * 2) : 0) + align256(g->workspaceBytes),
      kWsConv));
  auto operand = [&](const Operand &o) {
    if (!half || o.is16)
      return const_cast<void *>(o.p);
    auto *y = reinterpret_cast<uint16_t *>(p);
    k.prec == static_cast<int>(Precision::BF16) ? toBf16(static_cast<const float *>(o.p), y, o.n)
                                                : toF16(static_cast<const float *>(o.p), y, o.n);
    p += align256(o.n * 2);
    return static_cast<void *>(y);
  };
  void *pa = operand(a), *pb = operand(b), *pc = c;
  if (half && c16) {
    pc = c16;
  } else if (half) {
    pc = p;
    p += align256(nc * 2);
  }
  void *ws = g->workspaceBytes ? p : nullptr;
  // The graph's uids: forward x 1, w 2, y 3; data dy 3, w 2, dx 1; filter
  // x 1, dy 3, dw 2.
  std::vector<int64_t> uids = kind == ConvKind::Forward ? std::vector<int64_t>{1, 2, 3}
                              : kind == ConvKind::Data  ? std::vector<int64_t>{3, 2, 1}
                                                        : std::vector<int64_t>{1, 3, 2};
  static const char *const names[3] = {"cuDNN convolution forward",
                                       "cuDNN convolution backward data",
                                       "cuDNN convolution backward filter"};
  ConvState &st = convState();
  execute(st.handle, *g, uids, {pa, pb, pc}, ws, names[static_cast<int>(kind)]);
  ++st.calls[static_cast<int>(kind)];
  if (half && c)
    widen(static_cast<const uint16_t *>(pc), c, nc);
}

} // namespace

void cudnnConvolutionCalls(int64_t &forward, int64_t &data, int64_t &filter) {
  const ConvState &st = convState();
  forward = st.calls[0];
  data = st.calls[1];
  filter = st.calls[2];
}

#endif // CARVE_HAVE_CUDNN

namespace {

/// The entries' common part: the shapes checked, 16-bit operands only under
/// a 16-bit precision, empty results left alone.
void call(ConvKind kind, const void *a, bool a16, const Dims &as, const void *b, bool b16,
          const Dims &bs, float *c, uint16_t *c16, const Dims &cs, const Dims &xs, const Dims &ws,
          const Dims &ys, const Conv2dGeometry &g) {
  const ConvKey k = keyOf(kind, xs, ws, ys, g);
  if ((a16 || b16 || c16) && k.prec == static_cast<int>(Precision::F32))
    rt::fatal("%s: a tensor given in 16 bits under an fp32 plan", kindName(kind));
  if (!c && !c16)
    rt::fatal("%s: no result to write (neither the f32 result nor its 16-bit copy)",
              kindName(kind));
  if (count(cs))
    run(kind, {a, a16, count(as)}, {b, b16, count(bs)}, c, c16, count(cs), k);
}

} // namespace

void conv2d(const void *x, bool x16, Dims xs, const void *w, bool w16, Dims ws, Conv2dGeometry g,
            float *y, uint16_t *y16, Dims ys) {
  call(ConvKind::Forward, x, x16, xs, w, w16, ws, y, y16, ys, xs, ws, ys, g);
}

void conv2d_grad_input(const void *dy, bool dy16, Dims ys, const void *w, bool w16, Dims ws,
                       Conv2dGeometry g, float *dx, uint16_t *dx16, Dims xs) {
  call(ConvKind::Data, dy, dy16, ys, w, w16, ws, dx, dx16, xs, xs, ws, ys, g);
}

void conv2d_grad_weight(const void *x, bool x16, Dims xs, const void *dy, bool dy16, Dims ys,
                        Conv2dGeometry g, float *dw, uint16_t *dw16, Dims ws) {
  call(ConvKind::Filter, x, x16, xs, dy, dy16, ys, dw, dw16, ws, xs, ws, ys, g);
}

} // namespace carve::gpu
