//===- Interpreter.cpp - reference evaluation of carve functions -----------===//
//
// 1. Check that every value of the function is a ranked tensor of a supported
//    element type (f64, f32, i64, i32, i1) and rank (at most rt::kMaxRank).
// 2. Bind the arguments, then evaluate the ops in order: each op reads its
//    operands' buffers, allocates its results zeroed and calls one runtime
//    kernel. Integer neg/abs/relu and integer reductions, which have no
//    integer kernels, run on double copies and cast back (exact below 2^53).
// 3. Return copies of the values named by `func.return`.
//
// The kernels abort the process on bad indices; the interpreter checks
// gather indices and cross-entropy targets first so that such input is an
// error message instead.
//
//===----------------------------------------------------------------------===//

#include "compiler/interp/Interpreter.h"

#include "carve/rt/kernels.h"
#include "carve/rt/philox.h"
#include "dialects/carve/CarveOps.h"
#include "dialects/carve/Shapes.h"

#include "mlir/IR/DialectResourceBlobManager.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/TypeSwitch.h"

#include <cstring>
#include <type_traits>

using namespace mlir;
namespace rt = carve::rt;

namespace carve {

int64_t hostElementBytes(Type t) {
  if (t.isF64() || t.isInteger(64))
    return 8;
  if (t.isF32() || t.isInteger(32))
    return 4;
  if (t.isInteger(1))
    return 1;
  return 0;
}

/// Calls `f(T())` with T the storage type of element type `t`, which must be
/// supported (hostElementBytes(t) != 0).
template <class F> static void dispatchAny(Type t, F &&f) {
  if (t.isF64())
    f(double());
  else if (t.isF32())
    f(float());
  else if (t.isInteger(64))
    f(int64_t());
  else if (t.isInteger(32))
    f(int32_t());
  else
    f(uint8_t());
}

HostValue HostValue::zeros(RankedTensorType type) {
  HostValue v;
  v.type = type;
  v.bytes.assign(type.getNumElements() * hostElementBytes(type.getElementType()), 0);
  return v;
}

HostValue HostValue::fromDoubles(RankedTensorType type, ArrayRef<double> values) {
  HostValue v = zeros(type);
  if (!hostElementBytes(type.getElementType()))
    return v;
  dispatchAny(type.getElementType(), [&](auto tag) {
    using T = decltype(tag);
    rt::cast<double, T>(values.data(), v.data<T>(),
                        std::min<int64_t>(values.size(), v.numElements()));
  });
  return v;
}

std::vector<double> HostValue::toDoubles() const {
  if (!hostElementBytes(type.getElementType()))
    return {};
  std::vector<double> out(numElements());
  dispatchAny(type.getElementType(), [&](auto tag) {
    using T = decltype(tag);
    rt::cast<T, double>(data<T>(), out.data(), numElements());
  });
  return out;
}

namespace {

RankedTensorType typeOf(Value v) { return cast<RankedTensorType>(v.getType()); }

rt::Dims dimsOf(RankedTensorType t) { return rt::Dims(t.getShape().data(), (int)t.getRank()); }
rt::Dims dimsOf(Value v) { return dimsOf(typeOf(v)); }
rt::Dims dimsOf(ArrayRef<int64_t> shape) { return rt::Dims(shape.data(), (int)shape.size()); }

bool isFloat(Value v) { return isa<FloatType>(typeOf(v).getElementType()); }

std::string typeString(Type t) {
  std::string s;
  llvm::raw_string_ostream os(s);
  t.print(os);
  return s;
}

std::optional<rt::Unary> unaryFn(StringRef fn) {
  return llvm::StringSwitch<std::optional<rt::Unary>>(fn)
      .Case("neg", rt::Unary::Neg)
      .Case("abs", rt::Unary::Abs)
      .Case("exp", rt::Unary::Exp)
      .Case("log", rt::Unary::Log)
      .Case("sqrt", rt::Unary::Sqrt)
      .Case("rsqrt", rt::Unary::Rsqrt)
      .Case("reciprocal", rt::Unary::Reciprocal)
      .Case("tanh", rt::Unary::Tanh)
      .Case("erf", rt::Unary::Erf)
      .Case("sigmoid", rt::Unary::Sigmoid)
      .Case("relu", rt::Unary::Relu)
      .Case("sin", rt::Unary::Sin)
      .Case("cos", rt::Unary::Cos)
      .Case("silu", rt::Unary::Silu)
      .Case("gelu", rt::Unary::Gelu)
      .Case("gelu_tanh", rt::Unary::GeluTanh)
      .Default(std::nullopt);
}

std::optional<rt::Unary> unaryOf(Operation *op) {
  if (auto gelu = dyn_cast<GeluOp>(op))
    return gelu.getApproximate() == "tanh" ? rt::Unary::GeluTanh : rt::Unary::Gelu;
  // The elementwise unary ops are spelled like their rt::Unary names.
  if (!isa<NegOp, AbsOp, ExpOp, LogOp, SqrtOp, RsqrtOp, ReciprocalOp, TanhOp, ErfOp, SigmoidOp,
           ReluOp, SinOp, CosOp, SiluOp>(op))
    return std::nullopt;
  return unaryFn(op->getName().stripDialect());
}

std::optional<rt::Binary> binaryOf(Operation *op) {
  return llvm::TypeSwitch<Operation *, std::optional<rt::Binary>>(op)
      .Case([](AddOp) { return rt::Binary::Add; })
      .Case([](SubOp) { return rt::Binary::Sub; })
      .Case([](MulOp) { return rt::Binary::Mul; })
      .Case([](DivOp) { return rt::Binary::Div; })
      .Case([](PowOp) { return rt::Binary::Pow; })
      .Case([](MaximumOp) { return rt::Binary::Max; })
      .Case([](MinimumOp) { return rt::Binary::Min; })
      .Default([](Operation *) { return std::nullopt; });
}

std::optional<rt::Compare> compareOf(Operation *op) {
  return llvm::TypeSwitch<Operation *, std::optional<rt::Compare>>(op)
      .Case([](EqualOp) { return rt::Compare::Eq; })
      .Case([](LessOp) { return rt::Compare::Lt; })
      .Case([](GreaterOp) { return rt::Compare::Gt; })
      .Default([](Operation *) { return std::nullopt; });
}

/// `v` converted to element type `to` (a copy when it already has it).
HostValue convert(const HostValue &v, Type to) {
  if (v.type.getElementType() == to)
    return v;
  HostValue r = HostValue::zeros(RankedTensorType::get(v.type.getShape(), to));
  dispatchAny(v.type.getElementType(), [&](auto from) {
    using From = decltype(from);
    dispatchAny(to, [&](auto too) {
      using To = decltype(too);
      rt::cast<From, To>(v.data<From>(), r.data<To>(), v.numElements());
    });
  });
  return r;
}

uint32_t axesMask(ArrayRef<int64_t> axes) {
  uint32_t mask = 0;
  for (int64_t a : axes)
    mask |= 1u << a;
  return mask;
}

class Interpreter {
public:
  explicit Interpreter(std::string &error) : error(error) {}

