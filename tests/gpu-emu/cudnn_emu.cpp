//===- cudnn_emu.cpp - cuDNN's backend graph API subset carve uses, on the CPU -===//
//
// Tests only (tests/gpu-emu/README.md, "cuDNN"): the emulated build links
// this instead of libcudnn, so that runtime code written against <cudnn.h>
// (attention_cudnn.cpp's flash attention, 2-D convolutions) runs as it is.
//
// - Descriptors: every attribute a Set passes is checked against the
//   attribute's CUDNN_TYPE_* and element count (cudnn_graph.h), stored, and
//   read back by Finalize, which turns it into the descriptor's meaning (a
//   tensor, an operation, a graph, a plan) or fails with the status and a
//   last-error string naming the descriptor, the attribute and the cause.
//   Descriptors set as attributes must be finalized; a finalized descriptor
//   takes no more attributes. Descriptor types and attributes outside the
//   subset return CUDNN_STATUS_NOT_SUPPORTED, naming them.
// - Engine 0 (global index) models cuDNN's fused flash-attention engine
//   for graphs with matmuls: 16-bit operands, fp32 accumulation, head
//   dimensions that are multiples of 8 up to 256, an additive bias only in
//   the operands' 16-bit type and over the scores' last two dimensions
//   whole (broadcast over batch and heads). Graphs without matmuls
//   (pointwise, reductions, reshapes) run generically on it. Heuristics
//   return one configuration where it takes the graph and none, with the
//   reason as the last error, where it does not.
// - A graph of one 2-D convolution (forward, backward data or backward
//   filter; CONVOLUTION descriptors with two spatial dimensions, compute
//   type FLOAT, either mode, asymmetric padding, groups) has engines 1 to 4
//   instead: 1, TF32 (notes TENSOR_CORE and DOWN_CONVERT_INPUTS: fp32
//   inputs rounded to 10 mantissa bits); 2, exact fp32 (no note); 3, 16-bit
//   tensor cores (TENSOR_CORE: HALF or BFLOAT16 inputs as stored); 4, the
//   backward filter summed in reverse (NONDETERMINISTIC). The heuristics
//   give, best first, 4 (backward filter only), then 1 and 2 for FLOAT or 3
//   for the 16-bit types, so a caller's choice among them matters. Each
//   sums in float in a fixed order (runConvolution) into an fp32 workspace.
// - CARVE_EMU_CUDNN=unsupported makes every graph unsupported,
//   CARVE_EMU_CUDNN=plan-fails makes every execution plan's Finalize fail,
//   so tests reach a caller's fallbacks.
// - Execution is queued on the handle's stream (recorded under CUDA-graph
//   capture) and interprets the graph: operations in a topological order,
//   every tensor, virtual ones too, a buffer laid out by its own dims and
//   strides holding its own data type, so a virtual 16-bit tensor rounds as
//   the engine's 16-bit probabilities do. Matmuls sum in float in increasing
//   k order.
// - Strict: a variant pack that misses a tensor, binds one twice or binds
//   one the graph lacks, a pointer that is not device memory (a by-value one
//   that is), a misaligned pointer, a missing or short workspace, or outputs
//   that share memory with another tensor end the process with one line
//   naming cudnnBackendExecute, the UID and the cause.
// - Calls from one thread at a time (the registries take no lock).
//
//===----------------------------------------------------------------------===//

#include "cuda_emu.h"

#include "cudnn_emu.h"
#include "emu_internal.h"

#include <cudnn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

// The handle type cudnn_graph.h leaves opaque.
struct cudnnContext {
  cudaStream_t stream = nullptr; // the legacy stream until cudnnSetStream
};

