//===- GpuCost.cpp - what a lowered CUDA program launches, and its time ---===//
//
// Each entry below mirrors the host code of its runtime/cuda function: the
// kernels it launches (by the name CARVE_GPU_PROFILE prints, template
// arguments left out), under the same conditions. A change there that adds,
// drops or splits a launch is a change here; tests/e2e/gpu_model.py compares
// the two on the emulated GPU.
//
//===----------------------------------------------------------------------===//

#include "compiler/lower/GpuCost.h"
#include "compiler/precision/Precision.h"

#include "compiler/fusion/Fusion.h"
#include "compiler/lower/Kernels.h"
#include "compiler/optimizer/Optimizer.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Contract.h"
#include "dialects/dist/DistDialect.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cmath>

using namespace mlir;

namespace carve {

const char *gpuClassName(GpuClass c) {
  switch (c) {
  case GpuClass::Gemm:
    return "gemm";
  case GpuClass::Attention:
    return "attention";
  case GpuClass::Conversion:
    return "conversion";
  case GpuClass::Layout:
    return "layout";
  case GpuClass::Elementwise:
    return "elementwise";
  case GpuClass::Normalization:
    return "normalization";
  case GpuClass::Reduction:
    return "reduction";
  case GpuClass::Gather:
    return "gather";
  case GpuClass::Loss:
    return "loss";
  case GpuClass::Optimizer:
    return "optimizer";
  case GpuClass::Convolution:
    return "convolution";
  }
  return "?";
}

namespace {

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }
int64_t numel(Value v) { return typeOf(v).getNumElements(); }

int64_t elemBytes(Type t) {
  if (t.isBF16() || t.isF16())
    return 2;
  if (t.isF64() || t.isInteger(64))
    return 8;
  if (t.isInteger(1) || t.isInteger(8))
    return 1;
  return 4;
}
double bytesOf(Value v) { return double(numel(v)) * elemBytes(typeOf(v).getElementType()); }

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// runtime/cuda's constants the launch structure depends on.
constexpr int64_t kReduceThreads = int64_t(1) << 18; // kernels_basic.cu
constexpr int64_t kReduceWarps = 8192;
constexpr int64_t kPieceBytes = int64_t(256) << 20; // the emitter's convolution pieces

struct Model {
  GpuStep &s;
  bool half16 = false; // matmul and attention inputs rounded to 16 bits
  bool tf32 = false;   // fp32 GEMMs through TF32 tensor cores
  const PlanAttrs *plan = nullptr; // the module's plan
  Operation *current = nullptr;    // the op whose launches add() records

  void add(const char *kernel, GpuClass c, double flops, double bytes, int64_t count = 1,
           bool half = false) {
    GpuLaunch l;
    l.kernel = kernel;
    l.cls = c;
    l.count = count;
    l.flops = flops;
    l.bytes = bytes;
    l.half = half;
    l.tf32 = (c == GpuClass::Gemm || c == GpuClass::Convolution) && !half && tf32;
    if (current) {
      l.op = current->getName().getStringRef().str();
      l.node = nodeName(current->getLoc());
    }
    s.launches.push_back(std::move(l));
  }
  void unpriced(Operation *op, const std::string &why) {
    s.unpriced.push_back(op->getName().getStringRef().str() + ": " + why);
  }

  /// kernels_matmul.cu's matmul: the operands rounded to 16 bits in scratch
  /// under a 16-bit plan, then one cuBLAS call (the batch folded into M, or
  /// one strided batch).
  void matmul(int64_t m, int64_t n, int64_t k, int64_t batch, int64_t aNumel, int64_t bNumel,
              bool accumulate, bool a16 = false, bool b16 = false, bool y16 = false,
              double epilogueBytes = 0) {
    if (m == 0 || n == 0 || batch == 0)
      return;
    if (k == 0) {
      if (!accumulate && !y16) // a 16-bit result: cudaMemsetAsync
        add("fillKernel", GpuClass::Elementwise, 0, 4.0 * batch * m * n);
      return;
    }
    const int in = half16 ? 2 : 4;
    if (half16 && !a16)
      add("roundKernel", GpuClass::Conversion, 0, 6.0 * aNumel);
    if (half16 && !b16)
      add("roundKernel", GpuClass::Conversion, 0, 6.0 * bNumel);
    const double c = (y16 ? 2.0 : 4.0) * batch * m * n * (accumulate ? 2 : 1) + epilogueBytes;
    add("cuBLAS GEMM", GpuClass::Gemm, 2.0 * m * n * k * batch, double(in) * (aNumel + bNumel) + c,
        1, half16);
  }

  /// A matmul op (or the matmul a "product" transpose computes); `read16`:
  /// matmul16's operands read as stored in 16 bits (no rounding kernel).
  void matmulOp(Operation *mm, DenseBoolArrayAttr read16 = {}, bool y16 = false,
                double epilogueBytes = 0) {
    Value a = mm->getOperand(0), b = mm->getOperand(1), y = mm->getResult(0);
    ArrayRef<int64_t> ys = typeOf(y).getShape(), as = typeOf(a).getShape();
    const int64_t k = as.back();
    int64_t m = 1, n = 1;
    if (typeOf(b).getRank() >= 2)
      n = ys.back();
    if (typeOf(a).getRank() >= 2)
      m = ys[ys.size() - (typeOf(b).getRank() >= 2 ? 2 : 1)];
    const int64_t batch = (m != 0 && n != 0) ? numel(y) / (m * n) : 0;
    const bool a16 = read16 && read16[0], b16 = read16 && read16[1];
    matmul(m, n, k, batch, numel(a), numel(b), false, a16, b16, y16, epilogueBytes);
  }