  bool run(func::FuncOp fn, ArrayRef<HostValue> args, std::vector<HostValue> &results) {
    if (fn.getBody().getBlocks().size() != 1)
      return failWith("@" + fn.getName().str() + " must have exactly one block");
    Block &body = fn.getBody().front();
    if (!checkTypes(fn))
      return false;
    if (args.size() != fn.getNumArguments())
      return failWith("@" + fn.getName().str() + " takes " + std::to_string(fn.getNumArguments()) +
                      " arguments, got " + std::to_string(args.size()));
    for (auto [i, a] : llvm::enumerate(fn.getArguments())) {
      if (args[i].type != a.getType() ||
          (int64_t)args[i].bytes.size() !=
              args[i].numElements() * hostElementBytes(args[i].type.getElementType()))
        return failWith("argument " + std::to_string(i) + " of @" + fn.getName().str() +
                        " should be " + typeString(a.getType()) + " but is " +
                        typeString(args[i].type) + " with " + std::to_string(args[i].bytes.size()) +
                        " bytes");
      env[a] = args[i];
    }
    for (Operation &op : body) {
      if (auto ret = dyn_cast<func::ReturnOp>(op)) {
        results.clear();
        for (Value v : ret.getOperands())
          results.push_back(get(v));
        return true;
      }
      if (!evaluate(&op))
        return false;
    }
    return failWith("@" + fn.getName().str() + " does not end in func.return");
  }

private:
  std::string &error;
  llvm::DenseMap<Value, HostValue> env;

  bool failWith(const std::string &msg) {
    error = msg;
    return false;
  }
  bool fail(Operation *op, const std::string &msg) {
    return failWith(op->getName().getStringRef().str() + ": " + msg);
  }

  bool checkValue(Operation *where, Value v) {
    auto t = dyn_cast<RankedTensorType>(v.getType());
    std::string what = where ? where->getName().getStringRef().str() + ": " : "";
    if (!t)
      return failWith(what + "the interpreter needs ranked tensors, not " +
                      typeString(v.getType()));
    if (!t.hasStaticShape())
      return failWith(what + "the interpreter needs static shapes, not " + typeString(t));
    if (!hostElementBytes(t.getElementType()))
      return failWith(what + "element type " + typeString(t.getElementType()) +
                      " is not supported by the interpreter (f64, f32, i64, i32, i1)");
    if (t.getRank() > rt::kMaxRank)
      return failWith(what + "rank " + std::to_string(t.getRank()) + " exceeds the kernels' " +
                      std::to_string(rt::kMaxRank));
    return true;
  }