namespace {

// ---- Names, for messages ------------------------------------------------------------

const char *descriptorName(int t) {
#define CARVE_CASE(x)                                                                              \
  case CUDNN_BACKEND_##x##_DESCRIPTOR:                                                             \
    return "CUDNN_BACKEND_" #x "_DESCRIPTOR";
  switch (t) {
    CARVE_CASE(POINTWISE)
    CARVE_CASE(CONVOLUTION)
    CARVE_CASE(ENGINE)
    CARVE_CASE(ENGINECFG)
    CARVE_CASE(ENGINEHEUR)
    CARVE_CASE(EXECUTION_PLAN)
    CARVE_CASE(INTERMEDIATE_INFO)
    CARVE_CASE(KNOB_CHOICE)
    CARVE_CASE(KNOB_INFO)
    CARVE_CASE(LAYOUT_INFO)
    CARVE_CASE(OPERATION_CONVOLUTION_FORWARD)
    CARVE_CASE(OPERATION_CONVOLUTION_BACKWARD_FILTER)
    CARVE_CASE(OPERATION_CONVOLUTION_BACKWARD_DATA)
    CARVE_CASE(OPERATION_POINTWISE)
    CARVE_CASE(OPERATION_GEN_STATS)
    CARVE_CASE(OPERATIONGRAPH)
    CARVE_CASE(VARIANT_PACK)
    CARVE_CASE(TENSOR)
    CARVE_CASE(MATMUL)
    CARVE_CASE(OPERATION_MATMUL)
    CARVE_CASE(OPERATION_BN_FINALIZE_STATISTICS)
    CARVE_CASE(REDUCTION)
    CARVE_CASE(OPERATION_REDUCTION)
    CARVE_CASE(OPERATION_BN_BWD_WEIGHTS)
    CARVE_CASE(RESAMPLE)
    CARVE_CASE(OPERATION_RESAMPLE_FWD)
    CARVE_CASE(OPERATION_RESAMPLE_BWD)
    CARVE_CASE(OPERATION_CONCAT)
    CARVE_CASE(OPERATION_SIGNAL)
    CARVE_CASE(OPERATION_NORM_FORWARD)
    CARVE_CASE(OPERATION_NORM_BACKWARD)
    CARVE_CASE(OPERATION_RESHAPE)
    CARVE_CASE(RNG)
    CARVE_CASE(OPERATION_RNG)
    CARVE_CASE(KERNEL_CACHE)
    CARVE_CASE(OPERATION_PAGED_CACHE_LOAD)
    CARVE_CASE(OPERATION_BLOCK_SCALE_QUANTIZE)
    CARVE_CASE(OPERATION_BLOCK_SCALE_DEQUANTIZE)
    CARVE_CASE(DEVICEPROP)
    CARVE_CASE(OPERATION_EXPAND_BAND_MATRIX)
    CARVE_CASE(OPERATION_CONTRACT_BAND_MATRIX)
    CARVE_CASE(OPERATION_SDPA_FWD)
    CARVE_CASE(OPERATION_MOE_GROUPED_MATMUL)
    CARVE_CASE(OPERATION_SDPA_BWD)
  default:
    return "an unknown descriptor type";
  }
#undef CARVE_CASE
}

const char *attrTypeName(cudnnBackendAttributeType_t t) {
#define CARVE_CASE(x)                                                                              \
  case CUDNN_TYPE_##x:                                                                             \
    return "CUDNN_TYPE_" #x;
  switch (t) {
    CARVE_CASE(HANDLE)
    CARVE_CASE(DATA_TYPE)
    CARVE_CASE(BOOLEAN)
    CARVE_CASE(INT64)
    CARVE_CASE(FLOAT)
    CARVE_CASE(DOUBLE)
    CARVE_CASE(VOID_PTR)
    CARVE_CASE(CONVOLUTION_MODE)
    CARVE_CASE(HEUR_MODE)
    CARVE_CASE(KNOB_TYPE)
    CARVE_CASE(NAN_PROPOGATION)
    CARVE_CASE(NUMERICAL_NOTE)
    CARVE_CASE(LAYOUT_TYPE)
    CARVE_CASE(ATTRIB_NAME)
    CARVE_CASE(POINTWISE_MODE)
    CARVE_CASE(BACKEND_DESCRIPTOR)
    CARVE_CASE(GENSTATS_MODE)
    CARVE_CASE(BN_FINALIZE_STATS_MODE)
    CARVE_CASE(REDUCTION_OPERATOR_TYPE)
    CARVE_CASE(BEHAVIOR_NOTE)
    CARVE_CASE(TENSOR_REORDERING_MODE)
    CARVE_CASE(RESAMPLE_MODE)
    CARVE_CASE(PADDING_MODE)
    CARVE_CASE(INT32)
    CARVE_CASE(CHAR)
    CARVE_CASE(SIGNAL_MODE)
    CARVE_CASE(FRACTION)
    CARVE_CASE(NORM_MODE)
    CARVE_CASE(NORM_FWD_PHASE)
    CARVE_CASE(RNG_DISTRIBUTION)
    CARVE_CASE(MOE_GROUPED_MATMUL_MODE)
  default:
    return "an unknown attribute type";
  }
#undef CARVE_CASE
}

const char *dataTypeName(cudnnDataType_t t) {
#define CARVE_CASE(x)                                                                              \
  case CUDNN_DATA_##x:                                                                             \
    return "CUDNN_DATA_" #x;
  switch (t) {
    CARVE_CASE(FLOAT)
    CARVE_CASE(DOUBLE)
    CARVE_CASE(HALF)
    CARVE_CASE(INT8)
    CARVE_CASE(INT32)
    CARVE_CASE(INT8x4)
    CARVE_CASE(UINT8)
    CARVE_CASE(UINT8x4)
    CARVE_CASE(INT8x32)
    CARVE_CASE(BFLOAT16)
    CARVE_CASE(INT64)
    CARVE_CASE(BOOLEAN)
    CARVE_CASE(FP8_E4M3)
    CARVE_CASE(FP8_E5M2)
    CARVE_CASE(FAST_FLOAT_FOR_FP8)
    CARVE_CASE(FP8_E8M0)
    CARVE_CASE(FP4_E2M1)
    CARVE_CASE(INT4)
    CARVE_CASE(UINT4)
    CARVE_CASE(UINT32)
    CARVE_CASE(COMPLEX_FP32)
    CARVE_CASE(COMPLEX_FP64)
  default:
    return nullptr;
  }
#undef CARVE_CASE
}

const char *pointwiseName(cudnnPointwiseMode_t m) {
#define CARVE_CASE(x)                                                                              \
  case CUDNN_POINTWISE_##x:                                                                        \
    return "CUDNN_POINTWISE_" #x;
  switch (m) {
    CARVE_CASE(ADD)
    CARVE_CASE(ADD_SQUARE)
    CARVE_CASE(DIV)
    CARVE_CASE(MAX)
    CARVE_CASE(MIN)
    CARVE_CASE(MOD)
    CARVE_CASE(MUL)
    CARVE_CASE(POW)
    CARVE_CASE(SUB)
    CARVE_CASE(ABS)
    CARVE_CASE(CEIL)
    CARVE_CASE(COS)
    CARVE_CASE(EXP)
    CARVE_CASE(FLOOR)
    CARVE_CASE(LOG)
    CARVE_CASE(NEG)
    CARVE_CASE(RSQRT)
    CARVE_CASE(SIN)
    CARVE_CASE(SQRT)
    CARVE_CASE(TAN)
    CARVE_CASE(ERF)
    CARVE_CASE(IDENTITY)
    CARVE_CASE(RECIPROCAL)
    CARVE_CASE(ATAN2)
    CARVE_CASE(RELU_FWD)
    CARVE_CASE(TANH_FWD)
    CARVE_CASE(SIGMOID_FWD)
    CARVE_CASE(ELU_FWD)
    CARVE_CASE(GELU_FWD)
    CARVE_CASE(SOFTPLUS_FWD)
    CARVE_CASE(SWISH_FWD)
    CARVE_CASE(GELU_APPROX_TANH_FWD)
    CARVE_CASE(RELU_BWD)
    CARVE_CASE(TANH_BWD)
    CARVE_CASE(SIGMOID_BWD)
    CARVE_CASE(ELU_BWD)
    CARVE_CASE(GELU_BWD)
    CARVE_CASE(SOFTPLUS_BWD)
    CARVE_CASE(SWISH_BWD)
    CARVE_CASE(GELU_APPROX_TANH_BWD)
    CARVE_CASE(CMP_EQ)
    CARVE_CASE(CMP_NEQ)
    CARVE_CASE(CMP_GT)
    CARVE_CASE(CMP_GE)
    CARVE_CASE(CMP_LT)
    CARVE_CASE(CMP_LE)
    CARVE_CASE(LOGICAL_AND)
    CARVE_CASE(LOGICAL_OR)
    CARVE_CASE(LOGICAL_NOT)
    CARVE_CASE(GEN_INDEX)
    CARVE_CASE(BINARY_SELECT)
  default:
    return nullptr;
  }
#undef CARVE_CASE
}

const char *reductionName(cudnnReduceTensorOp_t op) {
#define CARVE_CASE(x)                                                                              \
  case CUDNN_REDUCE_TENSOR_##x:                                                                    \
    return "CUDNN_REDUCE_TENSOR_" #x;
  switch (op) {
    CARVE_CASE(ADD)
    CARVE_CASE(MUL)
    CARVE_CASE(MIN)
    CARVE_CASE(MAX)
    CARVE_CASE(AMAX)
    CARVE_CASE(AVG)
    CARVE_CASE(NORM1)
    CARVE_CASE(NORM2)
    CARVE_CASE(MUL_NO_ZEROS)
  default:
    return nullptr;
  }
#undef CARVE_CASE
}

std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char *fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

std::string dimsText(const std::vector<int64_t> &v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// ---- Errors -------------------------------------------------------------------------

/// What cudnnGetLastErrorString reports: the last failure on this thread.
thread_local std::string gLastError;

cudnnStatus_t fail(cudnnStatus_t s, const std::string &why) {
  gLastError = why;
  return s;
}

/// CARVE_EMU_CUDNN: how the emulated engine answers, for tests of a
/// caller's fallbacks.
enum class EngineMode { Normal, Unsupported, PlanFails };
EngineMode engineMode() {
  const char *e = std::getenv("CARVE_EMU_CUDNN");
  if (!e || !*e)
    return EngineMode::Normal;
  if (!std::strcmp(e, "unsupported"))
    return EngineMode::Unsupported;
  if (!std::strcmp(e, "plan-fails"))
    return EngineMode::PlanFails;
  carve_emu::fatalCall("CARVE_EMU_CUDNN=%s: expected \"unsupported\" or \"plan-fails\"", e);
}

// ---- Descriptors and their attributes -----------------------------------------------

struct Desc;

/// One attribute as cudnnBackendSetAttribute passed it.
struct Attr {
  cudnnBackendAttributeType_t type = CUDNN_TYPE_INT64;
  int64_t count = 0;
  std::vector<unsigned char> bytes;
  /// CUDNN_TYPE_BACKEND_DESCRIPTOR: the descriptors themselves, kept alive
  /// however the caller destroys its handles (finalized ones do not change).
  std::vector<std::shared_ptr<Desc>> descs;
};

struct TensorSpec;
struct ConvSpec;
struct OpSpec;
struct GraphSpec;

struct Desc {
  explicit Desc(cudnnBackendDescriptorType_t t) : type(t) {}
  cudnnBackendDescriptorType_t type;
  bool finalized = false;
  std::map<cudnnBackendAttributeName_t, Attr> attrs;

  // What Finalize made of the attributes, by descriptor type:
  std::shared_ptr<const TensorSpec> tensor; // TENSOR
  std::shared_ptr<const OpSpec> op;         // OPERATION_*
  /// OPERATIONGRAPH and what hangs off it: ENGINEHEUR, ENGINE, ENGINECFG,
  /// EXECUTION_PLAN.
  std::shared_ptr<const GraphSpec> graph;
  /// CONVOLUTION: its geometry.
  std::shared_ptr<const ConvSpec> conv;
  /// ENGINEHEUR: the configurations it found, best first (none: no engine
  /// takes the graph).
  std::vector<std::shared_ptr<Desc>> results;
  int64_t engine = 0;    // ENGINE, ENGINECFG, EXECUTION_PLAN: the global index
  int64_t workspace = 0; // ENGINECFG, EXECUTION_PLAN: bytes
  // VARIANT_PACK:
  std::vector<int64_t> uids;
  std::vector<void *> pointers;
  void *workspacePtr = nullptr;
};

/// The descriptors the caller holds, by handle (a Desc's address).
std::map<const void *, std::shared_ptr<Desc>> &descriptors() {
  static auto *m = new std::map<const void *, std::shared_ptr<Desc>>;
  return *m;
}
std::set<const cudnnContext *> &handles() {
  static auto *s = new std::set<const cudnnContext *>;
  return *s;
}

std::shared_ptr<Desc> lookup(const void *d) {
  auto it = descriptors().find(d);
  return it == descriptors().end() ? nullptr : it->second;
}
bool liveHandle(const cudnnContext *h) { return h && handles().count(h); }

const Attr *attr(const Desc &d, cudnnBackendAttributeName_t n) {
  auto it = d.attrs.find(n);
  return it == d.attrs.end() ? nullptr : &it->second;
}
template <typename T> T value(const Attr *a, size_t i = 0) {
  T v;
  std::memcpy(&v, a->bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}
std::vector<int64_t> int64s(const Attr *a) {
  std::vector<int64_t> v(a->count);
  if (a->count)
    std::memcpy(v.data(), a->bytes.data(), a->count * sizeof(int64_t));
  return v;
}
double scalarOf(const Attr *a) {
  return a->type == CUDNN_TYPE_DOUBLE ? value<double>(a) : value<float>(a);
}

size_t attrElementBytes(cudnnBackendAttributeType_t t) {
  switch (t) {
  case CUDNN_TYPE_HANDLE:
    return sizeof(cudnnHandle_t);
  case CUDNN_TYPE_BOOLEAN:
    return sizeof(bool);
  case CUDNN_TYPE_INT64:
    return sizeof(int64_t);
  case CUDNN_TYPE_FLOAT:
    return sizeof(float);
  case CUDNN_TYPE_DOUBLE:
    return sizeof(double);
  case CUDNN_TYPE_VOID_PTR:
    return sizeof(void *);
  case CUDNN_TYPE_BACKEND_DESCRIPTOR:
    return sizeof(cudnnBackendDescriptor_t);
  case CUDNN_TYPE_INT32:
    return sizeof(int32_t);
  case CUDNN_TYPE_CHAR:
    return sizeof(char);
  case CUDNN_TYPE_FRACTION:
    return sizeof(cudnnFraction_t);
  default: // the enumerations (cudnnDataType_t, cudnnPointwiseMode_t, ...)
    return sizeof(cudnnDataType_t);
  }
}

// ---- The attributes the emulation knows (cudnn_graph.h's names and types) -----------

constexpr int kNoReference = -2;
constexpr int kAnyOperation = -1; // OPERATIONGRAPH_OPS: one of the four operation types
constexpr int64_t kMany = std::numeric_limits<int64_t>::max();

struct AttrSpec {
  cudnnBackendDescriptorType_t owner;
  cudnnBackendAttributeName_t name;
  const char *text;
  cudnnBackendAttributeType_t type;
  int64_t minCount, maxCount; // what a Set may pass
  /// CUDNN_TYPE_BACKEND_DESCRIPTOR: the descriptor type of the elements.
  int refersTo;
  bool settable;                        // false: GetAttribute only
  cudnnBackendAttributeType_t alsoType; // a second type a Set may use
};

// clang-format off
#define CARVE_SETS(D, N, T, LO, HI)                                                                \
  {CUDNN_BACKEND_##D##_DESCRIPTOR, CUDNN_ATTR_##N, "CUDNN_ATTR_" #N, CUDNN_TYPE_##T, LO, HI,      \
   kNoReference, true, CUDNN_TYPE_##T}
#define CARVE_REFS(D, N, R, LO, HI)                                                                \
  {CUDNN_BACKEND_##D##_DESCRIPTOR, CUDNN_ATTR_##N, "CUDNN_ATTR_" #N, CUDNN_TYPE_BACKEND_DESCRIPTOR, \
   LO, HI, CUDNN_BACKEND_##R##_DESCRIPTOR, true, CUDNN_TYPE_BACKEND_DESCRIPTOR}
#define CARVE_GETS(D, N, T, R)                                                                     \
  {CUDNN_BACKEND_##D##_DESCRIPTOR, CUDNN_ATTR_##N, "CUDNN_ATTR_" #N, CUDNN_TYPE_##T, 0, kMany, R,  \
   false, CUDNN_TYPE_##T}
// A scaling factor: a float or a double (cudnn-frontend sets either).
#define CARVE_SCALE(D, N)                                                                          \
  {CUDNN_BACKEND_##D##_DESCRIPTOR, CUDNN_ATTR_##N, "CUDNN_ATTR_" #N, CUDNN_TYPE_FLOAT, 1, 1,       \
   kNoReference, true, CUDNN_TYPE_DOUBLE}

// clang-format on

const AttrSpec kAttrs[] = {
    CARVE_SETS(TENSOR, TENSOR_BYTE_ALIGNMENT, INT64, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_DATA_TYPE, DATA_TYPE, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_DIMENSIONS, INT64, 1, CUDNN_DIM_MAX),
    CARVE_SETS(TENSOR, TENSOR_STRIDES, INT64, 1, CUDNN_DIM_MAX),
    CARVE_SETS(TENSOR, TENSOR_VECTOR_COUNT, INT64, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_VECTORIZED_DIMENSION, INT64, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_UNIQUE_ID, INT64, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_IS_VIRTUAL, BOOLEAN, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_IS_BY_VALUE, BOOLEAN, 1, 1),
    CARVE_SETS(TENSOR, TENSOR_REORDERING_MODE, TENSOR_REORDERING_MODE, 1, 1),

    CARVE_SETS(POINTWISE, POINTWISE_MODE, POINTWISE_MODE, 1, 1),
    CARVE_SETS(POINTWISE, POINTWISE_MATH_PREC, DATA_TYPE, 1, 1),
    CARVE_SETS(POINTWISE, POINTWISE_NAN_PROPAGATION, NAN_PROPOGATION, 1, 1),
    CARVE_SETS(POINTWISE, POINTWISE_AXIS, INT64, 1, 1),

    CARVE_REFS(OPERATION_POINTWISE, OPERATION_POINTWISE_PW_DESCRIPTOR, POINTWISE, 1, 1),
    CARVE_REFS(OPERATION_POINTWISE, OPERATION_POINTWISE_XDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_POINTWISE, OPERATION_POINTWISE_BDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_POINTWISE, OPERATION_POINTWISE_TDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_POINTWISE, OPERATION_POINTWISE_YDESC, TENSOR, 1, 1),
    // Y = op(alpha1 * X, alpha2 * B): a float or a double (cudnn-frontend
    // sets either).
    {CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1,
     "CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1", CUDNN_TYPE_FLOAT, 1, 1, kNoReference, true,
     CUDNN_TYPE_DOUBLE},
    {CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2,
     "CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2", CUDNN_TYPE_FLOAT, 1, 1, kNoReference, true,
     CUDNN_TYPE_DOUBLE},

    CARVE_SETS(MATMUL, MATMUL_COMP_TYPE, DATA_TYPE, 1, 1),
    CARVE_REFS(OPERATION_MATMUL, OPERATION_MATMUL_ADESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_MATMUL, OPERATION_MATMUL_BDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_MATMUL, OPERATION_MATMUL_CDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_MATMUL, OPERATION_MATMUL_DESC, MATMUL, 1, 1),

    CARVE_SETS(REDUCTION, REDUCTION_OPERATOR, REDUCTION_OPERATOR_TYPE, 1, 1),
    CARVE_SETS(REDUCTION, REDUCTION_COMP_TYPE, DATA_TYPE, 1, 1),
    CARVE_SETS(REDUCTION, REDUCTION_IS_DETERMINISTIC, BOOLEAN, 1, 1),
    CARVE_REFS(OPERATION_REDUCTION, OPERATION_REDUCTION_XDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_REDUCTION, OPERATION_REDUCTION_YDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_REDUCTION, OPERATION_REDUCTION_DESC, REDUCTION, 1, 1),

    CARVE_REFS(OPERATION_RESHAPE, OPERATION_RESHAPE_XDESC, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_RESHAPE, OPERATION_RESHAPE_YDESC, TENSOR, 1, 1),

    // The per-dimension arrays may hold up to CUDNN_DIM_MAX - 2 elements;
    // Finalize wants exactly SPATIAL_DIMS of each.
    CARVE_SETS(CONVOLUTION, CONVOLUTION_COMP_TYPE, DATA_TYPE, 1, 1),
    CARVE_SETS(CONVOLUTION, CONVOLUTION_CONV_MODE, CONVOLUTION_MODE, 1, 1),
    CARVE_SETS(CONVOLUTION, CONVOLUTION_SPATIAL_DIMS, INT64, 1, 1),
    CARVE_SETS(CONVOLUTION, CONVOLUTION_DILATIONS, INT64, 1, CUDNN_DIM_MAX - 2),
    CARVE_SETS(CONVOLUTION, CONVOLUTION_FILTER_STRIDES, INT64, 1, CUDNN_DIM_MAX - 2),
    CARVE_SETS(CONVOLUTION, CONVOLUTION_PRE_PADDINGS, INT64, 1, CUDNN_DIM_MAX - 2),
    CARVE_SETS(CONVOLUTION, CONVOLUTION_POST_PADDINGS, INT64, 1, CUDNN_DIM_MAX - 2),

    CARVE_SCALE(OPERATION_CONVOLUTION_FORWARD, OPERATION_CONVOLUTION_FORWARD_ALPHA),
    CARVE_SCALE(OPERATION_CONVOLUTION_FORWARD, OPERATION_CONVOLUTION_FORWARD_BETA),
    CARVE_REFS(OPERATION_CONVOLUTION_FORWARD, OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CONVOLUTION,
               1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_FORWARD, OPERATION_CONVOLUTION_FORWARD_W, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_FORWARD, OPERATION_CONVOLUTION_FORWARD_X, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_FORWARD, OPERATION_CONVOLUTION_FORWARD_Y, TENSOR, 1, 1),
    CARVE_SCALE(OPERATION_CONVOLUTION_BACKWARD_DATA, OPERATION_CONVOLUTION_BWD_DATA_ALPHA),
    CARVE_SCALE(OPERATION_CONVOLUTION_BACKWARD_DATA, OPERATION_CONVOLUTION_BWD_DATA_BETA),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_DATA, OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
               CONVOLUTION, 1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_DATA, OPERATION_CONVOLUTION_BWD_DATA_W, TENSOR, 1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_DATA, OPERATION_CONVOLUTION_BWD_DATA_DX, TENSOR, 1,
               1),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_DATA, OPERATION_CONVOLUTION_BWD_DATA_DY, TENSOR, 1,
               1),
    CARVE_SCALE(OPERATION_CONVOLUTION_BACKWARD_FILTER, OPERATION_CONVOLUTION_BWD_FILTER_ALPHA),
    CARVE_SCALE(OPERATION_CONVOLUTION_BACKWARD_FILTER, OPERATION_CONVOLUTION_BWD_FILTER_BETA),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_FILTER, OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
               CONVOLUTION, 1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_FILTER, OPERATION_CONVOLUTION_BWD_FILTER_DW, TENSOR,
               1, 1),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_FILTER, OPERATION_CONVOLUTION_BWD_FILTER_X, TENSOR, 1,
               1),
    CARVE_REFS(OPERATION_CONVOLUTION_BACKWARD_FILTER, OPERATION_CONVOLUTION_BWD_FILTER_DY, TENSOR,
               1, 1),

    {CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, CUDNN_ATTR_OPERATIONGRAPH_OPS,
     "CUDNN_ATTR_OPERATIONGRAPH_OPS", CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, kMany, kAnyOperation, true,
     CUDNN_TYPE_BACKEND_DESCRIPTOR},
    CARVE_SETS(OPERATIONGRAPH, OPERATIONGRAPH_HANDLE, HANDLE, 1, 1),
    CARVE_GETS(OPERATIONGRAPH, OPERATIONGRAPH_ENGINE_GLOBAL_COUNT, INT64, kNoReference),

    CARVE_REFS(ENGINEHEUR, ENGINEHEUR_OPERATION_GRAPH, OPERATIONGRAPH, 1, 1),
    CARVE_SETS(ENGINEHEUR, ENGINEHEUR_MODE, HEUR_MODE, 1, 1),
    CARVE_SETS(ENGINEHEUR, ENGINEHEUR_SM_COUNT_TARGET, INT32, 1, 1),
    CARVE_GETS(ENGINEHEUR, ENGINEHEUR_RESULTS, BACKEND_DESCRIPTOR,
               CUDNN_BACKEND_ENGINECFG_DESCRIPTOR),

    CARVE_REFS(ENGINECFG, ENGINECFG_ENGINE, ENGINE, 1, 1),
    CARVE_REFS(ENGINECFG, ENGINECFG_KNOB_CHOICES, KNOB_CHOICE, 0, kMany),
    CARVE_REFS(ENGINECFG, ENGINECFG_INTERMEDIATE_INFO, INTERMEDIATE_INFO, 0, 1),
    CARVE_GETS(ENGINECFG, ENGINECFG_WORKSPACE_SIZE, INT64, kNoReference),

    CARVE_REFS(ENGINE, ENGINE_OPERATION_GRAPH, OPERATIONGRAPH, 1, 1),
    CARVE_SETS(ENGINE, ENGINE_GLOBAL_INDEX, INT64, 1, 1),
    CARVE_SETS(ENGINE, ENGINE_SM_COUNT_TARGET, INT32, 1, 1),
    CARVE_GETS(ENGINE, ENGINE_NUMERICAL_NOTE, NUMERICAL_NOTE, kNoReference),
    CARVE_GETS(ENGINE, ENGINE_BEHAVIOR_NOTE, BEHAVIOR_NOTE, kNoReference),
    CARVE_GETS(ENGINE, ENGINE_KNOB_INFO, BACKEND_DESCRIPTOR, CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR),
    CARVE_GETS(ENGINE, ENGINE_LAYOUT_INFO, BACKEND_DESCRIPTOR,
               CUDNN_BACKEND_LAYOUT_INFO_DESCRIPTOR),

    CARVE_SETS(EXECUTION_PLAN, EXECUTION_PLAN_HANDLE, HANDLE, 1, 1),
    CARVE_REFS(EXECUTION_PLAN, EXECUTION_PLAN_ENGINE_CONFIG, ENGINECFG, 1, 1),
    CARVE_GETS(EXECUTION_PLAN, EXECUTION_PLAN_WORKSPACE_SIZE, INT64, kNoReference),

    CARVE_SETS(VARIANT_PACK, VARIANT_PACK_UNIQUE_IDS, INT64, 0, kMany),
    CARVE_SETS(VARIANT_PACK, VARIANT_PACK_DATA_POINTERS, VOID_PTR, 0, kMany),
    CARVE_SETS(VARIANT_PACK, VARIANT_PACK_WORKSPACE, VOID_PTR, 1, 1),

    CARVE_SETS(KNOB_CHOICE, KNOB_CHOICE_KNOB_TYPE, KNOB_TYPE, 1, 1),
    CARVE_SETS(KNOB_CHOICE, KNOB_CHOICE_KNOB_VALUE, INT64, 1, 1),
};
#undef CARVE_SETS
#undef CARVE_REFS
#undef CARVE_GETS
#undef CARVE_SCALE

const AttrSpec *specFor(int owner, cudnnBackendAttributeName_t n) {
  for (const AttrSpec &s : kAttrs)
    if (s.owner == owner && s.name == n)
      return &s;
  return nullptr;
}
const AttrSpec *specAnywhere(cudnnBackendAttributeName_t n) {
  for (const AttrSpec &s : kAttrs)
    if (s.name == n)
      return &s;
  return nullptr;
}
std::string attrName(cudnnBackendAttributeName_t n) {
  const AttrSpec *s = specAnywhere(n);
  return s ? s->text : format("attribute %d", static_cast<int>(n));
}

bool isConvolutionOperation(int t) {
  return t == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR ||
         t == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR ||
         t == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR;
}
bool isOperation(int t) {
  return t == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR ||
         t == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR ||
         t == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR ||
         t == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR || isConvolutionOperation(t);
}

bool modelledDescriptor(cudnnBackendDescriptorType_t t) {
  switch (t) {
  case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
  case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
  case CUDNN_BACKEND_MATMUL_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
  case CUDNN_BACKEND_REDUCTION_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR:
  case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
  case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
  case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
  case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
  case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
  case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
  case CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR:
    return true;
  default:
    return false;
  }
}

// ---- Tensors ------------------------------------------------------------------------

/// A finalized tensor descriptor.
struct TensorSpec {
  int64_t uid = 0;
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  std::vector<int64_t> dims, strides;
  int64_t alignment = 0;
  bool isVirtual = false, byValue = false;
  cudnnBackendTensorReordering_t reordering = CUDNN_TENSOR_REORDERING_NONE;
  int64_t vectorCount = 1;
  int64_t count = 1;  // elements
  int64_t extent = 1; // the largest offset (in elements) plus one

  bool sameAs(const TensorSpec &o) const {
    return uid == o.uid && type == o.type && dims == o.dims && strides == o.strides &&
           alignment == o.alignment && isVirtual == o.isVirtual && byValue == o.byValue &&
           reordering == o.reordering && vectorCount == o.vectorCount;
  }
  std::string text() const {
    return format("UID %lld (%s%s %s, strides %s)", static_cast<long long>(uid),
                  isVirtual ? "virtual " : (byValue ? "by-value " : ""), dataTypeName(type),
                  dimsText(dims).c_str(), dimsText(strides).c_str());
  }
};

/// The data types the interpreter stores; anything else makes a graph
/// unsupported.
bool modelledType(cudnnDataType_t t) {
  switch (t) {
  case CUDNN_DATA_FLOAT:
  case CUDNN_DATA_DOUBLE:
  case CUDNN_DATA_HALF:
  case CUDNN_DATA_BFLOAT16:
  case CUDNN_DATA_INT8:
  case CUDNN_DATA_UINT8:
  case CUDNN_DATA_INT32:
  case CUDNN_DATA_INT64:
  case CUDNN_DATA_BOOLEAN:
    return true;
  default:
    return false;
  }
}
bool is16(cudnnDataType_t t) { return t == CUDNN_DATA_HALF || t == CUDNN_DATA_BFLOAT16; }

/// Bytes per element in memory. BOOLEAN is a byte here: only virtual
/// boolean tensors are modelled (cuDNN packs non-virtual ones 8 to a byte).
int64_t elementBytes(cudnnDataType_t t) {
  switch (t) {
  case CUDNN_DATA_DOUBLE:
  case CUDNN_DATA_INT64:
    return 8;
  case CUDNN_DATA_FLOAT:
  case CUDNN_DATA_INT32:
    return 4;
  case CUDNN_DATA_HALF:
  case CUDNN_DATA_BFLOAT16:
    return 2;
  default:
    return 1;
  }
}

int64_t offsetOf(const TensorSpec &t, const std::vector<int64_t> &idx) {
  int64_t o = 0;
  for (size_t i = 0; i < idx.size(); ++i)
    o += idx[i] * t.strides[i];
  return o;
}
/// The offset of the element an output index reads from a broadcast input
/// (a dimension of 1 repeats).
int64_t broadcastOffset(const TensorSpec &t, const std::vector<int64_t> &idx) {
  int64_t o = 0;
  for (size_t i = 0; i < idx.size(); ++i)
    o += (t.dims[i] == 1 ? 0 : idx[i]) * t.strides[i];
  return o;
}

/// Calls f(index, linear) for every index of `dims` in row-major order.
template <typename F> void forEachIndex(const std::vector<int64_t> &dims, F f) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  std::vector<int64_t> idx(dims.size(), 0);
  for (int64_t l = 0; l < n; ++l) {
    f(static_cast<const std::vector<int64_t> &>(idx), l);
    for (size_t i = dims.size(); i-- > 0;) {
      if (++idx[i] < dims[i])
        break;
      idx[i] = 0;
    }
  }
}

/// Every element's offset, in row-major order of the index.
std::vector<int64_t> offsets(const TensorSpec &t) {
  std::vector<int64_t> out(t.count);
  forEachIndex(t.dims,
               [&](const std::vector<int64_t> &idx, int64_t l) { out[l] = offsetOf(t, idx); });
  return out;
}

/// Whether two elements of `t` share an offset.
bool selfOverlaps(const TensorSpec &t) {
  std::vector<char> seen(t.extent, 0);
  for (int64_t o : offsets(t)) {
    if (seen[o])
      return true;
    seen[o] = 1;
  }
  return false;
}

// ---- Operations ---------------------------------------------------------------------

/// A finalized convolution descriptor: two spatial dimensions (the only
/// number modelled), the compute type FLOAT.
struct ConvSpec {
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  int64_t stride[2] = {1, 1}, dilation[2] = {1, 1}, pre[2] = {0, 0}, post[2] = {0, 0};
};

/// A finalized operation descriptor.
struct OpSpec {
  enum Kind {
    Pointwise,
    Matmul,
    Reduction,
    Reshape,
    ConvForward,
    ConvBackwardData,
    ConvBackwardFilter
  } kind = Pointwise;
  /// Pointwise: x, b, t (as many as the mode takes); matmul: a, b;
  /// reduction, reshape: x; convolutions: forward X, W; backward data DY,
  /// W; backward filter X, DY.
  std::vector<std::shared_ptr<const TensorSpec>> in;
  /// Convolutions: Y, DX, DW.
  std::shared_ptr<const TensorSpec> out;
  cudnnPointwiseMode_t mode = CUDNN_POINTWISE_IDENTITY;
  /// Pointwise: the math precision; matmul, reduction: the compute type.
  cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  int64_t axis = -1;
  double alpha1 = 1, alpha2 = 1;
  cudnnReduceTensorOp_t reduce = CUDNN_REDUCE_TENSOR_ADD;
  // Convolutions: out = alpha * conv + beta * out, over `groups` groups.
  std::shared_ptr<const ConvSpec> conv;
  double alpha = 1, beta = 0;
  int64_t groups = 1;

