//===- kernels_basic_test.cu - kernels_basic/data/optim.cu vs the CPU -----===//
//
// Every function of runtime/cuda/kernels_basic.cu, kernels_data.cu and
// kernels_optim.cu on random inputs (odd sizes, broadcast shapes, ranks 0
// to 4, transposes, batched and broadcast GEMMs, empty tensors) against the CPU kernels: the float64 instantiations
// where the GPU rounds differently, the float ones where it must match bit
// for bit (data movement, casts, optimizer updates, bf16/fp16 GEMM inputs).
// Tolerances are stated at each check with the reason. The last checks make
// the device error record fire and read it back through kCudaTarget.
//
//===----------------------------------------------------------------------===//

#include "../../runtime/cuda/conv_fallback.h"
#include "carve/rt/philox.h"
#include "harness.h"

#include "carve/rt/dist.h"
#include "carve/rt/elementwise.h"
#include "carve/rt/gpu.h"
#include "carve/rt/kernels.h"
#include "carve/rt/optim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

using namespace gputest;
namespace g = carve::gpu;
namespace rt = carve::rt;
using rt::Dims;

namespace {

const char *kBinary = "carve-gpu-kernels_basic_test";

/// Broadcast result shape of two shapes (NumPy rules).
Dims broadcastShape(const Dims &a, const Dims &b) {
  Dims y;
  y.rank = std::max(a.rank, b.rank);
  for (int i = 0; i < y.rank; ++i) {
    const int ia = i - (y.rank - a.rank), ib = i - (y.rank - b.rank);
    const int64_t da = ia >= 0 ? a.d[ia] : 1, db = ib >= 0 ? b.d[ib] : 1;
    y.d[i] = da == 1 ? db : da;
  }
  return y;
}

//===--- Elementwise -------------------------------------------------------===//

const char *unaryName(rt::Unary f) {
  static const char *names[] = {"neg",        "abs",  "exp",  "log",      "sqrt", "rsqrt",
                                "reciprocal", "tanh", "erf",  "sigmoid",  "relu", "sin",
                                "cos",        "silu", "gelu", "gelu_tanh"};
  return names[static_cast<int>(f)];
}

std::vector<float> unaryInputs(rt::Unary f, int64_t n) {
  using U = rt::Unary;
  std::vector<float> x;
  if (f == U::Log || f == U::Sqrt || f == U::Rsqrt)
    x = uniform(n, 0.05f, 4.0f);
  else if (f == U::Reciprocal) {
    x = uniform(n, 0.2f, 3.0f);
    for (int64_t i = 0; i < n; i += 2)
      x[i] = -x[i];
  } else {
    x = randn(n, 2.0f);
    // The gradients of Relu and Abs at exactly 0 are PyTorch's choice (0).
    for (int64_t i = 0; i < n; i += 97)
      x[i] = 0.0f;
  }
  return x;
}

void testUnary() {
  for (int fi = 0; fi <= static_cast<int>(rt::Unary::GeluTanh); ++fi) {
    const auto f = static_cast<rt::Unary>(fi);
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000003)}) {
      const std::vector<float> x = unaryInputs(f, n), dy = randn(n);
      auto dx = up(x), ddy = up(dy);
      auto y = poisoned<float>(n), dgrad = poisoned<float>(n);
      g::unary(f, dx->p, y->p, n);
      g::unary_grad(f, dx->p, ddy->p, dgrad->p, n);
      std::vector<double> xd = toDouble(x), dyd = toDouble(dy), ry(n), rg(n);
      rt::unary<double>(f, xd.data(), ry.data(), n);
      rt::unary_grad<double>(f, xd.data(), dyd.data(), rg.data(), n);
      // CUDA's single-precision functions are within 2 ulp (expf, logf,
      // tanhf, erff, sinf/cosf on |x| < 10), and each formula adds at most ~10
      // float roundings: 1e-5 relative; 1e-6 absolute for the cancellations
      // near zeros of the result (1 - tanh^2, the GELU gradient's dip).
      const std::string what = std::string(unaryName(f)) + " n=" + std::to_string(n);
      expectClose(what, y->download(), ry, 1e-5, 1e-6);
      // Gradients: |dy| up to ~5 times one rounding of a value near 1 where
      // they cancel (1 - tanh^2), and GELU-tanh's tail: tanhf(u) is exactly
      // -1 for u <= -9.01 (x <= -5.16), where the true gradient, up to 5.7e-7
      // there, becomes 0; times |dy| <= 5.5 (a million normal draws): 4e-6.
      expectClose(what + " grad", dgrad->download(), rg, 1e-5, 4e-6);
    }
  }
  g::unary(rt::Unary::Exp, nullptr, nullptr, 0); // empty: no launch
}

// Dropout draws the CPU kernel's masks bitwise: the whole tensor, and a
// rank's piece (tp split in two groups, a share of the batch inside a merged
// dimension), a million elements, p = 0 the identity.
void testDropout() {
  struct Case {
    const char *what;
    rt::philox::DropoutPiece piece;
  };
  rt::philox::DropoutPiece whole, piece, big;
  whole.dims = Dims{6, 5, 7};
  piece.dims = Dims{3 * 2, 8};
  piece.tpDim = 1, piece.tpGroups = 2, piece.tpParts = 2, piece.tpRank = 1;
  piece.batchDim = 0, piece.batchOuter = 3, piece.localBatch = 2, piece.globalBatch = 8;
  piece.batchOffset = 6;
  big.dims = Dims{1000, 1000};
  for (const Case &c : {Case{"whole", whole}, Case{"piece", piece}, Case{"1e6", big}}) {
    const int64_t n = c.piece.dims.numel();
    const std::vector<float> x = randn(n);
    auto dx = up(x);
    for (double p : {0.0, 0.1, 0.5}) {
      auto y = poisoned<float>(n);
      g::setDropoutState(0x1234567890ull, 12);
      g::dropout(dx->p, c.piece, p, 5, y->p);
      std::vector<float> ref(n);
      rt::dropout<float>(x.data(), c.piece, p, 0x1234567890ull, 12, 5, ref.data());
      expectEqual(std::string("dropout ") + c.what + " p=" + std::to_string(p), y->download(), ref);
    }
  }
}

void testBinary() {
  struct Case {
    Dims a, b;
  };
  const Case cases[] = {
      {{7, 13}, {7, 13}},           // equal shapes
      {{4, 1, 5}, {3, 1}},          // both broadcast
      {{}, {1000003}},              // a rank-0 scalar
      {{2, 3, 4, 5}, {3, 1, 5}},    // rank 4 against rank 3
      {{1000003}, {1}},             // a one-element exponent (pow's special cases)
      {{6, 1, 1, 7}, {1, 5, 3, 1}}, // interleaved broadcast dims
  };
  const rt::Binary ops[] = {rt::Binary::Add, rt::Binary::Sub, rt::Binary::Mul, rt::Binary::Div,
                            rt::Binary::Pow, rt::Binary::Max, rt::Binary::Min};
  const char *names[] = {"add", "sub", "mul", "div", "pow", "max", "min"};
  for (const Case &c : cases) {
    const Dims ys = broadcastShape(c.a, c.b);
    const int64_t na = c.a.numel(), nb = c.b.numel(), ny = ys.numel();
    for (int oi = 0; oi < 7; ++oi) {
      const rt::Binary f = ops[oi];
      std::vector<float> a, b;
      if (f == rt::Binary::Pow) {
        a = uniform(na, 0.5f, 2.0f);
        b = uniform(nb, -2.0f, 2.0f);
      } else {
        a = randn(na);
        b = f == rt::Binary::Div ? uniform(nb, 0.5f, 2.0f) : randn(nb);
      }
      if (f == rt::Binary::Max || f == rt::Binary::Min) {
        // NaN in either operand propagates, like torch.maximum.
        a[0] = std::numeric_limits<float>::quiet_NaN();
        if (nb > 2)
          b[nb - 1] = std::numeric_limits<float>::quiet_NaN();
      }
      auto da = up(a), db = up(b);
      auto y = poisoned<float>(ny);
      g::binary(f, da->p, c.a, db->p, c.b, y->p, ys);
      std::vector<double> ad = toDouble(a), bd = toDouble(b), ref(ny);
      rt::binary<double>(f, ad.data(), c.a, bd.data(), c.b, ref.data(), ys);
      // One correctly rounded float operation: 2^-24 relative; powf is
      // within a few ulp.
      const double rtol = f == rt::Binary::Pow ? 2e-6 : 1.2e-7;
      expectCloseNan(std::string(names[oi]) + " " + str(c.a) + " " + str(c.b), y->download(), ref,
                     rtol, 0);
    }
  }
  // Pow's scalar special cases (2, 3, 0.5, -0.5, -1, -2) and a general one.
  for (float e : {2.0f, 3.0f, 0.5f, -0.5f, -1.0f, -2.0f, 1.7f}) {
    const int64_t n = 4099;
    const std::vector<float> a = uniform(n, 0.25f, 3.0f);
    auto da = up(a), de = up(std::vector<float>{e});
    auto y = poisoned<float>(n);
    g::binary(rt::Binary::Pow, da->p, Dims{n}, de->p, Dims{1}, y->p, Dims{n});
    std::vector<float> ref(n);
    rt::binary<float>(rt::Binary::Pow, a.data(), Dims{n}, &e, Dims{1}, ref.data(), Dims{n});
    // The special cases are the same float operations as the CPU's: exact;
    // powf against the host's powf: a few ulp.
    expectClose("pow by scalar " + std::to_string(e), y->download(), toDouble(ref),
                e == 1.7f ? 2e-6 : 0, 0);
  }
  auto empty = poisoned<float>(1);
  g::binary(rt::Binary::Add, empty->p, Dims{0, 3}, empty->p, Dims{3}, empty->p, Dims{0, 3});
}

void testCompareLogicWhere() {
  const Dims as{5, 1, 9}, bs{4, 1}, ys{5, 4, 9};
  const int64_t na = as.numel(), nb = bs.numel(), ny = ys.numel(), nc = Dims{4, 9}.numel();
  std::vector<float> a = randn(na), b = randn(nb);
  for (int64_t i = 0; i < nb; ++i) // some ties for Eq
    a[i] = b[i];
  std::vector<int64_t> ai = randint(na, -3, 4), bi = randint(nb, -3, 4);
  std::vector<uint8_t> ca(na), cb(nb), cond(nc);
  for (auto *v : {&ca, &cb, &cond})
    for (auto &x : *v)
      x = static_cast<uint8_t>(rng()() % 2);
  auto da = up(a), db = up(b);
  auto dai = up(ai), dbi = up(bi);
  auto dca = up(ca), dcb = up(cb), dcond = up(cond);
  const char *cnames[] = {"equal", "less", "greater"};
  for (int ci = 0; ci < 3; ++ci) {
    const auto f = static_cast<rt::Compare>(ci);
    auto y = poisoned<uint8_t>(ny), yi = poisoned<uint8_t>(ny);
    g::compare(f, da->p, as, db->p, bs, y->p, ys);
    g::compare(f, dai->p, as, dbi->p, bs, yi->p, ys);
    std::vector<uint8_t> ref(ny), refi(ny);
    rt::compare<float>(f, a.data(), as, b.data(), bs, ref.data(), ys);
    rt::compare<int64_t>(f, ai.data(), as, bi.data(), bs, refi.data(), ys);
    expectEqual(std::string(cnames[ci]) + " float", y->download(), ref);
    expectEqual(std::string(cnames[ci]) + " int64", yi->download(), refi);
  }
  const char *lnames[] = {"and", "or", "not"};
  for (int li = 0; li < 3; ++li) {
    const auto f = static_cast<rt::Logic>(li);
    const Dims outShape = f == rt::Logic::Not ? as : ys;
    auto y = poisoned<uint8_t>(outShape.numel());
    g::logic(f, dca->p, as, dcb->p, bs, y->p, outShape);
    std::vector<uint8_t> ref(outShape.numel());
    rt::logic(f, ca.data(), as, cb.data(), bs, ref.data(), outShape);
    expectEqual(lnames[li], y->download(), ref);
  }
  // where(c [4, 9], a [5, 1, 9], b [4, 1]) -> [5, 4, 9]
  const Dims cs{4, 9};
  auto y = poisoned<float>(ny);
  auto yi = poisoned<int64_t>(ny);
  g::where(dcond->p, cs, da->p, as, db->p, bs, y->p, ys);
  g::where(dcond->p, cs, dai->p, as, dbi->p, bs, yi->p, ys);
  std::vector<float> ref(ny);
  std::vector<int64_t> refi(ny);
  rt::where<float>(cond.data(), cs, a.data(), as, b.data(), bs, ref.data(), ys);
  rt::where<int64_t>(cond.data(), cs, ai.data(), as, bi.data(), bs, refi.data(), ys);
  expectEqual("where float", y->download(), ref);
  expectEqual("where int64", yi->download(), refi);
}

template <class T> const char *typeName() {
  if constexpr (std::is_same_v<T, float>)
    return "float";
  else if constexpr (std::is_same_v<T, double>)
    return "double";
  else if constexpr (std::is_same_v<T, int64_t>)
    return "int64";
  else if constexpr (std::is_same_v<T, int32_t>)
    return "int32";
  else
    return "uint8";
}

/// Values every type holds (uint8: 0..255; others: -100..100 with halves for
/// the floating types, so that float -> int truncates), zeros included.
template <class T> std::vector<T> castSource(int64_t n) {
  std::vector<T> v(n);
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, uint8_t>)
      v[i] = static_cast<T>(rng()() % 256);
    else if constexpr (std::is_floating_point_v<T>)
      v[i] = static_cast<T>(static_cast<int>(rng()() % 401) - 200) / T(2);
    else
      v[i] = static_cast<T>(static_cast<int>(rng()() % 201) - 100);
    if (i % 5 == 0)
      v[i] = T(0);
  }
  return v;
}

template <class From, class To> void testCastPair() {
  const int64_t n = 1001;
  const std::vector<From> x = castSource<From>(n);
  auto dx = up(x);
  auto y = poisoned<To>(n);
  g::cast<From, To>(dx->p, y->p, n);
  std::vector<To> ref(n);
  rt::cast<From, To>(x.data(), ref.data(), n);
  expectEqual(std::string("cast ") + typeName<From>() + " -> " + typeName<To>(), y->download(),
              ref);
}

template <class From> void testCastFrom() {
  testCastPair<From, float>();
  testCastPair<From, double>();
  testCastPair<From, int64_t>();
  testCastPair<From, int32_t>();
  testCastPair<From, uint8_t>();
}

template <class T> void testFillCopy() {
  const int64_t n = 1000003;
  auto y = poisoned<T>(n);
  g::fill<T>(y->p, n, T(3));
  expectEqual(std::string("fill ") + typeName<T>(), y->download(), std::vector<T>(n, T(3)));
  const std::vector<T> x = castSource<T>(n);
  auto dx = up(x);
  auto z = poisoned<T>(n);
  g::copy<T>(dx->p, z->p, n);
  expectEqual(std::string("copy ") + typeName<T>(), z->download(), x);
  g::fill<T>(y->p, 0, T(1));
  g::copy<T>(dx->p, z->p, 0);
}

/// roundCopyBf16 / roundCopyF16 (carve.round16_in_copy): bit for bit
/// roundBf16 then toBf16 (roundF16, toF16) -- values at every scale, halfway
/// cases, subnormals, overflow to infinity, NaN and signed zero; sizes from
/// empty to past one block's grid.
void testRoundCopy16() {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(1000003)}) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t r = static_cast<uint32_t>(rng()());
      float v;
      std::memcpy(&v, &r, 4); // any bit pattern: every exponent, NaNs, subnormals
      x[i] = v;
    }
    const float special[] = {0.0f,
                             -0.0f,
                             1.0f + 1.0f / 256,
                             65520.0f,
                             3.4e38f,
                             1e-40f,
                             std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN()};
    for (int64_t i = 0; i < n && i < 8; ++i)
      x[i] = special[i];
    for (int f16 = 0; f16 < 2; ++f16) {
      const std::string w =
          std::string(f16 ? "roundCopyF16" : "roundCopyBf16") + " n " + std::to_string(n);
      auto refX = up(x), gotX = up(x);
      auto refC = poisoned<uint16_t>(std::max<int64_t>(n, 1));
      auto gotC = poisoned<uint16_t>(std::max<int64_t>(n, 1));
      (f16 ? g::roundF16 : g::roundBf16)(refX->p, n);
      (f16 ? g::toF16 : g::toBf16)(refX->p, refC->p, n);
      (f16 ? g::roundCopyF16 : g::roundCopyBf16)(gotX->p, gotC->p, n);
      const std::vector<float> rx = refX->download(), gx = gotX->download();
      bool same = rx.size() == gx.size() &&
                  std::memcmp(rx.data(), gx.data(), rx.size() * sizeof(float)) == 0;
      ++checks();
      if (!same) {
        std::printf("FAIL %s: rounded values differ from roundBf16/roundF16\n", w.c_str());
        ++failures();
      }
      expectEqual(w + " copy", gotC->download(), refC->download());
    }
  }
}

