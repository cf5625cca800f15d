//===- ImportRecurrent.cpp - LSTM and GRU, unrolled -----------------------===//
//
// ONNX's LSTM and GRU (what nn.LSTM and nn.GRU export, one node per layer)
// unrolled over their static sequence length into ops that have kernels,
// gradients and partition rules on both targets: the input projection of
// every step as one matrix product, then per step the recurrent product,
// the gates (carve.sigmoid, carve.tanh) and the state update. Backward
// through time is then ordinary autodiff of the unrolled graph.
//
//===----------------------------------------------------------------------===//

#include "compiler/frontend/Importer.h"
#include "dialects/carve/CarveOps.h"

using namespace mlir;
using llvm::SmallVector;

namespace carve::frontend {

void Importer::buildRecurrent(const onnx::NodeProto &n) {
  const std::string &op = n.op_type();
  const bool lstm = op == "LSTM";
  const int64_t gates = lstm ? 4 : 3;
  Value x = val(0), w = val(1), r = val(2);
  Type elt = eltOf(x);
  if (!isa<FloatType>(elt) || eltOf(w) != elt || eltOf(r) != elt)
    fail("X, W and R must be floating-point, of one element type");
  if (attrInt("layout", 0) != 0)
    fail("layout 1 (batch first) is not supported; PyTorch exports layout 0");
  if (attr("activations") || attr("activation_alpha") || attr("activation_beta"))
    fail("custom activations are not supported (the defaults are)");
  if (attr("clip"))
    fail("clip is not supported");
  if (lstm && attrInt("input_forget", 0) != 0)
    fail("input_forget is not supported");
  if (lstm && hasInput(7))
    fail("peephole weights (P) are not supported");
  const std::string direction = attrString("direction", "forward");
  if (direction != "forward" && direction != "reverse" && direction != "bidirectional")
    fail("direction must be forward, reverse or bidirectional, got '" + direction + "'");
  const int64_t dirs = direction == "bidirectional" ? 2 : 1;
  const int64_t hidden = attrInt("hidden_size", 0);
  if (shp(x).size() != 3)
    fail("X must be [seq, batch, input]");
  const int64_t steps = shp(x)[0], batch = shp(x)[1], in = shp(x)[2], gh = gates * hidden;
  auto expectShape = [&](Value v, SmallVector<int64_t> want, const std::string &what) {
    if (SmallVector<int64_t>(shp(v)) != want)
      fail(what + " has shape " + formatShape(shp(v)) + ", expected " + formatShape(want));
  };
  if (hidden <= 0)
    fail("hidden_size must be positive");
  expectShape(w, {dirs, gh, in}, "W");
  expectShape(r, {dirs, gh, hidden}, "R");
  if (hasInput(4)) {
    const HostTensor &lens = needConst(4, "sequence_lens");
    for (int64_t k = 0; k < lens.size(); ++k)
      if (lens.asInt(k) != steps)
        fail("sequence_lens other than the full length " + std::to_string(steps) +
             " (padded batches) are not supported");
  }
  Value bias = hasInput(3) ? val(3) : Value();
  if (bias)
    expectShape(bias, {dirs, 2 * gh}, "B");
  Value h0 = hasInput(5) ? val(5) : Value(), c0 = lstm && hasInput(6) ? val(6) : Value();
  if (h0)
    expectShape(h0, {dirs, batch, hidden}, "initial_h");
  if (c0)
    expectShape(c0, {dirs, batch, hidden}, "initial_c");

  auto type = [&](ArrayRef<int64_t> s) { return tensorType(s, elt); };
  // v[.., start:end, ..] along `axis`.
  auto slice = [&](Value v, int64_t axis, int64_t start, int64_t end) {
    SmallVector<int64_t> st(shp(v).size(), 0), en(shp(v)), sp(shp(v).size(), 1), s(shp(v));
    st[axis] = start;
    en[axis] = end;
    s[axis] = end - start;
    return (Value)SliceOp::create(b, loc, type(s), v, b.getDenseI64ArrayAttr(st),
                                  b.getDenseI64ArrayAttr(en), b.getDenseI64ArrayAttr(sp));
  };
  auto transpose2d = [&](Value v) {
    return (Value)TransposeOp::create(b, loc, type({shp(v)[1], shp(v)[0]}), v,
                                      b.getDenseI64ArrayAttr({1, 0}));
  };
  auto matmul = [&](Value a, Value m) {
    return (Value)MatmulOp::create(b, loc, type({shp(a)[0], shp(m)[1]}), a, m);
  };
  auto sigmoid = [&](Value v) { return (Value)SigmoidOp::create(b, loc, v.getType(), v); };
  auto tanh = [&](Value v) { return (Value)TanhOp::create(b, loc, v.getType(), v); };
  auto zeros = [&]() {
    return materialize(HostTensor::floats((ElemKind)kindOf(0), {batch, hidden},
                                          std::vector<double>(batch * hidden, 0.0)),
                       "");
  };
  const bool linearBeforeReset = !lstm && attrInt("linear_before_reset", 0) != 0;
  Value one = materialize(HostTensor::floats((ElemKind)kindOf(0), {}, {1.0}), "");

  SmallVector<Value> ys(dirs), hs(dirs), cs(dirs);
  for (int64_t d = 0; d < dirs; ++d) {
    Value wt = transpose2d(reshape(slice(w, 0, d, d + 1), {gh, in}));     // [in, gh]
    Value rt = transpose2d(reshape(slice(r, 0, d, d + 1), {gh, hidden})); // [hidden, gh]
    Value wb, rb;
    if (bias) {
      Value bd = reshape(slice(bias, 0, d, d + 1), {2 * gh});
      wb = slice(bd, 0, 0, gh);
      rb = slice(bd, 0, gh, 2 * gh);
    }
    // Every step's input projection at once.
    Value xw = matmul(reshape(x, {steps * batch, in}), wt);
    if (wb)
      xw = binary<AddOp>(xw, wb);
    xw = reshape(xw, {steps, batch, gh});
    Value h = h0 ? reshape(slice(h0, 0, d, d + 1), {batch, hidden}) : zeros();
    Value c;
    if (lstm)
      c = c0 ? reshape(slice(c0, 0, d, d + 1), {batch, hidden}) : zeros();
    const bool backward = direction == "reverse" || d == 1;
    SmallVector<Value> outs(steps);
    for (int64_t k = 0; k < steps; ++k) {
      const int64_t t = backward ? steps - 1 - k : k;
      Value xt = reshape(slice(xw, 0, t, t + 1), {batch, gh});
      Value hr = matmul(h, rt);
      if (rb)
        hr = binary<AddOp>(hr, rb);
      auto part = [&](Value v, int64_t g) { return slice(v, 1, g * hidden, (g + 1) * hidden); };
      if (lstm) {
        // Gates in ONNX's order: input, output, forget, cell.
        Value g = binary<AddOp>(xt, hr);
        Value i = sigmoid(part(g, 0)), o = sigmoid(part(g, 1)), f = sigmoid(part(g, 2));
        Value cc = tanh(part(g, 3));
        c = binary<AddOp>(binary<MulOp>(f, c), binary<MulOp>(i, cc));
        h = binary<MulOp>(o, tanh(c));
      } else {
        // Gates in ONNX's order: update, reset, hidden.
        Value z = sigmoid(binary<AddOp>(part(xt, 0), part(hr, 0)));
        Value rg = sigmoid(binary<AddOp>(part(xt, 1), part(hr, 1)));
        Value cand;
        if (linearBeforeReset) {
          cand = binary<AddOp>(part(xt, 2), binary<MulOp>(rg, part(hr, 2)));
        } else {
          Value rh = matmul(binary<MulOp>(rg, h), slice(rt, 1, 2 * hidden, 3 * hidden));
          if (rb)
            rh = binary<AddOp>(rh, slice(rb, 0, 2 * hidden, 3 * hidden));
          cand = binary<AddOp>(part(xt, 2), rh);
        }
        Value hh = tanh(cand);
        h = binary<AddOp>(binary<MulOp>(binary<SubOp>(one, z), hh), binary<MulOp>(z, h));
      }
      outs[t] = reshape(h, {1, 1, batch, hidden});
    }
    ys[d] = outs.size() == 1 ? outs.front()
                             : (Value)ConcatOp::create(b, loc, type({steps, 1, batch, hidden}),
                                                       outs, b.getI64IntegerAttr(0));
    hs[d] = reshape(h, {1, batch, hidden});
    if (lstm)
      cs[d] = reshape(c, {1, batch, hidden});
  }
  auto join = [&](SmallVector<Value> &parts, SmallVector<int64_t> shape, int64_t axis) {
    if (parts.size() == 1)
      return parts.front();
    return (Value)ConcatOp::create(b, loc, type(shape), parts, b.getI64IntegerAttr(axis));
  };
  define(0, join(ys, {steps, dirs, batch, hidden}, 1));
  if (n.output_size() > 1)
    define(1, join(hs, {dirs, batch, hidden}, 0));
  if (lstm && n.output_size() > 2)
    define(2, join(cs, {dirs, batch, hidden}, 0));
}

} // namespace carve::frontend