  bool isConvolution() const {
    return kind == ConvForward || kind == ConvBackwardData || kind == ConvBackwardFilter;
  }
  std::string text() const {
    switch (kind) {
    case Pointwise:
      return std::string("pointwise ") + pointwiseName(mode);
    case Matmul:
      return "matmul";
    case Reduction:
      return std::string("reduction ") + reductionName(reduce);
    case Reshape:
      return "reshape";
    case ConvForward:
      return "convolution forward";
    case ConvBackwardData:
      return "convolution backward data";
    case ConvBackwardFilter:
      return "convolution backward filter";
    }
    return "";
  }
};

/// How many of x, b, t a pointwise mode reads (0: not modelled here).
int arity(cudnnPointwiseMode_t m) {
  switch (m) {
  case CUDNN_POINTWISE_ADD:
  case CUDNN_POINTWISE_ADD_SQUARE:
  case CUDNN_POINTWISE_DIV:
  case CUDNN_POINTWISE_MAX:
  case CUDNN_POINTWISE_MIN:
  case CUDNN_POINTWISE_MOD:
  case CUDNN_POINTWISE_MUL:
  case CUDNN_POINTWISE_POW:
  case CUDNN_POINTWISE_SUB:
  case CUDNN_POINTWISE_ATAN2:
  case CUDNN_POINTWISE_CMP_EQ:
  case CUDNN_POINTWISE_CMP_NEQ:
  case CUDNN_POINTWISE_CMP_GT:
  case CUDNN_POINTWISE_CMP_GE:
  case CUDNN_POINTWISE_CMP_LT:
  case CUDNN_POINTWISE_CMP_LE:
  case CUDNN_POINTWISE_LOGICAL_AND:
  case CUDNN_POINTWISE_LOGICAL_OR:
    return 2;
  case CUDNN_POINTWISE_BINARY_SELECT:
    return 3;
  case CUDNN_POINTWISE_RELU_BWD:
  case CUDNN_POINTWISE_TANH_BWD:
  case CUDNN_POINTWISE_SIGMOID_BWD:
  case CUDNN_POINTWISE_ELU_BWD:
  case CUDNN_POINTWISE_GELU_BWD:
  case CUDNN_POINTWISE_SOFTPLUS_BWD:
  case CUDNN_POINTWISE_SWISH_BWD:
  case CUDNN_POINTWISE_GELU_APPROX_TANH_BWD:
    return 0; // these read DYDESC and write DXDESC, which are not modelled
  default:
    return 1;
  }
}

/// Whether the interpreter computes `m` in math precision `p`.
bool pointwiseModelled(cudnnPointwiseMode_t m, cudnnDataType_t p) {
  const bool logical = m == CUDNN_POINTWISE_CMP_EQ || m == CUDNN_POINTWISE_CMP_NEQ ||
                       m == CUDNN_POINTWISE_CMP_GT || m == CUDNN_POINTWISE_CMP_GE ||
                       m == CUDNN_POINTWISE_CMP_LT || m == CUDNN_POINTWISE_CMP_LE ||
                       m == CUDNN_POINTWISE_LOGICAL_AND || m == CUDNN_POINTWISE_LOGICAL_OR ||
                       m == CUDNN_POINTWISE_LOGICAL_NOT || m == CUDNN_POINTWISE_BINARY_SELECT ||
                       m == CUDNN_POINTWISE_GEN_INDEX || m == CUDNN_POINTWISE_IDENTITY;
  const bool integer =
      logical || m == CUDNN_POINTWISE_ADD || m == CUDNN_POINTWISE_SUB || m == CUDNN_POINTWISE_MUL ||
      m == CUDNN_POINTWISE_DIV || m == CUDNN_POINTWISE_MOD || m == CUDNN_POINTWISE_MAX ||
      m == CUDNN_POINTWISE_MIN || m == CUDNN_POINTWISE_NEG || m == CUDNN_POINTWISE_ABS;
  const bool real =
      integer || m == CUDNN_POINTWISE_ADD_SQUARE || m == CUDNN_POINTWISE_POW ||
      m == CUDNN_POINTWISE_EXP || m == CUDNN_POINTWISE_LOG || m == CUDNN_POINTWISE_SQRT ||
      m == CUDNN_POINTWISE_RSQRT || m == CUDNN_POINTWISE_RECIPROCAL || m == CUDNN_POINTWISE_CEIL ||
      m == CUDNN_POINTWISE_FLOOR || m == CUDNN_POINTWISE_SIN || m == CUDNN_POINTWISE_COS ||
      m == CUDNN_POINTWISE_TAN || m == CUDNN_POINTWISE_ERF || m == CUDNN_POINTWISE_ATAN2 ||
      m == CUDNN_POINTWISE_RELU_FWD || m == CUDNN_POINTWISE_TANH_FWD ||
      m == CUDNN_POINTWISE_SIGMOID_FWD;
  switch (p) {
  case CUDNN_DATA_FLOAT:
  case CUDNN_DATA_DOUBLE:
  case CUDNN_DATA_HALF:
  case CUDNN_DATA_BFLOAT16:
    return real;
  case CUDNN_DATA_INT32:
  case CUDNN_DATA_INT64:
    return integer;
  case CUDNN_DATA_BOOLEAN:
    return logical;
  default:
    return false;
  }
}

// ---- Operation graphs ---------------------------------------------------------------

/// A finalized operation graph, as the interpreter runs it.
struct GraphSpec {
  struct Node {
    std::shared_ptr<const OpSpec> op;
    std::vector<int> in; // tensor indices, in OpSpec::in's order
    int out = -1;
    int number = 0; // its position in CUDNN_ATTR_OPERATIONGRAPH_OPS (from 1), for messages
  };
  std::vector<TensorSpec> tensors; // distinct tensors, in order of first appearance
  std::map<int64_t, int> byUid;
  std::vector<int> producer; // per tensor: the index into `order` of the op writing it, or -1
  std::vector<Node> order;   // the operations in a topological order
  bool hasMatmul = false;
  /// Whether an operation is a convolution (the convolution engines take
  /// the graph only when it is the graph's one operation).
  bool hasConvolution = false;
  /// Why the emulated engine does not take this graph ("": it does).
  std::string unsupported;
  /// The engine's workspace: an fp32 accumulator for every non-virtual
  /// 16-bit tensor a matmul writes (offsets per tensor, -1: none).
  int64_t workspace = 0;
  std::vector<int64_t> accumulatorOffset;
};

int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

/// The element type a matmul operand is multiplied in: the fused engine's
/// tensor cores take 16-bit operands, so an fp32 virtual operand (the
/// frontend's dS) is rounded to its partner's 16-bit type.
cudnnDataType_t operandType(const TensorSpec &x, const TensorSpec &partner) {
  if (x.type == CUDNN_DATA_FLOAT && x.isVirtual && is16(partner.type))
    return partner.type;
  return x.type;
}

/// Why the emulated engine does not take `g` ("": it does). The fused
/// flash-attention engine's conditions for graphs with matmuls, the
/// interpreter's own limits for all.
std::string whyUnsupported(const GraphSpec &g) {
  for (const TensorSpec &t : g.tensors) {
    if (!modelledType(t.type))
      return format("tensor %s: the emulation does not model %s", t.text().c_str(),
                    dataTypeName(t.type));
    if (t.type == CUDNN_DATA_BOOLEAN && !t.isVirtual)
      return format("tensor %s: a non-virtual CUDNN_DATA_BOOLEAN tensor (cuDNN packs them 8 "
                    "to a byte, which the emulation does not model)",
                    t.text().c_str());
    if (t.reordering != CUDNN_TENSOR_REORDERING_NONE || t.vectorCount != 1)
      return format("tensor %s: reordered or vectorized tensors are not modelled",
                    t.text().c_str());
  }
  for (const GraphSpec::Node &n : g.order) {
    const OpSpec &op = *n.op;
    const std::string where = format("%s (operation #%d)", op.text().c_str(), n.number);
    if (op.isConvolution()) {
      if (g.order.size() != 1)
        return format("%s: the emulated convolution engines take a graph of one convolution and "
                      "nothing else (this one has %zu operations; fused convolutions are not "
                      "modelled)",
                      where.c_str(), g.order.size());
      for (int t : {n.in[0], n.in[1], n.out}) {
        const TensorSpec &x = g.tensors[t];
        if (x.type != CUDNN_DATA_FLOAT && !is16(x.type))
          return format("%s: tensor %s: the emulated convolution engines take FLOAT, HALF or "
                        "BFLOAT16 tensors",
                        where.c_str(), x.text().c_str());
        if (x.isVirtual)
          return format("%s: tensor %s is virtual (a convolution alone in its graph reads and "
                        "writes memory)",
                        where.c_str(), x.text().c_str());
      }
      continue;
    }
    if (op.kind == OpSpec::Pointwise) {
      if (!pointwiseModelled(op.mode, op.prec))
        return format("%s: the emulation does not compute this mode in math precision %s",
                      where.c_str(), dataTypeName(op.prec));
      if (op.alpha1 != 1 || op.alpha2 != 1)
        return format("%s: ALPHA1 %g, ALPHA2 %g (the fused engines take 1.0 only)", where.c_str(),
                      op.alpha1, op.alpha2);
    }
    // The fused engine's additive bias (the frontend's SDPA bias): a
    // tensor in memory added to the scores, in the operands' 16-bit type,
    // [1 or b, 1 or h, sq, skv] -- broadcast over batch and heads only.
    if (g.hasMatmul && op.kind == OpSpec::Pointwise && op.mode == CUDNN_POINTWISE_ADD)
      for (size_t i = 0; i < n.in.size(); ++i) {
        const TensorSpec &b = g.tensors[n.in[i]], &y = g.tensors[n.out];
        if (b.isVirtual || b.byValue)
          continue;
        if (!is16(b.type))
          return format("%s: the bias %s is %s; the fused attention engine adds a HALF or "
                        "BFLOAT16 bias",
                        where.c_str(), b.text().c_str(), dataTypeName(b.type));
        const size_t r = y.dims.size();
        if (b.dims.size() != r || r < 2 || b.dims[r - 1] != y.dims[r - 1] ||
            b.dims[r - 2] != y.dims[r - 2])
          return format("%s: the bias %s does not cover the scores' last two dimensions %s (the "
                        "fused attention engine broadcasts a bias over batch and heads only)",
                        where.c_str(), b.text().c_str(), dimsText(y.dims).c_str());
      }
    if (op.kind == OpSpec::Reduction && op.prec != CUDNN_DATA_FLOAT && op.prec != CUDNN_DATA_DOUBLE)
      return format("%s: compute type %s is not modelled (FLOAT or DOUBLE)", where.c_str(),
                    dataTypeName(op.prec));
    if (op.kind != OpSpec::Matmul)
      continue;
    // The fused flash-attention engine.
    const TensorSpec &a = g.tensors[n.in[0]], &b = g.tensors[n.in[1]];
    if (op.prec != CUDNN_DATA_FLOAT)
      return format("%s: compute type %s (the fused attention engine accumulates in "
                    "CUDNN_DATA_FLOAT)",
                    where.c_str(), dataTypeName(op.prec));
    const cudnnDataType_t at = operandType(a, b), bt = operandType(b, a);
    for (auto [t, role] : {std::pair{&a, "A"}, std::pair{&b, "B"}}) {
      const cudnnDataType_t mt = t == &a ? at : bt;
      if (!is16(mt))
        return format("%s: %s is %s; the fused attention engine multiplies HALF or BFLOAT16 "
                      "operands (an fp32 operand only when it is virtual and the other is 16-bit)",
                      where.c_str(), role, t->text().c_str());
    }
    if (at != bt)
      return format("%s: A is multiplied as %s and B as %s (one 16-bit type)", where.c_str(),
                    dataTypeName(at), dataTypeName(bt));
    if (!a.isVirtual && !b.isVirtual) {
      const int64_t k = a.dims.back();
      if (k % 8 || k > 256)
        return format("%s: head dimension K = %lld of A %s (the fused attention engine takes "
                      "multiples of 8 up to 256)",
                      where.c_str(), static_cast<long long>(k), a.text().c_str());
    }
  }
  return "";
}

// ---- Finalize -----------------------------------------------------------------------

std::string finalizeWhere(const Desc &d) {
  return format("cudnnBackendFinalize(%s)", descriptorName(d.type));
}
cudnnStatus_t missing(const Desc &d, cudnnBackendAttributeName_t n) {
  return fail(CUDNN_STATUS_BAD_PARAM,
              finalizeWhere(d) + ": " + attrName(n) + " is required and was not set");
}
cudnnStatus_t badParam(const Desc &d, const std::string &why) {
  return fail(CUDNN_STATUS_BAD_PARAM, finalizeWhere(d) + ": " + why);
}

/// The first element of a descriptor attribute.
std::shared_ptr<Desc> refOf(const Attr *a) { return a ? a->descs.at(0) : nullptr; }

cudnnStatus_t finalizeTensor(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_ATTR_TENSOR_STRIDES,
        CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT})
    if (!attr(d, n))
      return missing(d, n);
  auto t = std::make_shared<TensorSpec>();
  t->type = value<cudnnDataType_t>(attr(d, CUDNN_ATTR_TENSOR_DATA_TYPE));
  t->dims = int64s(attr(d, CUDNN_ATTR_TENSOR_DIMENSIONS));
  t->strides = int64s(attr(d, CUDNN_ATTR_TENSOR_STRIDES));
  t->uid = value<int64_t>(attr(d, CUDNN_ATTR_TENSOR_UNIQUE_ID));
  t->alignment = value<int64_t>(attr(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT));
  if (const Attr *a = attr(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL))
    t->isVirtual = value<bool>(a);
  if (const Attr *a = attr(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE))
    t->byValue = value<bool>(a);
  if (const Attr *a = attr(d, CUDNN_ATTR_TENSOR_REORDERING_MODE))
    t->reordering = value<cudnnBackendTensorReordering_t>(a);
  if (const Attr *a = attr(d, CUDNN_ATTR_TENSOR_VECTOR_COUNT))
    t->vectorCount = value<int64_t>(a);
  const std::string uid = format("tensor UID %lld", static_cast<long long>(t->uid));
  if (!dataTypeName(t->type))
    return badParam(d, format("%s: CUDNN_ATTR_TENSOR_DATA_TYPE %d is no cudnnDataType_t",
                              uid.c_str(), static_cast<int>(t->type)));
  if (t->dims.size() != t->strides.size())
    return badParam(d,
                    format("%s: CUDNN_ATTR_TENSOR_DIMENSIONS %s and CUDNN_ATTR_TENSOR_STRIDES "
                           "%s differ in length",
                           uid.c_str(), dimsText(t->dims).c_str(), dimsText(t->strides).c_str()));
  for (size_t i = 0; i < t->dims.size(); ++i) {
    if (t->dims[i] <= 0)
      return badParam(d, format("%s: CUDNN_ATTR_TENSOR_DIMENSIONS %s: dimension %zu is not "
                                "positive",
                                uid.c_str(), dimsText(t->dims).c_str(), i));
    if (t->strides[i] <= 0)
      return badParam(d, format("%s: CUDNN_ATTR_TENSOR_STRIDES %s: stride %zu is not positive "
                                "(the emulation takes positive strides only)",
                                uid.c_str(), dimsText(t->strides).c_str(), i));
  }
  if (t->alignment <= 0 || (t->alignment & (t->alignment - 1)))
    return badParam(d, format("%s: CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT %lld is not a power of two",
                              uid.c_str(), static_cast<long long>(t->alignment)));
  if (t->isVirtual && t->byValue)
    return badParam(d,
                    uid + ": both CUDNN_ATTR_TENSOR_IS_VIRTUAL and CUDNN_ATTR_TENSOR_IS_BY_VALUE");
  if (t->vectorCount < 1)
    return badParam(d, uid + ": CUDNN_ATTR_TENSOR_VECTOR_COUNT below 1");
  int64_t count = 1, last = 0;
  for (size_t i = 0; i < t->dims.size(); ++i) {
    int64_t reach;
    if (__builtin_mul_overflow(count, t->dims[i], &count) ||
        __builtin_mul_overflow(t->dims[i] - 1, t->strides[i], &reach) ||
        __builtin_add_overflow(last, reach, &last) || last >= (int64_t(1) << 40))
      return badParam(d, format("%s: dims %s and strides %s reach past 2^40 elements", uid.c_str(),
                                dimsText(t->dims).c_str(), dimsText(t->strides).c_str()));
  }
  t->count = count;
  t->extent = last + 1;
  d.tensor = t;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeModeDescriptor(Desc &d) {
  cudnnBackendAttributeName_t need[2];
  switch (d.type) {
  case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
    need[0] = CUDNN_ATTR_POINTWISE_MODE;
    need[1] = CUDNN_ATTR_POINTWISE_MATH_PREC;
    break;
  case CUDNN_BACKEND_MATMUL_DESCRIPTOR:
    need[0] = need[1] = CUDNN_ATTR_MATMUL_COMP_TYPE;
    break;
  default: // REDUCTION
    need[0] = CUDNN_ATTR_REDUCTION_OPERATOR;
    need[1] = CUDNN_ATTR_REDUCTION_COMP_TYPE;
    break;
  }
  for (cudnnBackendAttributeName_t n : need)
    if (!attr(d, n))
      return missing(d, n);
  if (d.type == CUDNN_BACKEND_POINTWISE_DESCRIPTOR &&
      !pointwiseName(value<cudnnPointwiseMode_t>(attr(d, CUDNN_ATTR_POINTWISE_MODE))))
    return badParam(d, "CUDNN_ATTR_POINTWISE_MODE is no cudnnPointwiseMode_t");
  if (d.type == CUDNN_BACKEND_REDUCTION_DESCRIPTOR &&
      !reductionName(value<cudnnReduceTensorOp_t>(attr(d, CUDNN_ATTR_REDUCTION_OPERATOR))))
    return badParam(d, "CUDNN_ATTR_REDUCTION_OPERATOR is no cudnnReduceTensorOp_t");
  return CUDNN_STATUS_SUCCESS;
}