//===--- Operands read as their 16-bit tensors (carve.read16, rule 3g) ----===//

/// Random values `x` stored in bf16 (f16: fp16), on the device: the 16-bit
/// tensor (`bits`) and its exact f32 view (`view`, fromBf16 / fromF16), what
/// a program held before rule 3g read the tensor itself.
struct Stored16 {
  std::unique_ptr<DevBuf<uint16_t>> bits;
  std::unique_ptr<DevBuf<float>> view;
};

Stored16 store16(const std::vector<float> &x, bool f16) {
  const int64_t n = static_cast<int64_t>(x.size());
  auto f = up(x);
  Stored16 s{poisoned<uint16_t>(std::max<int64_t>(n, 1)), poisoned<float>(std::max<int64_t>(n, 1))};
  (f16 ? g::toF16 : g::toBf16)(f->p, s.bits->p, n);
  (f16 ? g::fromF16 : g::fromBf16)(s.bits->p, s.view->p, n);
  return s;
}

/// unary_grad16, binary16, gather16 and concat16 under bf16 and fp16: an
/// operand read as its 16-bit tensor gives bit for bit what the f32 entry
/// gives on the f32 view (the kernel widens exactly as fromBf16 / fromF16
/// does; rule 3g), and a result's 16-bit copy written by the op has the bits
/// toBf16 / toF16 write (rule 3h), with or without the f32 result; broadcast
/// shapes, every function, empty tensors.
void testRead16() {
  for (int f16 = 0; f16 < 2; ++f16) {
    const rt::Precision p = f16 ? rt::Precision::F16 : rt::Precision::BF16;
    const std::string fmt = f16 ? " fp16" : " bf16";
    // unary_grad16: every function; x read as stored.
    for (int fi = 0; fi <= static_cast<int>(rt::Unary::GeluTanh); ++fi) {
      const auto f = static_cast<rt::Unary>(fi);
      for (int64_t n : {int64_t(0), int64_t(20011)}) {
        const Stored16 x = store16(unaryInputs(f, n), f16);
        auto dy = up(randn(n));
        const int64_t m = std::max<int64_t>(n, 1);
        auto want = poisoned<float>(m), got = poisoned<float>(m), got2 = poisoned<float>(m);
        auto want16 = poisoned<uint16_t>(m), got16 = poisoned<uint16_t>(m);
        g::setPrecision(p);
        g::unary_grad(f, x.view->p, dy->p, want->p, n);
        (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, n);
        g::unary_grad16(f, x.bits->p, true, dy->p, got->p, nullptr, false, n);
        // With the gradient's 16-bit copy written as well (rule 3h).
        g::unary_grad16(f, x.view->p, false, dy->p, got2->p, got16->p, false, n);
        g::setPrecision(rt::Precision::F32);
        const std::string w =
            std::string("unary_grad16 ") + unaryName(f) + fmt + " n " + std::to_string(n);
        expectEqual(w, got->download(), want->download());
        expectEqual(w + " writing its copy", got2->download(), want->download());
        expectEqual(w + " copy", got16->download(), want16->download());
      }
    }
    // binary16: each operand as stored, alone and together.
    struct Case {
      Dims a, b;
    };
    const Case cases[] = {{{7, 13}, {7, 13}},
                          {{768}, {2, 16, 768}},
                          {{4, 1, 5}, {3, 1}},
                          {{20011}, {1}},
                          {{0, 3}, {3}}};
    const rt::Binary ops[] = {rt::Binary::Add, rt::Binary::Sub, rt::Binary::Mul, rt::Binary::Div,
                              rt::Binary::Pow, rt::Binary::Max, rt::Binary::Min};
    const char *names[] = {"add", "sub", "mul", "div", "pow", "max", "min"};
    for (const Case &c : cases) {
      const Dims ys = broadcastShape(c.a, c.b);
      for (int oi = 0; oi < 7; ++oi) {
        const bool pow = ops[oi] == rt::Binary::Pow;
        const Stored16 a =
            store16(pow ? uniform(c.a.numel(), 0.5f, 2.0f) : randn(c.a.numel()), f16);
        const Stored16 b =
            store16(pow ? uniform(c.b.numel(), -2.0f, 2.0f) : randn(c.b.numel()), f16);
        const int64_t m = std::max<int64_t>(ys.numel(), 1);
        auto want = poisoned<float>(m);
        auto want16 = poisoned<uint16_t>(m);
        g::binary(ops[oi], a.view->p, c.a, b.view->p, c.b, want->p, ys);
        g::setPrecision(p);
        (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, ys.numel());
        g::setPrecision(rt::Precision::F32);
        // The result rounded as written (carve.round16): what roundBf16 /
        // roundF16 after the f32 call leave.
        auto wantR = up(want->download());
        g::setPrecision(p);
        (f16 ? g::roundF16 : g::roundBf16)(wantR->p, ys.numel());
        g::setPrecision(rt::Precision::F32);
        // flags: bit 0 a read as stored, bit 1 b, bit 2 the copy written too
        // (rule 3h; with bit 3 as well, no f32 result; with bit 4, the
        // result rounded as written).
        for (int flags : {1, 2, 3, 4, 7, 12, 20}) {
          const bool a16 = flags & 1, b16 = flags & 2, copy = flags & 4, only16 = flags & 8,
                     round = flags & 16;
          auto got = poisoned<float>(m);
          auto got16 = poisoned<uint16_t>(m);
          g::setPrecision(p);
          g::binary16(ops[oi], a16 ? (const void *)a.bits->p : a.view->p, a16, c.a,
                      b16 ? (const void *)b.bits->p : b.view->p, b16, c.b,
                      only16 ? nullptr : got->p, copy ? got16->p : nullptr, round, ys);
          g::setPrecision(rt::Precision::F32);
          const std::string w = std::string("binary16 ") + names[oi] + " " + str(c.a) +
                                (a16 ? "16" : "") + " " + str(c.b) + (b16 ? "16" : "") + fmt +
                                (round ? " rounded" : "");
          if (!only16)
            expectEqual(w, got->download(), (round ? wantR : want)->download());
          if (copy)
            expectEqual(w + (only16 ? " copy only" : " copy"), got16->download(),
                        want16->download());
        }
      }
    }
    // gather16: an embedding table stored in 16 bits, rows picked by index
    // (negative ones count from the end), and an inner axis.
    for (int axis : {0, 1}) {
      const Dims ts = axis == 0 ? Dims{50, 24} : Dims{3, 50, 5};
      const Dims is{4, 7};
      std::vector<int64_t> idx = randint(is.numel(), -50, 50);
      const Stored16 t = store16(randn(ts.numel()), f16);
      auto di = up(idx);
      Dims ys;
      ys.rank = 0;
      for (int i = 0; i < axis; ++i)
        ys.d[ys.rank++] = ts.d[i];
      for (int i = 0; i < is.rank; ++i)
        ys.d[ys.rank++] = is.d[i];
      for (int i = axis + 1; i < ts.rank; ++i)
        ys.d[ys.rank++] = ts.d[i];
      auto want = poisoned<float>(ys.numel()), got = poisoned<float>(ys.numel());
      g::gather<float>(t.view->p, ts, di->p, is, axis, want->p);
      g::setPrecision(p);
      g::gather16(t.bits->p, ts, di->p, is, axis, got->p);
      g::setPrecision(rt::Precision::F32);
      expectEqual("gather16 " + str(ts) + " axis " + std::to_string(axis) + fmt, got->download(),
                  want->download());
    }
    // reduce16: a bias gradient (sum over the leading axes, the columns
    // kernel), a row sum (the rows kernel, in segments), a general
    // reduction, a sum over no element: the f32 result's bits rounded.
    struct RCase {
      Dims xs;
      uint32_t mask;
    };
    for (const RCase &rc : {RCase{{64, 16, 24}, 0x3u}, RCase{{3, 5000}, 0x2u},
                            RCase{{4, 6, 5}, 0x5u}, RCase{{0, 7}, 0x1u}}) {
      Dims ys;
      ys.rank = 0;
      for (int i = 0; i < rc.xs.rank; ++i)
        if (!(rc.mask >> i & 1u))
          ys.d[ys.rank++] = rc.xs.d[i];
      const int64_t m = std::max<int64_t>(ys.numel(), 1);
      auto x = up(randn(rc.xs.numel()));
      auto want = poisoned<float>(m);
      auto want16 = poisoned<uint16_t>(m), got16 = poisoned<uint16_t>(m);
      g::reduce(rt::Reduce::Sum, x->p, rc.xs, rc.mask, want->p);
      g::setPrecision(p);
      (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, ys.numel());
      g::reduce16(rt::Reduce::Sum, x->p, false, rc.xs, rc.mask, nullptr, got16->p);
      g::setPrecision(rt::Precision::F32);
      expectEqual("reduce16 sum " + str(rc.xs) + fmt, got16->download(), want16->download());
    }
    // reduce16 reading its input as stored in 16 bits (rule 3g: a concat of
    // cuDNN's 16-bit gradients): reduce of the exact f32 view, bit for bit,
    // with the f32 result, its 16-bit copy, or both; sums, means and maxima
    // through each kernel (columns in one launch at {2048, 300}).
    for (const RCase &rc : {RCase{{64, 16, 24}, 0x3u}, RCase{{2048, 300}, 0x1u},
                            RCase{{3, 5000}, 0x2u}, RCase{{4, 6, 5}, 0x5u}}) {
      Dims ys;
      ys.rank = 0;
      for (int i = 0; i < rc.xs.rank; ++i)
        if (!(rc.mask >> i & 1u))
          ys.d[ys.rank++] = rc.xs.d[i];
      const int64_t m = ys.numel();
      const Stored16 x = store16(randn(rc.xs.numel()), f16);
      for (rt::Reduce f : {rt::Reduce::Sum, rt::Reduce::Mean, rt::Reduce::Max}) {
        const std::string name = f == rt::Reduce::Sum    ? "sum"
                                 : f == rt::Reduce::Mean ? "mean"
                                                         : "max";
        auto want = poisoned<float>(m), got = poisoned<float>(m), only = poisoned<float>(m);
        auto want16 = poisoned<uint16_t>(m), got16 = poisoned<uint16_t>(m);
        auto only16 = poisoned<uint16_t>(m);
        g::reduce(f, x.view->p, rc.xs, rc.mask, want->p);
        g::setPrecision(p);
        (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, m);
        g::reduce16(f, x.bits->p, true, rc.xs, rc.mask, got->p, got16->p);
        g::reduce16(f, x.bits->p, true, rc.xs, rc.mask, only->p, nullptr);
        g::reduce16(f, x.bits->p, true, rc.xs, rc.mask, nullptr, only16->p);
        g::setPrecision(rt::Precision::F32);
        const std::string what = "reduce16 " + name + " of 16-bit x " + str(rc.xs) + fmt;
        expectEqual(what, got->download(), want->download());
        expectEqual(what + " (its copy)", got16->download(), want16->download());
        expectEqual(what + " (f32 only)", only->download(), want->download());
        expectEqual(what + " (copy only)", only16->download(), want16->download());
      }
    }
    // concat16: q, k, v gradients joined on the last axis, the result's copy
    // written too (rule 3h; a split's gradient).
    {
      const Dims ps{2, 5, 24}, ys{2, 5, 72};
      std::vector<std::unique_ptr<DevBuf<float>>> parts;
      const float *xs[3];
      const Dims shapes[3] = {ps, ps, ps};
      for (int i = 0; i < 3; ++i) {
        parts.push_back(up(randn(ps.numel())));
        xs[i] = parts.back()->p;
      }
      auto want = poisoned<float>(ys.numel()), got = poisoned<float>(ys.numel());
      auto want16 = poisoned<uint16_t>(ys.numel()), got16 = poisoned<uint16_t>(ys.numel());
      g::concat<float>(3, xs, shapes, 2, want->p);
      g::setPrecision(p);
      (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, ys.numel());
      g::concat16(3, xs, shapes, 2, got->p, got16->p, false);
      g::setPrecision(rt::Precision::F32);
      expectEqual("concat16" + fmt, got->download(), want->download());
      expectEqual("concat16 copy" + fmt, got16->download(), want16->download());
    }
    // transpose16: attention's q to heads ([B, T, H, D] -> [B, H, T, D],
    // the view kernel) and a last-two swap (the tiled kernel), rounded as
    // written (carve.round16) and not.
    for (const Dims perm : {Dims{0, 2, 1, 3}, Dims{0, 1, 3, 2}}) {
      const Dims xs{2, 33, 3, 40};
      Dims ys;
      ys.rank = 4;
      for (int i = 0; i < 4; ++i)
        ys.d[i] = xs.d[perm.d[i]];
      auto x = up(randn(xs.numel()));
      auto want = poisoned<float>(xs.numel()), wantR = poisoned<float>(xs.numel());
      auto want16 = poisoned<uint16_t>(xs.numel());
      g::transpose<float>(x->p, xs, perm, want->p);
      g::transpose<float>(x->p, xs, perm, wantR->p);
      g::setPrecision(p);
      (f16 ? g::roundF16 : g::roundBf16)(wantR->p, xs.numel());
      (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, xs.numel());
      g::setPrecision(rt::Precision::F32);
      for (bool round : {false, true}) {
        auto got = poisoned<float>(xs.numel());
        auto got16 = poisoned<uint16_t>(xs.numel());
        g::setPrecision(p);
        g::transpose16(x->p, xs, perm, got->p, got16->p, round);
        g::setPrecision(rt::Precision::F32);
        const std::string w =
            "transpose16 " + str(xs) + " perm " + str(perm) + fmt + (round ? " rounded" : "");
        expectEqual(w, got->download(), (round ? wantR : want)->download());
        expectEqual(w + " copy", got16->download(), want16->download());
      }
    }
    // expand16: grouped-query attention's repeated keys ([B, KV, 1, T, D]
    // -> [B, KV, rep, T, D]), rounded as written and not, and the copy only
    // (a null y); against expand then the rounding and the conversion.
    {
      const Dims xs{2, 3, 1, 9, 16}, ys{2, 3, 4, 9, 16};
      auto x = up(randn(xs.numel()));
      auto want = poisoned<float>(ys.numel()), wantR = poisoned<float>(ys.numel());
      auto want16 = poisoned<uint16_t>(ys.numel());
      g::expand<float>(x->p, xs, want->p, ys);
      g::expand<float>(x->p, xs, wantR->p, ys);
      g::setPrecision(p);
      (f16 ? g::roundF16 : g::roundBf16)(wantR->p, ys.numel());
      (f16 ? g::toF16 : g::toBf16)(want->p, want16->p, ys.numel());
      g::setPrecision(rt::Precision::F32);
      for (int mode = 0; mode < 3; ++mode) {
        const bool round = mode == 1, copyOnly = mode == 2;
        auto got = poisoned<float>(ys.numel());
        auto got16 = poisoned<uint16_t>(ys.numel());
        g::setPrecision(p);
        g::expand16(x->p, xs, ys, copyOnly ? nullptr : got->p, got16->p, round);
        g::setPrecision(rt::Precision::F32);
        const std::string w = "expand16 " + str(xs) + " to " + str(ys) + fmt +
                              (round      ? " rounded"
                               : copyOnly ? " copy only"
                                          : "");
        if (!copyOnly)
          expectEqual(w, got->download(), (round ? wantR : want)->download());
        expectEqual(w + " copy", got16->download(), want16->download());
      }
    }
    // transpose16_view: q, k and v read in place from the QKV projection's
    // output (carve-fold-views), against slice + transpose16, bit for bit.
    for (const Dims perm : {Dims{0, 2, 1, 3}, Dims{0, 1, 3, 2}})
      for (int part = 0; part < 3; ++part) {
        const Dims src{2, 33, 360}, sl{2, 33, 120}, vs{2, 33, 3, 40};
        auto x = up(randn(src.numel()));
        auto piece = poisoned<float>(sl.numel());
        g::slice<float>(x->p, src, Dims{0, 0, 120 * part}, Dims{1, 1, 1}, piece->p, sl);
        auto want = poisoned<float>(sl.numel()), got = poisoned<float>(sl.numel());
        auto want16 = poisoned<uint16_t>(sl.numel()), got16 = poisoned<uint16_t>(sl.numel());
        g::setPrecision(p);
        g::transpose16(piece->p, vs, perm, want->p, want16->p, true);
        g::transpose16_view(x->p + 120 * part, vs, Dims{33 * 360, 360, 40, 1}, perm, got->p,
                            got16->p, true);
        g::setPrecision(rt::Precision::F32);
        const std::string w =
            "transpose16_view part " + std::to_string(part) + " perm " + str(perm) + fmt;
        expectEqual(w, got->download(), want->download());
        expectEqual(w + " copy", got16->download(), want16->download());
      }
  }
  // transpose_view: the tiled kernel (the last two swapped), the view kernel,
  // and a view no dimension of which is contiguous (a slice with step 2 on
  // the last axis), against slice + transpose, bit for bit; f32 and i64.
  {
    struct VCase {
      Dims src, starts, steps, sl, perm;
    };
    for (const VCase &c : {VCase{{3, 40, 70}, {1, 3, 5}, {1, 1, 1}, {2, 33, 64}, {0, 2, 1}},
                           VCase{{3, 40, 70}, {0, 2, 0}, {1, 2, 1}, {3, 19, 70}, {1, 0, 2}},
                           VCase{{2, 5, 14}, {0, 0, 1}, {1, 1, 2}, {2, 5, 7}, {2, 0, 1}}}) {
      Dims st;
      st.rank = c.src.rank;
      int64_t acc = 1, off = 0;
      for (int i = c.src.rank - 1; i >= 0; --i) {
        st.d[i] = acc * c.steps.d[i];
        off += c.starts.d[i] * acc;
        acc *= c.src.d[i];
      }
      auto x = up(randn(c.src.numel()));
      auto piece = poisoned<float>(c.sl.numel());
      g::slice<float>(x->p, c.src, c.starts, c.steps, piece->p, c.sl);
      auto want = poisoned<float>(c.sl.numel()), got = poisoned<float>(c.sl.numel());
      g::transpose<float>(piece->p, c.sl, c.perm, want->p);
      g::transpose_view<float>(x->p + off, c.sl, st, c.perm, got->p);
      expectEqual("transpose_view " + str(c.sl) + " strides " + str(st) + " perm " + str(c.perm),
                  got->download(), want->download());
      std::vector<int64_t> xi(c.src.numel());
      for (size_t i = 0; i < xi.size(); ++i)
        xi[i] = (int64_t)i * 7 - 3;
      auto dxi = up(xi);
      auto pi = poisoned<int64_t>(c.sl.numel());
      auto wi = poisoned<int64_t>(c.sl.numel()), gi = poisoned<int64_t>(c.sl.numel());
      g::slice<int64_t>(dxi->p, c.src, c.starts, c.steps, pi->p, c.sl);
      g::transpose<int64_t>(pi->p, c.sl, c.perm, wi->p);
      g::transpose_view<int64_t>(dxi->p + off, c.sl, st, c.perm, gi->p);
      expectEqual("transpose_view i64 " + str(c.sl) + " perm " + str(c.perm), gi->download(),
                  wi->download());
    }
  }
}

