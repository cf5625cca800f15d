//===- cudnn_graph.h - building cuDNN backend graphs ----------*- C++ -*-===//
//
// The helpers attention_cudnn.cpp and conv_cudnn.cpp build their graphs with,
// through cuDNN 9's backend API (cudnn_graph.h; these machines have no
// cudnn-frontend header): descriptors owned and destroyed with their graph,
// attributes set with their types, every failure while building a refusal
// (the caller runs carve's own kernel and says why), every failure while
// running fatal, naming the call. Included only where CARVE_HAVE_CUDNN.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_CUDA_CUDNN_GRAPH_H
#define CARVE_RT_CUDA_CUDNN_GRAPH_H

#include "internal.h"

#include <cudnn.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace carve::gpu::dnn {

/// A cuDNN call that failed while a graph was built: why cuDNN refused it.
struct Refused {
  std::string why;
};

inline std::string lastError() {
  char buf[512] = {};
  cudnnGetLastErrorString(buf, sizeof buf);
  return buf;
}

/// Building: a failure is a refusal (carve's kernel runs instead).
inline void check(cudnnStatus_t s, const char *what) {
  if (s != CUDNN_STATUS_SUCCESS) {
    std::string why = std::string(what) + ": " + cudnnGetErrorString(s);
    std::string detail = lastError();
    if (!detail.empty())
      why += " (" + detail + ")";
    throw Refused{why};
  }
}

/// Running a graph that was built: a failure is fatal, naming the call.
inline void checkRun(cudnnStatus_t s, const char *what, const char *op) {
  if (s != CUDNN_STATUS_SUCCESS) {
    std::string detail = lastError();
    rt::fatal("%s: cuDNN %s failed: %s%s%s%s", op, what, cudnnGetErrorString(s),
              detail.empty() ? "" : " (", detail.c_str(), detail.empty() ? "" : ")");
  }
}

/// One backend descriptor, destroyed with its owner.
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  explicit Desc(cudnnBackendDescriptorType_t t) {
    check(cudnnBackendCreateDescriptor(t, &d), "cudnnBackendCreateDescriptor");
  }
  ~Desc() {
    if (d)
      cudnnBackendDestroyDescriptor(d);
  }
  Desc(const Desc &) = delete;
  Desc &operator=(const Desc &) = delete;

  template <typename T>
  Desc &set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T *values,
            int64_t count = 1) {
    check(cudnnBackendSetAttribute(d, name, type, count, values), "cudnnBackendSetAttribute");
    return *this;
  }
  Desc &setInt(cudnnBackendAttributeName_t name, int64_t v) {
    return set(name, CUDNN_TYPE_INT64, &v);
  }
  Desc &setType(cudnnBackendAttributeName_t name, cudnnDataType_t t) {
    return set(name, CUDNN_TYPE_DATA_TYPE, &t);
  }
  Desc &setDesc(cudnnBackendAttributeName_t name, const Desc &o) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &o.d);
  }
  void finalize(const char *what) { check(cudnnBackendFinalize(d), what); }
};

using Dims4 = std::array<int64_t, 4>;

/// The tensors and ops of one graph under construction.
class Graph {
public:
  explicit Graph(cudnnDataType_t io) : io(io) {}