/// Whether `in` broadcasts to `out` (same rank; each dimension equal or 1).
bool broadcasts(const TensorSpec &in, const TensorSpec &out) {
  if (in.dims.size() != out.dims.size())
    return false;
  for (size_t i = 0; i < in.dims.size(); ++i)
    if (in.dims[i] != out.dims[i] && in.dims[i] != 1)
      return false;
  return true;
}

cudnnStatus_t finalizePointwiseOp(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
        CUDNN_ATTR_OPERATION_POINTWISE_YDESC})
    if (!attr(d, n))
      return missing(d, n);
  auto pw = refOf(attr(d, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR));
  auto op = std::make_shared<OpSpec>();
  op->kind = OpSpec::Pointwise;
  op->mode = value<cudnnPointwiseMode_t>(attr(*pw, CUDNN_ATTR_POINTWISE_MODE));
  op->prec = value<cudnnDataType_t>(attr(*pw, CUDNN_ATTR_POINTWISE_MATH_PREC));
  if (const Attr *a = attr(*pw, CUDNN_ATTR_POINTWISE_AXIS))
    op->axis = value<int64_t>(a);
  if (const Attr *a = attr(d, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1))
    op->alpha1 = scalarOf(a);
  if (const Attr *a = attr(d, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2))
    op->alpha2 = scalarOf(a);
  const int n = arity(op->mode);
  const char *mode = pointwiseName(op->mode);
  if (n == 0)
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                finalizeWhere(d) + ": " + mode +
                    " reads CUDNN_ATTR_OPERATION_POINTWISE_DYDESC, which the emulation does not "
                    "model");
  const Attr *b = attr(d, CUDNN_ATTR_OPERATION_POINTWISE_BDESC);
  const Attr *t = attr(d, CUDNN_ATTR_OPERATION_POINTWISE_TDESC);
  if (n >= 2 && !b)
    return badParam(d, std::string(mode) +
                           " takes CUDNN_ATTR_OPERATION_POINTWISE_BDESC, which was not set");
  if (n < 2 && b)
    return badParam(d, std::string(mode) + " takes no CUDNN_ATTR_OPERATION_POINTWISE_BDESC");
  if (n == 3 && !t)
    return badParam(d, std::string(mode) +
                           " takes CUDNN_ATTR_OPERATION_POINTWISE_TDESC, which was not set");
  if (n < 3 && t)
    return badParam(d, std::string(mode) + " takes no CUDNN_ATTR_OPERATION_POINTWISE_TDESC");
  op->in.push_back(refOf(attr(d, CUDNN_ATTR_OPERATION_POINTWISE_XDESC))->tensor);
  if (b)
    op->in.push_back(refOf(b)->tensor);
  if (t)
    op->in.push_back(refOf(t)->tensor);
  op->out = refOf(attr(d, CUDNN_ATTR_OPERATION_POINTWISE_YDESC))->tensor;
  const char *roles[] = {"XDESC", "BDESC", "TDESC"};
  for (size_t i = 0; i < op->in.size(); ++i)
    if (!broadcasts(*op->in[i], *op->out))
      return badParam(d,
                      format("%s: %s %s does not broadcast to YDESC %s (same rank, each "
                             "dimension equal or 1)",
                             mode, roles[i], op->in[i]->text().c_str(), op->out->text().c_str()));
  if (op->mode == CUDNN_POINTWISE_GEN_INDEX &&
      (op->axis < 0 || op->axis >= static_cast<int64_t>(op->out->dims.size())))
    return badParam(d, format("CUDNN_POINTWISE_GEN_INDEX: CUDNN_ATTR_POINTWISE_AXIS %lld is not "
                              "a dimension of YDESC %s",
                              static_cast<long long>(op->axis), op->out->text().c_str()));
  if (op->out->byValue)
    return badParam(d, "YDESC " + op->out->text() + " is passed by value");
  d.op = op;
  return CUDNN_STATUS_SUCCESS;
}

/// Whether a batch dimension of extent `x` maps onto the output's `c`: equal,
/// broadcast (1), or grouped (c a multiple of x: output index i reads i / (c/x),
/// grouped-query attention's heads).
bool batchMaps(int64_t x, int64_t c) { return x == c || x == 1 || (x < c && c % x == 0); }

cudnnStatus_t finalizeMatmulOp(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_ATTR_OPERATION_MATMUL_BDESC,
        CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_ATTR_OPERATION_MATMUL_DESC})
    if (!attr(d, n))
      return missing(d, n);
  auto op = std::make_shared<OpSpec>();
  op->kind = OpSpec::Matmul;
  op->prec = value<cudnnDataType_t>(
      attr(*refOf(attr(d, CUDNN_ATTR_OPERATION_MATMUL_DESC)), CUDNN_ATTR_MATMUL_COMP_TYPE));
  op->in = {refOf(attr(d, CUDNN_ATTR_OPERATION_MATMUL_ADESC))->tensor,
            refOf(attr(d, CUDNN_ATTR_OPERATION_MATMUL_BDESC))->tensor};
  op->out = refOf(attr(d, CUDNN_ATTR_OPERATION_MATMUL_CDESC))->tensor;
  const TensorSpec &a = *op->in[0], &b = *op->in[1], &c = *op->out;
  const std::string shapes =
      format("A %s, B %s, C %s", a.text().c_str(), b.text().c_str(), c.text().c_str());
  const size_t r = c.dims.size();
  if (r < 2 || a.dims.size() != r || b.dims.size() != r)
    return badParam(d, shapes + ": A, B and C need one rank of at least 2");
  const int64_t m = c.dims[r - 2], n = c.dims[r - 1], k = a.dims[r - 1];
  if (a.dims[r - 2] != m || b.dims[r - 2] != k || b.dims[r - 1] != n)
    return badParam(d, format("%s: not [..., M, K] x [..., K, N] -> [..., M, N] (A's K is %lld, "
                              "B's %lld)",
                              shapes.c_str(), static_cast<long long>(k),
                              static_cast<long long>(b.dims[r - 2])));
  for (size_t i = 0; i + 2 < r; ++i)
    if (!batchMaps(a.dims[i], c.dims[i]) || !batchMaps(b.dims[i], c.dims[i]))
      return badParam(d, format("%s: batch dimension %zu of A or B is neither C's, 1, nor a "
                                "divisor of C's",
                                shapes.c_str(), i));
  if (c.byValue)
    return badParam(d, "CDESC " + c.text() + " is passed by value");
  d.op = op;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeReductionOp(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_ATTR_OPERATION_REDUCTION_YDESC,
        CUDNN_ATTR_OPERATION_REDUCTION_DESC})
    if (!attr(d, n))
      return missing(d, n);
  auto op = std::make_shared<OpSpec>();
  op->kind = OpSpec::Reduction;
  const Desc &r = *refOf(attr(d, CUDNN_ATTR_OPERATION_REDUCTION_DESC));
  op->reduce = value<cudnnReduceTensorOp_t>(attr(r, CUDNN_ATTR_REDUCTION_OPERATOR));
  op->prec = value<cudnnDataType_t>(attr(r, CUDNN_ATTR_REDUCTION_COMP_TYPE));
  op->in = {refOf(attr(d, CUDNN_ATTR_OPERATION_REDUCTION_XDESC))->tensor};
  op->out = refOf(attr(d, CUDNN_ATTR_OPERATION_REDUCTION_YDESC))->tensor;
  const TensorSpec &x = *op->in[0], &y = *op->out;
  bool ok = x.dims.size() == y.dims.size();
  for (size_t i = 0; ok && i < x.dims.size(); ++i)
    ok = y.dims[i] == x.dims[i] || y.dims[i] == 1;
  if (!ok)
    return badParam(d, format("YDESC %s is not XDESC %s with reduced dimensions set to 1",
                              y.text().c_str(), x.text().c_str()));
  if (y.byValue)
    return badParam(d, "YDESC " + y.text() + " is passed by value");
  d.op = op;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeReshapeOp(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_ATTR_OPERATION_RESHAPE_YDESC})
    if (!attr(d, n))
      return missing(d, n);
  auto op = std::make_shared<OpSpec>();
  op->kind = OpSpec::Reshape;
  op->in = {refOf(attr(d, CUDNN_ATTR_OPERATION_RESHAPE_XDESC))->tensor};
  op->out = refOf(attr(d, CUDNN_ATTR_OPERATION_RESHAPE_YDESC))->tensor;
  if (op->in[0]->count != op->out->count)
    return badParam(d, format("XDESC %s and YDESC %s hold different numbers of elements",
                              op->in[0]->text().c_str(), op->out->text().c_str()));
  if (op->out->byValue)
    return badParam(d, "YDESC " + op->out->text() + " is passed by value");
  d.op = op;
  return CUDNN_STATUS_SUCCESS;
}

/// CONVOLUTION: every attribute is required; two spatial dimensions and
/// the compute type FLOAT are all that is modelled (NOT_SUPPORTED
/// otherwise).
cudnnStatus_t finalizeConvolution(Desc &d) {
  const cudnnBackendAttributeName_t arrays[] = {
      CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
      CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS};
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS})
    if (!attr(d, n))
      return missing(d, n);
  for (cudnnBackendAttributeName_t n : arrays)
    if (!attr(d, n))
      return missing(d, n);
  const int64_t dims = value<int64_t>(attr(d, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS));
  if (dims < 1 || dims > CUDNN_DIM_MAX - 2)
    return badParam(d, format("CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS %lld is not 1 to %d",
                              static_cast<long long>(dims), CUDNN_DIM_MAX - 2));
  if (dims != 2)
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                finalizeWhere(d) +
                    format(": CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS %lld: the emulation models 2-D "
                           "convolutions only",
                           static_cast<long long>(dims)));
  for (cudnnBackendAttributeName_t n : arrays)
    if (attr(d, n)->count != dims)
      return badParam(d, format("%s has %lld elements; CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS is %lld",
                                attrName(n).c_str(), static_cast<long long>(attr(d, n)->count),
                                static_cast<long long>(dims)));
  auto c = std::make_shared<ConvSpec>();
  const std::vector<int64_t> dil = int64s(attr(d, CUDNN_ATTR_CONVOLUTION_DILATIONS)),
                             str = int64s(attr(d, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES)),
                             pre = int64s(attr(d, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS)),
                             post = int64s(attr(d, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS));
  for (int i = 0; i < 2; ++i) {
    if (dil[i] < 1 || str[i] < 1)
      return badParam(d, format("CUDNN_ATTR_CONVOLUTION_DILATIONS %s and "
                                "CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES %s must be at least 1",
                                dimsText(dil).c_str(), dimsText(str).c_str()));
    if (pre[i] < 0 || post[i] < 0)
      return badParam(d, format("CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS %s and "
                                "CUDNN_ATTR_CONVOLUTION_POST_PADDINGS %s must not be negative",
                                dimsText(pre).c_str(), dimsText(post).c_str()));
    c->dilation[i] = dil[i];
    c->stride[i] = str[i];
    c->pre[i] = pre[i];
    c->post[i] = post[i];
  }
  c->mode = value<cudnnConvolutionMode_t>(attr(d, CUDNN_ATTR_CONVOLUTION_CONV_MODE));
  if (c->mode != CUDNN_CROSS_CORRELATION && c->mode != CUDNN_CONVOLUTION)
    return badParam(d, format("CUDNN_ATTR_CONVOLUTION_CONV_MODE %d is no cudnnConvolutionMode_t",
                              static_cast<int>(c->mode)));
  const auto comp = value<cudnnDataType_t>(attr(d, CUDNN_ATTR_CONVOLUTION_COMP_TYPE));
  if (!dataTypeName(comp))
    return badParam(d, format("CUDNN_ATTR_CONVOLUTION_COMP_TYPE %d is no cudnnDataType_t",
                              static_cast<int>(comp)));
  if (comp != CUDNN_DATA_FLOAT)
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                finalizeWhere(d) +
                    format(": CUDNN_ATTR_CONVOLUTION_COMP_TYPE %s: the emulation computes "
                           "convolutions in CUDNN_DATA_FLOAT only",
                           dataTypeName(comp)));
  d.conv = c;
  return CUDNN_STATUS_SUCCESS;
}

/// The attributes of one convolution operation, its tensors in the roles
/// of the forward's X, W and Y.
struct ConvRoles {
  cudnnBackendDescriptorType_t type;
  OpSpec::Kind kind;
  cudnnBackendAttributeName_t alpha, beta, conv, w, x, y;
  const char *wName, *xName, *yName;
};
const ConvRoles kConvRoles[] = {
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, OpSpec::ConvForward,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
     CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, "W",
     "X", "Y"},
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, OpSpec::ConvBackwardData,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, "W", "DX", "DY"},
    {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, OpSpec::ConvBackwardFilter,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
     CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, "DW", "X", "DY"},
};

