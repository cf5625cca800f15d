//===- Annotations.cpp - partition annotations of the carve ops -----------===//
//
// One string per op instance (PartitionableOpInterface): which dimensions may
// be split over a mesh axis and what a split leaves behind. The grammar is in
// CarveInterfaces.td and docs/partition.md; Annotation.{h,cpp} beside it parses it.
// Strings are built from the op's shapes, so a dimension of size 1 that is
// broadcast gets its own never-split name.
//
//===----------------------------------------------------------------------===//

#include "dialects/carve/CarveOps.h"

#include "llvm/ADT/TypeSwitch.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <string>
#include <vector>

using namespace mlir;
using namespace carve;

namespace {

using Dims = std::vector<std::string>;

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

/// Hands out dimension names: a..z, then A..Z, then z1, z2, ...
struct Names {
  int next = 0;
  std::string fresh() {
    int k = next++;
    if (k < 26)
      return std::string(1, static_cast<char>('a' + k));
    if (k < 52)
      return std::string(1, static_cast<char>('A' + k - 26));
    return "z" + std::to_string(k - 51);
  }
  Dims fresh(int64_t n, const char *suffix = "") {
    Dims d;
    for (int64_t i = 0; i < n; ++i)
      d.push_back(fresh() + suffix);
    return d;
  }
};

std::string join(const Dims &d) {
  if (d.empty())
    return "()";
  std::string s;
  for (const std::string &x : d)
    s += (s.empty() ? "" : " ") + x;
  return s;
}

std::string annotation(const std::vector<Dims> &ins, const std::vector<Dims> &outs) {
  std::string s;
  for (size_t i = 0; i < ins.size(); ++i)
    s += (i ? ", " : "") + join(ins[i]);
  s += ins.empty() ? "-> " : " -> ";
  for (size_t i = 0; i < outs.size(); ++i)
    s += (i ? ", " : "") + join(outs[i]);
  return s;
}

/// Operand dims of an elementwise op with NumPy broadcasting against the
/// result's names `out`: trailing alignment; a stretched size-1 dimension gets
/// a fresh never-split name.
Dims broadcastDims(Names &n, RankedTensorType t, ArrayRef<int64_t> outShape, const Dims &out) {
  Dims d;
  int64_t off = static_cast<int64_t>(outShape.size()) - t.getRank();
  for (int64_t i = 0; i < t.getRank(); ++i) {
    int64_t j = off + i;
    if (j >= 0 && t.getDimSize(i) == outShape[j])
      d.push_back(out[j]);
    else
      d.push_back(n.fresh() + "^");
  }
  return d;
}

std::string elementwise(Operation *op) {
  Names n;
  auto rt = typeOf(op->getResult(0));
  Dims out = n.fresh(rt.getRank());
  std::vector<Dims> ins;
  for (Value v : op->getOperands())
    ins.push_back(broadcastDims(n, typeOf(v), rt.getShape(), out));
  return annotation(ins, {out});
}

/// Marks `names[from..]` never split.
void never(Dims &d, int64_t from) {
  for (int64_t i = from; i < static_cast<int64_t>(d.size()); ++i)
    if (d[i].back() != '^')
      d[i] += "^";
}

std::string matmul(MatmulOp op) {
  Names n;
  auto a = typeOf(op.getLhs()), b = typeOf(op.getRhs());
  auto r = typeOf(op.getResult());
  std::string m = n.fresh(), k = n.fresh() + "+", nn = n.fresh();
  int64_t batch = r.getRank() - (a.getRank() > 1 ? 1 : 0) - (b.getRank() > 1 ? 1 : 0);
  Dims outBatch = n.fresh(batch);
  auto batchOf = [&](RankedTensorType t) {
    Dims d;
    int64_t rank = t.getRank() - 2;
    for (int64_t i = 0; i < rank; ++i) {
      int64_t j = batch - rank + i;
      d.push_back(t.getDimSize(i) == r.getDimSize(j) ? outBatch[j] : n.fresh() + "^");
    }
    return d;
  };
  Dims lhs, rhs, out = outBatch;
  if (a.getRank() == 1) {
    lhs = {k};
  } else {
    lhs = batchOf(a);
    lhs.push_back(m);
    lhs.push_back(k);
    out.push_back(m);
  }
  if (b.getRank() == 1) {
    rhs = {k};
  } else {
    rhs = batchOf(b);
    rhs.push_back(k);
    rhs.push_back(nn);
    out.push_back(nn);
  }
  return annotation({lhs, rhs}, {out});
}

/// Reductions: the reduced dimensions are `+` for sums (a split leaves partial
/// sums), `+max` for maxima, never split for means.
std::string reduce(Operation *op, ArrayRef<int64_t> axes, bool keep, const char *mark) {
  Names n;
  auto t = typeOf(op->getOperand(0));
  Dims in, out;
  for (int64_t i = 0; i < t.getRank(); ++i) {
    bool reduced = llvm::is_contained(axes, i);
    std::string name = n.fresh();
    in.push_back(reduced ? name + mark : name);
    if (!reduced)
      out.push_back(name);
    else if (keep)
      out.push_back(n.fresh() + "^");
  }
  return annotation({in}, {out});
}

/// One never-split name per dimension from `axis` on (normalized dimensions).
std::string normalize(Operation *op, int64_t axis, unsigned numParams, bool gradForm) {
  Names n;
  auto t = typeOf(op->getOperand(0));
  Dims x = n.fresh(t.getRank());
  never(x, axis);
  Dims normalized(x.begin() + axis, x.end());
  if (!gradForm) {
    std::vector<Dims> ins = {x};
    for (unsigned i = 0; i < numParams; ++i)
      ins.push_back(normalized);
    return annotation(ins, {x});
  }
  // input, grad[, scale] -> input_grad, scale_grad[, bias_grad]: the parameter
  // gradients sum over the leading dimensions.
  Dims xs = x;
  for (int64_t i = 0; i < axis; ++i)
    xs[i] += "+";
  std::vector<Dims> ins = {xs, xs};
  for (unsigned i = 2; i < op->getNumOperands(); ++i)
    ins.push_back(normalized);
  std::vector<Dims> outs = {x};
  for (unsigned i = 1; i < op->getNumResults(); ++i)
    outs.push_back(normalized);
  return annotation(ins, outs);
}

/// Attention and its gradient: batch and heads split; sequence and head
/// dimensions never (the softmax row needs every key). `numTensors` are the
/// operands before the optional mask: q, k, v (3), then dy (4) or, for
/// attention_grad_stats, the output, its row statistics and dy (6); the
/// results are the output (1), the output and its row statistics
/// (attention_stats, 2) or dq, dk, dv (3). The statistics split like the
/// output's rows.
std::string attention(Operation *op, unsigned numTensors, unsigned numResults) {
  Names n;
  auto q = typeOf(op->getOperand(0));
  int64_t lead = q.getRank() - 2;
  Dims batch = n.fresh(lead);
  std::string s = n.fresh() + "^", t = n.fresh() + "^", d = n.fresh() + "^", dv = n.fresh() + "^";
  auto with = [&](std::vector<std::string> tail) {
    Dims x = batch;
    x.insert(x.end(), tail.begin(), tail.end());
    return x;
  };
  Dims qd = with({s, d}), kd = with({t, d}), vd = with({t, dv}), od = with({s, dv}), ld = with({s});
  std::vector<Dims> ins = {qd, kd, vd};
  if (numTensors == 6) {
    ins.push_back(od);
    ins.push_back(ld);
  }
  if (numTensors >= 4)
    ins.push_back(od);
  for (unsigned i = numTensors; i < op->getNumOperands(); ++i) {
    // The additive mask broadcasts against [..., s, t].
    Dims full = with({s, t});
    SmallVector<int64_t> shape(q.getShape().drop_back(2));
    shape.push_back(q.getDimSize(q.getRank() - 2));
    shape.push_back(typeOf(op->getOperand(1)).getDimSize(q.getRank() - 2));
    ins.push_back(broadcastDims(n, typeOf(op->getOperand(i)), shape, full));
  }
  std::vector<Dims> outs = {od};
  if (numResults == 2)
    outs = {od, ld};
  if (numResults == 3)
    outs = {qd, kd, vd};
  return annotation(ins, outs);
}

/// A block of a reshape where several dimensions of each side cover the same
/// elements, `a[i0, i)` and `b[j0, j)` (the products agree): their common
/// refinement, when every boundary of either side divides the next of both
/// (in element order, outermost first). (T, B, H·D) -> (T, B·H, D), the
/// reshape nn.MultiheadAttention makes to give every (sample, head) pair its
/// own batch entry, refines [B, H·D] and [B·H, D] to [B, H, D]: `b (h d) ->
/// (b h) d`, so a split of the heads is a split of the inner factor of B·H.
/// Empty when there is none ([6, 4] against [4, 6]).
std::vector<int64_t> commonRefinement(ArrayRef<int64_t> a, ArrayRef<int64_t> b) {
  std::vector<int64_t> cuts; // cumulative products of both sides, ascending
  int64_t pa = 1, pb = 1;
  for (int64_t x : a)
    cuts.push_back(pa *= x);
  for (int64_t x : b)
    cuts.push_back(pb *= x);
  if (pa != pb || pa <= 0)
    return {};
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<int64_t> factors;
  int64_t prev = 1;
  for (int64_t c : cuts) {
    if (c % prev != 0)
      return {};
    factors.push_back(c / prev);
    prev = c;
  }
  return factors;
}

/// Reshape: dimensions are matched by products; a dimension that splits into
/// several becomes a group `(h d)` on the other side, and several that
/// regroup (`b (h d) -> (b h) d`) share the factors of their common
/// refinement.
std::string reshape(ReshapeOp op) {
  Names n;
  ArrayRef<int64_t> a = typeOf(op.getInput()).getShape();
  ArrayRef<int64_t> b = typeOf(op.getResult()).getShape();
  Dims in(a.size()), out(b.size());
  size_t i = 0, j = 0;
  auto ones = [&]() {
    while (i < a.size() && a[i] == 1)
      in[i++] = n.fresh() + "^";
    while (j < b.size() && b[j] == 1)
      out[j++] = n.fresh() + "^";
  };
  ones();
  while (i < a.size() && j < b.size()) {
    size_t i0 = i, j0 = j;
    int64_t pa = a[i++], pb = b[j++];
    while (pa != pb) {
      if (pa < pb && i < a.size())
        pa *= a[i++];
      else if (pb < pa && j < b.size())
        pb *= b[j++];
      else
        break;
    }
    size_t ni = i - i0, nj = j - j0;
    if (ni == 1 && nj == 1) {
      in[i0] = out[j0] = n.fresh();
    } else if (ni == 1 || nj == 1) {
      // One side's single dimension is the group of the other side's.
      Dims parts;
      size_t from = ni == 1 ? j0 : i0, count = ni == 1 ? nj : ni;
      Dims &many = ni == 1 ? out : in;
      ArrayRef<int64_t> manyShape = ni == 1 ? b : a;
      std::string group = "(";
      for (size_t k = 0; k < count; ++k) {
        // Size-1 sub-dimensions inside a group carry no split.
        std::string name = n.fresh();
        if (manyShape[from + k] == 1)
          name += "^";
        many[from + k] = name;
        group += (k ? " " : "") + name;
      }
      group += ")";
      (ni == 1 ? in[i0] : out[j0]) = group;
    } else if (std::vector<int64_t> f = commonRefinement(a.slice(i0, ni), b.slice(j0, nj));
               pa == pb && !f.empty()) {
      // Each side's dimension is the group of the refinement factors it
      // covers (a factor of 1 carries no split).
      Dims names;
      for (int64_t x : f)
        names.push_back(n.fresh() + (x == 1 ? "^" : ""));
      auto groups = [&](ArrayRef<int64_t> shape, size_t from, size_t count, Dims &side) {
        size_t k = 0;
        for (size_t d = 0; d < count; ++d) {
          int64_t want = shape[from + d], got = 1;
          if (want == 1) { // inside the block, it covers no factor
            side[from + d] = n.fresh() + "^";
            continue;
          }
          Dims parts;
          while (got < want && k < f.size()) {
            got *= f[k];
            parts.push_back(names[k++]);
          }
          if (parts.size() == 1) {
            side[from + d] = parts[0];
            continue;
          }
          std::string g = "(";
          for (size_t q = 0; q < parts.size(); ++q)
            g += (q ? " " : "") + parts[q];
          side[from + d] = g + ")";
        }
      };
      groups(a, i0, ni, in);
      groups(b, j0, nj, out);
    } else {
      for (size_t k = i0; k < i; ++k)
        in[k] = n.fresh() + "^";
      for (size_t k = j0; k < j; ++k)
        out[k] = n.fresh() + "^";
    }
    ones();
  }
  for (; i < a.size(); ++i)
    in[i] = n.fresh() + "^";
  for (; j < b.size(); ++j)
    out[j] = n.fresh() + "^";
  return annotation({in}, {out});
}

/// Slice (and its gradient, `reverse`): a dimension taken whole keeps its
/// name; one cut into equal aligned sections, `[k L, (k+1) L)` of `G L`, is
/// `(G x) -> x`; any other cut is never split.
std::string slice(Operation *op, Value whole, Value part, ArrayRef<int64_t> starts,
                  ArrayRef<int64_t> steps, bool reverse) {
  Names n;
  auto w = typeOf(whole), p = typeOf(part);
  Dims wd, pd;
  for (int64_t i = 0; i < w.getRank(); ++i) {
    int64_t full = w.getDimSize(i), len = p.getDimSize(i), s = starts[i];
    std::string x = n.fresh();
    if (len == full) {
      wd.push_back(x);
      pd.push_back(x);
    } else if (steps[i] == 1 && len > 0 && full % len == 0 && s % len == 0) {
      wd.push_back("(" + std::to_string(full / len) + " " + x + ")");
      pd.push_back(x);
    } else if (int64_t l = std::gcd(std::gcd(full, len), s);
               steps[i] == 1 && len > 0 && l > 1 && l < len) {
      // Several whole sections of equal ones: `[k L, (k+m) L)` of `G L` is
      // `(G x) -> (m x)` (nn.MultiheadAttention's cross-attention takes k
      // and v, two of the three sections of in_proj_weight, as one slice).
      wd.push_back("(" + std::to_string(full / l) + " " + x + ")");
      pd.push_back("(" + std::to_string(len / l) + " " + x + ")");
    } else {
      wd.push_back(x + "^");
      pd.push_back(n.fresh() + "^");
    }
  }
  return reverse ? annotation({pd}, {wd}) : annotation({wd}, {pd});
}

std::string concat(ConcatOp op) {
  Names n;
  auto r = typeOf(op.getResult());
  int64_t axis = op.getAxis();
  Dims out = n.fresh(r.getRank());
  bool equal = true;
  for (Value v : op.getInputs())
    equal &= typeOf(v).getDimSize(axis) == typeOf(op.getInputs()[0]).getDimSize(axis);
  std::string x = out[axis];
  std::vector<Dims> ins;
  if (equal) {
    out[axis] = "(" + std::to_string(op.getInputs().size()) + " " + x + ")";
    for (size_t k = 0; k < op.getInputs().size(); ++k) {
      Dims d = out;
      d[axis] = x;
      ins.push_back(d);
    }
  } else {
    out[axis] = x + "^";
    for (size_t k = 0; k < op.getInputs().size(); ++k) {
      Dims d = out;
      d[axis] = n.fresh() + "^";
      ins.push_back(d);
    }
  }
  return annotation(ins, {out});
}

/// gather(table, idx) along axis 0: a split of the table's rows leaves partial
/// sums (each rank looks up the rows it holds, zero elsewhere: a
/// vocab-parallel embedding). Other axes keep the table whole along `axis`.
std::string gather(GatherOp op) {
  Names n;
  auto t = typeOf(op.getData()), ix = typeOf(op.getIndices());
  int64_t axis = op.getAxis();
  Dims td = n.fresh(t.getRank()), id = n.fresh(ix.getRank());
  td[axis] += axis == 0 ? "+" : "^";
  Dims out(td.begin(), td.begin() + axis);
  out.insert(out.end(), id.begin(), id.end());
  out.insert(out.end(), td.begin() + axis + 1, td.end());
  return annotation({td, id}, {out});
}

/// gather_grad(dy, idx) -> dtable: splitting the table's rows (a name only in
/// the result) scatters into the rows this rank holds; splitting the indices
/// leaves partial sums.
std::string gatherGrad(GatherGradOp op) {
  Names n;
  auto r = typeOf(op.getResult()), ix = typeOf(op.getIndices());
  int64_t axis = op.getAxis();
  Dims td = n.fresh(r.getRank()), id = n.fresh(ix.getRank(), "+");
  if (axis != 0)
    td[axis] += "^";
  Dims dy(td.begin(), td.begin() + axis);
  dy.insert(dy.end(), id.begin(), id.end());
  dy.insert(dy.end(), td.begin() + axis + 1, td.end());
  return annotation({dy, id}, {td});
}

/// Cross-entropy over logits [N, C, d...]: the class dimension is split by the
/// vocab-parallel kernel (`~`); rows split leave partial sums of a summed loss
/// (a mean's divisor is global, so a mean's rows are never split here).
std::string crossEntropy(Operation *op, StringRef reduction, bool grad) {
  Names n;
  auto l = typeOf(op->getOperand(0));
  const char *rowMark = reduction == "sum" ? "+" : reduction == "none" ? "" : "^";
  Dims ld = {n.fresh() + rowMark, n.fresh() + "~"};
  for (int64_t i = 2; i < l.getRank(); ++i)
    ld.push_back(n.fresh() + rowMark);
  Dims td = ld;
  td.erase(td.begin() + 1);
  Dims loss = reduction == "none" ? td : Dims{};
  if (grad)
    return annotation({ld, td, loss}, {ld});
  return annotation({ld, td}, {loss});
}

std::string conv2d(Conv2dOp op) {
  // n c h w, o c/g kh kw -> n o h w; channels split only without groups.
  // With groups the weight's dimension 1 is C / group, not C: names of their own.
  bool grouped = op.getGroup() != 1;
  std::string nn = "a", c = grouped ? "b^" : "b+", o = grouped ? "c^" : "c";
  std::string wc = grouped ? "j^" : c;
  Dims x = {nn, c, "d^", "e^"}, w = {o, wc, "f^", "g^"}, y = {nn, o, "h^", "i^"};
  std::vector<Dims> ins = {x, w};
  if (op.getBias())
    ins.push_back({o});
  return annotation(ins, {y});
}

/// conv2d's gradients, named as conv2d names its operands: the input's
/// gradient sums over the output channels, the weight's over the samples and
/// pixels.
std::string conv2dGradInput(Conv2dGradInputOp op) {
  bool grouped = op.getGroup() != 1;
  std::string c = grouped ? "b^" : "b", o = grouped ? "c^" : "c+";
  Dims dy = {"a", o, "h^", "i^"}, w = {o, grouped ? "j^" : c, "f^", "g^"};
  Dims dx = {"a", c, "d^", "e^"};
  return annotation({dy, w}, {dx});
}

std::string conv2dGradWeight(Conv2dGradWeightOp op) {
  bool grouped = op.getGroup() != 1;
  std::string c = grouped ? "b^" : "b", o = grouped ? "c^" : "c";
  Dims x = {"a+", c, "d^", "e^"}, dy = {"a+", o, "h^", "i^"};
  Dims dw = {o, grouped ? "j^" : c, "f^", "g^"};
  return annotation({x, dy}, {dw});
}

std::string annotate(Operation *op) {
  return llvm::TypeSwitch<Operation *, std::string>(op)
      .Case([](ConstantOp c) {
        Names n;
        return annotation({}, {n.fresh(typeOf(c.getResult()).getRank(), "^")});
      })
      .Case([](MatmulOp m) { return matmul(m); })
      .Case([](ReduceSumOp r) { return reduce(r, r.getAxes(), r.getKeepDims(), "+"); })
      .Case([](ReduceMaxOp r) { return reduce(r, r.getAxes(), r.getKeepDims(), "+max"); })
      .Case([](ReduceMeanOp r) { return reduce(r, r.getAxes(), r.getKeepDims(), "^"); })
      .Case<SoftmaxOp, LogSoftmaxOp>([](auto s) {
        Names n;
        Dims d = n.fresh(typeOf(s.getInput()).getRank());
        int64_t axis = s.getAxis() < 0 ? s.getAxis() + static_cast<int64_t>(d.size()) : s.getAxis();
        d[axis] += "^";
        return annotation({d}, {d});
      })
      .Case([](SoftmaxGradOp s) {
        Names n;
        Dims d = n.fresh(typeOf(s.getOutput()).getRank());
        int64_t axis = s.getAxis() < 0 ? s.getAxis() + static_cast<int64_t>(d.size()) : s.getAxis();
        d[axis] += "^";
        return annotation({d, d}, {d});
      })
      .Case([](LayerNormOp l) { return normalize(l, l.getAxis(), l->getNumOperands() - 1, false); })
      .Case([](RmsNormOp l) { return normalize(l, l.getAxis(), l->getNumOperands() - 1, false); })
      .Case([](LayerNormGradOp l) { return normalize(l, l.getAxis(), 0, true); })
      .Case([](RmsNormGradOp l) { return normalize(l, l.getAxis(), 0, true); })
      .Case<RotaryOp, RotaryGradOp>([](auto r) {
        // Elementwise, but rotate_half pairs element j of the last
        // dimension's first half with element j of its second: that
        // dimension splits as its two halves split alike, `(2 x)` (as the
        // unraised chain's slices of the halves let it); cos and sin as
        // broadcast operands, split the same way.
        Names n;
        auto rt = typeOf(r->getResult(0));
        Dims out = n.fresh(rt.getRank());
        out.back() = "(2 " + out.back() + ")";
        std::vector<Dims> ins;
        for (Value v : r->getOperands())
          ins.push_back(broadcastDims(n, typeOf(v), rt.getShape(), out));
        return annotation(ins, {out});
      })
      .Case([](AttentionOp a) { return attention(a, 3, 1); })
      .Case([](AttentionGradOp a) { return attention(a, 4, 3); })
      .Case([](AttentionStatsOp a) { return attention(a, 3, 2); })
      .Case([](AttentionGradStatsOp a) { return attention(a, 6, 3); })
      .Case([](ReshapeOp r) { return reshape(r); })
      .Case([](TransposeOp t) {
        Names n;
        Dims in = n.fresh(typeOf(t.getInput()).getRank()), out;
        for (int64_t p : t.getPerm())
          out.push_back(in[p]);
        return annotation({in}, {out});
      })
      .Case([](SliceOp s) {
        return slice(s, s.getInput(), s.getResult(), s.getStarts(), s.getSteps(), false);
      })
      .Case([](SliceGradOp s) {
        return slice(s, s.getResult(), s.getGrad(), s.getStarts(), s.getSteps(), true);
      })
      .Case([](ConcatOp c) { return concat(c); })
      .Case([](GatherOp g) { return gather(g); })
      .Case([](GatherGradOp g) { return gatherGrad(g); })
      .Case([](ExpertAllToAllOp x) {
        // Whole on every rank of the other axes (tp replicas exchange alike).
        Names names;
        Dims in = names.fresh(typeOf(x.getInput()).getRank(), "^");
        return annotation({in}, {names.fresh(typeOf(x.getResult()).getRank(), "^")});
      })
      .Case([](NonzeroOp n) {
        // Positions in the whole input: nothing of it may be split.
        Names names;
        Dims in = names.fresh(typeOf(n.getInput()).getRank(), "^");
        return annotation({in}, {names.fresh(2, "^")});
      })
      .Case([](ExpandOp e) {
        // Broadcast dimensions are names of the result only: a split of one
        // keeps the input whole.
        Names n;
        auto r = typeOf(e.getResult());
        Dims out = n.fresh(r.getRank());
        return annotation({broadcastDims(n, typeOf(e.getInput()), r.getShape(), out)}, {out});
      })
      .Case([](Conv2dOp c) { return conv2d(c); })
      .Case([](Conv2dGradInputOp c) { return conv2dGradInput(c); })
      .Case([](Conv2dGradWeightOp c) { return conv2dGradWeight(c); })
      .Case([](MaxPool2dOp) { return std::string("a b c^ d^ -> a b e^ f^"); })
      .Case([](BatchNormOp b) {
        // Batch statistics need the whole batch and image.
        return std::string("a^ b c^ d^, b, b, b, b -> a^ b c^ d^, b, b");
      })
      .Case([](CrossEntropyOp c) { return crossEntropy(c, c.getReduction(), false); })
      .Case([](CrossEntropyGradOp c) { return crossEntropy(c, c.getReduction(), true); })
      .Default([](Operation *op) { return elementwise(op); });
}

} // namespace