  /// matmul_gathered: the gathered operand a piece of samples at a time
  /// (gatherKernel into scratch, then matmul).
  void matmulGathered(Operation *mm, Operation *gather) {
    Value a = mm->getOperand(0), y = mm->getResult(0);
    ArrayRef<int64_t> ys = typeOf(y).getShape();
    const int64_t m = ys[ys.size() - 2], n = ys.back(), k = typeOf(a).getShape().back();
    const int64_t n0 = ys.size() > 2 ? ys[0] : 1;
    const int64_t bNumel = numel(mm->getOperand(1));
    const int64_t unit = n0 > 0 ? bNumel / n0 : bNumel;
    const int64_t per =
        std::clamp<int64_t>(unit > 0 ? kPieceBytes / (unit * 4) : n0, 1, std::max<int64_t>(n0, 1));
    const int64_t pieces = n0 <= 1 ? 1 : ceilDiv(n0, per);
    (void)gather;
    for (int64_t j0 = 0; j0 < std::max<int64_t>(n0, 1); j0 += per) {
      const int64_t c = n0 <= 1 ? 1 : std::min(per, n0 - j0);
      add("gatherKernel", GpuClass::Gather, 0, 8.0 * unit * c);
      matmul(m, n, k, numel(y) / (m * n) * c / std::max<int64_t>(n0, 1),
             numel(a) * c / std::max<int64_t>(n0, 1), unit * c, false);
      if (pieces == 1)
        break;
    }
  }

  void invertIndices() {
    add("gatherInvCountKernel", GpuClass::Gather, 0, 0);
    add("gatherInvScanKernel", GpuClass::Gather, 0, 0);
    add("gatherInvPlaceKernel", GpuClass::Gather, 0, 0);
    add("gatherInvSortShortKernel", GpuClass::Gather, 0, 0);
    add("gatherInvSortLongKernel", GpuClass::Gather, 0, 0);
  }

  /// matmul_gather_grad: the product a piece at a time, scattered back by
  /// the inverted indices.
  void matmulGatherGrad(Operation *gg, Operation *mm) {
    Value y = mm->getResult(0);
    ArrayRef<int64_t> ys = typeOf(y).getShape();
    const int64_t m = ys[ys.size() - 2], n = ys.back(),
                  k = typeOf(mm->getOperand(0)).getShape().back();
    const int64_t n0 = ys.size() > 2 ? ys[0] : 1;
    const int64_t yUnit = n0 > 0 ? numel(y) / n0 : numel(y);
    const int64_t per = std::clamp<int64_t>(kPieceBytes / std::max<int64_t>(yUnit * 4, 1), 1,
                                            std::max<int64_t>(n0, 1));
    const double tableBytes = bytesOf(gg->getResult(0));
    if (n0 <= 1) {
      matmul(m, n, k, numel(y) / (m * n), numel(mm->getOperand(0)), numel(mm->getOperand(1)),
             false);
      gatherGrad(gg);
      return;
    }
    invertIndices();
    for (int64_t j0 = 0; j0 < n0; j0 += per) {
      const int64_t c = std::min(per, n0 - j0);
      matmul(m, n, k, numel(y) / (m * n) * c / n0, numel(mm->getOperand(0)) * c / n0,
             numel(mm->getOperand(1)) * c / n0, false);
      add("gatherGradRowsKernel", GpuClass::Gather, 0, 4.0 * yUnit * c + tableBytes * c / n0);
    }
  }

  void gatherGrad(Operation *op) {
    auto g = cast<GatherGradOp>(op);
    Value table = g.getResult();
    ArrayRef<int64_t> ts = typeOf(table).getShape();
    int64_t axis = g.getAxis();
    if (axis < 0)
      axis += ts.size();
    int64_t inner = 1;
    for (size_t i = axis + 1; i < ts.size(); ++i)
      inner *= ts[i];
    const int64_t size = ts[axis], ni = numel(op->getOperand(1));
    // gather_grad16 (rule 3h): reads its sums back and writes their 16-bit
    // copy in the same kernel.
    double copy = 0;
    for (Operation *c = op->getNextNode(); c && isa<CastOp>(c); c = c->getNextNode())
      if (c->hasAttr(kCopyByWriterAttr) && c->getOperand(0) == table) {
        copy = bytesOf(table) + 2.0 * numel(table);
        break;
      }
    const double moved = bytesOf(op->getOperand(0)) + bytesOf(table) + copy;
    if (inner == 1 && ni > 0 && ni < INT32_MAX && size > 0 && size < INT32_MAX &&
        numel(table) > 0) {
      invertIndices();
      add("gatherGradRowsKernel", GpuClass::Gather, 0, moved);
      return;
    }
    add("fillKernel", GpuClass::Elementwise, 0, bytesOf(table));
    if (numel(op->getOperand(0)) > 0)
      add("gatherGradOwnedKernel", GpuClass::Gather, 0, moved);
  }

  /// kernels_basic.cu's reduce: one kernel over [O, R, I] (rows or columns)
  /// or the general one, and the partials' combination when split.
  void reduce(Operation *op) {
    Value x = op->getOperand(0);
    ArrayRef<int64_t> xs = typeOf(x).getShape();
    uint32_t mask = 0;
    for (int64_t a : op->getAttrOfType<DenseI64ArrayAttr>("axes").asArrayRef())
      mask |= 1u << a;
    // elementwise.h's reduceGeom: dimensions of size 1 dropped, runs of
    // reduced and kept dimensions merged.
    int64_t outCount = 1, redCount = 1;
    std::vector<std::pair<int64_t, bool>> groups;
    for (size_t i = 0; i < xs.size(); ++i) {
      const bool red = (mask >> i) & 1u;
      (red ? redCount : outCount) *= xs[i];
      if (xs[i] == 1)
        continue;
      if (!groups.empty() && groups.back().second == red)
        groups.back().first *= xs[i];
      else
        groups.push_back({xs[i], red});
    }
    size_t k = 0;
    int64_t O = 1, R = 1, I = 1;
    if (k < groups.size() && !groups[k].second)
      O = groups[k++].first;
    if (k < groups.size() && groups[k].second)
      R = groups[k++].first;
    if (k < groups.size() && !groups[k].second)
      I = groups[k++].first;
    const bool ori = k == groups.size();
    // The input as its 16-bit tensor where carve.read16 says so (rule 3g).
    auto read16 = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
    const double in = read16 && read16.size() == 1 && read16[0] ? 2.0 * numel(x) : bytesOf(x);
    const double moved = in + bytesOf(op->getResult(0));
    const double flops = double(numel(x));
    if (outCount == 0)
      return;
    if (redCount == 0) {
      add("fillKernel", GpuClass::Elementwise, 0, bytesOf(op->getResult(0)));
      return;
    }
    int64_t S;
    if (ori) {
      S = I == 1 ? std::clamp<int64_t>(ceilDiv(kReduceWarps, O), 1, ceilDiv(R, 1024))
                 : std::clamp<int64_t>(ceilDiv(kReduceThreads, O * I), 1, ceilDiv(R, 32));
      S = ceilDiv(R, ceilDiv(R, S));
      if (I > 1 && S > 1 && S <= 65535) {
        // The columns and their partials in one launch (the last block of
        // each column tile combines them).
        add("reduceColumnsLastKernel", GpuClass::Reduction, flops, moved + 16.0 * outCount * S);
        return;
      }
      add(I == 1 ? "reduceRowsKernel" : "reduceColumnsKernel", GpuClass::Reduction, flops, moved);
    } else {
      S = std::clamp<int64_t>(ceilDiv(kReduceWarps, outCount), 1, ceilDiv(redCount, 1024));
      S = ceilDiv(redCount, ceilDiv(redCount, S));
      add("reduceGeneralKernel", GpuClass::Reduction, flops, moved);
    }
    if (S > 1)
      add("reducePartialsKernel", GpuClass::Reduction, 0, 16.0 * outCount * S);
  }