  bool checkTypes(func::FuncOp fn) {
    for (Value a : fn.getArguments())
      if (!checkValue(nullptr, a))
        return false;
    for (Operation &op : fn.getBody().front()) {
      if (isa<func::ReturnOp>(op))
        continue;
      if (op.getNumRegions())
        return fail(&op, "ops with regions are not supported by the interpreter");
      for (Value v : op.getResults())
        if (!checkValue(&op, v))
          return false;
    }
    return true;
  }

  const HostValue &get(Value v) { return env.find(v)->second; }
  /// The zeroed buffer of result `v`.
  HostValue &make(Value v) {
    env[v] = HostValue::zeros(typeOf(v));
    return env[v];
  }

  template <class T> const T *in(Value v) { return get(v).data<T>(); }
  template <class T> T *out(Value v) { return env.find(v)->second.data<T>(); }

  bool evaluate(Operation *op);
  bool evalNormalization(Operation *op);
  bool evalConvolution(Operation *op);
  bool evalDataMovement(Operation *op);
  bool evalConstant(ConstantOp op);
  bool evalUnary(Operation *op, rt::Unary f);
  bool evalBinary(Operation *op, rt::Binary f);
  bool evalCompare(Operation *op, rt::Compare f);
  bool evalWhere(WhereOp op);
  bool evalMatmul(MatmulOp op);
  bool evalReduce(Operation *op, rt::Reduce f, ArrayRef<int64_t> axes);
  bool evalCrossEntropy(Operation *op, Value logits, Value targets, StringRef reduction,
                        IntegerAttr ignoreIndex, Value grad);
  bool evalGather(Operation *op, Value data, Value indices, int64_t axis, Value grad);
  bool evalConcat(ConcatOp op);
  /// Runs `f(T())` for a float element type T of `v`, or fails naming the op.
  template <class F> bool withFloat(Operation *op, Value v, F &&f);
  /// `v` as an int64 buffer (a converted copy for i32 indices).
  HostValue indicesOf(Value v) { return convert(get(v), IntegerType::get(v.getContext(), 64)); }
};

template <class F> bool Interpreter::withFloat(Operation *op, Value v, F &&f) {
  Type t = typeOf(v).getElementType();
  if (t.isF64())
    f(double());
  else if (t.isF32())
    f(float());
  else
    return fail(op, "no reference kernel for " + typeString(t) + " tensors");
  return true;
}

bool Interpreter::evalConstant(ConstantOp op) {
  Value r = op.getResult();
  HostValue &v = make(r);
  Type elt = typeOf(r).getElementType();
  if (auto dense = dyn_cast<DenseElementsAttr>(op.getValue())) {
    dispatchAny(elt, [&](auto tag) {
      using T = decltype(tag);
      T *y = v.data<T>();
      int64_t i = 0;
      if constexpr (std::is_same_v<T, uint8_t>) {
        for (bool x : dense.getValues<bool>())
          y[i++] = x;
      } else {
        for (T x : dense.getValues<T>())
          y[i++] = x;
      }
    });
    return true;
  }
  if (auto res = dyn_cast<DenseResourceElementsAttr>(op.getValue())) {
    AsmResourceBlob *blob = res.getRawHandle().getBlob();
    if (!blob)
      return fail(op, "the data of dense_resource<" + res.getRawHandle().getKey().str() +
                          "> is not loaded");
    ArrayRef<char> data = blob->getData();
    if ((int64_t)data.size() != (int64_t)v.bytes.size())
      return fail(op, "dense_resource<" + res.getRawHandle().getKey().str() + "> holds " +
                          std::to_string(data.size()) + " bytes, " + typeString(r.getType()) +
                          " needs " + std::to_string(v.bytes.size()));
    std::memcpy(v.bytes.data(), data.data(), data.size());
    return true;
  }
  return fail(op, "only dense and dense_resource constants are supported by the interpreter");
}

bool Interpreter::evalUnary(Operation *op, rt::Unary f) {
  Value x = op->getOperand(0), y = op->getResult(0);
  make(y);
  if (!isFloat(x)) {
    // Integer neg/abs/relu: exact through double for |x| < 2^53.
    HostValue xd = convert(get(x), Float64Type::get(op->getContext()));
    HostValue yd = HostValue::zeros(xd.type);
    rt::unary<double>(f, xd.data<double>(), yd.data<double>(), xd.numElements());
    env[y] = convert(yd, typeOf(y).getElementType());
    return true;
  }
  return withFloat(op, x, [&](auto tag) {
    using T = decltype(tag);
    rt::unary<T>(f, in<T>(x), out<T>(y), typeOf(x).getNumElements());
  });
}

bool Interpreter::evalBinary(Operation *op, rt::Binary f) {
  Value a = op->getOperand(0), b = op->getOperand(1), y = op->getResult(0);
  Type elt = typeOf(y).getElementType();
  if (elt.isInteger(1))
    return fail(op, "no reference kernel for i1 arithmetic");
  if (f == rt::Binary::Div && !isFloat(y)) {
    // Integer division truncates toward zero in the kernel, as ONNX Div
    // does; a zero divisor would trap.
    std::vector<double> divisor = get(b).toDoubles();
    if (llvm::is_contained(divisor, 0.0))
      return fail(op, "integer division by zero");
  }
  make(y);
  dispatchAny(elt, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, uint8_t>)
      rt::binary<T>(f, in<T>(a), dimsOf(a), in<T>(b), dimsOf(b), out<T>(y), dimsOf(y));
  });
  return true;
}