#define CARVE_ANNOTATED(OP)                                                                        \
  std::string OP::getPartitionAnnotation() { return annotate(getOperation()); }

CARVE_ANNOTATED(ConstantOp)
CARVE_ANNOTATED(CastOp)
CARVE_ANNOTATED(AddOp)
CARVE_ANNOTATED(SubOp)
CARVE_ANNOTATED(MulOp)
CARVE_ANNOTATED(DivOp)
CARVE_ANNOTATED(PowOp)
CARVE_ANNOTATED(MaximumOp)
CARVE_ANNOTATED(MinimumOp)
CARVE_ANNOTATED(EqualOp)
CARVE_ANNOTATED(LessOp)
CARVE_ANNOTATED(GreaterOp)
CARVE_ANNOTATED(AndOp)
CARVE_ANNOTATED(OrOp)
CARVE_ANNOTATED(NegOp)
CARVE_ANNOTATED(AbsOp)
CARVE_ANNOTATED(ExpOp)
CARVE_ANNOTATED(LogOp)
CARVE_ANNOTATED(SqrtOp)
CARVE_ANNOTATED(RsqrtOp)
CARVE_ANNOTATED(ReciprocalOp)
CARVE_ANNOTATED(TanhOp)
CARVE_ANNOTATED(ErfOp)
CARVE_ANNOTATED(SigmoidOp)
CARVE_ANNOTATED(ReluOp)
CARVE_ANNOTATED(SinOp)
CARVE_ANNOTATED(CosOp)
CARVE_ANNOTATED(NotOp)
CARVE_ANNOTATED(SiluOp)
CARVE_ANNOTATED(GeluOp)
CARVE_ANNOTATED(DropoutOp)
CARVE_ANNOTATED(EvalSelectOp)
CARVE_ANNOTATED(ReplicaSumOp)
CARVE_ANNOTATED(AssignOp)
CARVE_ANNOTATED(WhereOp)
CARVE_ANNOTATED(MatmulOp)
CARVE_ANNOTATED(ReduceSumOp)
CARVE_ANNOTATED(ReduceMeanOp)
CARVE_ANNOTATED(ReduceMaxOp)
CARVE_ANNOTATED(SoftmaxOp)
CARVE_ANNOTATED(LogSoftmaxOp)
CARVE_ANNOTATED(LayerNormOp)
CARVE_ANNOTATED(RmsNormOp)
CARVE_ANNOTATED(AttentionOp)
CARVE_ANNOTATED(RotaryOp)
CARVE_ANNOTATED(RotaryGradOp)
CARVE_ANNOTATED(ReshapeOp)
CARVE_ANNOTATED(TransposeOp)
CARVE_ANNOTATED(SliceOp)
CARVE_ANNOTATED(ConcatOp)
CARVE_ANNOTATED(GatherOp)
CARVE_ANNOTATED(ExpandOp)
CARVE_ANNOTATED(Conv2dOp)
CARVE_ANNOTATED(Conv2dGradInputOp)
CARVE_ANNOTATED(Conv2dGradWeightOp)
CARVE_ANNOTATED(MaxPool2dOp)
CARVE_ANNOTATED(BatchNormOp)
CARVE_ANNOTATED(CrossEntropyOp)
CARVE_ANNOTATED(UnaryGradOp)
CARVE_ANNOTATED(SoftmaxGradOp)
CARVE_ANNOTATED(LayerNormGradOp)
CARVE_ANNOTATED(RmsNormGradOp)
CARVE_ANNOTATED(AttentionGradOp)
CARVE_ANNOTATED(AttentionStatsOp)
CARVE_ANNOTATED(AttentionGradStatsOp)
CARVE_ANNOTATED(CrossEntropyGradOp)
CARVE_ANNOTATED(GatherGradOp)
CARVE_ANNOTATED(NonzeroOp)
CARVE_ANNOTATED(ExpertAllToAllOp)
CARVE_ANNOTATED(SliceGradOp)