//===--- Matmul ------------------------------------------------------------===//

/// Shape of op(x) (the last two dims swapped when t).
Dims opShape(Dims s, bool t) {
  if (t)
    std::swap(s.d[s.rank - 1], s.d[s.rank - 2]);
  return s;
}

Dims matmulShape(const Dims &as, bool ta, const Dims &bs, bool tb) {
  const Dims oa = opShape(as, ta), ob = opShape(bs, tb);
  const Dims batch = broadcastShape(Dims(oa.d, oa.rank - 2), Dims(ob.d, ob.rank - 2));
  Dims y = batch;
  y.d[y.rank++] = oa.d[oa.rank - 2];
  y.d[y.rank++] = ob.d[ob.rank - 1];
  return y;
}

void testMatmulCase(const std::string &name, Dims as, bool ta, Dims bs, bool tb, bool acc) {
  const Dims ys = matmulShape(as, ta, bs, tb);
  const int64_t k = opShape(as, ta).d[as.rank - 1];
  const std::vector<float> a = randn(as.numel()), b = randn(bs.numel());
  const std::vector<float> y0 = randn(ys.numel());
  auto da = up(a), db = up(b);
  auto y = acc ? up(y0) : poisoned<float>(ys.numel());
  g::matmul(da->p, as, ta, db->p, bs, tb, y->p, ys, acc);
  std::vector<double> ad = toDouble(a), bd = toDouble(b), ref = toDouble(y0);
  if (!acc)
    std::fill(ref.begin(), ref.end(), 0.0);
  rt::matmul<double>(ad.data(), as, ta, bd.data(), bs, tb, ref.data(), ys, acc);
  // fp32 accumulation of k unit-normal products (TF32 off): each addition
  // rounds a partial sum of size ~sqrt(k) by 2^-24; 1e-6 * (k + 1) bounds the
  // sum of k of them with room, whatever order cuBLAS adds in.
  expectClose("matmul " + name + " " + str(as) + (ta ? "^T" : "") + " @ " + str(bs) +
                  (tb ? "^T" : "") + (acc ? " +=" : ""),
              y->download(), ref, 1e-5, 1e-6 * double(k + 1));
}

void testMatmul() {
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    testMatmulCase("2-D", opShape({7, 13}, ta), ta, opShape({13, 5}, tb), tb, false);
    testMatmulCase("vector-like", opShape({1, 31}, ta), ta, opShape({31, 1}, tb), tb, false);
    testMatmulCase("batched", opShape({3, 17, 33}, ta), ta, opShape({3, 33, 9}, tb), tb, false);
    // B shared: folds into M without transA, a stride-0 batch with it.
    testMatmulCase("shared B", opShape({2, 3, 17, 33}, ta), ta, opShape({33, 9}, tb), tb, false);
    testMatmulCase("shared A", opShape({17, 33}, ta), ta, opShape({4, 33, 9}, tb), tb, false);
    // Batch dims that do not merge: one strided batch per outer index.
    testMatmulCase("crossed batch", opShape({2, 1, 5, 6}, ta), ta, opShape({1, 3, 6, 4}, tb), tb,
                   false);
    testMatmulCase("accumulate", opShape({2, 3, 17, 33}, ta), ta, opShape({2, 1, 33, 9}, tb), tb,
                   true);
  }
  testMatmulCase("large", {512, 1024}, false, {1024, 768}, false, false);
  testMatmulCase("large", {4, 256, 384}, false, {512, 384}, true, true);

  // k == 0: zeros, or y unchanged when accumulating.
  auto dummy = up(std::vector<float>{0.0f});
  auto y = poisoned<float>(20);
  g::matmul(dummy->p, Dims{5, 0}, false, dummy->p, Dims{0, 4}, false, y->p, Dims{5, 4});
  expectEqual("matmul k=0", y->download(), std::vector<float>(20, 0.0f));
  const std::vector<float> y0 = randn(20);
  auto ya = up(y0);
  g::matmul(dummy->p, Dims{5, 0}, false, dummy->p, Dims{0, 4}, false, ya->p, Dims{5, 4}, true);
  expectEqual("matmul k=0 accumulate", ya->download(), y0);
  g::matmul(dummy->p, Dims{0, 3}, false, dummy->p, Dims{3, 4}, false, y->p, Dims{0, 4});
}

/// Positive values just below the midpoint above a bf16 (8-bit) or fp16
/// (11-bit significand) number: rounding to nearest takes each down by almost
/// half an ulp, so a GEMM that skipped the rounding would come out larger by
/// about k * 2^-9 (bf16) or k * 2^-12 (fp16) per unit product.
std::vector<float> justBelowMidpoint(int64_t n, int bits) {
  std::vector<float> v = uniform(n, 0.5f, 1.5f);
  for (float &x : v) {
    const float r = bits == 8 ? rt::roundToBf16(x) : rt::roundToF16(x);
    const float ulp = std::ldexp(1.0f, std::ilogb(r) - (bits - 1));
    x = r + 0.45f * ulp;
  }
  return v;
}

/// An epilogue GEMM's 16-bit results against a reference rounded the same
/// way: bit for bit on the emulated GPU (one formula, one summation order);
/// on a GPU each element within one 16-bit ulp, or within `atol` where that
/// is not 0 (cuBLASLt evaluates GELU its own way).
void expect16(const std::string &what, const char *against, const std::vector<uint16_t> &got,
              const std::vector<uint16_t> &want, bool bf, float atol) {
  auto value = [bf](uint16_t h) { return bf ? rt::ew::bf16Float(h) : rt::ew::f16Float(h); };
  int64_t far = 0, exact = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t d = std::abs(int64_t(got[i]) - int64_t(want[i]));
    exact += d == 0;
    far += d > 1 && (atol == 0 || std::fabs(value(got[i]) - value(want[i])) > atol);
  }
  ++checks();
#ifdef CARVE_CUDA_EMULATION
  const bool emulated = true;
#else
  const bool emulated = false;
#endif
  if (far || (emulated && exact != (int64_t)got.size())) {
    std::printf("FAIL %s: %lld of %zu elements differ from %s (%lld by more than the bound)\n",
                what.c_str(), (long long)(got.size() - exact), got.size(), against, (long long)far);
    ++failures();
  } else {
    std::printf("ok   %s (%lld of %zu bit for bit)\n", what.c_str(), (long long)exact, got.size());
  }
}

/// bf16 / fp16 inputs: both sides round every input to nearest even and
/// multiply exactly (8- and 11-bit significands: products fit in fp32); only
/// the fp32 additions differ, and tensor cores may truncate rather than round
/// them: each of the k additions errs by at most 2^-23 of a partial sum, so
/// |err| <= k * 2^-22 * sum|a b| covers both sides.
void testMatmulPrecision(rt::Precision p, const char *name) {
  struct Case {
    Dims a;
    bool ta;
    Dims b;
    bool tb;
    bool signs;
  };
  const Case cases[] = {{{64, 256}, false, {256, 96}, false, false},
                        {{3, 256, 40}, true, {3, 33, 256}, true, false},
                        {{2, 3, 16, 256}, false, {256, 24}, false, false},
                        {{64, 256}, false, {96, 256}, true, true}};
  const int bits = p == rt::Precision::BF16 ? 8 : 11;
  const int64_t lt0 = g::matmulBiasEpilogueCalls(), dg0 = g::matmulDgeluEpilogueCalls(),
                bg0 = g::matmulBiasGeluEpilogueCalls();
  for (const Case &c : cases) {
    const Dims ys = matmulShape(c.a, c.ta, c.b, c.tb);
    const int64_t k = 256;
    const std::vector<float> a =
        c.signs ? randn(c.a.numel()) : justBelowMidpoint(c.a.numel(), bits);
    const std::vector<float> b =
        c.signs ? randn(c.b.numel()) : justBelowMidpoint(c.b.numel(), bits);
    auto da = up(a), db = up(b);
    auto y = poisoned<float>(ys.numel());
    g::setPrecision(p);
    g::matmul(da->p, c.a, c.ta, db->p, c.b, c.tb, y->p, ys);
    g::setPrecision(rt::Precision::F32);
    std::vector<float> ref(ys.numel());
    rt::setPrecision(p);
    rt::matmul<float>(a.data(), c.a, c.ta, b.data(), c.b, c.tb, ref.data(), ys);
    rt::setPrecision(rt::Precision::F32);
    // sum|a b| of any output element is at most k * max|a| * max|b|.
    float ma = 0, mb = 0;
    for (float v : a)
      ma = std::max(ma, std::fabs(v));
    for (float v : b)
      mb = std::max(mb, std::fabs(v));
    const double atol = double(k) * std::ldexp(1.0, -22) * double(k) * ma * mb;
    const std::string what = std::string("matmul ") + name + " " + str(c.a) + (c.ta ? "^T" : "") +
                             " @ " + str(c.b) + (c.tb ? "^T" : "") +
                             (c.signs ? " normal" : " near midpoints");
    expectClose(what, y->download(), toDouble(ref), 1e-5, atol);

    // matmul16 (carve-select-kernels' read16): an operand given as its 16-bit
    // tensor, the other as f32, then both: the product of matmul on the
    // tensors' f32 views, bit for bit.
    auto a16 = poisoned<uint16_t>(c.a.numel()), b16 = poisoned<uint16_t>(c.b.numel());
    auto av = poisoned<float>(c.a.numel()), bv = poisoned<float>(c.b.numel());
    const bool bf = p == rt::Precision::BF16;
    (bf ? g::toBf16 : g::toF16)(da->p, a16->p, c.a.numel());
    (bf ? g::toBf16 : g::toF16)(db->p, b16->p, c.b.numel());
    (bf ? g::fromBf16 : g::fromF16)(a16->p, av->p, c.a.numel());
    (bf ? g::fromBf16 : g::fromF16)(b16->p, bv->p, c.b.numel());
    auto yv = poisoned<float>(ys.numel());
    g::setPrecision(p);
    g::matmul(av->p, c.a, c.ta, bv->p, c.b, c.tb, yv->p, ys);
    const std::vector<float> views = yv->download();
    for (int mode = 1; mode <= 3; ++mode) {
      const bool x16 = mode & 1, w16 = mode & 2;
      auto y16 = poisoned<float>(ys.numel());
      g::matmul16(x16 ? static_cast<const void *>(a16->p) : av->p, x16, c.a, c.ta,
                  w16 ? static_cast<const void *>(b16->p) : bv->p, w16, c.b, c.tb, y16->p, ys);
      expectEqual(what + " matmul16" + (x16 ? " a16" : "") + (w16 ? " b16" : ""), y16->download(),
                  views);
    }
    // matmul16_to16 (carve.write16): the product in 16 bits, cuBLAS rounding
    // its fp32 accumulators to nearest even. Against the f32 product rounded
    // the same way: the emulated GPU is bit for bit; on a GPU cuBLAS may take
    // another algorithm for a 16-bit C and sum in another order, so each
    // element may differ by the rounding of an fp32 difference: one unit in
    // the 16-bit format's last place.
    {
      auto out16 = poisoned<uint16_t>(ys.numel());
      g::matmul16_to16(a16->p, true, c.a, c.ta, b16->p, true, c.b, c.tb, out16->p, ys);
      auto dviews = up(views);
      auto ref16 = poisoned<uint16_t>(ys.numel());
      (bf ? g::toBf16 : g::toF16)(dviews->p, ref16->p, ys.numel());
      const std::vector<uint16_t> got = out16->download(), want = ref16->download();
      int64_t far = 0, exact = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const int64_t d = std::abs(int64_t(got[i]) - int64_t(want[i]));
        exact += d == 0;
        far += d > 1; // same sign: adjacent bit patterns are adjacent numbers
      }
      ++checks();
      if (far) {
        std::printf("FAIL %s matmul16_to16: %lld of %zu elements more than one 16-bit ulp from "
                    "the rounded f32 product\n",
                    what.c_str(), (long long)far, got.size());
        ++failures();
      } else {
        std::printf("ok   %s matmul16_to16 (%lld of %zu bit for bit)\n", what.c_str(),
                    (long long)exact, got.size());
      }
    }
    // matmul16_bias (carve-fold-views' "epilogue"): a 16-bit bias added to
    // the fp32 product before its one rounding, by cuBLASLt where the batch
    // folds into one GEMM (A not transposed, B shared: the first and third
    // cases), else by a kernel after matmul16 (the others). Against
    // binary16's add of the bias to the f32 product, rounded: bit for bit on
    // the emulated GPU; on a GPU within one 16-bit ulp, as matmul16_to16.
    {
      const int64_t n = ys.d[ys.rank - 1];
      auto bias = up(randn(n));
      auto bias16 = poisoned<uint16_t>(n);
      (bf ? g::toBf16 : g::toF16)(bias->p, bias16->p, n);
      auto dviews = up(views);
      auto want16 = poisoned<uint16_t>(ys.numel());
      g::binary16(rt::Binary::Add, bias16->p, true, Dims{n}, dviews->p, false, ys, nullptr,
                  want16->p, true, ys);
      auto got16 = poisoned<uint16_t>(ys.numel());
      g::matmul16_bias(a16->p, true, c.a, c.ta, b16->p, true, c.b, c.tb, bias16->p, got16->p, ys);
      expect16(what + " matmul16_bias", "the rounded f32 product plus the bias", got16->download(),
               want16->download(), bf, 0);
    }
    // matmul16_bias_gelu (carve-fold-views' "epilogue" on a GELU): the
    // pre-activation (product plus bias, rounded once) as matmul16_bias
    // writes it, and the tanh GELU of the f32 sum rounded once, by cuBLASLt's
    // GELU_AUX_BIAS where the batch folds into one GEMM and the rows are a
    // multiple of 8 (the first, third and fourth cases), else a kernel after
    // matmul16. Against the f32 product plus the bias and GELU of that on
    // the host: bit for bit on the emulated GPU; on a GPU, where the sum and
    // GELU are cuBLASLt's, within one 16-bit ulp or 1e-3 of the largest
    // value.
    {
      const int64_t n = ys.d[ys.rank - 1], count = ys.numel();
      auto bias = up(randn(n));
      auto bias16 = poisoned<uint16_t>(n);
      (bf ? g::toBf16 : g::toF16)(bias->p, bias16->p, n);
      const std::vector<uint16_t> b16h = bias16->download();
      std::vector<uint16_t> wantPre(count), wantY(count);
      float big = 0;
      for (int64_t i = 0; i < count; ++i) {
        const float bv = bf ? rt::ew::bf16Float(b16h[i % n]) : rt::ew::f16Float(b16h[i % n]);
        const float v = bv + views[i];
        const float y = rt::ew::unary<rt::Unary::GeluTanh>(v);
        wantPre[i] = bf ? rt::ew::bf16Bits(v) : rt::ew::f16Bits(v);
        wantY[i] = bf ? rt::ew::bf16Bits(y) : rt::ew::f16Bits(y);
        big = std::max(big, std::fabs(v));
      }
      auto pre16 = poisoned<uint16_t>(count), y16 = poisoned<uint16_t>(count);
      g::matmul16_bias_gelu(a16->p, true, c.a, c.ta, b16->p, true, c.b, c.tb, bias16->p, pre16->p,
                            y16->p, ys);
      std::vector<uint16_t> got = pre16->download(), want = wantPre;
      const std::vector<uint16_t> gotY = y16->download();
      got.insert(got.end(), gotY.begin(), gotY.end());
      want.insert(want.end(), wantY.begin(), wantY.end());
      expect16(what + " matmul16_bias_gelu", "the host's sum and GELU", got, want, bf, 1e-3f * big);
    }
    // matmul16_dgelu (carve-fold-views' "epilogue" on a GELU gradient): the
    // fp32 product times the tanh GELU's derivative at a 16-bit input,
    // rounded once, by cuBLASLt's DGELU where the batch folds into one GEMM
    // and the rows are a multiple of 8 (the first, third and fourth cases),
    // else matmul16 and unary_grad16. Against unary_grad16 of the f32
    // product: bit for bit on the emulated GPU (one formula, one summation
    // order); on a GPU, where cuBLASLt evaluates the derivative its own way,
    // within one 16-bit ulp or 1e-3 of the largest product.
    {
      const int64_t count = ys.numel();
      auto x = up(randn(count));
      auto x16 = poisoned<uint16_t>(count);
      (bf ? g::toBf16 : g::toF16)(x->p, x16->p, count);
      auto dviews = up(views);
      auto want16 = poisoned<uint16_t>(count);
      g::unary_grad16(rt::Unary::GeluTanh, x16->p, true, dviews->p, nullptr, want16->p, false,
                      count);
      auto got16 = poisoned<uint16_t>(count);
      g::matmul16_dgelu(a16->p, true, c.a, c.ta, b16->p, true, c.b, c.tb, x16->p, got16->p, ys);
      float big = 0;
      for (float v : views)
        big = std::max(big, std::fabs(v));
      expect16(what + " matmul16_dgelu", "unary_grad16 of the product", got16->download(),
               want16->download(), bf, 1e-3f * big);
    }
    g::setPrecision(rt::Precision::F32);
  }
  // The three cases whose batch folds into one GEMM (rows a multiple of 8)
  // ran through cuBLASLt's GELU_AUX_BIAS and DGELU epilogues.
  for (auto [call, calls] :
       {std::pair{"matmul16_bias_gelu", g::matmulBiasGeluEpilogueCalls() - bg0},
        std::pair{"matmul16_dgelu", g::matmulDgeluEpilogueCalls() - dg0}}) {
    ++checks();
    if (calls != 3) {
      std::printf("FAIL %s %s: %lld of 3 calls ran as cuBLASLt matmuls\n", call, name,
                  (long long)calls);
      ++failures();
    } else {
      std::printf("ok   %s %s: 3 calls ran as cuBLASLt matmuls\n", call, name);
    }
  }
  // The three cases whose batch folds into one GEMM ran through cuBLASLt's
  // bias epilogue (stderr says why where it refused); the other, the kernel.
  ++checks();
  const int64_t lt = g::matmulBiasEpilogueCalls() - lt0;
  if (lt != 3) {
    std::printf("FAIL matmul16_bias %s: %lld of 3 calls ran as cuBLASLt matmuls\n", name,
                (long long)lt);
    ++failures();
  } else {
    std::printf("ok   matmul16_bias %s: 3 calls ran as cuBLASLt matmuls\n", name);
  }
}