/// The three convolution operations. Their shapes are checked as cuDNN
/// does: X [N, C, H, W], W [O, C/g, kh, kw] for g groups (C a multiple of
/// W's dims[1], O of g), Y [N, O, Ho, Wo] with Ho = (H + pre + post -
/// dil (kh - 1) - 1) / stride + 1 (floor), likewise Wo; one data type.
cudnnStatus_t finalizeConvOp(Desc &d) {
  const ConvRoles *r = nullptr;
  for (const ConvRoles &c : kConvRoles)
    if (c.type == d.type)
      r = &c;
  for (cudnnBackendAttributeName_t n : {r->alpha, r->beta, r->conv, r->w, r->x, r->y})
    if (!attr(d, n))
      return missing(d, n);
  auto op = std::make_shared<OpSpec>();
  op->kind = r->kind;
  op->conv = refOf(attr(d, r->conv))->conv;
  op->alpha = scalarOf(attr(d, r->alpha));
  op->beta = scalarOf(attr(d, r->beta));
  const std::shared_ptr<const TensorSpec> x = refOf(attr(d, r->x))->tensor,
                                          w = refOf(attr(d, r->w))->tensor,
                                          y = refOf(attr(d, r->y))->tensor;
  switch (r->kind) {
  case OpSpec::ConvForward:
    op->in = {x, w};
    op->out = y;
    break;
  case OpSpec::ConvBackwardData:
    op->in = {y, w};
    op->out = x;
    break;
  default:
    op->in = {x, y};
    op->out = w;
    break;
  }
  const std::pair<const TensorSpec *, const char *> roles[] = {
      {x.get(), r->xName}, {w.get(), r->wName}, {y.get(), r->yName}};
  for (auto [t, name] : roles) {
    if (t->dims.size() != 4)
      return badParam(d, format("%s %s has %zu dimensions; a 2-D convolution's tensors have 4 "
                                "(X [N, C, H, W], W [O, C/groups, kh, kw], Y [N, O, Ho, Wo])",
                                name, t->text().c_str(), t->dims.size()));
    if (t->byValue)
      return badParam(d, format("%s %s is passed by value", name, t->text().c_str()));
  }
  if (x->type != w->type || x->type != y->type)
    return badParam(d, format("%s is %s, %s %s and %s %s: a convolution's tensors have one data "
                              "type",
                              r->xName, dataTypeName(x->type), r->wName, dataTypeName(w->type),
                              r->yName, dataTypeName(y->type)));
  const int64_t c = x->dims[1], cg = w->dims[1], o = w->dims[0];
  if (c % cg)
    return badParam(d, format("%s's channels %lld (dims %s) are not a multiple of %s's dims[1] "
                              "%lld (dims %s): no whole number of groups",
                              r->xName, static_cast<long long>(c), dimsText(x->dims).c_str(),
                              r->wName, static_cast<long long>(cg), dimsText(w->dims).c_str()));
  op->groups = c / cg;
  if (o % op->groups)
    return badParam(d, format("%s's dims %s: %lld output channels do not split into the %lld "
                              "groups of %s's %lld channels",
                              r->wName, dimsText(w->dims).c_str(), static_cast<long long>(o),
                              static_cast<long long>(op->groups), r->xName,
                              static_cast<long long>(c)));
  const ConvSpec &cs = *op->conv;
  std::vector<int64_t> want{x->dims[0], o, 0, 0};
  for (int i = 0; i < 2; ++i) {
    const int64_t span =
        x->dims[2 + i] + cs.pre[i] + cs.post[i] - cs.dilation[i] * (w->dims[2 + i] - 1) - 1;
    if (span < 0)
      return badParam(d,
                      format("spatial dimension %d: %s's extent %lld padded by %lld and %lld "
                             "is smaller than %s's %lld taps dilated by %lld",
                             i, r->xName, static_cast<long long>(x->dims[2 + i]),
                             static_cast<long long>(cs.pre[i]), static_cast<long long>(cs.post[i]),
                             r->wName, static_cast<long long>(w->dims[2 + i]),
                             static_cast<long long>(cs.dilation[i])));
    want[2 + i] = span / cs.stride[i] + 1;
  }
  if (y->dims != want)
    return badParam(
        d, format("%s's dims %s, expected %s from %s %s and %s %s (strides %lld, "
                  "%lld; dilations %lld, %lld; pre-paddings %lld, %lld; "
                  "post-paddings %lld, %lld; groups %lld)",
                  r->yName, dimsText(y->dims).c_str(), dimsText(want).c_str(), r->xName,
                  dimsText(x->dims).c_str(), r->wName, dimsText(w->dims).c_str(),
                  static_cast<long long>(cs.stride[0]), static_cast<long long>(cs.stride[1]),
                  static_cast<long long>(cs.dilation[0]), static_cast<long long>(cs.dilation[1]),
                  static_cast<long long>(cs.pre[0]), static_cast<long long>(cs.pre[1]),
                  static_cast<long long>(cs.post[0]), static_cast<long long>(cs.post[1]),
                  static_cast<long long>(op->groups)));
  d.op = op;
  return CUDNN_STATUS_SUCCESS;
}

/// The operation graph: its distinct tensors, a topological order, whether
/// the engine takes it and the engine's workspace.
cudnnStatus_t finalizeGraph(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_ATTR_OPERATIONGRAPH_HANDLE})
    if (!attr(d, n))
      return missing(d, n);
  if (!liveHandle(value<cudnnHandle_t>(attr(d, CUDNN_ATTR_OPERATIONGRAPH_HANDLE))))
    return badParam(d, "CUDNN_ATTR_OPERATIONGRAPH_HANDLE is not a live cuDNN handle");
  auto g = std::make_shared<GraphSpec>();
  std::map<const TensorSpec *, int> index;
  auto tensorIndex = [&](const std::shared_ptr<const TensorSpec> &t, std::string &why) {
    auto it = index.find(t.get());
    if (it != index.end())
      return it->second;
    auto u = g->byUid.find(t->uid);
    if (u != g->byUid.end()) {
      // Two descriptors that say the same about one UID are one tensor.
      if (!g->tensors[u->second].sameAs(*t)) {
        why =
            format("two different tensors have UID %lld: %s and %s", static_cast<long long>(t->uid),
                   g->tensors[u->second].text().c_str(), t->text().c_str());
        return -1;
      }
      return index[t.get()] = u->second;
    }
    g->tensors.push_back(*t);
    g->byUid[t->uid] = static_cast<int>(g->tensors.size() - 1);
    return index[t.get()] = static_cast<int>(g->tensors.size() - 1);
  };
  const Attr *ops = attr(d, CUDNN_ATTR_OPERATIONGRAPH_OPS);
  std::vector<GraphSpec::Node> nodes;
  for (int64_t i = 0; i < ops->count; ++i) {
    GraphSpec::Node n;
    n.op = ops->descs[i]->op;
    n.number = static_cast<int>(i + 1);
    std::string why;
    for (const auto &t : n.op->in) {
      n.in.push_back(tensorIndex(t, why));
      if (!why.empty())
        return badParam(d, why);
    }
    n.out = tensorIndex(n.op->out, why);
    if (!why.empty())
      return badParam(d, why);
    nodes.push_back(std::move(n));
  }
  const size_t nt = g->tensors.size();
  std::vector<int> producer(nt, -1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    int &p = producer[nodes[i].out];
    if (p >= 0)
      return badParam(d, format("tensor %s is written by operation #%d (%s) and operation #%d (%s)",
                                g->tensors[nodes[i].out].text().c_str(), nodes[p].number,
                                nodes[p].op->text().c_str(), nodes[i].number,
                                nodes[i].op->text().c_str()));
    p = static_cast<int>(i);
  }
  for (const GraphSpec::Node &n : nodes)
    for (int t : n.in)
      if (g->tensors[t].isVirtual && producer[t] < 0)
        return badParam(d, format("virtual tensor %s is read by operation #%d (%s) and written "
                                  "by none",
                                  g->tensors[t].text().c_str(), n.number, n.op->text().c_str()));
  for (size_t t = 0; t < nt; ++t)
    if (producer[t] >= 0 && selfOverlaps(g->tensors[t]))
      return badParam(d, format("tensor %s is written by operation #%d, and its strides give two "
                                "elements one address",
                                g->tensors[t].text().c_str(), nodes[producer[t]].number));
  // Kahn's order, the listed order among the operations that can run.
  std::vector<bool> ready(nt), done(nodes.size());
  for (size_t t = 0; t < nt; ++t)
    ready[t] = producer[t] < 0;
  g->producer.assign(nt, -1);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (done[i] ||
          !std::all_of(nodes[i].in.begin(), nodes[i].in.end(), [&](int t) { return ready[t]; }))
        continue;
      done[i] = true;
      ready[nodes[i].out] = true;
      g->producer[nodes[i].out] = static_cast<int>(g->order.size());
      g->order.push_back(nodes[i]);
      progress = true;
    }
  }
  if (g->order.size() != nodes.size()) {
    for (size_t i = 0; i < nodes.size(); ++i)
      if (!done[i])
        return badParam(d, format("the operations form a cycle: operation #%d (%s) waits on "
                                  "itself through the tensors it reads",
                                  nodes[i].number, nodes[i].op->text().c_str()));
  }
  g->accumulatorOffset.assign(nt, -1);
  for (const GraphSpec::Node &n : g->order) {
    g->hasConvolution = g->hasConvolution || n.op->isConvolution();
    if (n.op->kind != OpSpec::Matmul)
      continue;
    g->hasMatmul = true;
    const TensorSpec &c = g->tensors[n.out];
    if (!c.isVirtual && is16(c.type)) {
      g->accumulatorOffset[n.out] = g->workspace;
      g->workspace += align256(c.count * static_cast<int64_t>(sizeof(float)));
    }
  }
  g->unsupported = whyUnsupported(*g);
  d.graph = g;
  return CUDNN_STATUS_SUCCESS;
}

/// The emulated engines, by CUDNN_ATTR_ENGINE_GLOBAL_INDEX.
enum EngineIndex : int64_t {
  /// The fused flash-attention engine for graphs with matmuls, the generic
  /// one for pointwise, reduction and reshape graphs; no convolutions.
  kFusedEngine = 0,
  /// Convolutions in FLOAT on tensor cores: the inputs rounded to TF32
  /// (notes TENSOR_CORE, DOWN_CONVERT_INPUTS).
  kConvTf32 = 1,
  /// Convolutions in FLOAT, exactly (no note).
  kConvFloat = 2,
  /// Convolutions in HALF or BFLOAT16 on tensor cores (note TENSOR_CORE).
  kConvTensorCore16 = 3,
  /// Backward filter, any modelled type, the sums in reverse order (note
  /// NONDETERMINISTIC): a caller that takes it sees other low bits.
  kConvNondeterministic = 4,
};

/// CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT: indices 0 to count - 1
/// exist for `g` (engine 0 refuses convolutions).
int64_t engineCount(const GraphSpec &g) {
  return g.hasConvolution ? kConvNondeterministic + 1 : kFusedEngine + 1;
}

/// Why engine `e` does not take `g` right now ("": it does).
std::string refusal(const GraphSpec &g, int64_t e) {
  if (engineMode() == EngineMode::Unsupported)
    return "CARVE_EMU_CUDNN=unsupported: the emulated engines take no graph";
  if (e == kFusedEngine)
    return g.hasConvolution ? "it runs no convolution (flash attention, pointwise, reduction and "
                              "reshape graphs only)"
                            : g.unsupported;
  if (!g.hasConvolution)
    return "it runs convolutions only";
  if (!g.unsupported.empty())
    return g.unsupported;
  const OpSpec &op = *g.order[0].op;
  const cudnnDataType_t t = op.out->type;
  if ((e == kConvTf32 || e == kConvFloat) && t != CUDNN_DATA_FLOAT)
    return format("it takes CUDNN_DATA_FLOAT tensors, not %s", dataTypeName(t));
  if (e == kConvTensorCore16 && !is16(t))
    return format("it takes HALF or BFLOAT16 tensors, not %s", dataTypeName(t));
  if (e == kConvNondeterministic && op.kind != OpSpec::ConvBackwardFilter)
    return "it runs backward-filter convolutions only";
  return "";
}

/// The numerical notes of engine `e` on `g`.
std::vector<cudnnBackendNumericalNote_t> numericalNotes(const GraphSpec &g, int64_t e) {
  switch (e) {
  case kConvTf32:
    return {CUDNN_NUMERICAL_NOTE_TENSOR_CORE, CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS};
  case kConvFloat:
    return {};
  case kConvTensorCore16:
    return {CUDNN_NUMERICAL_NOTE_TENSOR_CORE};
  case kConvNondeterministic:
    return {CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC};
  default:
    if (g.hasMatmul)
      return {CUDNN_NUMERICAL_NOTE_TENSOR_CORE};
    return {};
  }
}

/// Where a convolution engine keeps things in its workspace (byte offsets,
/// each 256-byte aligned; -1: not kept): the fp32 sums of every output
/// element before alpha and beta, and, for the TF32 engine, its two inputs
/// rounded to TF32 (a DOWN_CONVERT_INPUTS engine converts them first), each
/// dense in row-major order of its dims.
struct ConvWorkspace {
  int64_t sums = 0, in0 = -1, in1 = -1, bytes = 0;
};
ConvWorkspace convWorkspace(const GraphSpec &g, int64_t e) {
  const GraphSpec::Node &n = g.order[0];
  const auto floats = [&](int t) {
    return align256(g.tensors[t].count * static_cast<int64_t>(sizeof(float)));
  };
  ConvWorkspace w;
  w.bytes = floats(n.out);
  if (e == kConvTf32) {
    w.in0 = w.bytes;
    w.bytes += floats(n.in[0]);
    w.in1 = w.bytes;
    w.bytes += floats(n.in[1]);
  }
  return w;
}

/// The workspace engine `e` needs for `g`.
int64_t workspaceOf(const GraphSpec &g, int64_t e) {
  return e == kFusedEngine ? g.workspace : convWorkspace(g, e).bytes;
}