  /// kernels_data.cu's transpose: a view copy when the innermost dimension
  /// of the result is contiguous in the input (or no dimension is: a strided
  /// view's), 32 x 32 tiles otherwise. `copy16`: the bytes of the 16-bit
  /// copy it writes too (transpose16); `view`: the strided view of a folded
  /// slice it reads in place (transpose_view), its input otherwise.
  void transpose(TransposeOp t, double copy16 = 0, const StridedView *in = nullptr) {
    Value x = t.getInput();
    if (numel(x) == 0)
      return;
    ArrayRef<int64_t> xs = typeOf(x).getShape();
    ArrayRef<int64_t> perm = t.getPerm();
    std::vector<int64_t> stride(xs.size(), 1);
    for (int i = (int)xs.size() - 2; i >= 0; --i)
      stride[i] = stride[i + 1] * xs[i + 1];
    if (in)
      stride.assign(in->strides.begin(), in->strides.end());
    // transposeNest: y's dimensions of size > 1 with their x strides,
    // neighbours that stay neighbours in x merged.
    std::vector<int64_t> st;
    for (int64_t p : perm) {
      if (xs[p] == 1)
        continue;
      if (!st.empty() && st.back() == stride[p] * xs[p])
        st.back() = stride[p];
      else
        st.push_back(stride[p]);
    }
    const bool unit = llvm::is_contained(st, int64_t(1));
    const bool view = st.empty() || st.back() == 1 || !unit;
    const double moved = 2 * bytesOf(x) + copy16;
    add(view ? "viewKernel" : "transposeTilesKernel", GpuClass::Layout, 0, moved);
  }

  /// attention_cudnn.cpp: q, k, v (and o, dy) converted to 16 bits where
  /// they are not given so, one cuDNN graph (counted as one launch: the
  /// call), the results widened (dq, dk, dv: unless written in place).
  /// FLOPs are the causal pairs' (as for carve's kernel): 2 GEMMs forward,
  /// 5 backward (S again, dV, dP, dK, dQ).
  /// An attention op's shapes and the query-key pairs it computes:
  /// causally, query i sees keys up to i (`lastKeys`: up to i + Tk - Tq, the
  /// queries aligned to the last keys).
  struct AttnShape {
    int64_t tq, tk, d, dv, items;
    double pairs;
  };
  AttnShape attnShape(Operation *op, bool lastKeys) {
    Value q = op->getOperand(0), k = op->getOperand(1), v = op->getOperand(2);
    ArrayRef<int64_t> qs = typeOf(q).getShape(), ks = typeOf(k).getShape(),
                      vs = typeOf(v).getShape();
    AttnShape a;
    a.tq = qs[qs.size() - 2], a.d = qs.back(), a.tk = ks[ks.size() - 2], a.dv = vs.back();
    a.items = (a.tq != 0 && a.d != 0) ? numel(q) / (a.tq * a.d) : 0;
    a.pairs = double(a.tq) * a.tk;
    if (op->getAttrOfType<BoolAttr>("causal").getValue()) {
      const int64_t off = lastKeys ? a.tk - a.tq : 0;
      a.pairs = 0;
      for (int64_t i = 0; i < a.tq; ++i)
        a.pairs += std::clamp<int64_t>(i + off + 1, 0, a.tk);
    }
    a.pairs *= a.items;
    return a;
  }

  /// The elements of the bias attention_cudnn.cpp makes of an attention's
  /// mask: [1 or b, 1 or h, tq, tk], b the batch items before the heads, h
  /// the heads, each 1 where the mask broadcasts over all of it (0: no mask).
  double maskBias16(Operation *op, const AttnShape &a) {
    Value mask = isa<AttentionStatsOp>(op) ? cast<AttentionStatsOp>(op).getMask()
                                           : cast<AttentionGradStatsOp>(op).getMask();
    if (!mask)
      return 0;
    ArrayRef<int64_t> qs = typeOf(op->getOperand(0)).getShape(), ms = typeOf(mask).getShape();
    const int64_t r = qs.size(), off = r - int64_t(ms.size());
    double b = 1, h = 1;
    bool overB = false, overH = false;
    for (int64_t i = 0; i + 2 < r; ++i) {
      const int64_t dim = i >= off ? ms[i - off] : 1;
      (i + 3 == r ? h : b) *= qs[i];
      (i + 3 == r ? overH : overB) |= dim != 1;
    }
    return (overB ? b : 1) * (overH ? h : 1) * double(a.tq) * a.tk;
  }