/// matmul16_to16_bgrad (carve-select-kernels' rule 3i): y = a^T b in 16 bits
/// and the sums over K of a's columns (biasOfA) or b's, the bias gradient,
/// by cuBLASLt's BGRADB / BGRADA epilogue where the pointers are 16-byte
/// aligned, else matmul16_to16 and reduce16 (the last case: a and b one
/// element into their buffers). The product: bit for bit matmul16_to16's on
/// the emulated GPU (one summation order), within one 16-bit ulp on a GPU.
/// The sums, of the 16-bit values: within their one rounding (half an ulp:
/// 2^-8 relative in bf16, 2^-11 in fp16) plus fp32 additions (K * 2^-23 *
/// sum|x|) of the float64 sums of the same 16-bit values.
void testMatmulBiasGrad(rt::Precision p, const char *name) {
  struct Case {
    int64_t K, R, C;
    bool biasOfA, aligned;
  };
  const Case cases[] = {{64, 96, 40, true, true},
                        {256, 128, 32, false, true},
                        {100, 24, 56, true, true},
                        {64, 40, 24, true, false}};
  const bool bf = p == rt::Precision::BF16;
  const int bits = bf ? 8 : 11;
  const int64_t lt0 = g::matmulBiasGradEpilogueCalls();
  int alignedCases = 0;
  for (const Case &c : cases) {
    alignedCases += c.aligned;
    const Dims as{c.K, c.R}, bs{c.K, c.C}, ys{c.R, c.C};
    const int64_t off = c.aligned ? 0 : 1;
    auto a = up(randn(as.numel() + off)), b = up(randn(bs.numel() + off));
    auto a16 = poisoned<uint16_t>(as.numel() + off), b16 = poisoned<uint16_t>(bs.numel() + off);
    (bf ? g::toBf16 : g::toF16)(a->p, a16->p, as.numel() + off);
    (bf ? g::toBf16 : g::toF16)(b->p, b16->p, bs.numel() + off);
    const uint16_t *pa = a16->p + off, *pb = b16->p + off;
    g::setPrecision(p);
    auto want16 = poisoned<uint16_t>(ys.numel());
    g::matmul16_to16(pa, true, as, true, pb, true, bs, false, want16->p, ys);
    auto got16 = poisoned<uint16_t>(ys.numel());
    const int64_t nb = c.biasOfA ? c.R : c.C;
    auto bias16 = poisoned<uint16_t>(nb);
    g::matmul16_to16_bgrad(pa, as, pb, bs, c.biasOfA, got16->p, ys, bias16->p);
    g::setPrecision(rt::Precision::F32);
    const std::string what = std::string("matmul16_to16_bgrad ") + name + " [" +
                             std::to_string(c.K) + " x " + std::to_string(c.R) + "]^T @ [" +
                             std::to_string(c.K) + " x " + std::to_string(c.C) + "], bias of " +
                             (c.biasOfA ? "a" : "b") + (c.aligned ? "" : ", unaligned");
    {
      const std::vector<uint16_t> got = got16->download(), want = want16->download();
      int64_t far = 0, exact = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const int64_t d = std::abs(int64_t(got[i]) - int64_t(want[i]));
        exact += d == 0;
        far += d > 1;
      }
#ifdef CARVE_CUDA_EMULATION
      const bool emulated = true;
#else
      const bool emulated = false;
#endif
      ++checks();
      if (far || (emulated && exact != (int64_t)got.size())) {
        std::printf("FAIL %s: %lld of %zu product elements differ from matmul16_to16's (%lld by "
                    "more than one 16-bit ulp)\n",
                    what.c_str(), (long long)(got.size() - exact), got.size(), (long long)far);
        ++failures();
      } else {
        std::printf("ok   %s: product (%lld of %zu bit for bit)\n", what.c_str(), (long long)exact,
                    got.size());
      }
    }
    {
      // The 16-bit values the sums read, widened on the host.
      auto wide = poisoned<float>(c.biasOfA ? as.numel() : bs.numel());
      (bf ? g::fromBf16 : g::fromF16)(c.biasOfA ? pa : pb, wide->p,
                                      c.biasOfA ? as.numel() : bs.numel());
      const std::vector<float> x = wide->download();
      auto biasWide = poisoned<float>(nb);
      (bf ? g::fromBf16 : g::fromF16)(bias16->p, biasWide->p, nb);
      const std::vector<float> got = biasWide->download();
      int bad = 0;
      double worst = 0;
      for (int64_t j = 0; j < nb; ++j) {
        double sum = 0, abs = 0;
        for (int64_t kk = 0; kk < c.K; ++kk) {
          sum += x[kk * nb + j];
          abs += std::fabs(x[kk * nb + j]);
        }
        const double tol = std::ldexp(std::fabs(sum), -bits) + double(c.K) * std::ldexp(abs, -23);
        const double err = std::fabs(double(got[j]) - sum);
        worst = std::max(worst, tol > 0 ? err / tol : err);
        bad += !(err <= tol);
      }
      ++checks();
      if (bad) {
        std::printf("FAIL %s: %d of %lld bias-gradient sums outside their bound (worst %.3g of "
                    "it)\n",
                    what.c_str(), bad, (long long)nb, worst);
        ++failures();
      } else {
        std::printf("ok   %s: bias gradient within %.2g of its bound\n", what.c_str(), worst);
      }
    }
  }
  // The aligned cases ran through cuBLASLt's epilogue. The emulation offers
  // an algorithm for every shape; a GPU's cuBLASLt may refuse one (stderr
  // says which), and the reduction runs instead: reported, not failed.
  const int64_t lt = g::matmulBiasGradEpilogueCalls() - lt0;
#ifdef CARVE_CUDA_EMULATION
  ++checks();
  if (lt != alignedCases) {
    std::printf("FAIL matmul16_to16_bgrad %s: %lld of %d aligned calls ran through cuBLASLt's "
                "epilogue\n",
                name, (long long)lt, alignedCases);
    ++failures();
  } else {
    std::printf("ok   matmul16_to16_bgrad %s: the %d aligned calls ran through cuBLASLt's "
                "epilogue, the unaligned one did not\n",
                name, alignedCases);
  }
#else
  std::printf("note matmul16_to16_bgrad %s: %lld of %d aligned calls ran through cuBLASLt's "
              "epilogue (the others: its reduction)\n",
              name, (long long)lt, alignedCases);
#endif
}

/// Plan field tf32 (g::setTf32): matmuls of fp32 inputs through TF32 tensor
/// cores. TF32 keeps 10 mantissa bits, as fp16 does: inputs just below the
/// midpoint above an fp16-representable number in [0.5, 1.5] (where TF32's
/// and fp16's numbers coincide) round down by almost half an ulp however the
/// tensor cores round (nearest even, nearest away, or truncation), so the
/// product must equal the exact product of the rounded inputs up to fp32's
/// additions (k * 2^-22 * sum|a b|, as for bf16), and a GEMM that did not
/// round would be about k * 2^-11 per unit product too large. Normal inputs:
/// within the TF32 bound of the exact product of the unrounded ones (each
/// input off by at most 2^-10 relative, truncation included). With tf32
/// off, the same call is fp32 again; bf16 inputs ignore it (bit for bit).
void testMatmulTf32() {
  const int64_t k = 256;
  const Dims as{64, k}, bs{k, 96}, ys{64, 96};
  for (bool signs : {false, true}) {
    const std::vector<float> a = signs ? randn(as.numel()) : justBelowMidpoint(as.numel(), 11);
    const std::vector<float> b = signs ? randn(bs.numel()) : justBelowMidpoint(bs.numel(), 11);
    auto da = up(a), db = up(b);
    auto y = poisoned<float>(ys.numel());
    g::setTf32(true);
    g::matmul(da->p, as, false, db->p, bs, false, y->p, ys);
    g::setTf32(false);
    auto y32 = poisoned<float>(ys.numel());
    g::matmul(da->p, as, false, db->p, bs, false, y32->p, ys);
    std::vector<double> ad = toDouble(a), bd = toDouble(b);
    float ma = 0, mb = 0;
    for (float v : a)
      ma = std::max(ma, std::fabs(v));
    for (float v : b)
      mb = std::max(mb, std::fabs(v));
    const double sumAb = double(k) * ma * mb; // bounds sum|a b| of any element
    const std::string what = std::string("matmul tf32 ") + (signs ? "normal" : "near midpoints");
    std::vector<double> exact(ys.numel());
    rt::matmul<double>(ad.data(), as, false, bd.data(), bs, false, exact.data(), ys);
    if (!signs) {
      std::vector<double> ar(ad.size()), br(bd.size());
      for (size_t i = 0; i < ad.size(); ++i)
        ar[i] = rt::roundToF16(a[i]);
      for (size_t i = 0; i < bd.size(); ++i)
        br[i] = rt::roundToF16(b[i]);
      std::vector<double> rounded(ys.numel());
      rt::matmul<double>(ar.data(), as, false, br.data(), bs, false, rounded.data(), ys);
      expectClose(what + " (the rounded inputs' product)", y->download(), rounded, 1e-5,
                  double(k) * std::ldexp(1.0, -22) * sumAb);
      // Not the unrounded product: about k * 2^-11 away (4 times the bound
      // above here), so a GEMM that skipped the rounding fails that check.
      const std::vector<float> got = y->download();
      double least = 1e30;
      for (size_t i = 0; i < got.size(); ++i)
        least = std::min(least, exact[i] - got[i]);
      ++checks();
      if (!(least > double(k) * std::ldexp(1.0, -22) * sumAb)) {
        std::printf("FAIL %s: the product is within %g of the unrounded inputs' (the inputs were "
                    "not rounded to TF32)\n",
                    what.c_str(), least);
        ++failures();
      } else {
        std::printf("ok   %s: every element at least %g below the unrounded inputs' product\n",
                    what.c_str(), least);
      }
    } else {
      expectClose(what, y->download(), exact, 1e-5,
                  (std::ldexp(1.0, -9) + double(k) * std::ldexp(1.0, -22)) * sumAb);
    }
    expectClose(what + ", tf32 off again (fp32)", y32->download(), exact, 1e-5,
                1e-6 * double(k + 1) * (signs ? 1.0 : sumAb / double(k)));
  }
  // bf16 inputs: TF32 does not apply.
  const std::vector<float> a = randn(as.numel()), b = randn(bs.numel());
  auto da = up(a), db = up(b);
  auto y0 = poisoned<float>(ys.numel()), y1 = poisoned<float>(ys.numel());
  g::setPrecision(rt::Precision::BF16);
  g::matmul(da->p, as, false, db->p, bs, false, y0->p, ys);
  g::setTf32(true);
  g::matmul(da->p, as, false, db->p, bs, false, y1->p, ys);
  g::setTf32(false);
  g::setPrecision(rt::Precision::F32);
  expectEqual("matmul bf16 with tf32 on: as without it", y1->download(), y0->download());
}

