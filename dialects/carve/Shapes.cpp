//===- Shapes.cpp - static shape rules shared by verifiers and the importer ===//

#include "dialects/carve/Shapes.h"

#include "llvm/ADT/STLExtras.h"
#include <algorithm>

using llvm::ArrayRef;
using llvm::SmallVector;

namespace carve {

std::string formatShape(ArrayRef<int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i)
      s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

int64_t numElements(ArrayRef<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      return INT64_MAX; // saturate: callers compare against limits
  return n;
}

ShapeOrError broadcastShapes(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  ShapeOrError r;
  size_t rank = std::max(a.size(), b.size());
  r.shape.resize(rank);
  for (size_t i = 0; i < rank; ++i) {
    int64_t da = i < a.size() ? a[a.size() - 1 - i] : 1;
    int64_t db = i < b.size() ? b[b.size() - 1 - i] : 1;
    if (da != db && da != 1 && db != 1)
      return ShapeOrError::fail("shapes " + formatShape(a) + " and " + formatShape(b) +
                                " do not broadcast");
    r.shape[rank - 1 - i] = da == 1 ? db : da;
  }
  return r;
}

bool broadcastsTo(ArrayRef<int64_t> from, ArrayRef<int64_t> to) {
  if (from.size() > to.size())
    return false;
  for (size_t i = 0; i < from.size(); ++i) {
    int64_t f = from[from.size() - 1 - i], t = to[to.size() - 1 - i];
    if (f != t && f != 1)
      return false;
  }
  return true;
}

ShapeOrError matmulShape(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  if (a.empty() || b.empty())
    return ShapeOrError::fail("matmul operands must have rank >= 1");
  SmallVector<int64_t> sa(a), sb(b);
  bool vecA = sa.size() == 1, vecB = sb.size() == 1;
  if (vecA)
    sa.insert(sa.begin(), 1);
  if (vecB)
    sb.push_back(1);
  int64_t k1 = sa.back(), k2 = sb[sb.size() - 2];
  if (k1 != k2)
    return ShapeOrError::fail("contraction dimensions differ: " + formatShape(a) + " x " +
                              formatShape(b));
  ShapeOrError batch = broadcastShapes(ArrayRef<int64_t>(sa).drop_back(2),
                                       ArrayRef<int64_t>(sb).drop_back(2));
  if (!batch.ok())
    return ShapeOrError::fail("batch dimensions of " + formatShape(a) + " and " +
                              formatShape(b) + " do not broadcast");
  ShapeOrError r = batch;
  if (!vecA)
    r.shape.push_back(sa[sa.size() - 2]);
  if (!vecB)
    r.shape.push_back(sb.back());
  return r;
}

ShapeOrError reduceShape(ArrayRef<int64_t> in, ArrayRef<int64_t> axes, bool keepDims) {
  for (size_t i = 0; i < axes.size(); ++i) {
    if (axes[i] < 0 || axes[i] >= (int64_t)in.size())
      return ShapeOrError::fail("axis " + std::to_string(axes[i]) +
                                " is out of range for rank " + std::to_string(in.size()));
    if (i && axes[i] <= axes[i - 1])
      return ShapeOrError::fail("axes must be sorted and unique");
  }
  ShapeOrError r;
  for (int64_t d = 0; d < (int64_t)in.size(); ++d) {
    if (llvm::is_contained(axes, d)) {
      if (keepDims)
        r.shape.push_back(1);
    } else {
      r.shape.push_back(in[d]);
    }
  }
  return r;
}

ShapeOrError transposeShape(ArrayRef<int64_t> in, ArrayRef<int64_t> perm) {
  if (perm.size() != in.size())
    return ShapeOrError::fail("permutation has " + std::to_string(perm.size()) +
                              " entries for rank " + std::to_string(in.size()));
  SmallVector<bool> seen(in.size(), false);
  ShapeOrError r;
  for (int64_t p : perm) {
    if (p < 0 || p >= (int64_t)in.size() || seen[p])
      return ShapeOrError::fail("perm " + formatShape(perm) + " is not a permutation");
    seen[p] = true;
    r.shape.push_back(in[p]);
  }
  return r;
}

ShapeOrError sliceShape(ArrayRef<int64_t> in, ArrayRef<int64_t> starts,
                        ArrayRef<int64_t> ends, ArrayRef<int64_t> steps) {
  if (starts.size() != in.size() || ends.size() != in.size() ||
      steps.size() != in.size())
    return ShapeOrError::fail("starts, ends and steps need one entry per dimension");
  ShapeOrError r;
  for (size_t i = 0; i < in.size(); ++i) {
    if (steps[i] < 1)
      return ShapeOrError::fail("slice steps must be >= 1");
    if (starts[i] < 0 || starts[i] > ends[i] || ends[i] > in[i])
      return ShapeOrError::fail("slice bounds [" + std::to_string(starts[i]) + ", " +
                                std::to_string(ends[i]) + ") do not fit dimension " +
                                std::to_string(i) + " of size " + std::to_string(in[i]));
    r.shape.push_back((ends[i] - starts[i] + steps[i] - 1) / steps[i]);
  }
  return r;
}

ShapeOrError concatShape(ArrayRef<SmallVector<int64_t>> inputs, int64_t axis) {
  if (inputs.empty())
    return ShapeOrError::fail("concat needs at least one operand");
  ShapeOrError r;
  r.shape = inputs.front();
  if (axis < 0 || axis >= (int64_t)r.shape.size())
    return ShapeOrError::fail("concat axis " + std::to_string(axis) +
                              " is out of range for rank " + std::to_string(r.shape.size()));
  for (size_t n = 1; n < inputs.size(); ++n) {
    const auto &s = inputs[n];
    if (s.size() != r.shape.size())
      return ShapeOrError::fail("concat operands have different ranks");
    for (size_t i = 0; i < s.size(); ++i) {
      if ((int64_t)i == axis)
        continue;
      if (s[i] != r.shape[i])
        return ShapeOrError::fail("concat operands " + formatShape(inputs.front()) +
                                  " and " + formatShape(s) + " differ off the axis");
    }
    r.shape[axis] += s[axis];
  }
  return r;
}

ShapeOrError gatherShape(ArrayRef<int64_t> data, ArrayRef<int64_t> indices,
                         int64_t axis) {
  if (axis < 0 || axis >= (int64_t)data.size())
    return ShapeOrError::fail("gather axis " + std::to_string(axis) +
                              " is out of range for rank " + std::to_string(data.size()));
  ShapeOrError r;
  r.shape.append(data.begin(), data.begin() + axis);
  r.shape.append(indices.begin(), indices.end());
  r.shape.append(data.begin() + axis + 1, data.end());
  return r;
}

static ShapeOrError windowShape(ArrayRef<int64_t> in, int64_t channels,
                                ArrayRef<int64_t> kernel, ArrayRef<int64_t> strides,
                                ArrayRef<int64_t> pads, ArrayRef<int64_t> dilations) {
  if (kernel.size() != 2 || strides.size() != 2 || pads.size() != 4 ||
      dilations.size() != 2)
    return ShapeOrError::fail("2-D window needs 2 kernel sizes, 2 strides, 2 dilations "
                              "and 4 pads");
  ShapeOrError r;
  r.shape = {in[0], channels};
  for (int i = 0; i < 2; ++i) {
    if (strides[i] < 1 || dilations[i] < 1 || kernel[i] < 1)
      return ShapeOrError::fail("kernel, strides and dilations must be >= 1");
    if (pads[i] < 0 || pads[i + 2] < 0)
      return ShapeOrError::fail("pads must be >= 0");
    int64_t extent = dilations[i] * (kernel[i] - 1) + 1;
    int64_t padded = in[2 + i] + pads[i] + pads[i + 2];
    if (padded < extent)
      return ShapeOrError::fail("window of " + std::to_string(extent) +
                                " does not fit padded size " + std::to_string(padded));
    r.shape.push_back((padded - extent) / strides[i] + 1);
  }
  return r;
}

ShapeOrError conv2dShape(ArrayRef<int64_t> in, ArrayRef<int64_t> weight,
                         ArrayRef<int64_t> strides, ArrayRef<int64_t> pads,
                         ArrayRef<int64_t> dilations, int64_t group) {
  if (in.size() != 4 || weight.size() != 4)
    return ShapeOrError::fail("conv2d needs 4-D input (NCHW) and weight (OIHW)");
  if (group < 1 || in[1] % group != 0 || weight[0] % group != 0)
    return ShapeOrError::fail("group " + std::to_string(group) +
                              " does not divide the channels");
  if (in[1] / group != weight[1])
    return ShapeOrError::fail("input has " + std::to_string(in[1]) +
                              " channels but the weight expects " +
                              std::to_string(weight[1] * group));
  return windowShape(in, weight[0], {weight[2], weight[3]}, strides, pads, dilations);
}

ShapeOrError pool2dShape(ArrayRef<int64_t> in, ArrayRef<int64_t> kernel,
                         ArrayRef<int64_t> strides, ArrayRef<int64_t> pads) {
  if (in.size() != 4)
    return ShapeOrError::fail("pooling needs a 4-D input (NCHW)");
  return windowShape(in, in[1], kernel, strides, pads, {1, 1});
}

ShapeOrError attentionShape(ArrayRef<int64_t> q, ArrayRef<int64_t> k,
                            ArrayRef<int64_t> v) {
  if (q.size() < 2 || k.size() != q.size() || v.size() != q.size())
    return ShapeOrError::fail("query, key and value need the same rank >= 2");
  size_t r = q.size();
  if (q.drop_back(2) != k.drop_back(2) || q.drop_back(2) != v.drop_back(2))
    return ShapeOrError::fail("query, key and value batch dimensions differ");
  if (q[r - 1] != k[r - 1])
    return ShapeOrError::fail("query and key head sizes differ");
  if (k[r - 2] != v[r - 2])
    return ShapeOrError::fail("key and value lengths differ");
  ShapeOrError out;
  out.shape.assign(q.begin(), q.end());
  out.shape.back() = v.back();
  return out;
}

ShapeOrError crossEntropyShape(ArrayRef<int64_t> logits, ArrayRef<int64_t> targets,
                               bool reduce) {
  if (logits.size() < 2)
    return ShapeOrError::fail("logits need rank >= 2 ([N, C, ...])");
  if (targets.size() != logits.size() - 1 || targets[0] != logits[0] ||
      targets.drop_front() != logits.drop_front(2))
    return ShapeOrError::fail("targets " + formatShape(targets) +
                              " do not match logits " + formatShape(logits));
  ShapeOrError r;
  if (!reduce)
    r.shape.assign(targets.begin(), targets.end());
  return r;
}

} // namespace carve