bool Interpreter::evalCompare(Operation *op, rt::Compare f) {
  Value a = op->getOperand(0), b = op->getOperand(1), y = op->getResult(0);
  make(y);
  dispatchAny(typeOf(a).getElementType(), [&](auto tag) {
    using T = decltype(tag);
    rt::compare<T>(f, in<T>(a), dimsOf(a), in<T>(b), dimsOf(b), out<uint8_t>(y), dimsOf(y));
  });
  return true;
}

bool Interpreter::evalWhere(WhereOp op) {
  Value c = op.getCondition(), a = op.getOnTrue(), b = op.getOnFalse(), y = op.getResult();
  make(y);
  dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
    using T = decltype(tag);
    rt::where<T>(in<uint8_t>(c), dimsOf(c), in<T>(a), dimsOf(a), in<T>(b), dimsOf(b), out<T>(y),
                 dimsOf(y));
  });
  return true;
}

bool Interpreter::evalMatmul(MatmulOp op) {
  Value a = op.getLhs(), b = op.getRhs(), y = op.getResult();
  // numpy.matmul on vectors: [k] is [1, k] on the left and [k, 1] on the
  // right; the inserted 1 is absent from the declared result, which holds the
  // same elements in the same order.
  SmallVector<int64_t> as(typeOf(a).getShape()), bs(typeOf(b).getShape());
  if (as.size() == 1)
    as.insert(as.begin(), 1);
  if (bs.size() == 1)
    bs.push_back(1);
  ShapeOrError ys = matmulShape(as, bs);
  if (!ys.ok())
    return fail(op, ys.error);
  if ((int64_t)ys.shape.size() > rt::kMaxRank)
    return fail(op, "rank exceeds the kernels' limit");
  make(y);
  return withFloat(op, y, [&](auto tag) {
    using T = decltype(tag);
    rt::matmul<T>(in<T>(a), dimsOf(as), false, in<T>(b), dimsOf(bs), false, out<T>(y),
                  dimsOf(ys.shape));
  });
}

bool Interpreter::evalReduce(Operation *op, rt::Reduce f, ArrayRef<int64_t> axes) {
  Value x = op->getOperand(0), y = op->getResult(0);
  make(y);
  // The kernel writes the keep-dims layout, which is the same memory as the
  // result with the reduced dimensions dropped.
  if (!isFloat(x)) {
    Type f64 = Float64Type::get(op->getContext());
    HostValue xd = convert(get(x), f64);
    HostValue yd = HostValue::zeros(RankedTensorType::get(typeOf(y).getShape(), f64));
    rt::reduce<double>(f, xd.data<double>(), dimsOf(x), axesMask(axes), yd.data<double>());
    env[y] = convert(yd, typeOf(y).getElementType());
    return true;
  }
  return withFloat(op, x, [&](auto tag) {
    using T = decltype(tag);
    rt::reduce<T>(f, in<T>(x), dimsOf(x), axesMask(axes), out<T>(y));
  });
}

bool Interpreter::evalCrossEntropy(Operation *op, Value logits, Value targets, StringRef reduction,
                                   IntegerAttr ignoreIndex, Value grad) {
  int red =
      llvm::StringSwitch<int>(reduction).Case("mean", 0).Case("sum", 1).Case("none", 2).Default(-1);
  if (red < 0)
    return fail(op, "unknown reduction '" + reduction.str() + "'");
  HostValue t = indicesOf(targets);
  int64_t classes = typeOf(logits).getDimSize(1);
  bool hasIgnore = (bool)ignoreIndex;
  int64_t ignore = hasIgnore ? ignoreIndex.getInt() : 0;
  for (int64_t i = 0, n = t.numElements(); i < n; ++i) {
    int64_t c = t.data<int64_t>()[i];
    if ((!hasIgnore || c != ignore) && (c < 0 || c >= classes))
      return fail(op, "target " + std::to_string(c) + " at position " + std::to_string(i) +
                          " is outside [0, " + std::to_string(classes) + ")");
  }
  Value y = op->getResult(0);
  make(y);
  return withFloat(op, logits, [&](auto tag) {
    using T = decltype(tag);
    if (grad)
      rt::cross_entropy_grad<T>(in<T>(logits), dimsOf(logits), t.data<int64_t>(), red, hasIgnore,
                                ignore, in<T>(grad), out<T>(y));
    else
      rt::cross_entropy<T>(in<T>(logits), dimsOf(logits), t.data<int64_t>(), red, hasIgnore, ignore,
                           out<T>(y));
  });
}