//===--- Reduce ------------------------------------------------------------===//

void testReduceCase(const Dims &xs, uint32_t mask, bool withNan = false) {
  std::vector<float> x = randn(xs.numel());
  if (withNan && !x.empty())
    x[x.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  Dims ysd = xs;
  for (int i = 0; i < xs.rank; ++i)
    if ((mask >> i) & 1u)
      ysd.d[i] = 1;
  const int64_t ny = ysd.numel();
  auto dx = up(x);
  const char *names[] = {"sum", "mean", "max"};
  for (int fi = 0; fi < 3; ++fi) {
    const auto f = static_cast<rt::Reduce>(fi);
    if (f == rt::Reduce::Max && xs.numel() == 0)
      continue;
    auto y = poisoned<float>(ny);
    g::reduce(f, dx->p, xs, mask, y->p);
    std::vector<double> xd = toDouble(x), ref(ny);
    rt::reduce<double>(f, xd.data(), xs, mask, ref.data());
    // Both sides add in double, then round once to float (2^-24 relative);
    // max is exact.
    const double rtol = f == rt::Reduce::Max ? 0 : 1.2e-7;
    char m[16];
    std::snprintf(m, sizeof m, "0x%x", mask);
    expectCloseNan(std::string("reduce ") + names[fi] + " " + str(xs) + " axes " + m +
                       (withNan ? " with NaN" : ""),
                   y->download(), ref, rtol, 1e-9);
  }
}

void testReduce() {
  testReduceCase({1000003}, 0x1);       // one row: split over many warps
  testReduceCase({1000003}, 0x1, true); // NaN propagates through max and sums
  testReduceCase({64, 1000}, 0x2);      // rows
  testReduceCase({64, 1000}, 0x1);      // columns
  // Columns over many row segments, the last tile partly full (one launch:
  // the last block of each tile combines its segments, reduceColumnsLastKernel).
  testReduceCase({2048, 300}, 0x1);
  testReduceCase({1, 100000, 3}, 0x2);  // few columns, many rows: split rows
  testReduceCase({3, 4, 5, 6}, 0xA);    // kept, reduced, kept, reduced: general
  testReduceCase({3, 4, 5, 6}, 0x5);    // reduced, kept, reduced, kept: general
  // Batch norm's statistics ([N, C, H, W] over N, H, W): general, each
  // channel's 12800 elements split over 13 warps and their partials combined.
  testReduceCase({32, 16, 20, 20}, 0xD);
  testReduceCase({32, 16, 20, 20}, 0xD, true);
  // General with a strided innermost reduced run (stride 4), split.
  testReduceCase({50, 3, 200, 4}, 0x5);
  // Three reduced groups: a lane's step of 32 carries through several
  // digits (innermost 7 < 32), in one segment and split over 32.
  testReduceCase({4, 3, 5, 2, 7}, 0x15);
  testReduceCase({16, 3, 40, 2, 50}, 0x15);
  testReduceCase({3, 4, 5, 6}, 0x6);    // [O, R, I]
  testReduceCase({3, 4, 5, 6}, 0xF);    // everything
  testReduceCase({3, 4, 5, 6}, 0x0);    // nothing: a copy
  testReduceCase({7, 1, 3}, 0x2);       // only a size-1 axis
  testReduceCase({5, 0}, 0x2);          // empty reduction: 0 and NaN
  testReduceCase({0, 5}, 0x2);          // empty output
}

//===--- Data movement -----------------------------------------------------===//

template <class T> std::vector<T> values(int64_t n) { return castSource<T>(n); }
template <> std::vector<float> values<float>(int64_t n) { return randn(n); }

template <class T> void testTranspose(const Dims &xs, const Dims &perm) {
  const std::vector<T> x = values<T>(xs.numel());
  auto dx = up(x);
  auto y = poisoned<T>(xs.numel());
  g::transpose<T>(dx->p, xs, perm, y->p);
  std::vector<T> ref(xs.numel());
  rt::transpose<T>(x.data(), xs, perm, ref.data());
  expectEqual(std::string("transpose ") + typeName<T>() + " " + str(xs) + " perm " + str(perm),
              y->download(), ref);
}

template <class T> void testSlice() {
  const Dims xs{10, 20, 30}, starts{1, 2, 3}, steps{2, 3, 1}, ys{5, 6, 27};
  const std::vector<T> x = values<T>(xs.numel()), dy = values<T>(ys.numel());
  auto dx = up(x), ddy = up(dy);
  auto y = poisoned<T>(ys.numel());
  auto dgrad = poisoned<T>(xs.numel());
  g::slice<T>(dx->p, xs, starts, steps, y->p, ys);
  g::slice_grad<T>(ddy->p, ys, starts, steps, dgrad->p, xs);
  std::vector<T> ref(ys.numel()), refg(xs.numel());
  rt::slice<T>(x.data(), xs, starts, steps, ref.data(), ys);
  rt::slice_grad<T>(dy.data(), ys, starts, steps, refg.data(), xs);
  expectEqual(std::string("slice ") + typeName<T>(), y->download(), ref);
  expectEqual(std::string("slice_grad ") + typeName<T>(), dgrad->download(), refg);
}

/// `parts` inputs: 3 (one empty), or 12 (three empty, nine in two of
/// concatKernel's launches of up to 8 parts).
template <class T> void testConcat(int axis, int parts = 3) {
  std::vector<Dims> shapes, shapesAxis(parts);
  if (parts == 3)
    shapes = {{4, 2, 5}, {4, 3, 5}, {4, 0, 5}};
  else
    for (int i = 0; i < parts; ++i)
      shapes.push_back({4, i % 5 == 0 ? 0 : i % 4 + 1, 5});
  std::vector<std::vector<T>> xs;
  std::vector<std::unique_ptr<DevBuf<T>>> dxs;
  std::vector<const T *> hostPtrs(parts), devPtrs(parts);
  int64_t total = 0;
  for (int i = 0; i < parts; ++i) {
    // axis 0: the same shapes with the varying dimension moved first.
    shapesAxis[i] = shapes[i];
    if (axis == 0)
      std::swap(shapesAxis[i].d[0], shapesAxis[i].d[1]);
    xs.push_back(values<T>(shapesAxis[i].numel()));
    dxs.push_back(up(xs.back()));
    hostPtrs[i] = xs.back().data();
    devPtrs[i] = dxs.back()->p;
    total += shapesAxis[i].numel();
  }
  auto y = poisoned<T>(total);
  g::concat<T>(parts, devPtrs.data(), shapesAxis.data(), axis, y->p);
  std::vector<T> ref(total);
  rt::concat<T>(parts, hostPtrs.data(), shapesAxis.data(), axis, ref.data());
  expectEqual(std::string("concat ") + typeName<T>() + " axis " + std::to_string(axis) + ", " +
                  std::to_string(parts) + " parts",
              y->download(), ref);
}

/// An im2col index as LowerConvolutions builds it: [kh*kw, Ho*Wo] positions
/// in an h x w image, the taps in the padding at h*w (the appended element).
std::vector<int64_t> im2colIndex(int64_t h, int64_t w, int64_t k, int64_t stride, int64_t pad) {
  const int64_t ho = (h + 2 * pad - k) / stride + 1, wo = (w + 2 * pad - k) / stride + 1;
  std::vector<int64_t> idx;
  for (int64_t ki = 0; ki < k; ++ki)
    for (int64_t kj = 0; kj < k; ++kj)
      for (int64_t i = 0; i < ho; ++i)
        for (int64_t j = 0; j < wo; ++j) {
          const int64_t r = i * stride + ki - pad, c = j * stride + kj - pad;
          idx.push_back(r >= 0 && r < h && c >= 0 && c < w ? r * w + c : h * w);
        }
  return idx;
}

template <class T>
void testGather(const Dims &ts, int axis, const Dims &is, std::vector<int64_t> idx = {}) {
  const int64_t size = ts.d[axis < 0 ? axis + ts.rank : axis];
  const std::vector<T> table = values<T>(ts.numel());
  if (idx.empty())
    idx = randint(is.numel(), -size, size);
  Dims ys;
  const int ax = axis < 0 ? axis + ts.rank : axis;
  for (int i = 0; i < ax; ++i)
    ys.d[ys.rank++] = ts.d[i];
  for (int i = 0; i < is.rank; ++i)
    ys.d[ys.rank++] = is.d[i];
  for (int i = ax + 1; i < ts.rank; ++i)
    ys.d[ys.rank++] = ts.d[i];
  auto dt = up(table);
  auto di = up(idx);
  auto y = poisoned<T>(ys.numel());
  g::gather<T>(dt->p, ts, di->p, is, axis, y->p);
  std::vector<T> ref(ys.numel());
  rt::gather<T>(table.data(), ts, idx.data(), is, axis, ref.data());
  const std::string what =
      std::string(typeName<T>()) + " " + str(ts) + " axis " + std::to_string(axis) + " " + str(is);
  expectEqual("gather " + what, y->download(), ref);

  // Indices repeat (is.numel() > size), so rows get several additions.
  const std::vector<T> dy = values<T>(ys.numel());
  auto ddy = up(dy);
  auto dtab = poisoned<T>(ts.numel());
  g::gather_grad<T>(ddy->p, di->p, is, axis, dtab->p, ts);
  if constexpr (std::is_same_v<T, float>) {
    std::vector<double> dyd = toDouble(dy), refg(ts.numel());
    rt::gather_grad<double>(dyd.data(), idx.data(), is, axis, refg.data(), ts);
    // A float sum of n terms, one after another, is within (n - 1) u sum|x|
    // of the exact sum (u = 2^-24): n is the most positions one row has.
    std::vector<int64_t> reps(size);
    for (int64_t v : idx)
      ++reps[v < 0 ? v + size : v];
    double most = 0, big = 0;
    for (int64_t r : reps)
      most = std::max(most, static_cast<double>(r));
    for (T v : dy)
      big = std::max(big, std::fabs(static_cast<double>(v)));
    const double atol = std::max(1e-6, std::ldexp(most * most * big, -24));
    expectClose("gather_grad " + what, dtab->download(), refg, atol, 1e-6);
  }
  // Each element sums its rows by increasing index position, as the CPU
  // target does: the same floats, bitwise, on every run.
  std::vector<T> refg(ts.numel());
  rt::gather_grad<T>(dy.data(), idx.data(), is, axis, refg.data(), ts);
  expectEqual("gather_grad " + what + " (the CPU target's order)", dtab->download(), refg);
  // gather_grad16 (rule 3h): the same sums, and their 16-bit copies as
  // toBf16 / toF16 write them, from the same kernel.
  if constexpr (std::is_same_v<T, float>) {
    for (rt::Precision p : {rt::Precision::BF16, rt::Precision::F16}) {
      const bool bf = p == rt::Precision::BF16;
      auto t32 = poisoned<float>(ts.numel());
      auto t16 = poisoned<uint16_t>(ts.numel()), want16 = poisoned<uint16_t>(ts.numel());
      g::setPrecision(p);
      g::gather_grad16(ddy->p, di->p, is, axis, t32->p, ts, t16->p);
      (bf ? g::toBf16 : g::toF16)(dtab->p, want16->p, ts.numel());
      g::setPrecision(rt::Precision::F32);
      const std::string w = "gather_grad16 " + what + (bf ? " bf16" : " fp16");
      expectEqual(w + " (sums)", t32->download(), dtab->download());
      expectEqual(w + " (16-bit copy)", t16->download(), want16->download());
    }
  }
}

/// A convolution's GEMMs on its windows without the windows whole in memory
/// (matmul_gathered: the forward and the weight gradient) and without their
/// gradient whole (matmul_gather_grad: the input gradient), in pieces of
/// `perPiece` samples, against the same device's gather + matmul and matmul
/// + gather_grad (bitwise: the same GEMMs on the same values, the same sums)
/// and against the float64 CPU kernels (within fp32 GEMM rounding).
void testConvPieces(int64_t n, int64_t c, int64_t o, int64_t h, int64_t stride, int64_t perPiece,
                    rt::Precision p, int64_t groups = 1) {
  const int64_t hw = h * h, size = hw + 1, k = 3;
  const std::vector<int64_t> idx = im2colIndex(h, h, k, stride, 1);
  const int64_t px = static_cast<int64_t>(idx.size()) / 9, ck = c * 9, ckg = ck / groups;
  const int64_t og = o / groups;
  const bool plain = groups == 1;
  // A grouped convolution's GEMMs have the groups as a second batch
  // dimension, the weight shared by every sample (broadcast).
  const Dims ts{n, c, size}, is{9, px};
  const Dims bs = plain ? Dims{n, ck, px} : Dims{n, groups, ckg, px};
  // The image with its padding element (0) after each channel's pixels.
  std::vector<float> image = randn(ts.numel());
  for (int64_t r = 0; r < n * c; ++r)
    image[r * size + hw] = 0.0f;
  const std::vector<float> w = randn(o * ck), dyv = randn(n * o * px);
  auto dimg = up(image), dw = up(w), ddy = up(dyv);
  auto di = up(idx);
  const int64_t piece = perPiece * ck * px * 4;
  const std::string what = std::string(p == rt::Precision::BF16 ? "bf16 " : "") + "N " +
                           std::to_string(n) + " C " + std::to_string(c) + " O " +
                           std::to_string(o) + " " + std::to_string(h) + "x" + std::to_string(h) +
                           " stride " + std::to_string(stride) + ", " + std::to_string(perPiece) +
                           " per piece" + (plain ? "" : ", " + std::to_string(groups) + " groups");
  g::setPrecision(p);
  // The windows, gathered whole, for the references.
  auto win = poisoned<float>(bs.numel());
  g::gather<float>(dimg->p, ts, di->p, is, 2, win->p);
  // Forward: [O, C*9] @ [N, C*9, px] -> [N, O, px].
  const Dims wd = plain ? Dims{o, ck} : Dims{groups, og, ckg};
  const Dims yf = plain ? Dims{n, o, px} : Dims{n, groups, og, px};
  auto y = poisoned<float>(yf.numel()), ref = poisoned<float>(yf.numel());
  g::matmul_gathered(dw->p, wd, false, dimg->p, ts, di->p, is, bs, false, y->p, yf, piece);
  g::matmul(dw->p, wd, false, win->p, bs, false, ref->p, yf);
  const std::vector<float> yForward = y->download();
  expectEqual("matmul_gathered forward " + what, yForward, ref->download());
  // Weight gradient: [N, O, px] @ [N, C*9, px]^T -> [N, O, C*9].
  const Dims dyd = yf, yg = plain ? Dims{n, o, ck} : Dims{n, groups, og, ckg};
  auto g1 = poisoned<float>(yg.numel()), g2 = poisoned<float>(yg.numel());
  g::matmul_gathered(ddy->p, dyd, false, dimg->p, ts, di->p, is, bs, true, g1->p, yg, piece);
  g::matmul(ddy->p, dyd, false, win->p, bs, true, g2->p, yg);
  expectEqual("matmul_gathered weight gradient " + what, g1->download(), g2->download());
  // Input gradient: [O, C*9]^T @ [N, O, px] -> [N, C*9, px], summed into the image.
  const Dims prod = bs;
  auto dimage = poisoned<float>(ts.numel()), dref = poisoned<float>(ts.numel());
  auto product = poisoned<float>(prod.numel());
  g::matmul_gather_grad(dw->p, wd, true, ddy->p, dyd, false, prod, di->p, is, dimage->p, ts, piece);
  g::matmul(dw->p, wd, true, ddy->p, dyd, false, product->p, prod);
  g::gather_grad<float>(product->p, di->p, is, 2, dref->p, ts);
  const std::vector<float> dImage = dimage->download();
  expectEqual("matmul_gather_grad " + what, dImage, dref->download());
  g::setPrecision(rt::Precision::F32);
  if (p != rt::Precision::F32)
    return;
  // Against float64, by matmul's bound (k + 1) 1e-6: the forward's k = C*9;
  // each pixel of the image gradient sums at most 9 products of k = O. The
  // padding element, which sums every padded tap and which every program
  // slices off, is left out.
  std::vector<double> imgD = toDouble(image), wD = toDouble(w), dyD = toDouble(dyv);
  std::vector<double> fwd(yf.numel()), dimg64(ts.numel());
  rt::matmul_gathered<double>(wD.data(), wd, false, imgD.data(), ts, idx.data(), is, bs, false,
                              fwd.data(), yf);
  expectClose("matmul_gathered forward " + what + " (float64)", yForward, fwd, 1e-5,
              1e-6 * double(ckg + 1));
  rt::matmul_gather_grad<double>(wD.data(), wd, true, dyD.data(), dyd, false, prod, idx.data(), is,
                                 dimg64.data(), ts);
  std::vector<float> dImageNoPad = dImage;
  for (int64_t r = 0; r < n * c; ++r)
    dImageNoPad[r * size + hw] = 0.0f, dimg64[r * size + hw] = 0.0;
  expectClose("matmul_gather_grad " + what + " (float64)", dImageNoPad, dimg64, 1e-5,
              9 * 1e-6 * double(og + 1));
}

void testConvolutionPieces() {
  // One piece, pieces of 2 with a shorter last one, one sample a piece.
  testConvPieces(5, 3, 4, 6, 1, 5, rt::Precision::F32);
  testConvPieces(5, 3, 4, 6, 1, 2, rt::Precision::F32);
  testConvPieces(3, 2, 8, 7, 2, 1, rt::Precision::F32);
  testConvPieces(4, 3, 4, 6, 1, 3, rt::Precision::BF16);
  // Grouped: the weight broadcast over the samples, pieces of the samples.
  testConvPieces(5, 4, 6, 6, 1, 2, rt::Precision::F32, 2);
  // One sample: gathered whole, then matmul.
  testConvPieces(1, 3, 4, 6, 1, 1, rt::Precision::F32);
}

//===--- Convolutions through cuDNN ----------------------------------------===//

struct ConvCase {
  int64_t n, c, h, w, o, kh, kw;
  g::Conv2dGeometry geo;
};

/// The float64 convolution of x and w and its two gradients (of dy), each
/// element with the sum of its terms' magnitudes (the f32 sums' bound).
struct ConvRef {
  std::vector<double> y, ya, dx, dxa, dw, dwa;
};

ConvRef convReference(const ConvCase &k, int64_t ho, int64_t wo, const std::vector<float> &x,
                      const std::vector<float> &w, const std::vector<float> &dy) {
  const int64_t g = k.geo.group, cg = k.c / g, og = k.o / g;
  ConvRef r;
  r.y.assign(k.n * k.o * ho * wo, 0), r.ya = r.y;
  r.dx.assign(k.n * k.c * k.h * k.w, 0), r.dxa = r.dx;
  r.dw.assign(k.o * cg * k.kh * k.kw, 0), r.dwa = r.dw;
  for (int64_t n = 0; n < k.n; ++n)
    for (int64_t o = 0; o < k.o; ++o)
      for (int64_t i = 0; i < ho; ++i)
        for (int64_t j = 0; j < wo; ++j)
          for (int64_t cw = 0; cw < cg; ++cw)
            for (int64_t a = 0; a < k.kh; ++a)
              for (int64_t b = 0; b < k.kw; ++b) {
                const int64_t yy = i * k.geo.strides[0] - k.geo.pads[0] + a * k.geo.dilations[0];
                const int64_t xx = j * k.geo.strides[1] - k.geo.pads[1] + b * k.geo.dilations[1];
                if (yy < 0 || yy >= k.h || xx < 0 || xx >= k.w)
                  continue;
                const int64_t c = (o / og) * cg + cw;
                const int64_t xi = ((n * k.c + c) * k.h + yy) * k.w + xx;
                const int64_t wi = ((o * cg + cw) * k.kh + a) * k.kw + b;
                const int64_t yi = ((n * k.o + o) * ho + i) * wo + j;
                const double xw = double(x[xi]) * w[wi], gw = double(dy[yi]) * w[wi];
                const double gx = double(dy[yi]) * x[xi];
                r.y[yi] += xw, r.ya[yi] += std::fabs(xw);
                r.dx[xi] += gw, r.dxa[xi] += std::fabs(gw);
                r.dw[wi] += gx, r.dwa[wi] += std::fabs(gx);
              }
  return r;
}

/// |got - ref| <= u16 |ref| + K 2^-23 sum|terms| per element: the 16-bit
/// result's rounding (u16 = 2^-8 bf16, 2^-11 fp16, 0 fp32) and the f32 sum
/// of K terms.
void expectConv(const std::string &what, const std::vector<float> &got,
                const std::vector<double> &ref, const std::vector<double> &abs, int64_t terms,
                double u16) {
  ++checks();
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = u16 * std::fabs(ref[i]) + double(terms) * std::ldexp(abs[i], -23) + 1e-30;
    const double err = std::fabs(double(got[i]) - ref[i]);
    if (!(err <= tol)) {
      std::printf("FAIL %s: element %zu is %.9g, reference %.9g (|err| %.3g > %.3g)\n",
                  what.c_str(), i, got[i], ref[i], err, tol);
      ++failures();
      return;
    }
    worst = std::max(worst, err / tol);
  }
  std::printf("ok   %s (%zu elements, worst error %.2f of the bound)\n", what.c_str(), got.size(),
              worst);
}