  /// A tensor the caller binds in the variant pack.
  const Desc &input(int64_t uid, cudnnDataType_t t, Dims4 dims, Dims4 strides) {
    return tensor(uid, t, dims, strides, false, false);
  }
  /// A scalar passed by value (its host address goes in the variant pack).
  const Desc &scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }
  /// An intermediate the engine keeps on chip.
  const Desc &virt(cudnnDataType_t t, Dims4 dims) { return virt(t, dims, rowMajor(dims)); }
  const Desc &virt(cudnnDataType_t t, Dims4 dims, Dims4 strides) {
    return tensor(nextVirtual++, t, dims, strides, true, false);
  }

  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, const Desc &x, const Desc *b,
                 const Desc *t, const Desc &y, int64_t axis = -1) {
    auto pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
    pw->setType(CUDNN_ATTR_POINTWISE_MATH_PREC, prec);
    if (axis >= 0)
      pw->setInt(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw->finalize("the pointwise descriptor");
    auto op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->setDesc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw);
    op->setDesc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b)
      op->setDesc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t)
      op->setDesc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op->setDesc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    op->finalize("a pointwise operation");
    ops.push_back(op->d);
  }
  void matmul(const Desc &a, const Desc &b, const Desc &c) {
    auto mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm->setType(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT);
    mm->finalize("the matmul descriptor");
    auto op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->setDesc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op->setDesc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op->setDesc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op->setDesc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
    op->finalize("a matmul operation");
    ops.push_back(op->d);
  }
  void reduction(cudnnReduceTensorOp_t mode, const Desc &x, const Desc &y) {
    auto r = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    r->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
    r->setType(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT);
    r->finalize("the reduction descriptor");
    auto op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->setDesc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op->setDesc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op->setDesc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *r);
    op->finalize("a reduction operation");
    ops.push_back(op->d);
  }
  /// A convolution's geometry, as cuDNN's convolution descriptor takes it
  /// (cross-correlation, fp32 accumulation).
  struct ConvGeometry {
    int64_t strides[2], pre[2], post[2], dilations[2];
  };
  /// One convolution operation: forward (a = X, b = W, c = Y), data gradient
  /// (a = DY, b = W, c = DX) or filter gradient (a = X, b = DY, c = DW).
  void convolution(cudnnBackendDescriptorType_t kind, const ConvGeometry &geo, const Desc &a,
                   const Desc &b, const Desc &c) {
    auto conv = keep(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
    conv->setType(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_DATA_FLOAT);
    cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
    conv->set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, &mode);
    conv->setInt(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, 2);
    conv->set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, geo.dilations, 2);
    conv->set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, geo.strides, 2);
    conv->set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, geo.pre, 2);
    conv->set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, geo.post, 2);
    conv->finalize("the convolution descriptor");
    auto op = keep(kind);
    const float alpha = 1.0f, beta = 0.0f;
    if (kind == CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR) {
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, &alpha);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, &beta);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, *conv);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, a);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, b);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, c);
    } else if (kind == CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR) {
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_TYPE_FLOAT, &alpha);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, CUDNN_TYPE_FLOAT, &beta);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, *conv);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, a);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, b);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, c);
    } else {
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_TYPE_FLOAT, &alpha);
      op->set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, CUDNN_TYPE_FLOAT, &beta);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, *conv);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, a);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, b);
      op->setDesc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, c);
    }
    op->finalize("a convolution operation");
    ops.push_back(op->d);
  }

  /// y is x's memory read through y's dims and strides (a transpose).
  void reshape(const Desc &x, const Desc &y) {
    auto op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->setDesc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op->setDesc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    op->finalize("a reshape operation");
    ops.push_back(op->d);
  }

  /// row >= col ? s : -inf, the causal (top-left) mask as the frontend's
  /// CompositeDiagonalBandMaskNode writes it for cuDNN before 9.21.
  const Desc &causalMask(const Desc &s, Dims4 sd, int64_t negInfUid) {
    const Desc &row = virt(CUDNN_DATA_INT32, sd);
    const Desc &col = virt(CUDNN_DATA_INT32, sd);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, s, nullptr, nullptr, row, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, s, nullptr, nullptr, col, 3);
    const Desc &keepIt = virt(CUDNN_DATA_BOOLEAN, sd);
    pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, &col, nullptr, keepIt);
    const Desc &out = virt(CUDNN_DATA_FLOAT, sd);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, &scalar(negInfUid), &keepIt, out);
    return out;
  }

  /// Why an engine configuration must not run this graph ("": it may).
  using EngineFilter = std::function<std::string(cudnnBackendDescriptor_t cfg)>;

  /// The operation graph, the first engine configuration of heuristic A
  /// that `filter` (if any) accepts and whose plan finalizes, and that
  /// plan's workspace size; with `fallbackList`, where heuristic A offers
  /// none, the same from cuDNN's fallback list (every engine that supports
  /// the graph: what a filter that refuses A's top choices still finds).
  void plan(cudnnHandle_t handle, const EngineFilter &filter = nullptr, bool fallbackList = false) {
    graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(),
               static_cast<int64_t>(ops.size()));
    graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle);
    graph->finalize("the operation graph");
    std::string why = planFrom(handle, CUDNN_HEUR_MODE_A, filter);
    if (!why.empty() && fallbackList) {
      std::string fallback = planFrom(handle, CUDNN_HEUR_MODE_FALLBACK, filter);
      if (fallback.empty())
        return;
      why += "; the fallback list: " + fallback;
    }
    if (!why.empty())
      throw Refused{why};
  }

  cudnnDataType_t io;
  std::unique_ptr<Desc> executionPlan;
  int64_t workspaceBytes = 0;