bool Interpreter::evalGather(Operation *op, Value data, Value indices, int64_t axis, Value grad) {
  HostValue idx = indicesOf(indices);
  Value table = grad ? op->getResult(0) : data;
  int64_t size = typeOf(table).getDimSize(axis);
  for (int64_t i = 0, n = idx.numElements(); i < n; ++i) {
    int64_t k = idx.data<int64_t>()[i];
    if (k < -size || k >= size)
      return fail(op, "index " + std::to_string(k) + " at position " + std::to_string(i) +
                          " is outside [-" + std::to_string(size) + ", " + std::to_string(size) +
                          ") for dimension " + std::to_string(axis));
  }
  Value y = op->getResult(0);
  make(y);
  if (grad)
    return withFloat(op, y, [&](auto tag) {
      using T = decltype(tag);
      rt::gather_grad<T>(in<T>(grad), idx.data<int64_t>(), dimsOf(indices), (int)axis, out<T>(y),
                         dimsOf(y));
    });
  dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
    using T = decltype(tag);
    rt::gather<T>(in<T>(data), dimsOf(data), idx.data<int64_t>(), dimsOf(indices), (int)axis,
                  out<T>(y));
  });
  return true;
}

bool Interpreter::evalConcat(ConcatOp op) {
  Value y = op.getResult();
  make(y);
  SmallVector<rt::Dims> shapes;
  for (Value x : op.getInputs())
    shapes.push_back(dimsOf(x));
  dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
    using T = decltype(tag);
    SmallVector<const T *> ptrs;
    for (Value x : op.getInputs())
      ptrs.push_back(in<T>(x));
    rt::concat<T>((int)ptrs.size(), ptrs.data(), shapes.data(), (int)op.getAxis(), out<T>(y));
  });
  return true;
}