/// gpu::conv2d, conv2d_grad_input and conv2d_grad_weight (cuDNN's
/// convolution graphs; on the emulation, cudnn_emu.cpp's engines, whose
/// fp32 list puts a TF32 engine first, so a call that took it would fail
/// the fp32 bound) and carve's direct kernels (conv_fallback.h) against the
/// float64 convolution of the inputs as the precision rounds them, and that
/// cuDNN ran every call.
void testConvolutionCase(const ConvCase &k, rt::Precision p) {
  const int64_t g = k.geo.group, cg = k.c / g, og = k.o / g;
  const int64_t ho = (k.h + k.geo.pads[0] + k.geo.pads[2] - k.geo.dilations[0] * (k.kh - 1) - 1) /
                         k.geo.strides[0] +
                     1;
  const int64_t wo = (k.w + k.geo.pads[1] + k.geo.pads[3] - k.geo.dilations[1] * (k.kw - 1) - 1) /
                         k.geo.strides[1] +
                     1;
  const Dims xs{k.n, k.c, k.h, k.w}, ws{k.o, cg, k.kh, k.kw}, ys{k.n, k.o, ho, wo};
  const std::vector<float> x = randn(xs.numel()), w = randn(ws.numel()), dy = randn(ys.numel());
  const bool half = p != rt::Precision::F32, bf = p == rt::Precision::BF16;
  const double u16 = !half ? 0.0 : bf ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  char label[160];
  std::snprintf(label, sizeof label,
                "%s x [%lld, %lld, %lld, %lld] w [%lld, %lld, %lld, %lld] strides %lldx%lld pads "
                "%lld %lld %lld %lld dilations %lldx%lld groups %lld",
                !half ? "fp32"
                : bf  ? "bf16"
                      : "fp16",
                (long long)k.n, (long long)k.c, (long long)k.h, (long long)k.w, (long long)k.o,
                (long long)cg, (long long)k.kh, (long long)k.kw, (long long)k.geo.strides[0],
                (long long)k.geo.strides[1], (long long)k.geo.pads[0], (long long)k.geo.pads[1],
                (long long)k.geo.pads[2], (long long)k.geo.pads[3], (long long)k.geo.dilations[0],
                (long long)k.geo.dilations[1], (long long)g);
  // The references read the operands as the precision rounds them.
  auto rounded = [&](const std::vector<float> &v) {
    if (!half)
      return v;
    auto d = up(v);
    (bf ? g::roundBf16 : g::roundF16)(d->p, static_cast<int64_t>(v.size()));
    return d->download();
  };
  const ConvRef ref = convReference(k, ho, wo, rounded(x), rounded(w), rounded(dy));
  g::setPrecision(p);
  auto dx_ = up(x), dw_ = up(w), ddy = up(dy);
  int64_t f0, d0, w0, f1, d1, w1;
  g::cudnnConvolutionCalls(f0, d0, w0);
  auto y = poisoned<float>(ys.numel()), gx = poisoned<float>(xs.numel());
  auto gw = poisoned<float>(ws.numel());
  g::conv2d(dx_->p, false, xs, dw_->p, false, ws, k.geo, y->p, nullptr, ys);
  g::conv2d_grad_input(ddy->p, false, ys, dw_->p, false, ws, k.geo, gx->p, nullptr, xs);
  g::conv2d_grad_weight(dx_->p, false, xs, ddy->p, false, ys, k.geo, gw->p, nullptr, ws);
  g::cudnnConvolutionCalls(f1, d1, w1);
  const std::string what = std::string(label);
  const std::vector<float> yv = y->download(), gxv = gx->download(), gwv = gw->download();
  expectConv("conv2d " + what, yv, ref.y, ref.ya, cg * k.kh * k.kw, u16);
  expectConv("conv2d_grad_input " + what, gxv, ref.dx, ref.dxa, og * k.kh * k.kw, u16);
  expectConv("conv2d_grad_weight " + what, gwv, ref.dw, ref.dwa, k.n * ho * wo, u16);
  if (half) {
    // The operands given as their 16-bit tensors (carve.read16): the same
    // bits as the f32 operands the call rounds itself.
    auto as16 = [&](const std::unique_ptr<DevBuf<float>> &v, int64_t n) {
      auto c = poisoned<uint16_t>(n);
      (bf ? g::toBf16 : g::toF16)(v->p, c->p, n);
      return c;
    };
    auto x16 = as16(dx_, xs.numel()), w16 = as16(dw_, ws.numel()), dy16 = as16(ddy, ys.numel());
    auto y3 = poisoned<float>(ys.numel()), gx3 = poisoned<float>(xs.numel());
    auto gw3 = poisoned<float>(ws.numel());
    // The results' 16-bit copies written by the calls (rule 3h), alone (no
    // f32 result) or with the f32 result: the 16-bit values of the results.
    auto y16 = poisoned<uint16_t>(ys.numel()), gx16 = poisoned<uint16_t>(xs.numel());
    auto gw16 = poisoned<uint16_t>(ws.numel());
    g::conv2d(x16->p, true, xs, w16->p, true, ws, k.geo, y3->p, y16->p, ys);
    g::conv2d_grad_input(dy16->p, true, ys, w16->p, true, ws, k.geo, nullptr, gx16->p, xs);
    g::conv2d_grad_weight(x16->p, true, xs, ddy->p, false, ys, k.geo, gw3->p, gw16->p, ws);
    g::conv2d_grad_input(dy16->p, true, ys, w16->p, true, ws, k.geo, gx3->p, nullptr, xs);
    expectEqual("conv2d from 16-bit x and w " + what, y3->download(), yv);
    expectEqual("conv2d_grad_input from 16-bit dy and w " + what, gx3->download(), gxv);
    expectEqual("conv2d_grad_weight from 16-bit x " + what, gw3->download(), gwv);
    expectEqual("conv2d's 16-bit result " + what, y16->download(), as16(y, ys.numel())->download());
    expectEqual("conv2d_grad_input's 16-bit result alone " + what, gx16->download(),
                as16(gx, xs.numel())->download());
    expectEqual("conv2d_grad_weight's 16-bit result " + what, gw16->download(),
                as16(gw, ws.numel())->download());
  }
  ++checks();
  if (g::cudnnAttentionBuilt() && (f1 - f0 != 1 || d1 - d0 != 1 || w1 - w0 != 1)) {
    std::printf("FAIL %s: cuDNN ran %lld forward, %lld data and %lld filter calls, not 1 each\n",
                what.c_str(), (long long)(f1 - f0), (long long)(d1 - d0), (long long)(w1 - w0));
    ++failures();
  }
  // carve's direct kernels, as conv_cudnn.cpp runs them where cuDNN refuses.
  g::ConvDims cd;
  cd.n = k.n, cd.c = k.c, cd.h = k.h, cd.w = k.w, cd.o = k.o, cd.kh = k.kh, cd.kw = k.kw;
  cd.ho = ho, cd.wo = wo, cd.group = g;
  for (int i = 0; i < 2; ++i)
    cd.stride[i] = k.geo.strides[i], cd.pad[i] = k.geo.pads[i], cd.dil[i] = k.geo.dilations[i];
  auto y2 = poisoned<float>(ys.numel()), gx2 = poisoned<float>(xs.numel());
  auto gw2 = poisoned<float>(ws.numel());
  g::conv2dByCarve(g::ConvKind::Forward, dx_->p, dw_->p, y2->p, cd, static_cast<int>(p));
  g::conv2dByCarve(g::ConvKind::Data, ddy->p, dw_->p, gx2->p, cd, static_cast<int>(p));
  g::conv2dByCarve(g::ConvKind::Filter, dx_->p, ddy->p, gw2->p, cd, static_cast<int>(p));
  expectConv("carve's conv2d " + what, y2->download(), ref.y, ref.ya, cg * k.kh * k.kw, u16);
  expectConv("carve's conv2d_grad_input " + what, gx2->download(), ref.dx, ref.dxa,
             og * k.kh * k.kw, u16);
  expectConv("carve's conv2d_grad_weight " + what, gw2->download(), ref.dw, ref.dwa, k.n * ho * wo,
             u16);
  g::setPrecision(rt::Precision::F32);
}

void testConvolutionCudnn() {
  const ConvCase cases[] = {
      {2, 3, 8, 8, 4, 3, 3, {{1, 1}, {1, 1, 1, 1}, {1, 1}, 1}},   // 3x3, padding 1
      {2, 4, 9, 7, 6, 3, 3, {{2, 2}, {1, 0, 0, 1}, {1, 1}, 1}},   // stride 2, asymmetric padding
      {1, 2, 10, 10, 3, 3, 3, {{1, 1}, {2, 2, 2, 2}, {2, 2}, 1}}, // dilation 2
      {2, 4, 6, 6, 6, 3, 3, {{1, 1}, {1, 1, 1, 1}, {1, 1}, 2}},   // 2 groups
      {2, 8, 6, 6, 8, 3, 3, {{1, 1}, {1, 1, 1, 1}, {1, 1}, 8}},   // depthwise
      {2, 4, 8, 8, 8, 1, 1, {{2, 2}, {0, 0, 0, 0}, {1, 1}, 1}},   // 1x1 stride 2 (a shortcut)
      {1, 3, 16, 16, 8, 7, 7, {{2, 2}, {3, 3, 3, 3}, {1, 1}, 1}}, // ResNet's stem
  };
  for (rt::Precision p : {rt::Precision::F32, rt::Precision::BF16, rt::Precision::F16})
    for (const ConvCase &k : cases)
      testConvolutionCase(k, p);
}

/// NonZero at its static bound, against the CPU kernel: the coordinates of
/// the non-zeros in row-major order (one block's threads count their slices
/// and take their offsets from a scan), zeros past the last.
template <class T> void testNonzero(const Dims &xs) {
  std::vector<T> x = values<T>(xs.numel());
  for (int64_t i = 0; i < xs.numel(); ++i)
    if ((i * 7919) % 5 < 2 || (i > xs.numel() / 2 && i < xs.numel() / 2 + 40))
      x[i] = T(0);
  auto dx = up(x);
  auto y = poisoned<int64_t>(xs.rank * xs.numel());
  g::nonzero<T>(dx->p, xs, y->p);
  std::vector<int64_t> ref(xs.rank * xs.numel());
  rt::nonzero<T>(x.data(), xs, ref.data());
  expectEqual(std::string("nonzero ") + typeName<T>() + " " + str(xs), y->download(), ref);
}

template <class T> void testExpand(const Dims &xs, const Dims &ys) {
  const std::vector<T> x = values<T>(xs.numel());
  auto dx = up(x);
  auto y = poisoned<T>(ys.numel());
  g::expand<T>(dx->p, xs, y->p, ys);
  std::vector<T> ref(ys.numel());
  rt::expand<T>(x.data(), xs, ref.data(), ys);
  expectEqual(std::string("expand ") + typeName<T>() + " " + str(xs) + " -> " + str(ys),
              y->download(), ref);
}