/// A finalized engine (global index `e`) and configuration of it for
/// `graphDesc`.
std::shared_ptr<Desc> engineConfig(const std::shared_ptr<Desc> &graphDesc, int64_t e) {
  auto engine = std::make_shared<Desc>(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  Attr graphAttr;
  graphAttr.type = CUDNN_TYPE_BACKEND_DESCRIPTOR;
  graphAttr.count = 1;
  graphAttr.bytes.resize(sizeof(void *));
  graphAttr.descs = {graphDesc};
  engine->attrs[CUDNN_ATTR_ENGINE_OPERATION_GRAPH] = graphAttr;
  Attr index;
  index.type = CUDNN_TYPE_INT64;
  index.count = 1;
  index.bytes.resize(sizeof(int64_t));
  std::memcpy(index.bytes.data(), &e, sizeof e);
  engine->attrs[CUDNN_ATTR_ENGINE_GLOBAL_INDEX] = index;
  engine->graph = graphDesc->graph;
  engine->engine = e;
  engine->finalized = true;
  auto cfg = std::make_shared<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  Attr engineAttr = graphAttr;
  engineAttr.descs = {engine};
  cfg->attrs[CUDNN_ATTR_ENGINECFG_ENGINE] = engineAttr;
  cfg->graph = graphDesc->graph;
  cfg->engine = e;
  cfg->workspace = workspaceOf(*graphDesc->graph, e);
  cfg->finalized = true;
  return cfg;
}

/// Every mode of the heuristics gives the engines that take the graph in
/// this order: the nondeterministic backward filter first, then TF32
/// before exact fp32, so a caller's choice among them matters.
cudnnStatus_t finalizeHeuristics(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_ATTR_ENGINEHEUR_MODE})
    if (!attr(d, n))
      return missing(d, n);
  auto graphDesc = refOf(attr(d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH));
  d.graph = graphDesc->graph;
  const std::vector<int64_t> ranked =
      d.graph->hasConvolution
          ? std::vector<int64_t>{kConvNondeterministic, kConvTf32, kConvFloat, kConvTensorCore16}
          : std::vector<int64_t>{kFusedEngine};
  std::string why;
  for (int64_t e : ranked) {
    const std::string no = refusal(*d.graph, e);
    if (no.empty())
      d.results.push_back(engineConfig(graphDesc, e));
    else if (why.empty())
      why = no;
  }
  if (d.results.empty())
    gLastError = "cudnnBackendFinalize(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR): no engine: " + why;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeEngine(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_ATTR_ENGINE_GLOBAL_INDEX})
    if (!attr(d, n))
      return missing(d, n);
  const int64_t i = value<int64_t>(attr(d, CUDNN_ATTR_ENGINE_GLOBAL_INDEX));
  d.graph = refOf(attr(d, CUDNN_ATTR_ENGINE_OPERATION_GRAPH))->graph;
  const int64_t count = engineCount(*d.graph);
  if (i < 0 || i >= count)
    return badParam(d, format("CUDNN_ATTR_ENGINE_GLOBAL_INDEX %lld: the emulation has %lld "
                              "engine%s for this graph, global indices 0 to %lld",
                              static_cast<long long>(i), static_cast<long long>(count),
                              count == 1 ? "" : "s", static_cast<long long>(count - 1)));
  const std::string why = refusal(*d.graph, i);
  if (!why.empty())
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                finalizeWhere(d) + format(": engine %lld: ", static_cast<long long>(i)) + why);
  d.engine = i;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeEngineConfig(Desc &d) {
  if (!attr(d, CUDNN_ATTR_ENGINECFG_ENGINE))
    return missing(d, CUDNN_ATTR_ENGINECFG_ENGINE);
  const Desc &engine = *refOf(attr(d, CUDNN_ATTR_ENGINECFG_ENGINE));
  d.graph = engine.graph;
  d.engine = engine.engine;
  d.workspace = workspaceOf(*d.graph, d.engine);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizePlan(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_ATTR_EXECUTION_PLAN_HANDLE})
    if (!attr(d, n))
      return missing(d, n);
  if (!liveHandle(value<cudnnHandle_t>(attr(d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE))))
    return badParam(d, "CUDNN_ATTR_EXECUTION_PLAN_HANDLE is not a live cuDNN handle");
  const Desc &cfg = *refOf(attr(d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG));
  if (engineMode() == EngineMode::PlanFails)
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                finalizeWhere(d) + ": CARVE_EMU_CUDNN=plan-fails: no plan finalizes");
  const std::string why = refusal(*cfg.graph, cfg.engine);
  if (!why.empty())
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                finalizeWhere(d) + ": " +
                    (cfg.engine == kFusedEngine
                         ? ""
                         : format("engine %lld: ", static_cast<long long>(cfg.engine))) +
                    why);
  d.graph = cfg.graph;
  d.engine = cfg.engine;
  d.workspace = cfg.workspace;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeVariantPack(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS})
    if (!attr(d, n))
      return missing(d, n);
  const Attr *uids = attr(d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
  const Attr *ptrs = attr(d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
  if (uids->count != ptrs->count)
    return badParam(d, format("%lld unique ids and %lld data pointers",
                              static_cast<long long>(uids->count),
                              static_cast<long long>(ptrs->count)));
  d.uids = int64s(uids);
  d.pointers.resize(ptrs->count);
  for (int64_t i = 0; i < ptrs->count; ++i)
    d.pointers[i] = value<void *>(ptrs, i);
  if (const Attr *w = attr(d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE))
    d.workspacePtr = value<void *>(w);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalizeKnobChoice(Desc &d) {
  for (cudnnBackendAttributeName_t n :
       {CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE})
    if (!attr(d, n))
      return missing(d, n);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalize(Desc &d) {
  switch (d.type) {
  case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
    return finalizeTensor(d);
  case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
  case CUDNN_BACKEND_MATMUL_DESCRIPTOR:
  case CUDNN_BACKEND_REDUCTION_DESCRIPTOR:
    return finalizeModeDescriptor(d);
  case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
    return finalizePointwiseOp(d);
  case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
    return finalizeMatmulOp(d);
  case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
    return finalizeReductionOp(d);
  case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR:
    return finalizeReshapeOp(d);
  case CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR:
    return finalizeConvolution(d);
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR:
  case CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR:
    return finalizeConvOp(d);
  case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
    return finalizeGraph(d);
  case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
    return finalizeHeuristics(d);
  case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
    return finalizeEngine(d);
  case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
    return finalizeEngineConfig(d);
  case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
    return finalizePlan(d);
  case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
    return finalizeVariantPack(d);
  default: // KNOB_CHOICE
    return finalizeKnobChoice(d);
  }
}

// ---- Elements -----------------------------------------------------------------------

template <typename T> T read(const char *base, int64_t i) {
  T v;
  std::memcpy(&v, base + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}
template <typename T> void write(char *base, int64_t i, T v) {
  std::memcpy(base + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

/// Element i of a buffer of type t, exactly.
double load(cudnnDataType_t t, const char *base, int64_t i) {
  switch (t) {
  case CUDNN_DATA_FLOAT:
    return read<float>(base, i);
  case CUDNN_DATA_DOUBLE:
    return read<double>(base, i);
  case CUDNN_DATA_HALF:
    return __half2float(read<__half>(base, i));
  case CUDNN_DATA_BFLOAT16:
    return __bfloat162float(read<__nv_bfloat16>(base, i));
  case CUDNN_DATA_INT8:
    return read<int8_t>(base, i);
  case CUDNN_DATA_UINT8:
    return read<uint8_t>(base, i);
  case CUDNN_DATA_INT32:
    return read<int32_t>(base, i);
  case CUDNN_DATA_INT64:
    return static_cast<double>(read<int64_t>(base, i));
  default: // BOOLEAN
    return read<uint8_t>(base, i) != 0;
  }
}

// The int64 range as doubles (the largest double below 2^63 for the top).
constexpr double kInt64Lo = -9223372036854775808.0, kInt64Hi = 9223372036854774784.0;

/// v as an integer: to nearest (ties to even), saturated, NaN as 0.
int64_t toInteger(double v, double lo, double hi) {
  if (std::isnan(v))
    return 0;
  return static_cast<int64_t>(std::min(hi, std::max(lo, std::nearbyint(v))));
}

/// Stores v rounded to t (to nearest even for the floating types).
void store(cudnnDataType_t t, char *base, int64_t i, double v) {
  switch (t) {
  case CUDNN_DATA_FLOAT:
    return write<float>(base, i, static_cast<float>(v));
  case CUDNN_DATA_DOUBLE:
    return write<double>(base, i, v);
  case CUDNN_DATA_HALF:
    return write<__half>(base, i, __double2half(v));
  case CUDNN_DATA_BFLOAT16:
    return write<__nv_bfloat16>(base, i, __double2bfloat16(v));
  case CUDNN_DATA_INT8:
    return write<int8_t>(base, i, static_cast<int8_t>(toInteger(v, -128, 127)));
  case CUDNN_DATA_UINT8:
    return write<uint8_t>(base, i, static_cast<uint8_t>(toInteger(v, 0, 255)));
  case CUDNN_DATA_INT32:
    return write<int32_t>(base, i, static_cast<int32_t>(toInteger(v, -2147483648.0, 2147483647.0)));
  case CUDNN_DATA_INT64:
    return write<int64_t>(base, i, toInteger(v, kInt64Lo, kInt64Hi));
  default: // BOOLEAN
    return write<uint8_t>(base, i, v != 0);
  }
}

/// v rounded to t and back.
double roundTo(cudnnDataType_t t, double v) {
  char buf[8];
  store(t, buf, 0, v);
  return load(t, buf, 0);
}

// ---- The interpreter ----------------------------------------------------------------

template <typename T> T pointwiseReal(cudnnPointwiseMode_t m, T x, T b, T t, T index) {
  switch (m) {
  case CUDNN_POINTWISE_ADD:
    return x + b;
  case CUDNN_POINTWISE_ADD_SQUARE:
    return x + b * b;
  case CUDNN_POINTWISE_SUB:
    return x - b;
  case CUDNN_POINTWISE_MUL:
    return x * b;
  case CUDNN_POINTWISE_DIV:
    return x / b;
  case CUDNN_POINTWISE_MOD:
    return std::fmod(x, b);
  case CUDNN_POINTWISE_POW:
    return std::pow(x, b);
  case CUDNN_POINTWISE_ATAN2:
    return std::atan2(x, b);
  case CUDNN_POINTWISE_MAX:
    return std::fmax(x, b);
  case CUDNN_POINTWISE_MIN:
    return std::fmin(x, b);
  case CUDNN_POINTWISE_ABS:
    return std::fabs(x);
  case CUDNN_POINTWISE_CEIL:
    return std::ceil(x);
  case CUDNN_POINTWISE_FLOOR:
    return std::floor(x);
  case CUDNN_POINTWISE_EXP:
    return std::exp(x);
  case CUDNN_POINTWISE_LOG:
    return std::log(x);
  case CUDNN_POINTWISE_NEG:
    return -x;
  case CUDNN_POINTWISE_SQRT:
    return std::sqrt(x);
  case CUDNN_POINTWISE_RSQRT:
    return T(1) / std::sqrt(x);
  case CUDNN_POINTWISE_RECIPROCAL:
    return T(1) / x;
  case CUDNN_POINTWISE_SIN:
    return std::sin(x);
  case CUDNN_POINTWISE_COS:
    return std::cos(x);
  case CUDNN_POINTWISE_TAN:
    return std::tan(x);
  case CUDNN_POINTWISE_ERF:
    return std::erf(x);
  case CUDNN_POINTWISE_RELU_FWD:
    return x > 0 ? x : T(0);
  case CUDNN_POINTWISE_TANH_FWD:
    return std::tanh(x);
  case CUDNN_POINTWISE_SIGMOID_FWD:
    return T(1) / (T(1) + std::exp(-x));
  case CUDNN_POINTWISE_CMP_EQ:
    return x == b;
  case CUDNN_POINTWISE_CMP_NEQ:
    return x != b;
  case CUDNN_POINTWISE_CMP_GT:
    return x > b;
  case CUDNN_POINTWISE_CMP_GE:
    return x >= b;
  case CUDNN_POINTWISE_CMP_LT:
    return x < b;
  case CUDNN_POINTWISE_CMP_LE:
    return x <= b;
  case CUDNN_POINTWISE_LOGICAL_AND:
    return x != 0 && b != 0;
  case CUDNN_POINTWISE_LOGICAL_OR:
    return x != 0 || b != 0;
  case CUDNN_POINTWISE_LOGICAL_NOT:
    return x == 0;
  case CUDNN_POINTWISE_GEN_INDEX:
    return index;
  case CUDNN_POINTWISE_BINARY_SELECT:
    // y = t ? x : b: cudnn-frontend's binary_select(input0 -> XDESC,
    // input1 -> BDESC, mask -> TDESC) "selects between input0 or input1
    // based on the mask", and its causal mask keeps the scores (input0)
    // where row >= col.
    return t != 0 ? x : b;
  default: // IDENTITY
    return x;
  }
}

int64_t pointwiseInteger(cudnnPointwiseMode_t m, int64_t x, int64_t b, int64_t t, int64_t index) {
  switch (m) {
  case CUDNN_POINTWISE_ADD:
    return x + b;
  case CUDNN_POINTWISE_SUB:
    return x - b;
  case CUDNN_POINTWISE_MUL:
    return x * b;
  case CUDNN_POINTWISE_DIV:
    return b ? x / b : 0;
  case CUDNN_POINTWISE_MOD:
    return b ? x % b : 0;
  case CUDNN_POINTWISE_MAX:
    return std::max(x, b);
  case CUDNN_POINTWISE_MIN:
    return std::min(x, b);
  case CUDNN_POINTWISE_NEG:
    return -x;
  case CUDNN_POINTWISE_ABS:
    return x < 0 ? -x : x;
  default:
    return static_cast<int64_t>(
        pointwiseReal<double>(m, static_cast<double>(x), static_cast<double>(b),
                              static_cast<double>(t), static_cast<double>(index)));
  }
}

/// One element of a pointwise operation, in its math precision: the
/// operands are converted to it, the result rounded to it (the store then
/// rounds to the output's type).
double evalPointwise(const OpSpec &op, double x, double b, double t, int64_t index) {
  switch (op.prec) {
  case CUDNN_DATA_FLOAT:
    return pointwiseReal<float>(op.mode, static_cast<float>(x), static_cast<float>(b),
                                static_cast<float>(t), static_cast<float>(index));
  case CUDNN_DATA_HALF:
  case CUDNN_DATA_BFLOAT16: {
    auto r = [&](double v) { return static_cast<float>(roundTo(op.prec, v)); };
    return roundTo(op.prec, pointwiseReal<float>(op.mode, r(x), r(b), r(t), r(index)));
  }
  case CUDNN_DATA_INT32:
  case CUDNN_DATA_INT64: {
    auto i = [](double v) { return toInteger(v, kInt64Lo, kInt64Hi); };
    return static_cast<double>(pointwiseInteger(op.mode, i(x), i(b), i(t), index));
  }
  default: // DOUBLE; BOOLEAN (comparisons, logic, selection: exact on the operands)
    return pointwiseReal<double>(op.mode, x, b, t, static_cast<double>(index));
  }
}

/// The buffers of one run, per tensor index.
using Buffers = std::vector<char *>;

void runPointwise(const GraphSpec &g, const GraphSpec::Node &n, const Buffers &buf) {
  const OpSpec &op = *n.op;
  const TensorSpec &y = g.tensors[n.out];
  double v[3] = {0, 0, 0};
  forEachIndex(y.dims, [&](const std::vector<int64_t> &idx, int64_t) {
    for (size_t k = 0; k < n.in.size(); ++k) {
      const TensorSpec &x = g.tensors[n.in[k]];
      v[k] = load(x.type, buf[n.in[k]], broadcastOffset(x, idx));
    }
    const int64_t index = op.mode == CUDNN_POINTWISE_GEN_INDEX ? idx[op.axis] : 0;
    store(y.type, buf[n.out], offsetOf(y, idx), evalPointwise(op, v[0], v[1], v[2], index));
  });
}

/// C = A B per batch index, each element summed in float in increasing k
/// order. A 16-bit non-virtual C goes through its fp32 accumulator in the
/// workspace.
void runMatmul(const GraphSpec &g, const GraphSpec::Node &n, const Buffers &buf, char *workspace) {
  const TensorSpec &a = g.tensors[n.in[0]], &b = g.tensors[n.in[1]], &c = g.tensors[n.out];
  const cudnnDataType_t at = operandType(a, b), bt = operandType(b, a);
  const size_t r = c.dims.size();
  const int64_t m = c.dims[r - 2], nn = c.dims[r - 1], k = a.dims[r - 1];
  float *acc = g.accumulatorOffset[n.out] >= 0
                   ? reinterpret_cast<float *>(workspace + g.accumulatorOffset[n.out])
                   : nullptr;
  std::vector<int64_t> batch(c.dims.begin(), c.dims.end() - 2);
  std::vector<float> ta(m * k), tb(k * nn);
  auto base = [&](const TensorSpec &x, const std::vector<int64_t> &idx) {
    int64_t o = 0;
    for (size_t i = 0; i < idx.size(); ++i)
      o += (x.dims[i] == c.dims[i] ? idx[i] : idx[i] / (c.dims[i] / x.dims[i])) * x.strides[i];
    return o;
  };
  forEachIndex(batch, [&](const std::vector<int64_t> &idx, int64_t l) {
    const int64_t ao = base(a, idx), bo = base(b, idx), co = offsetOf(c, idx);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < k; ++j)
        ta[i * k + j] = static_cast<float>(roundTo(
            at, load(a.type, buf[n.in[0]], ao + i * a.strides[r - 2] + j * a.strides[r - 1])));
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < nn; ++j)
        tb[i * nn + j] = static_cast<float>(roundTo(
            bt, load(b.type, buf[n.in[1]], bo + i * b.strides[r - 2] + j * b.strides[r - 1])));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < nn; ++j) {
        float s = 0;
        for (int64_t q = 0; q < k; ++q)
          s += ta[i * k + q] * tb[q * nn + j];
        if (acc)
          acc[(l * m + i) * nn + j] = s;
        store(c.type, buf[n.out], co + i * c.strides[r - 2] + j * c.strides[r - 1], s);
      }
  });
}

template <typename T>
void reduceInto(cudnnReduceTensorOp_t op, const GraphSpec &g, const GraphSpec::Node &n,
                const Buffers &buf) {
  const TensorSpec &x = g.tensors[n.in[0]], &y = g.tensors[n.out];
  T init = 0;
  if (op == CUDNN_REDUCE_TENSOR_MUL || op == CUDNN_REDUCE_TENSOR_MUL_NO_ZEROS)
    init = 1;
  else if (op == CUDNN_REDUCE_TENSOR_MAX)
    init = -std::numeric_limits<T>::infinity();
  else if (op == CUDNN_REDUCE_TENSOR_MIN)
    init = std::numeric_limits<T>::infinity();
  std::vector<T> acc(y.count, init);
  std::vector<int64_t> ystride(y.dims.size(), 1); // y's row-major linear index
  for (size_t i = y.dims.size(); i-- > 1;)
    ystride[i - 1] = ystride[i] * y.dims[i];
  // x in row-major order: every output element sums its inputs in increasing
  // row-major order of the reduced dimensions.
  forEachIndex(x.dims, [&](const std::vector<int64_t> &idx, int64_t) {
    int64_t yl = 0;
    for (size_t i = 0; i < idx.size(); ++i)
      yl += (y.dims[i] == 1 ? 0 : idx[i]) * ystride[i];
    const T v = static_cast<T>(load(x.type, buf[n.in[0]], offsetOf(x, idx)));
    T &a = acc[yl];
    switch (op) {
    case CUDNN_REDUCE_TENSOR_ADD:
    case CUDNN_REDUCE_TENSOR_AVG:
      a += v;
      break;
    case CUDNN_REDUCE_TENSOR_MUL:
      a *= v;
      break;
    case CUDNN_REDUCE_TENSOR_MUL_NO_ZEROS:
      a = v == 0 ? a : a * v;
      break;
    case CUDNN_REDUCE_TENSOR_MIN:
      a = std::fmin(a, v);
      break;
    case CUDNN_REDUCE_TENSOR_MAX:
      a = std::fmax(a, v);
      break;
    case CUDNN_REDUCE_TENSOR_AMAX:
      a = std::fmax(a, std::fabs(v));
      break;
    case CUDNN_REDUCE_TENSOR_NORM1:
      a += std::fabs(v);
      break;
    default: // NORM2
      a += v * v;
      break;
    }
  });
  const T per = static_cast<T>(x.count / y.count);
  forEachIndex(y.dims, [&](const std::vector<int64_t> &idx, int64_t l) {
    T v = acc[l];
    if (op == CUDNN_REDUCE_TENSOR_AVG)
      v /= per;
    else if (op == CUDNN_REDUCE_TENSOR_NORM2)
      v = std::sqrt(v);
    store(y.type, buf[n.out], offsetOf(y, idx), v);
  });
}

void runReduction(const GraphSpec &g, const GraphSpec::Node &n, const Buffers &buf) {
  if (n.op->prec == CUDNN_DATA_DOUBLE)
    reduceInto<double>(n.op->reduce, g, n, buf);
  else
    reduceInto<float>(n.op->reduce, g, n, buf);
}

/// RESHAPE. When X and Y address the same set of offsets (a transpose
/// through permuted strides, as the frontend's reshape of P, dS and K), Y's
/// element at offset o is X's at offset o: the same memory read through Y's
/// dims. Otherwise Y takes X's elements in row-major order of the index.
/// Either way converted to Y's type (the frontend's P^T is written as the
/// 16-bit type while P is fp32).
void runReshape(const GraphSpec &g, const GraphSpec::Node &n, const Buffers &buf) {
  const TensorSpec &x = g.tensors[n.in[0]], &y = g.tensors[n.out];
  const std::vector<int64_t> xo = offsets(x), yo = offsets(y);
  bool sameMemory = x.extent == y.extent;
  if (sameMemory) {
    std::vector<char> seen(x.extent, 0);
    for (int64_t o : xo)
      seen[o] = 1;
    for (int64_t o : yo)
      sameMemory = sameMemory && seen[o];
  }
  for (int64_t i = 0; i < y.count; ++i)
    store(y.type, buf[n.out], yo[i], load(x.type, buf[n.in[0]], sameMemory ? yo[i] : xo[i]));
}

/// v rounded to TF32 (10 explicit mantissa bits, float's exponent range),
/// to nearest, ties to even: what an engine noted DOWN_CONVERT_INPUTS does
/// to fp32 inputs before its tensor cores multiply them.
float toTf32(float v) {
  if (!std::isfinite(v))
    return v;
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u += 0xFFFu + ((u >> 13) & 1u);
  u &= ~0x1FFFu;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

/// A convolution on engine `e`. Each input is first read through its own
/// dims, strides and type into a dense float array (row-major in its
/// dims): exactly for engines 2, 3 and 4 (16-bit values are exact in
/// float), rounded to TF32 into the workspace for engine 1. Every output
/// element is then one float sum, each term a float product, from 0, of
/// the valid taps only (those that fall into the padding are skipped):
///   forward       y[n,o,i,j]  over c in o's group, then a, then b, of
///                 x[n,c,i*s0-pre0+a*d0,j*s1-pre1+b*d1] w[o,c-c0,a,b];
///   backward data dx[n,c,h,v] over o in c's group, then a, then b, of
///                 dy[n,o,i,j] w[o,c-c0,a,b] where i*s0-pre0+a*d0 = h and
///                 j*s1-pre1+b*d1 = v;
///   backward filter dw[o,c,a,b] over n, then i, then j, of
///                 dy[n,o,i,j] x[n,c0+c,i*s0-pre0+a*d0,j*s1-pre1+b*d1]
/// (all increasing; engine 4 takes the backward filter's terms in
/// decreasing order). CUDNN_CONVOLUTION flips the filter: tap (a, b) uses
/// w[..., kh-1-a, kw-1-b]. The sums go to the workspace; then out =
/// alpha * sum + beta * out in float (out not read when beta is 0, so a
/// NaN there does not leak), rounded once to the output's type.
void runConvolution(const GraphSpec &g, const GraphSpec::Node &n, const Buffers &buf,
                    char *workspace, int64_t engine) {
  const OpSpec &op = *n.op;
  const ConvSpec &cs = *op.conv;
  const TensorSpec &out = g.tensors[n.out];
  const ConvWorkspace ws = convWorkspace(g, engine);
  float *sums = reinterpret_cast<float *>(workspace + ws.sums);
  std::vector<float> owned[2];
  const float *in[2];
  for (int k = 0; k < 2; ++k) {
    const TensorSpec &t = g.tensors[n.in[k]];
    const int64_t at = k == 0 ? ws.in0 : ws.in1;
    float *to;
    if (at >= 0) {
      to = reinterpret_cast<float *>(workspace + at);
    } else {
      owned[k].resize(t.count);
      to = owned[k].data();
    }
    const char *base = buf[n.in[k]];
    forEachIndex(t.dims, [&](const std::vector<int64_t> &idx, int64_t l) {
      const float v = static_cast<float>(load(t.type, base, offsetOf(t, idx)));
      to[l] = engine == kConvTf32 ? toTf32(v) : v;
    });
    in[k] = to;
  }
  // The geometry in the forward's terms, each array dense: X [batch, chans,
  // height, width], W [outChans, groupChans, kh, kw], Y [batch, outChans,
  // outH, outW].
  const std::vector<int64_t> &xd =
      op.kind == OpSpec::ConvBackwardData ? out.dims : g.tensors[n.in[0]].dims;
  const std::vector<int64_t> &wd =
      op.kind == OpSpec::ConvBackwardFilter ? out.dims : g.tensors[n.in[1]].dims;
  const std::vector<int64_t> &yd = op.kind == OpSpec::ConvForward        ? out.dims
                                   : op.kind == OpSpec::ConvBackwardData ? g.tensors[n.in[0]].dims
                                                                         : g.tensors[n.in[1]].dims;
  const int64_t batch = xd[0], chans = xd[1], height = xd[2], width = xd[3];
  const int64_t outChans = wd[0], groupChans = wd[1], kh = wd[2], kw = wd[3];
  const int64_t outH = yd[2], outW = yd[3];
  const int64_t outPerGroup = outChans / op.groups;
  const bool flip = cs.mode == CUDNN_CONVOLUTION;
  auto xAt = [&](const float *x, int64_t nn, int64_t c, int64_t h, int64_t v) {
    return x[((nn * chans + c) * height + h) * width + v];
  };
  auto wAt = [&](const float *w, int64_t o, int64_t c, int64_t a, int64_t b) {
    if (flip) {
      a = kh - 1 - a;
      b = kw - 1 - b;
    }
    return w[((o * groupChans + c) * kh + a) * kw + b];
  };
  auto yAt = [&](const float *y, int64_t nn, int64_t o, int64_t i, int64_t j) {
    return y[((nn * outChans + o) * outH + i) * outW + j];
  };
  // The input row (column) tap a (b) of output row i (column j) reads.
  auto row = [&](int64_t i, int64_t a) {
    return i * cs.stride[0] - cs.pre[0] + a * cs.dilation[0];
  };
  auto col = [&](int64_t j, int64_t b) {
    return j * cs.stride[1] - cs.pre[1] + b * cs.dilation[1];
  };
  switch (op.kind) {
  case OpSpec::ConvForward:
    for (int64_t nn = 0; nn < batch; ++nn)
      for (int64_t o = 0; o < outChans; ++o)
        for (int64_t i = 0; i < outH; ++i)
          for (int64_t j = 0; j < outW; ++j) {
            const int64_t c0 = o / outPerGroup * groupChans;
            float s = 0;
            for (int64_t c = 0; c < groupChans; ++c)
              for (int64_t a = 0; a < kh; ++a) {
                const int64_t h = row(i, a);
                if (h < 0 || h >= height)
                  continue;
                for (int64_t b = 0; b < kw; ++b) {
                  const int64_t v = col(j, b);
                  if (v >= 0 && v < width)
                    s += xAt(in[0], nn, c0 + c, h, v) * wAt(in[1], o, c, a, b);
                }
              }
            sums[((nn * outChans + o) * outH + i) * outW + j] = s;
          }
    break;
  case OpSpec::ConvBackwardData:
    for (int64_t nn = 0; nn < batch; ++nn)
      for (int64_t c = 0; c < chans; ++c)
        for (int64_t h = 0; h < height; ++h)
          for (int64_t v = 0; v < width; ++v) {
            const int64_t grp = c / groupChans, cg = c - grp * groupChans;
            float s = 0;
            for (int64_t o = grp * outPerGroup; o < (grp + 1) * outPerGroup; ++o)
              for (int64_t a = 0; a < kh; ++a) {
                const int64_t hi = h + cs.pre[0] - a * cs.dilation[0];
                if (hi < 0 || hi % cs.stride[0] || hi / cs.stride[0] >= outH)
                  continue;
                for (int64_t b = 0; b < kw; ++b) {
                  const int64_t vj = v + cs.pre[1] - b * cs.dilation[1];
                  if (vj < 0 || vj % cs.stride[1] || vj / cs.stride[1] >= outW)
                    continue;
                  s += yAt(in[0], nn, o, hi / cs.stride[0], vj / cs.stride[1]) *
                       wAt(in[1], o, cg, a, b);
                }
              }
            sums[((nn * chans + c) * height + h) * width + v] = s;
          }
    break;
  default: { // ConvBackwardFilter
    const bool reverse = engine == kConvNondeterministic;
    const int64_t terms = batch * outH * outW;
    for (int64_t o = 0; o < outChans; ++o)
      for (int64_t c = 0; c < groupChans; ++c)
        for (int64_t a = 0; a < kh; ++a)
          for (int64_t b = 0; b < kw; ++b) {
            const int64_t cx = o / outPerGroup * groupChans + c;
            float s = 0;
            for (int64_t q = 0; q < terms; ++q) {
              const int64_t t = reverse ? terms - 1 - q : q;
              const int64_t nn = t / (outH * outW), i = t / outW % outH, j = t % outW;
              const int64_t h = row(i, a), v = col(j, b);
              if (h >= 0 && h < height && v >= 0 && v < width)
                s += yAt(in[1], nn, o, i, j) * xAt(in[0], nn, cx, h, v);
            }
            // The tap (a, b) of a flipped filter is its element (kh-1-a, kw-1-b).
            const int64_t fa = flip ? kh - 1 - a : a, fb = flip ? kw - 1 - b : b;
            sums[((o * groupChans + c) * kh + fa) * kw + fb] = s;
          }
    break;
  }
  }
  const float alpha = static_cast<float>(op.alpha), beta = static_cast<float>(op.beta);
  char *base = buf[n.out];
  forEachIndex(out.dims, [&](const std::vector<int64_t> &idx, int64_t l) {
    const int64_t o = offsetOf(out, idx);
    float v = alpha * sums[l];
    if (beta != 0)
      v += beta * static_cast<float>(load(out.type, base, o));
    store(out.type, base, o, v);
  });
}

/// One execution of `g` on engine `engine`: `bound` holds the caller's
/// buffers (by-value ones copied), virtual tensors get buffers of their
/// own, filled with 0xFF bytes (NaN in the floating types) so that reading
/// an element no operation wrote shows.
void run(const GraphSpec &g, Buffers buf, char *workspace, int64_t engine) {
  std::vector<std::vector<char>> owned(g.tensors.size());
  for (size_t i = 0; i < g.tensors.size(); ++i)
    if (g.tensors[i].isVirtual) {
      owned[i].assign(g.tensors[i].extent * elementBytes(g.tensors[i].type), char(0xFF));
      buf[i] = owned[i].data();
    }
  for (const GraphSpec::Node &n : g.order) {
    switch (n.op->kind) {
    case OpSpec::Pointwise:
      runPointwise(g, n, buf);
      break;
    case OpSpec::Matmul:
      runMatmul(g, n, buf, workspace);
      break;
    case OpSpec::Reduction:
      runReduction(g, n, buf);
      break;
    case OpSpec::Reshape:
      runReshape(g, n, buf);
      break;
    case OpSpec::ConvForward:
    case OpSpec::ConvBackwardData:
    case OpSpec::ConvBackwardFilter:
      runConvolution(g, n, buf, workspace, engine);
      break;
    }
  }
}

std::atomic<int64_t> gExecutions{0};

// ---- cudnnBackendExecute's checks ---------------------------------------------------

/// A piece of memory the plan touches: a tensor's elements or the workspace.
struct Region {
  const char *base;
  const TensorSpec *tensor; // null: the workspace, `bytes` long
  int64_t bytes;
  bool written;
  std::string name;

  const char *lo() const { return base; }
  const char *hi() const {
    return base + (tensor ? tensor->extent * elementBytes(tensor->type) : bytes);
  }
  /// Calls f(first, last) for the byte range of every element.
  template <typename F> void forEachElement(F f) const {
    if (!tensor)
      return f(base, base + bytes);
    const int64_t size = elementBytes(tensor->type);
    for (int64_t o : offsets(*tensor))
      f(base + o * size, base + (o + 1) * size);
  }
};

/// The first address two regions share, or null.
const char *sharedByte(const Region &a, const Region &b) {
  const char *lo = std::max(a.lo(), b.lo()), *hi = std::min(a.hi(), b.hi());
  if (lo >= hi)
    return nullptr;
  std::vector<char> mark(hi - lo, 0);
  a.forEachElement([&](const char *p, const char *q) {
    for (const char *c = std::max(p, lo); c < std::min(q, hi); ++c)
      mark[c - lo] = 1;
  });
  const char *found = nullptr;
  b.forEachElement([&](const char *p, const char *q) {
    for (const char *c = std::max(p, lo); !found && c < std::min(q, hi); ++c)
      if (mark[c - lo])
        found = c;
  });
  return found;
}

} // namespace

// ---- The API ------------------------------------------------------------------------

extern "C" {

size_t cudnnGetVersion(void) { return CUDNN_VERSION; }

size_t cudnnGetCudartVersion(void) { return CUDART_VERSION; }

cudnnStatus_t cudnnGetProperty(libraryPropertyType type, int *value) {
  if (!value)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnGetProperty: value is null");
  switch (type) {
  case MAJOR_VERSION:
    *value = CUDNN_MAJOR;
    return CUDNN_STATUS_SUCCESS;
  case MINOR_VERSION:
    *value = CUDNN_MINOR;
    return CUDNN_STATUS_SUCCESS;
  case PATCH_LEVEL:
    *value = CUDNN_PATCHLEVEL;
    return CUDNN_STATUS_SUCCESS;
  default:
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnGetProperty: unknown libraryPropertyType");
  }
}

const char *cudnnGetErrorString(cudnnStatus_t status) {
#define CARVE_CASE(x)                                                                              \
  case CUDNN_STATUS_##x:                                                                           \
    return "CUDNN_STATUS_" #x;
  switch (status) {
    CARVE_CASE(SUCCESS)
    CARVE_CASE(NOT_INITIALIZED)
    CARVE_CASE(SUBLIBRARY_VERSION_MISMATCH)
    CARVE_CASE(SERIALIZATION_VERSION_MISMATCH)
    CARVE_CASE(DEPRECATED)
    CARVE_CASE(LICENSE_ERROR)
    CARVE_CASE(RUNTIME_IN_PROGRESS)
    CARVE_CASE(RUNTIME_FP_OVERFLOW)
    CARVE_CASE(SUBLIBRARY_LOADING_FAILED)
    CARVE_CASE(BAD_PARAM)
    CARVE_CASE(BAD_PARAM_NULL_POINTER)
    CARVE_CASE(BAD_PARAM_MISALIGNED_POINTER)
    CARVE_CASE(BAD_PARAM_NOT_FINALIZED)
    CARVE_CASE(BAD_PARAM_OUT_OF_BOUND)
    CARVE_CASE(BAD_PARAM_SIZE_INSUFFICIENT)
    CARVE_CASE(BAD_PARAM_STREAM_MISMATCH)
    CARVE_CASE(BAD_PARAM_SHAPE_MISMATCH)
    CARVE_CASE(BAD_PARAM_DUPLICATED_ENTRIES)
    CARVE_CASE(BAD_PARAM_ATTRIBUTE_TYPE)
    CARVE_CASE(BAD_PARAM_CUDA_GRAPH_MISMATCH)
    CARVE_CASE(BAD_PARAM_DESCRIPTOR_TYPE)
    CARVE_CASE(NOT_SUPPORTED)
    CARVE_CASE(NOT_SUPPORTED_GRAPH_PATTERN)
    CARVE_CASE(NOT_SUPPORTED_SHAPE)
    CARVE_CASE(NOT_SUPPORTED_DATA_TYPE)
    CARVE_CASE(NOT_SUPPORTED_LAYOUT)
    CARVE_CASE(NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER)
    CARVE_CASE(NOT_SUPPORTED_INCOMPATIBLE_CUDART)
    CARVE_CASE(NOT_SUPPORTED_ARCH_MISMATCH)
    CARVE_CASE(NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING)
    CARVE_CASE(NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE)
    CARVE_CASE(NOT_SUPPORTED_SHARED_MEMORY_INSUFFICIENT)
    CARVE_CASE(NOT_SUPPORTED_PADDING)
    CARVE_CASE(NOT_SUPPORTED_BAD_LAUNCH_PARAM)
    CARVE_CASE(NOT_SUPPORTED_CUDA_GRAPH_NATIVE_API)
    CARVE_CASE(NOT_SUPPORTED_INVALID_DYNAMIC_SHAPE)
    CARVE_CASE(INTERNAL_ERROR)
    CARVE_CASE(INTERNAL_ERROR_COMPILATION_FAILED)
    CARVE_CASE(INTERNAL_ERROR_UNEXPECTED_VALUE)
    CARVE_CASE(INTERNAL_ERROR_HOST_ALLOCATION_FAILED)
    CARVE_CASE(INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
    CARVE_CASE(INTERNAL_ERROR_BAD_LAUNCH_PARAM)
    CARVE_CASE(INTERNAL_ERROR_TEXTURE_CREATION_FAILED)
    CARVE_CASE(EXECUTION_FAILED)
    CARVE_CASE(EXECUTION_FAILED_CUDA_DRIVER)
    CARVE_CASE(EXECUTION_FAILED_CUBLAS)
    CARVE_CASE(EXECUTION_FAILED_CUDART)
    CARVE_CASE(EXECUTION_FAILED_CURAND)
  default:
    return "CUDNN_STATUS_UNKNOWN (not a cudnnStatus_t)";
  }
#undef CARVE_CASE
}

void cudnnGetLastErrorString(char *message, size_t max_size) {
  if (!message || !max_size)
    return;
  std::snprintf(message, max_size, "%s", gLastError.c_str());
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *handle) {
  if (!handle)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnCreate: handle is null");
  *handle = new cudnnContext;
  handles().insert(*handle);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  if (!liveHandle(handle))
    return fail(CUDNN_STATUS_BAD_PARAM,
                format("cudnnDestroy: %p is not a live cuDNN handle", static_cast<void *>(handle)));
  handles().erase(handle);
  delete handle;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId) {
  if (!liveHandle(handle))
    return fail(CUDNN_STATUS_BAD_PARAM, format("cudnnSetStream: %p is not a live cuDNN handle",
                                               static_cast<void *>(handle)));
  handle->stream = streamId;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnGetStream(cudnnHandle_t handle, cudaStream_t *streamId) {
  if (!liveHandle(handle) || !streamId)
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnGetStream: not a live cuDNN handle, or streamId is null");
  *streamId = handle->stream;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t descriptorType,
                                           cudnnBackendDescriptor_t *descriptor) {
  if (!descriptor)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendCreateDescriptor: descriptor is null");
  if (!modelledDescriptor(descriptorType))
    return fail(CUDNN_STATUS_NOT_SUPPORTED,
                format("cudnnBackendCreateDescriptor: %s (%d) is not modelled by the CPU "
                       "emulation of cuDNN (tests/gpu-emu/cudnn_emu.cpp)",
                       descriptorName(descriptorType), static_cast<int>(descriptorType)));
  auto d = std::make_shared<Desc>(descriptorType);
  *descriptor = d.get();
  descriptors()[d.get()] = d;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t descriptor) {
  if (!descriptors().erase(descriptor))
    return fail(CUDNN_STATUS_BAD_PARAM,
                format("cudnnBackendDestroyDescriptor: %p is not a live descriptor (never "
                       "created, or destroyed)",
                       descriptor));
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendInitialize(cudnnBackendDescriptor_t) {
  return fail(CUDNN_STATUS_NOT_SUPPORTED,
              "cudnnBackendInitialize (deprecated) is not modelled by the CPU emulation");
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t descriptor) {
  std::shared_ptr<Desc> d = lookup(descriptor);
  if (!d)
    return fail(CUDNN_STATUS_BAD_PARAM,
                format("cudnnBackendFinalize: %p is not a live descriptor", descriptor));
  if (d->finalized)
    return fail(CUDNN_STATUS_BAD_PARAM, finalizeWhere(*d) + ": already finalized");
  cudnnStatus_t s = finalize(*d);
  d->finalized = s == CUDNN_STATUS_SUCCESS;
  return s;
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t descriptor,
                                       cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType,
                                       int64_t elementCount, const void *arrayOfElements) {
  std::shared_ptr<Desc> d = lookup(descriptor);
  if (!d)
    return fail(CUDNN_STATUS_BAD_PARAM,
                format("cudnnBackendSetAttribute(%s): %p is not a live descriptor",
                       attrName(attributeName).c_str(), descriptor));
  const std::string where = format("cudnnBackendSetAttribute(%s, %s)", descriptorName(d->type),
                                   attrName(attributeName).c_str());
  if (d->finalized)
    return fail(CUDNN_STATUS_BAD_PARAM, where + ": the descriptor is finalized");
  const AttrSpec *spec = specFor(d->type, attributeName);
  if (!spec) {
    if (const AttrSpec *other = specAnywhere(attributeName))
      return fail(CUDNN_STATUS_BAD_PARAM,
                  where + ": an attribute of " + descriptorName(other->owner));
    return fail(CUDNN_STATUS_NOT_SUPPORTED, where + ": not modelled by the CPU emulation of cuDNN");
  }
  if (!spec->settable)
    return fail(CUDNN_STATUS_BAD_PARAM, where + ": read-only (cudnnBackendGetAttribute)");
  if (attributeType != spec->type && attributeType != spec->alsoType)
    return fail(CUDNN_STATUS_BAD_PARAM,
                where + format(": takes %s, not %s", attrTypeName(spec->type),
                               attrTypeName(attributeType)));
  if (elementCount < spec->minCount || elementCount > spec->maxCount) {
    std::string want = spec->minCount == spec->maxCount
                           ? std::to_string(spec->minCount)
                           : (spec->maxCount == kMany ? "at least " + std::to_string(spec->minCount)
                                                      : std::to_string(spec->minCount) + " to " +
                                                            std::to_string(spec->maxCount));
    return fail(CUDNN_STATUS_BAD_PARAM,
                where + format(": takes %s elements, not %lld", want.c_str(),
                               static_cast<long long>(elementCount)));
  }
  if (elementCount > 0 && !arrayOfElements)
    return fail(CUDNN_STATUS_BAD_PARAM, where + ": arrayOfElements is null");
  Attr a;
  a.type = attributeType;
  a.count = elementCount;
  const size_t bytes = attrElementBytes(attributeType) * elementCount;
  a.bytes.resize(bytes);
  if (bytes)
    std::memcpy(a.bytes.data(), arrayOfElements, bytes);
  if (attributeType == CUDNN_TYPE_BACKEND_DESCRIPTOR) {
    for (int64_t i = 0; i < elementCount; ++i) {
      const void *h = static_cast<const cudnnBackendDescriptor_t *>(arrayOfElements)[i];
      std::shared_ptr<Desc> e = lookup(h);
      if (!e)
        return fail(CUDNN_STATUS_BAD_PARAM,
                    where + format(": element %lld (%p) is not a live descriptor",
                                   static_cast<long long>(i), h));
      const bool typeOk =
          spec->refersTo == kAnyOperation ? isOperation(e->type) : e->type == spec->refersTo;
      if (!typeOk)
        return fail(CUDNN_STATUS_BAD_PARAM,
                    where + format(": element %lld is a %s, not a%s %s", static_cast<long long>(i),
                                   descriptorName(e->type),
                                   spec->refersTo == kAnyOperation ? "n" : "",
                                   spec->refersTo == kAnyOperation
                                       ? "operation descriptor (pointwise, matmul, reduction, "
                                         "reshape, convolution)"
                                       : descriptorName(spec->refersTo)));
      if (!e->finalized)
        return fail(CUDNN_STATUS_BAD_PARAM,
                    where + format(": element %lld (%s) is not finalized",
                                   static_cast<long long>(i), descriptorName(e->type)));
      a.descs.push_back(e);
    }
  }
  d->attrs[attributeName] = std::move(a);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const descriptor,
                                       cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType,
                                       int64_t requestedElementCount, int64_t *elementCount,
                                       void *arrayOfElements) {
  std::shared_ptr<Desc> d = lookup(descriptor);
  if (!d)
    return fail(CUDNN_STATUS_BAD_PARAM,
                format("cudnnBackendGetAttribute(%s): %p is not a live descriptor",
                       attrName(attributeName).c_str(), descriptor));
  const std::string where = format("cudnnBackendGetAttribute(%s, %s)", descriptorName(d->type),
                                   attrName(attributeName).c_str());
  const AttrSpec *spec = specFor(d->type, attributeName);
  if (!spec) {
    if (const AttrSpec *other = specAnywhere(attributeName))
      return fail(CUDNN_STATUS_BAD_PARAM,
                  where + ": an attribute of " + descriptorName(other->owner));
    return fail(CUDNN_STATUS_NOT_SUPPORTED, where + ": not modelled by the CPU emulation of cuDNN");
  }
  if (attributeType != spec->type && attributeType != spec->alsoType)
    return fail(CUDNN_STATUS_BAD_PARAM, where + format(": is %s, not %s", attrTypeName(spec->type),
                                                       attrTypeName(attributeType)));
  if (requestedElementCount < 0 || (requestedElementCount > 0 && !arrayOfElements))
    return fail(CUDNN_STATUS_BAD_PARAM,
                where + ": a negative requestedElementCount, or a null arrayOfElements");
  const bool computed = !spec->settable;
  if (computed && !d->finalized)
    return fail(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, where + ": the descriptor is not finalized");

  // How many elements the caller gets (elementCount: those, or, asked for
  // none, how many there are).
  auto answer = [&](int64_t available) {
    const int64_t n = arrayOfElements ? std::min(requestedElementCount, available) : 0;
    if (elementCount)
      *elementCount = n > 0 || (arrayOfElements && requestedElementCount > 0) ? n : available;
    return n;
  };
  // The real API fills descriptors the caller created: each must be live, of
  // the attribute's descriptor type, and not finalized yet.
  auto fillDescriptors = [&](const std::vector<std::shared_ptr<Desc>> &from) {
    const int64_t n = answer(static_cast<int64_t>(from.size()));
    for (int64_t i = 0; i < n; ++i) {
      void *h = static_cast<cudnnBackendDescriptor_t *>(arrayOfElements)[i];
      std::shared_ptr<Desc> to = lookup(h);
      if (!to || to->type != from[i]->type || to->finalized)
        return fail(CUDNN_STATUS_BAD_PARAM,
                    where + format(": element %lld (%p) must be a live, unfinalized %s the "
                                   "caller created",
                                   static_cast<long long>(i), h, descriptorName(from[i]->type)));
      *to = *from[i];
    }
    return CUDNN_STATUS_SUCCESS;
  };
  auto give = [&](const void *values, int64_t available, size_t size) {
    const int64_t n = answer(available);
    if (n && values)
      std::memcpy(arrayOfElements, values, n * size);
    return CUDNN_STATUS_SUCCESS;
  };

  switch (attributeName) {
  case CUDNN_ATTR_ENGINEHEUR_RESULTS:
    return fillDescriptors(d->results);
  case CUDNN_ATTR_ENGINECFG_WORKSPACE_SIZE:
  case CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE:
    return give(&d->workspace, 1, sizeof(int64_t));
  case CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT: {
    const int64_t engines = engineCount(*d->graph);
    return give(&engines, 1, sizeof(int64_t));
  }
  case CUDNN_ATTR_ENGINE_NUMERICAL_NOTE: {
    const std::vector<cudnnBackendNumericalNote_t> notes = numericalNotes(*d->graph, d->engine);
    return give(notes.data(), static_cast<int64_t>(notes.size()), sizeof(notes[0]));
  }
  case CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE:
  case CUDNN_ATTR_ENGINE_KNOB_INFO:
  case CUDNN_ATTR_ENGINE_LAYOUT_INFO:
    return give(nullptr, 0, 1);
  default:
    break;
  }
  const Attr *a = attr(*d, attributeName);
  if (!a) {
    if (attributeName == CUDNN_ATTR_ENGINECFG_KNOB_CHOICES)
      return give(nullptr, 0, 1);
    return fail(CUDNN_STATUS_BAD_PARAM, where + ": not set");
  }
  if (a->type != attributeType)
    return fail(CUDNN_STATUS_BAD_PARAM, where + format(": was set as %s", attrTypeName(a->type)));
  if (a->type == CUDNN_TYPE_BACKEND_DESCRIPTOR)
    return fillDescriptors(a->descs);
  return give(a->bytes.data(), a->count, attrElementBytes(a->type));
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                  cudnnBackendDescriptor_t variantPack) {
  if (!liveHandle(handle))
    return fail(CUDNN_STATUS_BAD_PARAM, format("cudnnBackendExecute: %p is not a live cuDNN handle",
                                               static_cast<void *>(handle)));
  std::shared_ptr<Desc> plan = lookup(executionPlan), pack = lookup(variantPack);
  if (!plan || plan->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR || !plan->finalized)
    return fail(CUDNN_STATUS_BAD_PARAM,
                "cudnnBackendExecute: executionPlan is not a live, finalized "
                "CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR");
  if (!pack || pack->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR || !pack->finalized)
    return fail(CUDNN_STATUS_BAD_PARAM, "cudnnBackendExecute: variantPack is not a live, finalized "
                                        "CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR");
  std::shared_ptr<const GraphSpec> g = plan->graph;
  const size_t nt = g->tensors.size();
  const int64_t engine = plan->engine, workspaceBytes = plan->workspace;

  // Every tensor the engine does not keep is bound once, to memory of the
  // right kind; nothing else is bound.
  Buffers bound(nt, nullptr);
  for (size_t i = 0; i < pack->uids.size(); ++i) {
    const long long uid = pack->uids[i];
    auto it = g->byUid.find(uid);
    if (it == g->byUid.end())
      carve_emu::fatalCall("cudnnBackendExecute: the variant pack binds UID %lld, which is no "
                           "tensor of the plan's graph",
                           uid);
    const TensorSpec &t = g->tensors[it->second];
    if (t.isVirtual)
      carve_emu::fatalCall("cudnnBackendExecute: the variant pack binds UID %lld, a virtual "
                           "tensor of the graph (the engine keeps it)",
                           uid);
    if (bound[it->second])
      carve_emu::fatalCall("cudnnBackendExecute: the variant pack binds UID %lld twice", uid);
    if (!pack->pointers[i])
      carve_emu::fatalCall("cudnnBackendExecute: UID %lld %s: the data pointer is null", uid,
                           t.text().c_str());
    bound[it->second] = static_cast<char *>(pack->pointers[i]);
  }
  // By-value tensors are read now, as the real call reads them (a captured
  // call keeps the value it saw).
  auto byValue = std::make_shared<std::vector<std::vector<char>>>(nt);
  std::vector<Region> regions;
  for (size_t i = 0; i < nt; ++i) {
    const TensorSpec &t = g->tensors[i];
    if (t.isVirtual)
      continue;
    const long long uid = t.uid;
    if (!bound[i])
      carve_emu::fatalCall("cudnnBackendExecute: the variant pack does not bind UID %lld %s", uid,
                           t.text().c_str());
    const size_t bytes = t.extent * elementBytes(t.type);
    if (t.byValue) {
      if (carve_emu::isDeviceMemory(bound[i], bytes))
        carve_emu::fatalCall("cudnnBackendExecute: UID %lld %s is passed by value, so its "
                             "pointer must be host memory; %p is device memory",
                             uid, t.text().c_str(), static_cast<void *>(bound[i]));
      (*byValue)[i].assign(bound[i], bound[i] + bytes);
      continue;
    }
    if (!carve_emu::isDeviceMemory(bound[i], bytes))
      carve_emu::fatalCall("cudnnBackendExecute: UID %lld %s: [%p, +%zu bytes) is not inside one "
                           "device allocation",
                           uid, t.text().c_str(), static_cast<void *>(bound[i]), bytes);
    if (reinterpret_cast<uintptr_t>(bound[i]) % t.alignment)
      carve_emu::fatalCall("cudnnBackendExecute: UID %lld %s: %p is not aligned to its "
                           "CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT of %lld bytes",
                           uid, t.text().c_str(), static_cast<void *>(bound[i]),
                           static_cast<long long>(t.alignment));
    regions.push_back({bound[i], &t, 0, g->producer[i] >= 0, "UID " + std::to_string(uid)});
  }
  char *workspace = static_cast<char *>(pack->workspacePtr);
  if (workspaceBytes > 0) {
    if (!workspace)
      carve_emu::fatalCall("cudnnBackendExecute: the plan needs a workspace of %lld bytes "
                           "(CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) and the variant pack has "
                           "none",
                           static_cast<long long>(workspaceBytes));
    if (!carve_emu::isDeviceMemory(workspace, workspaceBytes))
      carve_emu::fatalCall("cudnnBackendExecute: the workspace [%p, +%lld bytes) is not inside "
                           "one device allocation",
                           static_cast<void *>(workspace), static_cast<long long>(workspaceBytes));
    regions.push_back({workspace, nullptr, workspaceBytes, true, "the workspace"});
  }
  // What the plan writes shares no byte with anything else it touches.
  for (size_t i = 0; i < regions.size(); ++i)
    for (size_t j = i + 1; j < regions.size(); ++j)
      if (regions[i].written || regions[j].written)
        if (const char *p = sharedByte(regions[i], regions[j]))
          carve_emu::fatalCall(
              "cudnnBackendExecute: %s and %s share memory (at %p), and the "
              "plan writes %s",
              regions[i].name.c_str(), regions[j].name.c_str(), static_cast<const void *>(p),
              regions[i].written ? regions[i].name.c_str() : regions[j].name.c_str());
  carve_emu::enqueue(handle->stream, [g, bound, byValue, workspace, engine]() {
    Buffers buf = bound;
    for (size_t i = 0; i < buf.size(); ++i)
      if (!(*byValue)[i].empty())
        buf[i] = (*byValue)[i].data();
    run(*g, buf, workspace, engine);
    ++gExecutions;
  });
  return CUDNN_STATUS_SUCCESS;
}

int64_t carve_emu_cudnn_executions(void) { return gExecutions.load(); }

} // extern "C"