/// Softmax, layer and RMS norm, attention, and their gradients.
bool Interpreter::evalNormalization(Operation *op) {
  return llvm::TypeSwitch<Operation *, bool>(op)
      .Case<SoftmaxOp, LogSoftmaxOp>([&](Operation *o) {
        Value x = o->getOperand(0), y = o->getResult(0);
        int axis = (int)cast<IntegerAttr>(o->getAttr("axis")).getInt();
        bool log = isa<LogSoftmaxOp>(o);
        make(y);
        return withFloat(o, x, [&](auto tag) {
          using T = decltype(tag);
          rt::softmax<T>(in<T>(x), dimsOf(x), axis, log, out<T>(y));
        });
      })
      .Case([&](SoftmaxGradOp g) {
        make(g.getResult());
        return withFloat(g, g.getOutput(), [&](auto tag) {
          using T = decltype(tag);
          rt::softmax_grad<T>(in<T>(g.getOutput()), in<T>(g.getGrad()), dimsOf(g.getOutput()),
                              (int)g.getAxis(), g.getLog(), out<T>(g.getResult()));
        });
      })
      .Case([&](LayerNormOp ln) {
        Value x = ln.getInput(), y = ln.getResult();
        make(y);
        return withFloat(ln, x, [&](auto tag) {
          using T = decltype(tag);
          rt::layer_norm<T>(in<T>(x), dimsOf(x), (int)ln.getAxis(),
                            ln.getScale() ? in<T>(ln.getScale()) : nullptr,
                            ln.getBias() ? in<T>(ln.getBias()) : nullptr,
                            (T)ln.getEpsilonAttr().getValueAsDouble(), out<T>(y));
        });
      })
      .Case([&](LayerNormGradOp g) {
        Value x = g.getInput();
        make(g.getInputGrad());
        make(g.getScaleGrad());
        make(g.getBiasGrad());
        return withFloat(g, x, [&](auto tag) {
          using T = decltype(tag);
          rt::layer_norm_grad<T>(
              in<T>(x), dimsOf(x), (int)g.getAxis(), g.getScale() ? in<T>(g.getScale()) : nullptr,
              (T)g.getEpsilonAttr().getValueAsDouble(), in<T>(g.getGrad()),
              out<T>(g.getInputGrad()), out<T>(g.getScaleGrad()), out<T>(g.getBiasGrad()));
        });
      })
      .Case([&](RmsNormOp rn) {
        Value x = rn.getInput(), y = rn.getResult();
        make(y);
        return withFloat(rn, x, [&](auto tag) {
          using T = decltype(tag);
          rt::rms_norm<T>(in<T>(x), dimsOf(x), (int)rn.getAxis(),
                          rn.getScale() ? in<T>(rn.getScale()) : nullptr,
                          (T)rn.getEpsilonAttr().getValueAsDouble(), out<T>(y));
        });
      })
      .Case<RotaryOp, RotaryGradOp>([&](Operation *r) {
        Value x = r->getOperand(0), c = r->getOperand(1), sn = r->getOperand(2),
              y = r->getResult(0);
        make(y);
        return withFloat(r, x, [&](auto tag) {
          using T = decltype(tag);
          if (isa<RotaryOp>(r))
            rt::rotary<T>(in<T>(x), dimsOf(x), in<T>(c), dimsOf(c), in<T>(sn), dimsOf(sn),
                          out<T>(y));
          else
            rt::rotary_grad<T>(in<T>(x), dimsOf(x), in<T>(c), dimsOf(c), in<T>(sn), dimsOf(sn),
                               out<T>(y));
        });
      })
      .Case([&](RmsNormGradOp g) {
        Value x = g.getInput();
        make(g.getInputGrad());
        make(g.getScaleGrad());
        return withFloat(g, x, [&](auto tag) {
          using T = decltype(tag);
          rt::rms_norm_grad<T>(in<T>(x), dimsOf(x), (int)g.getAxis(),
                               g.getScale() ? in<T>(g.getScale()) : nullptr,
                               (T)g.getEpsilonAttr().getValueAsDouble(), in<T>(g.getGrad()),
                               out<T>(g.getInputGrad()), out<T>(g.getScaleGrad()));
        });
      })
      .Case([&](AttentionOp a) {
        Value q = a.getQuery(), k = a.getKey(), v = a.getValue(), m = a.getMask();
        make(a.getResult());
        return withFloat(a, q, [&](auto tag) {
          using T = decltype(tag);
          rt::attention<T>(in<T>(q), dimsOf(q), in<T>(k), dimsOf(k), in<T>(v), dimsOf(v),
                           m ? in<T>(m) : nullptr, m ? dimsOf(m) : rt::Dims(),
                           (T)a.getScaleAttr().getValueAsDouble(), a.getCausal(),
                           out<T>(a.getResult()));
        });
      })
      .Case([&](AttentionGradOp g) {
        Value q = g.getQuery(), k = g.getKey(), v = g.getValue(), m = g.getMask();
        make(g.getQueryGrad());
        make(g.getKeyGrad());
        make(g.getValueGrad());
        return withFloat(g, q, [&](auto tag) {
          using T = decltype(tag);
          rt::attention_grad<T>(in<T>(q), dimsOf(q), in<T>(k), dimsOf(k), in<T>(v), dimsOf(v),
                                m ? in<T>(m) : nullptr, m ? dimsOf(m) : rt::Dims(),
                                (T)g.getScaleAttr().getValueAsDouble(), g.getCausal(),
                                in<T>(g.getGrad()), out<T>(g.getQueryGrad()),
                                out<T>(g.getKeyGrad()), out<T>(g.getValueGrad()));
        });
      })
      .Default([&](Operation *o) {
        return failWith("no reference kernel for " + o->getName().getStringRef().str());
      });
}

/// Reshape, transpose, slice, concat, gather, expand, and their gradients.
bool Interpreter::evalDataMovement(Operation *op) {
  return llvm::TypeSwitch<Operation *, bool>(op)
      .Case([&](ReshapeOp r) {
        HostValue v = get(r.getInput());
        v.type = typeOf(r.getResult());
        env[r.getResult()] = std::move(v);
        return true;
      })
      .Case([&](TransposeOp t) {
        Value x = t.getInput(), y = t.getResult();
        make(y);
        dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
          using T = decltype(tag);
          rt::transpose<T>(in<T>(x), dimsOf(x), dimsOf(t.getPerm()), out<T>(y));
        });
        return true;
      })
      .Case([&](SliceOp s) {
        Value x = s.getInput(), y = s.getResult();
        make(y);
        dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
          using T = decltype(tag);
          rt::slice<T>(in<T>(x), dimsOf(x), dimsOf(s.getStarts()), dimsOf(s.getSteps()), out<T>(y),
                       dimsOf(y));
        });
        return true;
      })
      .Case([&](SliceGradOp s) {
        Value g = s.getGrad(), y = s.getResult();
        make(y);
        dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
          using T = decltype(tag);
          rt::slice_grad<T>(in<T>(g), dimsOf(g), dimsOf(s.getStarts()), dimsOf(s.getSteps()),
                            out<T>(y), dimsOf(y));
        });
        return true;
      })
      .Case([&](ConcatOp c) { return evalConcat(c); })
      .Case([&](GatherOp g) {
        return evalGather(g, g.getData(), g.getIndices(), (int64_t)g.getAxis(), Value());
      })
      .Case([&](GatherGradOp g) {
        return evalGather(g, Value(), g.getIndices(), (int64_t)g.getAxis(), g.getGrad());
      })
      .Case([&](NonzeroOp nz) {
        Value x = nz.getInput(), y = nz.getResult();
        make(y);
        dispatchAny(typeOf(x).getElementType(), [&](auto tag) {
          using T = decltype(tag);
          rt::nonzero<T>(in<T>(x), dimsOf(x), out<int64_t>(y));
        });
        return true;
      })
      .Case([&](ExpandOp e) {
        Value x = e.getInput(), y = e.getResult();
        make(y);
        dispatchAny(typeOf(y).getElementType(), [&](auto tag) {
          using T = decltype(tag);
          rt::expand<T>(in<T>(x), dimsOf(x), out<T>(y), dimsOf(y));
        });
        return true;
      })
      .Default([&](Operation *o) {
        return failWith("no reference kernel for " + o->getName().getStringRef().str());
      });
}