//===----------------------------------------------------------------------===//
// Custom ops: the annotation is an attribute (from the rules file)
//===----------------------------------------------------------------------===//

std::string CustomOp::getPartitionAnnotation() { return getAnnotation().str(); }
std::string CustomGradOp::getPartitionAnnotation() { return getAnnotation().str(); }

namespace {

/// The rank of each tensor on one side of an annotation: a group `(a b)`
/// counts as one dimension, `()` is a scalar. The full grammar is checked by
/// compiler/partition (which reads the rules file); this only matches the
/// annotation to the op's arity and ranks.
SmallVector<int64_t> ranksOf(StringRef side) {
  SmallVector<int64_t> ranks;
  side = side.trim();
  if (side.empty())
    return ranks;
  SmallVector<StringRef> tensors;
  side.split(tensors, ',');
  for (StringRef t : tensors) {
    t = t.trim();
    if (t == "()") {
      ranks.push_back(0);
      continue;
    }
    int64_t rank = 0, depth = 0;
    bool inWord = false;
    for (char c : t) {
      if (c == '(') {
        if (depth++ == 0)
          ++rank;
        inWord = false;
      } else if (c == ')') {
        --depth;
      } else if (c == ' ') {
        inWord = false;
      } else if (depth == 0 && !inWord) {
        ++rank;
        inWord = true;
      }
    }
    ranks.push_back(rank);
  }
  return ranks;
}

LogicalResult verifyCustomAnnotation(Operation *op, StringRef annotation, TypeRange operands,
                                     TypeRange results) {
  auto [lhs, rhs] = annotation.split("->");
  if (annotation.count("->") != 1)
    return op->emitOpError("annotation '") << annotation << "' must have exactly one '->'";
  SmallVector<int64_t> in = ranksOf(lhs), out = ranksOf(rhs);
  if (in.size() != operands.size() || out.size() != results.size())
    return op->emitOpError("annotation '")
           << annotation << "' describes " << in.size() << " operand(s) and " << out.size()
           << " result(s), the op has " << operands.size() << " and " << results.size();
  auto check = [&](ArrayRef<int64_t> ranks, TypeRange types, const char *what) -> LogicalResult {
    for (auto [k, pair] : llvm::enumerate(llvm::zip(ranks, types))) {
      auto [rank, type] = pair;
      if (cast<RankedTensorType>(type).getRank() != rank)
        return op->emitOpError("annotation '")
               << annotation << "' gives " << what << " " << k << " " << rank
               << " dimension(s), its type has " << cast<RankedTensorType>(type).getRank();
    }
    return success();
  };
  if (failed(check(in, operands, "operand")) || failed(check(out, results, "result")))
    return failure();
  return success();
}

LogicalResult verifySymbol(Operation *op, StringRef what, StringRef name, bool optional) {
  if (name.empty() && optional)
    return success();
  bool ok = !name.empty() && (std::isalpha(static_cast<unsigned char>(name[0])) || name[0] == '_');
  for (char c : name)
    ok &= std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  if (!ok)
    return op->emitOpError(what) << " '" << name << "' is not a C identifier";
  return success();
}

} // namespace