template <class T> void testDataMovement() {
  testTranspose<T>({2, 3, 4, 5}, {0, 2, 1, 3}); // innermost stays: a strided gather
  testTranspose<T>({2, 3, 4, 5}, {3, 1, 2, 0}); // tiles
  testTranspose<T>({1000, 777}, {1, 0});        // tiles, partial at both edges
  testTranspose<T>({33, 1, 65}, {2, 1, 0});
  testTranspose<T>({7}, {0});
  testSlice<T>();
  testConcat<T>(1);
  testConcat<T>(0);
  testConcat<T>(1, 12);
  testConcat<T>(0, 12);
  testGather<T>({50, 16}, 0, {7, 13});
  testGather<T>({4, 50, 3}, 1, {9});
  testGather<T>({4, 5, 6}, -1, {2, 3});
  // An embedding's shape: one table, split into row ranges (gatherGradParts).
  testGather<T>({1000, 32}, 0, {2048});
  // One element per index (inner 1): the inverted-index path. Rows indexed
  // about 125 times each (heapsort), and a 3x3 convolution's windows with
  // padding 1 and with stride 2 on [N*C, H*W + 1] (the padding element's
  // row has more than 32 positions).
  testGather<T>({6, 40}, 1, {5000});
  testGather<T>({6, 101}, 1, {9, 100}, im2colIndex(10, 10, 3, 1, 1));
  testGather<T>({5, 82}, -1, {9, 25}, im2colIndex(9, 9, 3, 2, 1));
  testExpand<T>({3, 1, 5}, {2, 3, 4, 5});
  testNonzero<T>({5, 7, 11});
  testNonzero<T>({3001}); // more elements than the block has threads
  testExpand<T>({}, {1000003});
}

void testGatherSharded() {
  const Dims ts{10, 8}, is{6, 7};
  const int64_t rowOffset = 20, globalRows = 50;
  const std::vector<float> table = randn(ts.numel());
  std::vector<int64_t> idx = randint(is.numel(), -globalRows, globalRows);
  for (int64_t i = 0; i < 10; ++i) // make sure some land in the local rows, twice
    idx[i] = rowOffset + (i % 5);
  idx[10] = rowOffset - globalRows + 3; // negative, local
  auto dt = up(table);
  auto di = up(idx);
  const Dims ys{6, 7, 8};
  auto y = poisoned<float>(ys.numel());
  g::gather_sharded(dt->p, ts, rowOffset, globalRows, di->p, is, y->p);
  std::vector<double> td = toDouble(table), ref(ys.numel());
  rt::gather_sharded<double>(td.data(), ts, rowOffset, globalRows, idx.data(), is, ref.data());
  expectClose("gather_sharded", y->download(), ref, 0, 0);
  const std::vector<float> dy = randn(ys.numel());
  auto ddy = up(dy);
  auto dtab = poisoned<float>(ts.numel());
  g::gather_sharded_grad(ddy->p, di->p, is, rowOffset, globalRows, dtab->p, ts);
  std::vector<double> dyd = toDouble(dy), refg(ts.numel());
  rt::gather_sharded_grad<double>(dyd.data(), idx.data(), is, rowOffset, globalRows, refg.data(),
                                  ts);
  expectClose("gather_sharded_grad", dtab->download(), refg, 1e-6, 1e-6);
  std::vector<float> reff(ts.numel());
  rt::gather_sharded_grad<float>(dy.data(), idx.data(), is, rowOffset, globalRows, reff.data(), ts);
  expectEqual("gather_sharded_grad (the CPU target's order)", dtab->download(), reff);
}

//===--- Tensor parallelism ------------------------------------------------===//

/// A stand-in for rank `me` of a group of `n`, usable with host pointers (for
/// the CPU reference) and device pointers alike (cudaMemcpyDefault). Peers'
/// all-gather contributions are given; for reduce-scatter and all-to-all
/// every peer is taken to hold the same tensor as this rank, so the result
/// still depends on which block of the packed buffer goes where.
class FakeComm : public rt::Communicator {
public:
  FakeComm(int n, int me, std::vector<const void *> peers) : n(n), me(me), peers(peers) {}
  int rank() const override { return me; }
  int size() const override { return n; }
  rt::CommHandle allReduceAsync(void *, int64_t, rt::CommType, rt::ReduceOp) override {
    return unsupported("allReduce");
  }
  rt::CommHandle allGatherAsync(const void *send, void *recv, int64_t nPerRank,
                                rt::CommType t) override {
    const int64_t bytes = nPerRank * rt::commTypeBytes(t);
    sync();
    for (int r = 0; r < n; ++r)
      GT_CUDA(cudaMemcpy(static_cast<char *>(recv) + r * bytes, r == me ? send : peers[r], bytes,
                         cudaMemcpyDefault));
    sync();
    return {};
  }
  rt::CommHandle reduceScatterAsync(const void *send, void *recv, const int64_t *counts,
                                    rt::CommType t, rt::ReduceOp op) override {
    if (t != rt::CommType::F32)
      return unsupported("reduceScatter of a type other than F32");
    int64_t off = 0;
    for (int r = 0; r < me; ++r)
      off += counts[r];
    std::vector<float> block(counts[me]);
    sync();
    GT_CUDA(cudaMemcpy(block.data(), static_cast<const float *>(send) + off,
                       block.size() * sizeof(float), cudaMemcpyDefault));
    if (op == rt::ReduceOp::Sum)
      for (float &v : block)
        v *= static_cast<float>(n);
    GT_CUDA(cudaMemcpy(recv, block.data(), block.size() * sizeof(float), cudaMemcpyDefault));
    sync();
    return {};
  }
  rt::CommHandle allToAllAsync(const void *send, void *recv, int64_t nPerRank,
                               rt::CommType t) override {
    const int64_t bytes = nPerRank * rt::commTypeBytes(t);
    sync();
    for (int r = 0; r < n; ++r)
      GT_CUDA(cudaMemcpy(static_cast<char *>(recv) + r * bytes,
                         static_cast<const char *>(send) + me * bytes, bytes, cudaMemcpyDefault));
    sync();
    return {};
  }
  rt::CommHandle sendAsync(const void *, int64_t, int, int) override { return unsupported("send"); }
  rt::CommHandle recvAsync(void *, int64_t, int, int) override { return unsupported("recv"); }
  void wait(rt::CommHandle) override {}
  void broadcast(void *, int64_t, int) override { unsupported("broadcast"); }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override {
    unsupported("split");
    return nullptr;
  }
  std::vector<int> worldRanks() const override {
    std::vector<int> r(n);
    for (int i = 0; i < n; ++i)
      r[i] = i;
    return r;
  }

private:
  rt::CommHandle unsupported(const char *what) {
    std::printf("FAIL FakeComm: %s is not used by these tests\n", what);
    std::exit(1);
  }
  int n, me;
  std::vector<const void *> peers;
};

void testShards() {
  const Dims full{6, 12, 5};
  const int parts = 2;
  const std::vector<float> x = randn(full.numel());
  auto dx = up(x);
  for (int dim = 0; dim < 3; ++dim) {
    for (int64_t groups : {int64_t(1), int64_t(3)}) {
      if (full.d[dim] % (groups * parts) != 0)
        continue;
      const rt::Split s{dim, groups, parts};
      const Dims local = rt::shardShape(full, s);
      const std::string what = "dim " + std::to_string(dim) + " groups " + std::to_string(groups);
      for (int index = 0; index < parts; ++index) {
        auto y = poisoned<float>(local.numel());
        g::takeShard(dx->p, full, s, index, y->p, 4);
        std::vector<float> ref(local.numel());
        rt::takeShard(x.data(), full, s, index, ref.data(), 4);
        expectEqual("takeShard " + what + " piece " + std::to_string(index), y->download(), ref);

        const std::vector<float> piece = randn(local.numel());
        auto dp = up(piece);
        auto dfull = up(x);
        g::placeShard(dp->p, local, s, index, dfull->p, 4);
        std::vector<float> reff = x;
        rt::placeShard(piece.data(), local, s, index, reff.data(), 4);
        expectEqual("placeShard " + what + " piece " + std::to_string(index), dfull->download(),
                    reff);
      }
      // Rank 1 of 2: rank 0's piece comes from the fake peer.
      const int me = 1;
      std::vector<float> pieceHost[2];
      std::unique_ptr<DevBuf<float>> pieceDev[2];
      for (int r = 0; r < parts; ++r) {
        pieceHost[r].resize(local.numel());
        rt::takeShard(x.data(), full, s, r, pieceHost[r].data(), 4);
        pieceDev[r] = up(pieceHost[r]);
      }
      FakeComm devComm(parts, me, {pieceDev[0]->p, pieceDev[1]->p});
      FakeComm hostComm(parts, me, {pieceHost[0].data(), pieceHost[1].data()});
      auto gathered = poisoned<float>(full.numel());
      g::allGatherSplit(devComm, pieceDev[me]->p, local, s, gathered->p, rt::CommType::F32);
      std::vector<float> refg(full.numel());
      rt::allGatherSplit(hostComm, pieceHost[me].data(), local, s, refg.data(), rt::CommType::F32);
      expectEqual("allGatherSplit " + what, gathered->download(), refg);

      auto scattered = poisoned<float>(local.numel());
      g::reduceScatterSplit(devComm, dx->p, full, s, scattered->p, rt::CommType::F32,
                            rt::ReduceOp::Sum);
      std::vector<float> refs(local.numel());
      rt::reduceScatterSplit(hostComm, x.data(), full, s, refs.data(), rt::CommType::F32,
                             rt::ReduceOp::Sum);
      expectEqual("reduceScatterSplit " + what, scattered->download(), refs);

      for (int toDim = 0; toDim < 3; ++toDim) {
        if (toDim == dim || local.d[toDim] % parts != 0)
          continue;
        const rt::Split to{toDim, 1, parts};
        const Dims outShape = rt::shardShape(rt::fullShape(local, s), to);
        auto out = poisoned<float>(outShape.numel());
        g::allToAllSplit(devComm, pieceDev[me]->p, local, s, to, out->p, rt::CommType::F32);
        std::vector<float> refa(outShape.numel());
        rt::allToAllSplit(hostComm, pieceHost[me].data(), local, s, to, refa.data(),
                          rt::CommType::F32);
        expectEqual("allToAllSplit " + what + " to dim " + std::to_string(toDim), out->download(),
                    refa);
      }
    }
  }
}

//===--- Optimizer ---------------------------------------------------------===//

void testOptimizer() {
  const int64_t n = 1000003;
  const std::vector<float> p0 = randn(n), gr = randn(n), m0 = randn(n, 0.1f);
  std::vector<float> v0 = uniform(n, 0.0f, 0.01f);
  auto dg = up(gr);
  // Bit-identical: the same float operations in the same order as optim.cpp.
  for (int variant = 0; variant < 6; ++variant) {
    const double momentum = variant == 0 ? 0.0 : 0.9;
    const double dampening = variant == 2 ? 0.1 : 0.0;
    const double wd = variant == 3 || variant == 5 ? 0.01 : 0.0;
    const bool nesterov = variant >= 4, first = variant == 1 || variant == 4;
    auto dp = up(p0), db = up(m0);
    g::sgdUpdate(dp->p, dg->p, db->p, n, 0.05, momentum, dampening, wd, nesterov, first);
    std::vector<float> p = p0, b = m0;
    rt::sgdUpdate(p.data(), gr.data(), b.data(), n, 0.05, momentum, dampening, wd, nesterov, first);
    const std::string what = "sgd variant " + std::to_string(variant);
    expectEqual(what + " param", dp->download(), p);
    expectEqual(what + " momentum", db->download(), b);
  }
  for (int64_t step : {int64_t(1), int64_t(7)}) {
    auto dp = up(p0), dm = up(m0), dv = up(v0);
    g::adamwUpdate(dp->p, dg->p, dm->p, dv->p, n, 3e-4, 0.9, 0.95, 1e-8, 0.1, step);
    std::vector<float> p = p0, m = m0, v = v0;
    rt::adamwUpdate(p.data(), gr.data(), m.data(), v.data(), n, 3e-4, 0.9, 0.95, 1e-8, 0.1, step);
    const std::string what = "adamw step " + std::to_string(step);
    expectEqual(what + " param", dp->download(), p);
    expectEqual(what + " exp_avg", dm->download(), m);
    expectEqual(what + " exp_avg_sq", dv->download(), v);
  }
  // adamwUpdateCopy16: the same update, and the master's bf16 / fp16 copy
  // exactly as toBf16 / toF16 of the updated master write it.
  for (bool f16 : {false, true}) {
    auto dp = up(p0), dm = up(m0), dv = up(v0);
    auto copy = poisoned<uint16_t>(n), ref16 = poisoned<uint16_t>(n);
    g::adamwUpdateCopy16(dp->p, dg->p, dm->p, dv->p, n, 3e-4, 0.9, 0.95, 1e-8, 0.1, 3, copy->p,
                         f16);
    auto rp = up(p0), rm = up(m0), rv = up(v0);
    g::adamwUpdate(rp->p, dg->p, rm->p, rv->p, n, 3e-4, 0.9, 0.95, 1e-8, 0.1, 3);
    (f16 ? g::toF16 : g::toBf16)(rp->p, ref16->p, n);
    const std::string what = std::string("adamwUpdateCopy16 ") + (f16 ? "fp16" : "bf16");
    expectEqual(what + " param", dp->download(), rp->download());
    expectEqual(what + " exp_avg", dm->download(), rm->download());
    expectEqual(what + " exp_avg_sq", dv->download(), rv->download());
    expectEqual(what + " copy", copy->download(), ref16->download());
  }
  {
    auto dp = up(p0);
    g::addInPlace(dp->p, dg->p, n);
    std::vector<float> p = p0;
    rt::addInPlace(p.data(), gr.data(), n);
    expectEqual("addInPlace", dp->download(), p);
    g::scaleInPlace(dp->p, n, 0.37f);
    rt::scaleInPlace(p.data(), n, 0.37f);
    expectEqual("scaleInPlace", dp->download(), p);
  }
  for (int64_t len : {int64_t(0), int64_t(1), int64_t(1000), n}) {
    const double got = g::sumSquares(dg->p, len), ref = rt::sumSquares(gr.data(), len);
    // Double sums of float squares (exact in double) in two orders.
    expectClose("sumSquares n=" + std::to_string(len), {static_cast<float>(got)}, {ref}, 1e-7, 0);
    ++checks();
    // Positive terms: two orders differ by at most n * 2^-53 relative.
    if (std::fabs(got - ref) > 1e-10 * std::fabs(ref)) {
      std::printf("FAIL sumSquares n=%lld in double: %.17g, reference %.17g\n", (long long)len, got,
                  ref);
      ++failures();
    }
  }
  // The step's gradient norm: sums added on the device, in order, equal the
  // host's `sq += sumSquares(g)` bit for bit (the same double additions).
  {
    double *acc = g::normAccumulators();
    double host = 0, other = 0;
    for (int64_t len : {int64_t(1000), n, int64_t(0), int64_t(7)}) {
      g::sumSquaresAdd(dg->p, len, acc + 1);
      host += g::sumSquares(dg->p, len);
    }
    g::sumSquaresAdd(dg->p, 3, acc);
    other += g::sumSquares(dg->p, 3);
    double got[2] = {-1, -1};
    g::readScalars(acc, got, 2);
    ++checks();
    if (got[0] != other || got[1] != host) {
      std::printf("FAIL sumSquaresAdd: device sums %.17g, %.17g; host sums %.17g, %.17g\n",
                  got[0], got[1], other, host);
      ++failures();
    }
    acc = g::normAccumulators();
    g::readScalars(acc, got, 2);
    ++checks();
    if (got[0] != 0 || got[1] != 0) {
      std::printf("FAIL normAccumulators: not zeroed (%.17g, %.17g)\n", got[0], got[1]);
      ++failures();
    }
  }
}