namespace {

/// The reference 2-D convolution and its gradients (the ops
/// carve-lower-convolutions keeps whole for cuDNN): x [N, C, H, W], w
/// [O, C / group, kh, kw], y [N, O, Ho, Wo]. kind 0: y = conv(x, w); 1: x =
/// the input gradient of y (dy) by w; 2: w = the weight gradient of x and dy.
/// Sums in T over the taps in order (sample, output channel, pixel, input
/// channel, tap).
template <class T>
void convolve(int kind, T *x, ArrayRef<int64_t> xs, T *w, ArrayRef<int64_t> ws, T *y,
              ArrayRef<int64_t> ys, ArrayRef<int64_t> strides, ArrayRef<int64_t> pads,
              ArrayRef<int64_t> dil, int64_t group) {
  const int64_t n = xs[0], c = xs[1], h = xs[2], wd = xs[3], o = ws[0], kh = ws[2], kw = ws[3];
  const int64_t ho = ys[2], wo = ys[3], cg = c / group, og = o / group;
  T *out = kind == 0 ? y : kind == 1 ? x : w;
  std::fill(out,
            out + (kind == 0   ? n * o * ho * wo
                   : kind == 1 ? n * c * h * wd
                               : o * cg * kh * kw),
            T(0));
  for (int64_t s = 0; s < n; ++s)
    for (int64_t oc = 0; oc < o; ++oc)
      for (int64_t i = 0; i < ho; ++i)
        for (int64_t j = 0; j < wo; ++j)
          for (int64_t q = 0; q < cg; ++q)
            for (int64_t a = 0; a < kh; ++a)
              for (int64_t b = 0; b < kw; ++b) {
                const int64_t yy = i * strides[0] - pads[0] + a * dil[0];
                const int64_t xx = j * strides[1] - pads[1] + b * dil[1];
                if (yy < 0 || yy >= h || xx < 0 || xx >= wd)
                  continue;
                T &xv = x[((s * c + (oc / og) * cg + q) * h + yy) * wd + xx];
                T &wv = w[((oc * cg + q) * kh + a) * kw + b];
                T &yv = y[((s * o + oc) * ho + i) * wo + j];
                if (kind == 0)
                  yv += xv * wv;
                else if (kind == 1)
                  xv += yv * wv;
                else
                  wv += yv * xv;
              }
}

} // namespace

bool Interpreter::evalConvolution(Operation *op) {
  // Operands and result as x, w, y of the forward.
  Value x, w, y;
  int kind = 0;
  if (isa<Conv2dOp>(op))
    x = op->getOperand(0), w = op->getOperand(1), y = op->getResult(0);
  else if (isa<Conv2dGradInputOp>(op))
    kind = 1, y = op->getOperand(0), w = op->getOperand(1), x = op->getResult(0);
  else
    kind = 2, x = op->getOperand(0), y = op->getOperand(1), w = op->getResult(0);
  if (isa<Conv2dOp>(op) && cast<Conv2dOp>(op).getBias())
    return failWith("no reference kernel for carve.conv2d with a bias (carve-lower-convolutions "
                    "adds it after the convolution)");
  Value res = op->getResult(0);
  make(res);
  auto strides = cast<DenseI64ArrayAttr>(op->getAttr("strides")).asArrayRef();
  auto pads = cast<DenseI64ArrayAttr>(op->getAttr("pads")).asArrayRef();
  auto dil = cast<DenseI64ArrayAttr>(op->getAttr("dilations")).asArrayRef();
  const int64_t group = cast<IntegerAttr>(op->getAttr("group")).getInt();
  return withFloat(op, res, [&](auto tag) {
    using T = decltype(tag);
    auto ptr = [&](Value v) { return v == res ? out<T>(v) : const_cast<T *>(in<T>(v)); };
    convolve<T>(kind, ptr(x), typeOf(x).getShape(), ptr(w), typeOf(w).getShape(), ptr(y),
                typeOf(y).getShape(), strides, pads, dil, group);
  });
}