  /// conv_cudnn.cpp: one cuDNN convolution graph (counted as one launch: the
  /// call), priced as a GEMM of the convolution's FLOPs (2 N O Ho Wo C/g kh
  /// kw, the same for either gradient) at the rates of carve's cuBLAS GEMMs
  /// (cuDNN's convolutions are not yet measured through carve); under
  /// bf16/fp16 the operands not read as their 16-bit tensors (carve.read16)
  /// converted to 16 bits first and the 16-bit result widened after.
  void convolutionCudnn(Operation *op, StringRef kernel) {
    const bool filter = kernel == "conv2d_grad_weight";
    Value w = filter ? op->getResult(0) : op->getOperand(1);
    Value y = kernel == "conv2d" ? op->getResult(0) : op->getOperand(filter ? 1 : 0);
    ArrayRef<int64_t> ws = typeOf(w).getShape();
    const double flops = 2.0 * numel(y) * ws[1] * ws[2] * ws[3];
    const double na = numel(op->getOperand(0)), nb = numel(op->getOperand(1));
    const double nc = numel(op->getResult(0));
    if (flops == 0)
      return;
    const bool half = plan->precision != "fp32";
    // Operands read as their 16-bit tensors (carve.read16) need no conversion.
    auto read16 = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
    auto given16 = [&](unsigned i) { return read16 && read16.size() == 2 && read16[i]; };
    if (half && !given16(0))
      add("to16Kernel", GpuClass::Conversion, 0, 6 * na);
    if (half && !given16(1))
      add("to16Kernel", GpuClass::Conversion, 0, 6 * nb);
    static const char *const names[3] = {"cuDNN convolution forward",
                                         "cuDNN convolution backward data",
                                         "cuDNN convolution backward filter"};
    const int k = kernel == "conv2d" ? 0 : kernel == "conv2d_grad_input" ? 1 : 2;
    add(names[k], GpuClass::Convolution, flops, (half ? 2.0 : 4.0) * (na + nb + nc), 1, half);
    // The 16-bit result widened where the f32 result is stored (not where
    // the call writes its copy and nothing reads the f32 value: rule 3h).
    Value r = op->getResult(0);
    bool copy = false;
    for (Operation *c = op->getNextNode(); c && isa<CastOp>(c); c = c->getNextNode())
      copy |= c->hasAttr(kCopyByWriterAttr) && c->getOperand(0) == r;
    if (half && !(copy && (neverStoredF32(r, *plan) || onlyRead16(r))))
      add("from16Kernel", GpuClass::Conversion, 0, 6 * nc);
  }