/// 16-bit gradients (optim.h Grad16, carve-store-grads16): every function on
/// the device equals the CPU's bit for bit, in both formats, at an offset.
void testOptimizer16() {
  const int64_t n = 100003;
  const std::vector<float> p0 = randn(n), gr = randn(n, 0.01f), m0 = randn(n, 0.1f);
  const std::vector<float> v0 = uniform(n, 0.0f, 0.01f);
  for (bool f16 : {false, true}) {
    const std::string fmt = f16 ? " (fp16)" : " (bf16)";
    std::vector<uint16_t> g16(n), h16(n);
    for (int64_t i = 0; i < n; ++i) {
      g16[i] = f16 ? rt::ew::f16Bits(gr[i]) : rt::ew::bf16Bits(gr[i]);
      h16[i] = f16 ? rt::ew::f16Bits(p0[i]) : rt::ew::bf16Bits(p0[i]);
    }
    auto dg = up(g16);
    const g::Grad16 dG{dg->p, f16};
    const rt::Grad16 hG{g16.data(), f16};
    {
      auto dp = up(p0), dm = up(m0), dv = up(v0);
      g::adamwUpdate(dp->p, dG + 3, dm->p, dv->p, n - 3, 3e-4, 0.9, 0.95, 1e-8, 0.1, 2);
      std::vector<float> p = p0, m = m0, v = v0;
      rt::adamwUpdate(p.data(), hG + 3, m.data(), v.data(), n - 3, 3e-4, 0.9, 0.95, 1e-8, 0.1, 2);
      expectEqual("adamw 16-bit gradient" + fmt, dp->download(), p);
      expectEqual("adamw 16-bit gradient exp_avg_sq" + fmt, dv->download(), v);
    }
    {
      auto dp = up(p0), db = up(m0);
      g::sgdUpdate(dp->p, dG, db->p, n, 0.05, 0.9, 0.1, 0.01, true, false);
      std::vector<float> p = p0, b = m0;
      rt::sgdUpdate(p.data(), hG, b.data(), n, 0.05, 0.9, 0.1, 0.01, true, false);
      expectEqual("sgd 16-bit gradient" + fmt, dp->download(), p);
    }
    {
      // Widen into fp32, accumulate into fp32, accumulate and scale in 16 bits.
      auto dw = up(p0);
      g::widen(dG, dw->p, n);
      g::addInPlace(dw->p, dG, n);
      std::vector<float> w = p0;
      rt::widen(hG, w.data(), n);
      rt::addInPlace(w.data(), hG, n);
      expectEqual("widen + addInPlace into fp32" + fmt, dw->download(), w);
      auto dh = up(h16);
      g::addInPlace(g::Grad16{dh->p, f16}, dG, n);
      g::scaleInPlace(g::Grad16{dh->p, f16}, n, 0.37f);
      std::vector<uint16_t> h = h16;
      rt::addInPlace(rt::Grad16{h.data(), f16}, hG, n);
      rt::scaleInPlace(rt::Grad16{h.data(), f16}, n, 0.37f);
      expectEqual("16-bit addInPlace + scaleInPlace" + fmt, dh->download(), h);
    }
    {
      double *acc = g::normAccumulators();
      g::sumSquaresAdd(dG, n, acc);
      double got[2] = {-1, -1};
      g::readScalars(acc, got, 2);
      const double host = g::sumSquares(dG, n), ref = rt::sumSquares(hG, n);
      ++checks();
      if (got[0] != host || std::fabs(host - ref) > 1e-10 * std::fabs(ref)) {
        std::printf("FAIL sumSquares 16-bit%s: device %.17g and %.17g, host %.17g\n", fmt.c_str(),
                    got[0], host, ref);
        ++failures();
      }
    }
  }
}

/// adamwMulti and sumSquaresMulti (the step's multi-tensor tail): every
/// tensor of a mixed table -- f32, bf16 and fp16 gradients, with and without
/// a 16-bit copy, an empty one, sizes from 1 to past one block's grid --
/// bit for bit the per-tensor calls; the norm's accumulators equal the
/// per-term sumSquaresAdd sequence exactly. Then the same table again (kept
/// on the device) with other values, and a changed table (uploaded again).
void testOptimizerMulti() {
  const std::vector<int64_t> sizes = {1000003, 1, 0, 4097, 300001, 77};
  const int count = static_cast<int>(sizes.size());
  struct Case {
    std::unique_ptr<DevBuf<float>> p, m, v, g32;
    std::unique_ptr<DevBuf<uint16_t>> g16, copy;
    std::vector<float> p0, m0, v0, gr;
    int kind; // 0 f32, 1 bf16, 2 fp16 gradient
    bool withCopy;
  };
  std::vector<Case> cs(count);
  for (int i = 0; i < count; ++i) {
    const int64_t n = sizes[i];
    Case &c = cs[i];
    c.kind = i % 3;
    c.withCopy = i % 2 == 0;
    c.p0 = randn(n);
    c.m0 = randn(n, 0.1f);
    c.v0 = uniform(n, 0.0f, 0.01f);
    c.gr = randn(n, 0.01f);
    std::vector<uint16_t> g16(n);
    for (int64_t j = 0; j < n; ++j)
      g16[j] = c.kind == 2 ? rt::ew::f16Bits(c.gr[j]) : rt::ew::bf16Bits(c.gr[j]);
    c.g32 = up(c.gr);
    c.g16 = up(g16);
    c.copy = poisoned<uint16_t>(n);
    c.p = poisoned<float>(n), c.m = poisoned<float>(n), c.v = poisoned<float>(n);
  }
  for (int round = 0; round < 3; ++round) {
    // Round 2 drops the last tensor: a changed table.
    const int used = round == 2 ? count - 1 : count;
    const int64_t step = 3 + round;
    std::vector<g::AdamwTensor> t;
    std::vector<g::SquaresTerm> terms;
    std::vector<std::unique_ptr<DevBuf<float>>> rp, rm, rv;
    std::vector<std::unique_ptr<DevBuf<uint16_t>>> rcopy;
    double *acc = g::normAccumulators();
    for (int i = 0; i < used; ++i) {
      Case &c = cs[i];
      const int64_t n = sizes[i];
      c.p->upload(c.p0), c.m->upload(c.m0), c.v->upload(c.v0); // the same buffers each round
      rp.push_back(up(c.p0)), rm.push_back(up(c.m0)), rv.push_back(up(c.v0));
      rcopy.push_back(poisoned<uint16_t>(n));
      const g::Grad16 g16{c.g16->p, c.kind == 2};
      uint16_t *copy = c.withCopy ? c.copy->p : nullptr;
      t.push_back(c.kind ? g::adamwTensor(c.p->p, g16, c.m->p, c.v->p, n, copy)
                         : g::adamwTensor(c.p->p, c.g32->p, c.m->p, c.v->p, n, copy));
      terms.push_back(c.kind ? g::squaresTerm(g16, n, i % 2) : g::squaresTerm(c.g32->p, n, i % 2));
      // The per-tensor reference, into acc[2], acc[3].
      if (c.kind)
        g::adamwUpdateCopy16(rp.back()->p, g16, rm.back()->p, rv.back()->p, n, 3e-4, 0.9, 0.95,
                             1e-8, 0.1, step, c.withCopy ? rcopy.back()->p : nullptr, c.kind == 2);
      else
        g::adamwUpdateCopy16(rp.back()->p, c.g32->p, rm.back()->p, rv.back()->p, n, 3e-4, 0.9,
                             0.95, 1e-8, 0.1, step, c.withCopy ? rcopy.back()->p : nullptr, false);
      if (c.kind)
        g::sumSquaresAdd(g16, n, acc + 2 + i % 2);
      else
        g::sumSquaresAdd(c.g32->p, n, acc + 2 + i % 2);
    }
    // One copy format per call: fp16 copies where the fp16 gradients are.
    g::adamwMulti(7, t.data(), used, /*copyF16=*/false, 3e-4, 0.9, 0.95, 1e-8, 0.1, step);
    g::sumSquaresMulti(7, terms.data(), used, acc);
    const std::string what = "multi-tensor round " + std::to_string(round);
    for (int i = 0; i < used; ++i) {
      const Case &c = cs[i];
      const std::string w = what + " tensor " + std::to_string(i) + " (n " +
                            std::to_string(sizes[i]) + ", gradient " +
                            (c.kind == 0 ? "f32" : c.kind == 1 ? "bf16" : "fp16") + ")";
      expectEqual(w + " param", c.p->download(), rp[i]->download());
      expectEqual(w + " exp_avg", c.m->download(), rm[i]->download());
      expectEqual(w + " exp_avg_sq", c.v->download(), rv[i]->download());
      // The reference wrote fp16 copies for fp16 gradients; adamwMulti's call
      // writes bf16 (copyF16 false): compare where the formats agree.
      if (c.withCopy && c.kind != 2)
        expectEqual(w + " 16-bit copy", c.copy->download(), rcopy[i]->download());
    }
    double got[4] = {-1, -1, -1, -1};
    g::readScalars(acc, got, 4);
    ++checks();
    if (got[0] != got[2] || got[1] != got[3]) {
      std::printf("FAIL %s sumSquaresMulti: %.17g, %.17g; per term %.17g, %.17g\n", what.c_str(),
                  got[0], got[1], got[2], got[3]);
      ++failures();
    } else {
      std::printf("ok   %s sumSquaresMulti: %.17g, %.17g, bit for bit the per-term sums\n",
                  what.c_str(), got[0], got[1]);
    }
    // The next round: new values in the same buffers (round 1 keeps the table).
    for (Case &c : cs)
      c.p0 = randn(static_cast<int64_t>(c.p0.size()));
  }
}

/// sgdMulti: every variant of SGD (momentum or none, first step, Nesterov,
/// weight decay, dampening) over a mixed table, bit for bit sgdUpdate per
/// tensor then toBf16 of the updated parameter where a copy is given.
void testSgdMulti() {
  const std::vector<int64_t> sizes = {100003, 1, 0, 4097};
  const int count = static_cast<int>(sizes.size());
  struct Variant {
    double momentum, dampening, wd;
    bool nesterov, first;
  };
  const Variant variants[] = {{0.0, 0.0, 0.0, false, false},
                              {0.9, 0.0, 0.01, false, true},
                              {0.9, 0.1, 0.01, false, false},
                              {0.9, 0.0, 0.0, true, false}};
  int vi = 0;
  for (const Variant &var : variants) {
    std::vector<std::unique_ptr<DevBuf<float>>> p, b, rp, rb, g32;
    std::vector<std::unique_ptr<DevBuf<uint16_t>>> g16, copy, rcopy;
    std::vector<g::SgdTensor> t;
    for (int i = 0; i < count; ++i) {
      const int64_t n = sizes[i];
      const int kind = i % 3;
      const std::vector<float> p0 = randn(n), b0 = randn(n, 0.1f), gr = randn(n, 0.01f);
      std::vector<uint16_t> h16(n);
      for (int64_t j = 0; j < n; ++j)
        h16[j] = kind == 2 ? rt::ew::f16Bits(gr[j]) : rt::ew::bf16Bits(gr[j]);
      p.push_back(up(p0)), b.push_back(up(b0)), rp.push_back(up(p0)), rb.push_back(up(b0));
      g32.push_back(up(gr)), g16.push_back(up(h16));
      copy.push_back(poisoned<uint16_t>(n)), rcopy.push_back(poisoned<uint16_t>(n));
      const g::Grad16 gh{g16.back()->p, kind == 2};
      float *buf = var.momentum != 0 ? b.back()->p : nullptr;
      float *rbuf = var.momentum != 0 ? rb.back()->p : nullptr;
      uint16_t *cp = i % 2 == 0 ? copy.back()->p : nullptr;
      t.push_back(kind ? g::sgdTensor(p.back()->p, gh, buf, n, cp)
                       : g::sgdTensor(p.back()->p, g32.back()->p, buf, n, cp));
      if (kind)
        g::sgdUpdate(rp.back()->p, gh, rbuf, n, 0.05, var.momentum, var.dampening, var.wd,
                     var.nesterov, var.first);
      else
        g::sgdUpdate(rp.back()->p, g32.back()->p, rbuf, n, 0.05, var.momentum, var.dampening,
                     var.wd, var.nesterov, var.first);
      if (cp)
        g::toBf16(rp.back()->p, rcopy.back()->p, n);
    }
    g::sgdMulti(20 + vi, t.data(), count, /*copyF16=*/false, 0.05, var.momentum, var.dampening,
                var.wd, var.nesterov, var.first);
    for (int i = 0; i < count; ++i) {
      const std::string w = "sgdMulti variant " + std::to_string(vi) + " tensor " +
                            std::to_string(i) + " (n " + std::to_string(sizes[i]) + ")";
      expectEqual(w + " param", p[i]->download(), rp[i]->download());
      if (var.momentum != 0)
        expectEqual(w + " momentum", b[i]->download(), rb[i]->download());
      if (i % 2 == 0)
        expectEqual(w + " bf16 copy", copy[i]->download(), rcopy[i]->download());
    }
    ++vi;
  }
}

//===--- Device errors -----------------------------------------------------===//

void testDeviceErrors() {
  std::string err;
  if (!g::kCudaTarget.synchronize(err)) {
    std::printf("FAIL synchronize before the error test: %s\n", err.c_str());
    ++failures();
    return;
  }
  const std::vector<float> table = randn(10 * 4);
  auto dt = up(table);
  auto di = up(std::vector<int64_t>{1, 2, 57, 3});
  auto y = poisoned<float>(16);
  g::gather<float>(dt->p, Dims{10, 4}, di->p, Dims{4}, 0, y->p);
  ++checks();
  const bool ok = g::kCudaTarget.synchronize(err);
  if (ok || err.find("index 57") == std::string::npos ||
      err.find("element 2") == std::string::npos || err.find("[-10, 10)") == std::string::npos) {
    std::printf("FAIL gather out of range: synchronize returned %s with \"%s\"\n",
                ok ? "true" : "false", err.c_str());
    ++failures();
  } else {
    std::printf("ok   gather out of range: \"%s\"\n", err.c_str());
  }
  // The record is cleared once reported.
  ++checks();
  if (!g::kCudaTarget.synchronize(err)) {
    std::printf("FAIL the error record was not cleared: %s\n", err.c_str());
    ++failures();
  } else {
    std::printf("ok   the error record is cleared once reported\n");
  }
  // gather_grad reports through the same record, on both of its paths.
  auto dy = up(randn(16));
  auto expectIndexError = [&](const char *what, const char *needle) {
    ++checks();
    if (g::kCudaTarget.synchronize(err) || err.find(needle) == std::string::npos) {
      std::printf("FAIL %s out of range: \"%s\"\n", what, err.c_str());
      ++failures();
    } else {
      std::printf("ok   %s out of range: \"%s\"\n", what, err.c_str());
    }
  };
  auto dtab = poisoned<float>(40);
  auto dneg = up(std::vector<int64_t>{-11, 0, 1, 2});
  g::gather_grad<float>(dy->p, dneg->p, Dims{4}, 0, dtab->p, Dims{10, 4});
  expectIndexError("gather_grad", "index -11");
  // One element per index: the inverted indices.
  auto dtab1 = poisoned<float>(10);
  auto dbig = up(std::vector<int64_t>{3, 0, 10, 2});
  g::gather_grad<float>(dy->p, dbig->p, Dims{4}, 0, dtab1->p, Dims{10});
  expectIndexError("gather_grad (inner 1)", "index 10");
}

} // namespace

int main() {
  requireDevice(kBinary);
  std::string err;
  if (!g::kCudaTarget.open(0, 0, 1, int64_t(1) << 20, err)) {
    std::printf("FAIL kCudaTarget.open: %s\n", err.c_str());
    return 1;
  }
  testUnary();
  testDropout();
  testBinary();
  testCompareLogicWhere();
  testCastFrom<float>();
  testCastFrom<double>();
  testCastFrom<int64_t>();
  testCastFrom<int32_t>();
  testCastFrom<uint8_t>();
  testFillCopy<float>();
  testFillCopy<double>();
  testFillCopy<int64_t>();
  testFillCopy<int32_t>();
  testFillCopy<uint8_t>();
  testRoundCopy16();
  testRead16();
  testMatmul();
  testMatmulPrecision(rt::Precision::BF16, "bf16");
  testMatmulPrecision(rt::Precision::F16, "fp16");
  testMatmulBiasGrad(rt::Precision::BF16, "bf16");
  testMatmulBiasGrad(rt::Precision::F16, "fp16");
  testMatmulTf32();
  testReduce();
  testDataMovement<float>();
  testDataMovement<int64_t>();
  testDataMovement<uint8_t>();
  testGatherSharded();
  testConvolutionPieces();
  testConvolutionCudnn();
  testShards();
  testOptimizer();
  testOptimizer16();
  testOptimizerMulti();
  testSgdMulti();
  testDeviceErrors();
  ++checks();
  if (!g::kCudaTarget.synchronize(err)) {
    std::printf("FAIL final synchronize: %s\n", err.c_str());
    ++failures();
  }
  g::kCudaTarget.close();
  return finish(kBinary);
}