LogicalResult CustomOp::verify() {
  if (getDomain().empty() || getOpType().empty())
    return emitOpError("needs a domain and an op_type");
  if (failed(verifySymbol(*this, "forward kernel", getForward(), false)) ||
      failed(verifySymbol(*this, "backward kernel", getBackward(), true)))
    return failure();
  if (failed(verifyCustomAnnotation(*this, getAnnotation(), getInputs().getTypes(),
                                    getOutputs().getTypes())))
    return failure();
  // The gradient op's operands: the inputs, then one gradient per output.
  SmallVector<Type> gradOperands(getInputs().getTypes());
  llvm::append_range(gradOperands, getOutputs().getTypes());
  return verifyCustomAnnotation(*this, getBackwardAnnotation(), gradOperands,
                                getInputs().getTypes());
}

LogicalResult CustomGradOp::verify() {
  if (failed(verifySymbol(*this, "backward kernel", getBackward(), false)))
    return failure();
  if (getInputs().size() < getInputGrads().size())
    return emitOpError("has ") << getInputs().size() << " operands, fewer than its "
                               << getInputGrads().size() << " results";
  for (auto [k, t] : llvm::enumerate(getInputGrads().getTypes()))
    if (t != getInputs()[k].getType())
      return emitOpError("result ")
             << k << " (the gradient of input " << k << ") must have that input's type";
  return verifyCustomAnnotation(*this, getAnnotation(), getInputs().getTypes(),
                                getInputGrads().getTypes());
}