bool Interpreter::evaluate(Operation *op) {
  if (isa<MaxPool2dOp, BatchNormOp>(op))
    return failWith("no reference kernel for " + op->getName().getStringRef().str() +
                    " (carve-lower-convolutions rewrites it)");
  if (isa<Conv2dOp, Conv2dGradInputOp, Conv2dGradWeightOp>(op))
    return evalConvolution(op);
  if (auto f = unaryOf(op))
    return evalUnary(op, *f);
  if (auto f = binaryOf(op))
    return evalBinary(op, *f);
  if (auto f = compareOf(op))
    return evalCompare(op, *f);

  return llvm::TypeSwitch<Operation *, bool>(op)
      .Case([&](ConstantOp c) { return evalConstant(c); })
      .Case([&](CastOp c) {
        env[c.getResult()] = convert(get(c.getInput()), typeOf(c.getResult()).getElementType());
        return true;
      })
      .Case([&](ReplicaSumOp s) {
        env[s.getResult()] = get(s.getInput()); // one replica
        return true;
      })
      .Case([&](EvalSelectOp s) {
        env[s.getResult()] = get(s.getTrain()); // a training step
        return true;
      })
      .Case([&](AssignOp a) {
        // The reference evaluation of one step leaves its arguments alone.
        env[a.getResult()] = get(a.getValue());
        return true;
      })
      .Case([&](DropoutOp d) {
        // The whole tensor of a 1-rank program: seed 0, step 0.
        make(d.getResult());
        return withFloat(d, d.getInput(), [&](auto tag) {
          using T = decltype(tag);
          rt::philox::DropoutPiece piece;
          piece.dims = dimsOf(d.getInput());
          rt::dropout<T>(in<T>(d.getInput()), piece, d.getP().convertToDouble(), 0, 0,
                         d.nodeIndex(), out<T>(d.getResult()));
        });
      })
      .Case<AndOp, OrOp, NotOp>([&](Operation *o) {
        Value a = o->getOperand(0), y = o->getResult(0);
        Value b = o->getNumOperands() > 1 ? o->getOperand(1) : a;
        rt::Logic f = isa<AndOp>(o)  ? rt::Logic::And
                      : isa<OrOp>(o) ? rt::Logic::Or
                                     : rt::Logic::Not;
        make(y);
        rt::logic(f, in<uint8_t>(a), dimsOf(a), in<uint8_t>(b), dimsOf(b), out<uint8_t>(y),
                  dimsOf(y));
        return true;
      })
      .Case([&](WhereOp w) { return evalWhere(w); })
      .Case([&](UnaryGradOp g) {
        std::optional<rt::Unary> f = unaryFn(g.getFn());
        if (!f)
          return fail(g, "unknown function '" + g.getFn().str() + "'");
        make(g.getResult());
        return withFloat(g, g.getInput(), [&](auto tag) {
          using T = decltype(tag);
          rt::unary_grad<T>(*f, in<T>(g.getInput()), in<T>(g.getGrad()), out<T>(g.getResult()),
                            typeOf(g.getInput()).getNumElements());
        });
      })
      .Case([&](MatmulOp m) { return evalMatmul(m); })
      .Case([&](ReduceSumOp r) { return evalReduce(r, rt::Reduce::Sum, r.getAxes()); })
      .Case([&](ReduceMeanOp r) { return evalReduce(r, rt::Reduce::Mean, r.getAxes()); })
      .Case([&](ReduceMaxOp r) { return evalReduce(r, rt::Reduce::Max, r.getAxes()); })
      .Case<SoftmaxOp, LogSoftmaxOp, SoftmaxGradOp, LayerNormOp, LayerNormGradOp, RmsNormOp,
            RmsNormGradOp, RotaryOp, RotaryGradOp, AttentionOp, AttentionGradOp>(
          [&](Operation *o) { return evalNormalization(o); })
      .Case([&](CrossEntropyOp ce) {
        return evalCrossEntropy(ce, ce.getLogits(), ce.getTargets(), ce.getReduction(),
                                ce.getIgnoreIndexAttr(), Value());
      })
      .Case([&](CrossEntropyGradOp g) {
        return evalCrossEntropy(g, g.getLogits(), g.getTargets(), g.getReduction(),
                                g.getIgnoreIndexAttr(), g.getGrad());
      })
      .Case<ReshapeOp, TransposeOp, SliceOp, SliceGradOp, ConcatOp, GatherOp, GatherGradOp,
            ExpandOp, NonzeroOp>([&](Operation *o) { return evalDataMovement(o); })
      .Default([&](Operation *o) {
        return failWith("no reference kernel for " + o->getName().getStringRef().str());
      });
}

} // namespace

bool interpret(func::FuncOp fn, ArrayRef<HostValue> args, std::vector<HostValue> &results,
               std::string &error) {
  Interpreter interp(error);
  return interp.run(fn, args, results);
}

} // namespace carve