  void attentionCudnn(Operation *op, bool grad) {
    // cuDNN's causal mask is top-left (query i sees keys up to i).
    const AttnShape a = attnShape(op, /*lastKeys=*/false);
    const int64_t tq = a.tq, d = a.d, tk = a.tk, dv = a.dv, items = a.items;
    const double pairs = a.pairs;
    const double nq = double(items) * tq * d, nk = double(items) * tk * d;
    const double nv = double(items) * tk * dv, no = double(items) * tq * dv;
    const double rows = double(items) * tq;
    auto convert = [&](const char *kernel, double n) {
      if (n > 0)
        add(kernel, GpuClass::Conversion, 0, 6 * n);
    };
    // q, k, v read as stored (16-bit copies, views) where carve.read16 says so.
    auto read16 = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
    auto given16 = [&](unsigned i) { return read16 && read16.size() == 3 && read16[i]; };
    if (!given16(0))
      convert("to16Kernel", nq);
    if (!given16(1))
      convert("to16Kernel", nk);
    if (!given16(2))
      convert("to16Kernel", nv);
    // A mask: cuDNN's 16-bit bias, written by the call from the f32 mask
    // (attentionMaskBias16), broadcast over the queries where the mask is.
    const double nb = maskBias16(op, a);
    if (nb > 0) {
      Value mask =
          grad ? cast<AttentionGradStatsOp>(op).getMask() : cast<AttentionStatsOp>(op).getMask();
      add("maskBias16Kernel", GpuClass::Conversion, 0, 4 * double(numel(mask)) + 2 * nb);
    }
    if (!grad) {
      add("cuDNN flash attention forward", GpuClass::Attention, 2 * pairs * (d + dv),
          2 * (nq + nk + nv + no + nb) + 4 * rows, 1, true);
      if (!outputCopy16(op->getResult(0))) // else written in 16 bits in place
        convert("from16Kernel", no);
      return;
    }
    if (!outputCopy16(op->getOperand(3))) // o, else read where the forward wrote it
      convert("to16Kernel", no);
    // dy, else written in 16 bits by its matmul (carve.write16).
    Value dy = consumedFrom(op->getOperand(5));
    Operation *dyWriter = aliasRoot(dy ? dy : op->getOperand(5)).getDefiningOp();
    if (!dyWriter || !dyWriter->hasAttr(kWrite16Attr))
      convert("to16Kernel", no);
    add("cuDNN flash attention backward", GpuClass::Attention, 2 * pairs * (3 * d + 2 * dv),
        2 * (2 * nq + 2 * nk + 2 * nv + 2 * no + nb) + 8 * rows + 8 * nq, 1, true);
    // dq, dk, dv written in 16 bits into an assembled concat's copy
    // (carve-fold-views), else widened.
    if (Value t = producedInto(op->getResult(0)); t) {
      int64_t column = 0;
      if (assembledInto(t.getDefiningOp(), column))
        return;
    }
    // Or into their own 16-bit copies (rule 3h), widened only where the
    // step keeps the f32 values too.
    int copies = 0;
    for (Operation *n = op->getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
      for (unsigned i = 0; i < 3; ++i)
        copies += n->hasAttr(kCopyByWriterAttr) && n->getOperand(0) == op->getResult(i);
    if (copies == 3) {
      const double counts[3] = {nq, nk, nv};
      for (unsigned i = 0; i < 3; ++i)
        if (!neverStoredF32(op->getResult(i), *plan))
          convert("from16Kernel", counts[i]);
      return;
    }
    convert("from16Kernel", nq);
    convert("from16Kernel", nk);
    convert("from16Kernel", nv);
  }

  /// kernels_attention.cu: attention (attention_stats also writes the row
  /// log-sum-exp); attention_grad runs the forward again, then D_i =
  /// dY_i . O_i and the dQ and dK, dV kernels; attention_grad_stats reads the
  /// saved output and log-sum-exp instead of the forward again.
  void attention(Operation *op, bool grad, bool saved = false) {
    Value q = op->getOperand(0), k = op->getOperand(1), v = op->getOperand(2);
    // Query-key pairs computed: causally, query i sees keys up to i (the
    // queries aligned to the last keys).
    const AttnShape a = attnShape(op, /*lastKeys=*/true);
    const int64_t tq = a.tq, tk = a.tk, d = a.d, dv = a.dv, items = a.items;
    const double pairs = a.pairs;
    const double qkv = bytesOf(q) + bytesOf(k) + bytesOf(v);
    const double out = double(items) * tq * dv * 4;
    if (items == 0 || tq == 0)
      return;
    const double fwd = 2 * pairs * (d + dv);
    if (!saved)
      add("attnForward", GpuClass::Attention, fwd, qkv + out);
    if (!grad)
      return;
    const double dy = out, rows = double(items) * tq;
    add("attnRowDot", GpuClass::Attention, 2 * rows * dv, 2 * out + 4 * rows);
    add("attnGradQ", GpuClass::Attention, 2 * pairs * (2 * d + dv),
        qkv + dy + 8 * rows + bytesOf(q));
    if (tk > 0)
      add("attnGradKV", GpuClass::Attention, 2 * pairs * (2 * d + 2 * dv),
          qkv + dy + 8 * rows + bytesOf(k) + bytesOf(v));
  }

  /// `l16`: the logits read in 16 bits (cross_entropy16 / _grad16's
  /// carve.read16); `d16`: the gradient written in 16 bits (carve.write16).
  void crossEntropy(Operation *op, bool grad, bool l16 = false, bool d16 = false) {
    Value logits = op->getOperand(0);
    ArrayRef<int64_t> ls = typeOf(logits).getShape();
    // ceGeom: classes on axis 1; e = the other elements, s = the stride.
    const int64_t c = ls.size() > 1 ? ls[1] : 1;
    int64_t s = 1;
    for (size_t i = 2; i < ls.size(); ++i)
      s *= ls[i];
    const int64_t e = c ? numel(logits) / c : 0;
    const double lb = l16 ? 2.0 * numel(logits) : bytesOf(logits);
    const double db = d16 ? 2.0 * numel(logits) : bytesOf(logits);
    StringRef reduction = op->getAttrOfType<StringAttr>("reduction").getValue();
    if (e > 0)
      add("ceCount", GpuClass::Loss, 0, 8.0 * e);
    if (!grad) {
      if (e > 0)
        add(s == 1 ? "ceLossRows" : "ceLossStrided", GpuClass::Loss, 3.0 * numel(logits), lb);
      if (reduction != "none")
        add("ceFinish", GpuClass::Loss, 0, 0);
      return;
    }
    if (e == 0 || c == 0)
      return;
    add(s == 1 ? "ceGradRows" : "ceGradStrided", GpuClass::Loss, 4.0 * numel(logits), lb + db);
  }

  /// cross_entropy_with_grad (rule 3j): one count, one pass over the rows
  /// writing the loss terms and the gradient, the loss's sum (where rows
  /// have a class stride: the two calls).
  void crossEntropyWithGrad(Operation *op, bool l16, bool d16) {
    ArrayRef<int64_t> ls = typeOf(op->getOperand(0)).getShape();
    int64_t s = 1;
    for (size_t i = 2; i < ls.size(); ++i)
      s *= ls[i];
    const int64_t c = ls.size() > 1 ? ls[1] : 1;
    if (s != 1 || c == 0) {
      crossEntropy(op, false, l16, false);
      crossEntropy(op, true, l16, d16);
      return;
    }
    Value logits = op->getOperand(0);
    const int64_t e = numel(logits) / c;
    const double lb = l16 ? 2.0 * numel(logits) : bytesOf(logits);
    const double db = d16 ? 2.0 * numel(logits) : bytesOf(logits);
    if (e > 0) {
      add("ceCount", GpuClass::Loss, 0, 8.0 * e);
      add("ceLossGradRows", GpuClass::Loss, 5.0 * numel(logits), lb + db);
    }
    if (op->getAttrOfType<StringAttr>("reduction").getValue() != "none")
      add("ceFinish", GpuClass::Loss, 0, 0);
  }

  /// One op of the step's body with its carve.kernel.
  void op(Operation *op, StringRef kernel) {
    // A loss its gradient's call computes (rule 3j) runs only when evaluating.
    if (op->hasAttr(kLossInGradAttr))
      return;
    // An operand read as its 16-bit tensor (carve.read16, rule 3g: one flag
    // per operand) moves two bytes an element.
    auto read16 = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
    auto readBytes = [&](unsigned k) {
      Value v = op->getOperand(k);
      return read16 && read16.size() == (int64_t)op->getNumOperands() && read16[k] ? 2.0 * numel(v)
                                                                                   : bytesOf(v);
    };
    // The 16-bit copy after it that the op writes too (rule 3h), less the
    // f32 result where that is not stored (neverStoredF32).
    auto copyBytes = [&] {
      for (Operation *c = op->getNextNode(); c && isa<CastOp>(c); c = c->getNextNode())
        if (c->hasAttr(kCopyByWriterAttr) && c->getOperand(0) == op->getResult(0))
          return 2.0 * numel(c->getResult(0)) -
                 (neverStoredF32(op->getResult(0), *plan) ? bytesOf(op->getResult(0)) : 0.0);
      return 0.0;
    };
    auto inOut = [&] {
      double b = 0;
      for (unsigned k = 0; k < op->getNumOperands(); ++k)
        b += readBytes(k);
      for (Value v : op->getResults())
        b += bytesOf(v);
      return b;
    };
    const double n = op->getNumResults() ? double(numel(op->getResult(0))) : 0;
    if (kernel == "unary") {
      if (n > 0)
        add("unaryKernel", GpuClass::Elementwise, n, inOut());
    } else if (kernel == "unary_grad" || kernel == "unary_grad16") {
      // With a 16-bit copy and no f32 reader (onlyRead16: the bias gradient
      // summed by a GEMM, rule 3i), the emitter passes no f32 result.
      const double copy = copyBytes();
      const double unread = copy > 0 && kernel == "unary_grad16" &&
                                    !neverStoredF32(op->getResult(0), *plan) &&
                                    onlyRead16(op->getResult(0))
                                ? bytesOf(op->getResult(0))
                                : 0.0;
      if (n > 0)
        add("unaryGradKernel", GpuClass::Elementwise, n, inOut() + copy - unread);
    } else if (kernel == "binary" || kernel == "binary16" || kernel == "compare" ||
               kernel == "logic") {
      if (n > 0)
        add("broadcast2Kernel", GpuClass::Elementwise, n, inOut() + copyBytes());
    } else if (kernel == "where") {
      if (n > 0)
        add("whereKernel", GpuClass::Elementwise, n, inOut());
    } else if (kernel == "cast") {
      if (n > 0)
        add("castKernel", GpuClass::Conversion, 0, inOut());
    } else if (kernel == "toBf16" || kernel == "toF16") {
      if (n > 0)
        add("to16Kernel", GpuClass::Conversion, 0, inOut());
    } else if (kernel == "roundCopyBf16" || kernel == "roundCopyF16") {
      // Reads the f32 input, writes it back rounded and the 16-bit copy.
      if (n > 0)
        add("roundCopy16Kernel", GpuClass::Conversion, 0, 10.0 * n);
    } else if (kernel == "fromBf16" || kernel == "fromF16") {
      if (n > 0)
        add("from16Kernel", GpuClass::Conversion, 0, inOut());
    } else if (kernel == "dropout") {
      if (n > 0)
        add("dropoutKernel", GpuClass::Elementwise, n, inOut());
    } else if (kernel == "matmul16_bias") {
      // cuBLASLt's BIAS epilogue: the add's 16-bit copy written, the bias read.
      matmulOp(op, op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr), true);
    } else if (kernel == "matmul16_bias_gelu") {
      // cuBLASLt's GELU_AUX_BIAS epilogue: the GELU's 16-bit copy written,
      // and the pre-activation's (the auxiliary output), the bias read.
      matmulOp(op, op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr), true,
               2.0 * double(numel(op->getResult(0))));
    } else if (kernel == "matmul16_dgelu") {
      // cuBLASLt's DGELU epilogue: the gradient's 16-bit copy written, the
      // 16-bit pre-activation read (one element per element of the product).
      matmulOp(op, op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr), true,
               2.0 * double(numel(op->getResult(0))));
    } else if (kernel == "matmul" || kernel == "matmul16" || kernel == "matmul16_to16" ||
               kernel == "matmul16_to16_bgrad") {
      // matmul16_to16_bgrad: the bias gradient summed in the GEMM's epilogue
      // (rule 3i), from the operand it reads anyway.
      auto read16 = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      const bool y16 = kernel == "matmul16_to16" || kernel == "matmul16_to16_bgrad";
      if (isa<MatmulOp>(op))
        matmulOp(op, read16, y16);
      else // a transpose of a matmul's product, computed by the matmul
        matmulOp(op->getOperand(0).getDefiningOp(), read16, y16);
    } else if (kernel == "matmul_gathered") {
      matmulGathered(op, gatheredOperand(op));
    } else if (kernel == "matmul_gather_grad") {
      matmulGatherGrad(op, scatteredMatmul(op));
    } else if (kernel == "reduce" || kernel == "reduce16") {
      reduce(op);
    } else if (kernel == "softmax" || kernel == "softmax_grad") {
      auto axisAttr = op->getAttrOfType<IntegerAttr>("axis");
      ArrayRef<int64_t> xs = typeOf(op->getOperand(0)).getShape();
      int64_t axis = axisAttr ? axisAttr.getInt() : (int64_t)xs.size() - 1;
      if (axis < 0)
        axis += xs.size();
      const bool rows = axis == (int64_t)xs.size() - 1;
      const bool g = kernel == "softmax_grad";
      if (n > 0)
        add(rows ? (g ? "softmaxGradRows" : "softmaxRows")
                 : (g ? "softmaxGradColumns" : "softmaxColumns"),
            GpuClass::Normalization, 5 * n, inOut());
    } else if (kernel == "layer_norm" || kernel == "rms_norm" || kernel == "layer_norm16" ||
               kernel == "rms_norm16") {
      if (n > 0)
        add(kernel.starts_with("layer_norm") ? "layerNormKernel" : "rmsNormKernel",
            GpuClass::Normalization, 8 * n, inOut() + copyBytes());
    } else if (kernel == "layer_norm_grad" || kernel == "rms_norm_grad" ||
               kernel == "layer_norm_grad16" || kernel == "rms_norm_grad16") {
      if (numel(op->getOperand(0)) > 0) {
        // Its input gradient's 16-bit copy where it writes it (rule 3h), less
        // the f32 value where nothing reads it (onlyRead16).
        double copy = 0;
        for (Operation *c = op->getNextNode(); c && isa<CastOp>(c); c = c->getNextNode())
          if (c->hasAttr(kCopyByWriterAttr) && c->getOperand(0) == op->getResult(0)) {
            copy = 2.0 * numel(c->getResult(0)) -
                   (onlyRead16(op->getResult(0)) ? bytesOf(op->getResult(0)) : 0.0);
            break;
          }
        add(kernel.starts_with("layer_norm") ? "layerNormGradKernel" : "rmsNormGradKernel",
            GpuClass::Normalization, 12 * n, inOut() + copy);
        add("sumPartials", GpuClass::Normalization, 0, 0);
      }
    } else if (kernel == "layer_norm_grad_add" || kernel == "rms_norm_grad_add" ||
               kernel == "layer_norm_grad_add16" || kernel == "rms_norm_grad_add16") {
      // Also reads the residual and writes the add's sum (in the input
      // gradient's place, counted by inOut unless the sum is stored in 16
      // bits only) and its 16-bit copy (rule 4c).
      if (numel(op->getOperand(0)) > 0) {
        Value sum = producedInto(op->getResult(0));
        double bytes = inOut() + bytesOf(accumulatedResidual(op));
        for (Operation *c = sum ? sum.getDefiningOp()->getNextNode() : nullptr; c && isa<CastOp>(c);
             c = c->getNextNode())
          if (c->hasAttr(kCopyByWriterAttr) && c->getOperand(0) == sum) {
            // No f32 sum either where nothing reads it as f32 (onlyRead16).
            bytes += 2.0 * numel(c->getResult(0)) -
                     (neverStoredF32(sum, *plan) || onlyRead16(sum) ? bytesOf(sum) : 0.0);
            break;
          }
        add(kernel.starts_with("layer_norm") ? "layerNormGradKernel" : "rmsNormGradKernel",
            GpuClass::Normalization, 13 * n, bytes);
        add("sumPartials", GpuClass::Normalization, 0, 0);
      }
    } else if (kernel == "attention") {
      attention(op, false);
    } else if (kernel == "attention_grad") {
      attention(op, true);
    } else if (kernel == "attention_stats") {
      attention(op, false);
    } else if (kernel == "attention_grad_stats") {
      attention(op, true, true);
    } else if (kernel == "conv2d" || kernel == "conv2d_grad_input" ||
               kernel == "conv2d_grad_weight") {
      convolutionCudnn(op, kernel);
    } else if (kernel == "attention_stats_cudnn") {
      attentionCudnn(op, false);
    } else if (kernel == "attention_grad_stats_cudnn") {
      attentionCudnn(op, true);
    } else if (kernel == "transpose16") {
      transpose(cast<TransposeOp>(op), copyBytes());
    } else if (kernel == "transpose") {
      transpose(cast<TransposeOp>(op));
    } else if (kernel == "transpose_view" || kernel == "transpose16_view") {
      if (std::optional<StridedView> v = foldedViewOf(op->getOperand(0)))
        transpose(cast<TransposeOp>(op), kernel == "transpose16_view" ? copyBytes() : 0, &*v);
      else
        unpriced(op, ("'" + kernel + "' on a transpose of no folded slice").str());
    } else if (kernel == "rotary" || kernel == "rotary_grad" || kernel == "rotary16" ||
               kernel == "rotary_grad16") {
      // kernels_fused.cu: one thread per element; x (dy) and its rotate_half
      // partner read (the same row, cached: once), cos and sin (tables the
      // rows share); the result, its 16-bit copy where it writes it (rule
      // 3h; with no f32 reader, as unary_grad16, no f32 result).
      const double copy = copyBytes();
      const double unread = copy > 0 && kernel.ends_with("16") &&
                                    !neverStoredF32(op->getResult(0), *plan) &&
                                    onlyRead16(op->getResult(0))
                                ? bytesOf(op->getResult(0))
                                : 0.0;
      if (n > 0)
        add(kernel.starts_with("rotary_grad") ? "rotaryGradKernel" : "rotaryKernel",
            GpuClass::Elementwise, 3.0 * n, inOut() + copy - unread);
    } else if (kernel == "slice" || kernel == "expand") {
      if (n > 0)
        add("viewKernel", GpuClass::Layout, 0, 2 * bytesOf(op->getResult(0)));
    } else if (kernel == "expand16") {
      // The result read and written (f32 where stored) and its 16-bit copy.
      if (n > 0)
        add("viewKernel", GpuClass::Layout, 0,
            (neverStoredF32(op->getResult(0), *plan) ? 1 : 2) * bytesOf(op->getResult(0)) +
                2.0 * n);
    } else if (kernel == "slice_grad") {
      add("fillKernel", GpuClass::Elementwise, 0, bytesOf(op->getResult(0)));
      if (numel(op->getOperand(0)) > 0)
        add("scatterViewKernel", GpuClass::Layout, 0, 2 * bytesOf(op->getOperand(0)));
    } else if (kernel == "concat" || kernel == "concat16") {
      // kernels_data.cu: one launch per 8 non-empty parts.
      int parts = 0;
      double moved = 0;
      for (Value v : op->getOperands())
        if (numel(v) > 0) {
          moved += 2 * bytesOf(v) + (kernel == "concat16" ? 2.0 * numel(v) : 0.0);
          if (++parts == 8) {
            add("concatKernel", GpuClass::Layout, 0, moved);
            parts = 0;
            moved = 0;
          }
        }
      if (parts)
        add("concatKernel", GpuClass::Layout, 0, moved);
    } else if (kernel == "gather" || kernel == "gather16") {
      // Reads one table element per element written (16-bit: gather16).
      if (n > 0)
        add("gatherKernel", GpuClass::Gather, 0,
            (kernel == "gather16" ? 2.0 * n : bytesOf(op->getResult(0))) +
                bytesOf(op->getResult(0)));
    } else if (kernel == "gather_grad" || kernel == "gather_grad16") {
      gatherGrad(op);
    } else if (kernel == "cross_entropy") {
      crossEntropy(op, false);
    } else if (kernel == "cross_entropy_grad") {
      crossEntropy(op, true);
    } else if (kernel == "cross_entropy16" || kernel == "cross_entropy_grad16") {
      auto f = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      crossEntropy(op, kernel == "cross_entropy_grad16", f && f.size() == 1 && f[0],
                   op->hasAttr(kWrite16Attr));
    } else if (kernel == "cross_entropy_with_grad") {
      auto f = op->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr);
      crossEntropyWithGrad(op, f && f.size() == 1 && f[0], op->hasAttr(kWrite16Attr));
    } else if (kernel == "nonzero") {
      add("nonzeroKernel", GpuClass::Layout, 0, inOut());
    } else if (kernel == "copy") {
      // cudaMemcpyAsync: no kernel of carve's; its bytes are priced.
      GpuLaunch l;
      l.kernel = "memcpy";
      l.cls = GpuClass::Layout;
      l.count = 0;
      l.bytes = 2 * bytesOf(op->getResult(0));
      s.launches.push_back(l);
    } else if (isa<dist::DistDialect>(op->getDialect()) || kernel == "allReduce" ||
               kernel == "allToAllSplit") {
      unpriced(op, "a collective (NCCL): not priced by the one-GPU model");
    } else {
      unpriced(op, ("runtime entry '" + kernel + "' has no launch model").str());
    }
    // (rule 3h's writers round as they write their copy)
    if (op->hasAttr(kRound16Attr) && !isa<CastOp>(op) && !op->hasAttr(kFusionGroupAttr) &&
        !op->hasAttr(kRound16InCopyAttr) && !op->hasAttr(kWrite16Attr) && op->getNumResults() &&
        copyBytes() == 0 && !isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(op))
      add("round16Kernel", GpuClass::Conversion, 0, 8.0 * numel(op->getResult(0)));
  }

  /// The step's tail (the emitter's Optimizer.cpp on the CUDA target).
  void tail(Operation *op) {
    auto k = op->getAttrOfType<StringAttr>(kKernelAttr);
    const bool multi = k && (k.getValue() == "adamwMulti" || k.getValue() == "sgdMulti" ||
                             k.getValue() == "sumSquaresMulti");
    if (auto g = dyn_cast<GradNormOp>(op); g && multi) {
      // sumSquaresMulti: every gradient's squares in one launch, their sums in one.
      double flops = 0, bytes = 0;
      for (Value v : g->getOperands())
        flops += 2.0 * numel(v), bytes += bytesOf(v);
      if (flops > 0) {
        add("sumSquaresMultiKernel", GpuClass::Optimizer, flops, bytes);
        add("sumPartialsMultiKernel", GpuClass::Optimizer, 0, 0);
      }
    } else if (auto g = dyn_cast<GradNormOp>(op)) {
      for (Value v : g->getOperands())
        if (numel(v) > 0) {
          add("sumSquaresKernel", GpuClass::Optimizer, 2.0 * numel(v), bytesOf(v));
          add("sumPartialsKernel", GpuClass::Optimizer, 0, 0);
        }
    } else if (auto c = dyn_cast<ClipCoefficientOp>(op)) {
      clipping = c.getMaxNorm().convertToDouble() > 0;
    } else if (auto sc = dyn_cast<ScaleGradientsOp>(op)) {
      // Runs when the norm exceeds the compiled max_norm: priced as if it did.
      if (clipping)
        for (Value v : sc->getOperands().drop_front())
          if (numel(v) > 0)
            add(elemBytes(typeOf(v).getElementType()) == 2 ? "scale16Kernel" : "scaleKernel",
                GpuClass::Optimizer, numel(v), 2 * bytesOf(v));
    } else if (isa<UnscaleGradientsOp>(op)) {
      for (Value v : op->getOperands())
        if (numel(v) > 0)
          add("scale16Kernel", GpuClass::Optimizer, numel(v), 2 * bytesOf(v));
    } else if (isa<AdamWOp, SGDOp>(op)) {
      Value p = op->getOperand(0), g = op->getOperand(1);
      const int64_t e = numel(p);
      if (e == 0)
        return;
      const bool adam = isa<AdamWOp>(op), copy16 = elemBytes(typeOf(p).getElementType()) == 2;
      const double flops = (adam ? 12.0 : 4.0) * e;
      const double bytes =
          8.0 * e + bytesOf(g) + (adam ? 16.0 : 8.0) * e + (adam && copy16 ? 2.0 * e : 0);
      if (multi) {
        // adamwMulti / sgdMulti: every parameter's update (and SGD's 16-bit
        // copy) is one launch's share.
        if (updateMulti < 0) {
          updateMulti = static_cast<int>(s.launches.size());
          add(adam ? "adamwMultiKernel" : "sgdMultiKernel", GpuClass::Optimizer, 0, 0);
        }
        s.launches[updateMulti].flops += flops;
        s.launches[updateMulti].bytes += bytes + (copy16 && !adam ? 2.0 * e : 0);
        return;
      }
      // AdamW writes a 16-bit parameter's copy itself (adamwUpdateCopy16);
      // SGD's is a to16Kernel after it.
      add(adam ? "adamwKernel" : "sgdKernel", GpuClass::Optimizer, flops, bytes);
      if (copy16 && !adam)
        add("to16Kernel", GpuClass::Conversion, 0, 6.0 * e);
    } else if (isa<ZeroGatherOp>(op)) {
      unpriced(op, "ZeRO-3's gathers: collectives, not priced by the one-GPU model");
    }
  }
  bool clipping = false;
  int updateMulti = -1; // the adamwMulti / sgdMulti launch, once its first tensor is seen
};

} // namespace