private:
  static Dims4 rowMajor(Dims4 d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }

  /// plan()'s search in one heuristic's list: "" where a plan was made,
  /// else why none was.
  std::string planFrom(cudnnHandle_t handle, cudnnBackendHeurMode_t mode,
                       const EngineFilter &filter) {
    const char *list = mode == CUDNN_HEUR_MODE_A ? "heuristic A" : "the fallback heuristic";
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.setDesc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *graph);
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    heur.finalize("the engine heuristics");
    int64_t count = 0;
    check(cudnnBackendGetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
          "the heuristics' result count");
    if (count <= 0) {
      std::string detail = lastError();
      return std::string("no cuDNN engine of ") + list + " takes this graph on this GPU" +
             (detail.empty() ? std::string() : ": " + detail);
    }
    std::vector<std::unique_ptr<Desc>> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(cfgs.back()->d);
    }
    int64_t got = 0;
    check(cudnnBackendGetAttribute(heur.d, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()),
          "the heuristics' results");
    std::string why = std::string("no engine configuration of ") + list + " finalized";
    for (int64_t i = 0; i < got; ++i) {
      if (filter) {
        std::string skip = filter(cfgs[i]->d);
        if (!skip.empty()) {
          why = skip;
          continue;
        }
      }
      auto p = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      try {
        p->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle);
        p->setDesc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[i]);
        p->finalize("the execution plan");
      } catch (const Refused &r) {
        why = r.why;
        continue;
      }
      int64_t n = 0;
      check(cudnnBackendGetAttribute(p->d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                     CUDNN_TYPE_INT64, 1, &n, &workspaceBytes),
            "the plan's workspace size");
      executionPlan = std::move(p);
      return "";
    }
    return why;
  }

  const Desc &tensor(int64_t uid, cudnnDataType_t t, Dims4 dims, Dims4 strides, bool isVirtual,
                     bool byValue) {
    auto d = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    d->setType(CUDNN_ATTR_TENSOR_DATA_TYPE, t);
    d->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4);
    d->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4);
    d->setInt(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
    d->setInt(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
    d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &isVirtual);
    d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &byValue);
    d->finalize("a tensor descriptor");
    return *d;
  }
  Desc *keep(cudnnBackendDescriptorType_t t) {
    owned.push_back(std::make_unique<Desc>(t));
    return owned.back().get();
  }

  std::vector<std::unique_ptr<Desc>> owned;
  std::vector<cudnnBackendDescriptor_t> ops;
  std::unique_ptr<Desc> graph;
  int64_t nextVirtual = 1000;
};

/// Runs a planned graph on the compute stream with the tensors `ptrs` bound
/// to `uids` and the plan's workspace `ws`; a failure is fatal, naming `op`.
inline void execute(cudnnHandle_t handle, Graph &g, std::vector<int64_t> uids,
                    std::vector<void *> ptrs, void *ws, const char *op) {
  checkRun(cudnnSetStream(handle, stream()), "cudnnSetStream", op);
  cudnnBackendDescriptor_t pack = nullptr;
  checkRun(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack),
           "variant pack", op);
  const int64_t n = static_cast<int64_t>(uids.size());
  checkRun(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n,
                                    uids.data()),
           "variant pack ids", op);
  checkRun(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                    CUDNN_TYPE_VOID_PTR, n, ptrs.data()),
           "variant pack pointers", op);
  checkRun(cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                                    &ws),
           "variant pack workspace", op);
  checkRun(cudnnBackendFinalize(pack), "variant pack", op);
  {
    KernelTimer timer(op, stream());
    checkRun(cudnnBackendExecute(handle, g.executionPlan->d, pack), "cudnnBackendExecute", op);
  }
  cudnnBackendDestroyDescriptor(pack);
}

} // namespace carve::gpu::dnn

#endif // CARVE_RT_CUDA_CUDNN_GRAPH_H