bool modelGpuStep(ModuleOp module, GpuStep &out, std::string &error) {
  FailureOr<PlanAttrs> plan = readPlan(module);
  if (failed(plan)) {
    error = "the module has no carve.plan";
    return false;
  }
  if (plan->target != "cuda") {
    error = "the GPU model prices CUDA programs; this plan's target is " + plan->target;
    return false;
  }
  func::FuncOp step = module.lookupSymbol<func::FuncOp>("train_step");
  if (!step || step.isExternal()) {
    error = "no train_step function: the GPU model prices one-stage programs (pp = 1, one "
            "micro-batch)";
    return false;
  }
  out = GpuStep();
  out.precision = plan->precision;
  Model m{out};
  m.half16 = plan->precision == "bf16" || plan->precision == "fp16";
  m.tf32 = plan->tf32;
  m.plan = &*plan;
  DenseSet<Value> interior;
  DenseMap<Operation *, const FusionGroup *> rootGroup;
  std::vector<FusionGroup> groups = fusionGroups(step, interior);
  for (const FusionGroup &g : groups)
    rootGroup[g.root] = &g;
  // The step's start: d(loss)/d(loss) = 1, and dropout's seed and step.
  m.add("fillKernel", GpuClass::Elementwise, 0, 4);
  bool dropout = false;
  step.walk([&](DropoutOp) { dropout = true; });
  if (dropout)
    m.add("setDropoutStateKernel", GpuClass::Elementwise, 0, 0);
  for (Operation &op : step.getBody().front().without_terminator()) {
    m.current = &op;
    if (isOptimizerOp(&op)) {
      m.tail(&op);
      continue;
    }
    auto k = op.getAttrOfType<StringAttr>(kKernelAttr);
    if (!k) {
      error = "'" + op.getName().getStringRef().str() +
              "' has no carve.kernel: the IR is not lowered (run carve-select-kernels)";
      return false;
    }
    if (k.getValue() == kNoKernel)
      continue;
    if (k.getValue() == kFusedKernel) {
      const FusionGroup *g = rootGroup.lookup(&op);
      if (!g)
        continue; // a member: the root launches the chain
      double b = 0;
      for (Value v : g->inputs) {
        // Read as its 16-bit tensor where a member says so (carve.read16).
        bool is16 = false;
        for (Operation *m : g->ops)
          if (auto f = m->getAttrOfType<DenseBoolArrayAttr>(kRead16Attr))
            for (unsigned j = 0; j < m->getNumOperands() && j < f.size(); ++j)
              is16 |= m->getOperand(j) == v && f[j];
        b += is16 ? 2.0 * numel(v) : bytesOf(v);
      }
      for (Value v : g->outputs)
        if (!neverStoredF32(v, *plan)) // (only its 16-bit copy)
          b += bytesOf(v);
      // The 16-bit copies it writes too (carve.copy_in_fused).
      for (Operation *n = op.getNextNode(); n && isa<CastOp>(n); n = n->getNextNode())
        if (n->hasAttr(kCopyInFusedAttr))
          b += bytesOf(n->getResult(0));
      if (numel(op.getResult(0)) > 0)
        m.add("fusedKernel", GpuClass::Elementwise, double(numel(op.getResult(0))) * g->ops.size(),
              b);
      continue;
    }
    m.op(&op, k.getValue());
  }
  return true;
}

} // namespace carve
