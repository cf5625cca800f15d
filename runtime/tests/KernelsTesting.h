//===- KernelsTesting.h - what the CPU kernel tests share ------------------===//
//
// Random inputs, float64 helpers, the closeness check with its tolerances
// and central finite differences, for KernelsTest.cpp (elementwise),
// KernelsMathTest.cpp (matmul, reductions, softmax, norms, attention,
// cross-entropy) and KernelsLayoutTest.cpp (transpose, slice, concat,
// gather, expand, errors).
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RUNTIME_TESTS_KERNELSTESTING_H
#define CARVE_RUNTIME_TESTS_KERNELSTESTING_H

#include "carve/rt/kernels.h"
#include "carve/rt/program.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace kernels_test {

using namespace carve::rt;

using Vec = std::vector<double>;
constexpr double kInf = std::numeric_limits<double>::infinity();

inline Vec uniform(int64_t n, uint64_t seed, double lo = -2.0, double hi = 2.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (double &x : v)
    x = dist(rng);
  return v;
}

template <class T> std::vector<T> to(const Vec &v) { return std::vector<T>(v.begin(), v.end()); }
template <class T> Vec toD(const std::vector<T> &v) { return Vec(v.begin(), v.end()); }

inline std::string str(const Dims &s) {
  std::string r = "[";
  for (int i = 0; i < s.rank; ++i)
    r += (i ? "," : "") + std::to_string(s.d[i]);
  return r + "]";
}

/// Flat index into `in` of the element that broadcasts to output element `flat`.
inline int64_t source(int64_t flat, const Dims &out, const Dims &in) {
  int64_t coord[kMaxRank];
  for (int i = out.rank - 1; i >= 0; --i) {
    coord[i] = flat % out.d[i];
    flat /= out.d[i];
  }
  int64_t idx = 0;
  const int off = out.rank - in.rank;
  for (int i = 0; i < in.rank; ++i)
    idx = idx * in.d[i] + (in.d[i] == 1 ? 0 : coord[i + off]);
  return idx;
}

/// Expects |got - want| <= atol + rtol |want| everywhere (NaN matches NaN,
/// infinities match exactly); reports the mismatch count and the first few.
template <class T>
void expectClose(const std::vector<T> &got, const Vec &want, double rtol, double atol,
                 const std::string &what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    bool ok;
    if (std::isnan(w))
      ok = std::isnan(g);
    else if (std::isinf(w))
      ok = g == w;
    else
      ok = std::fabs(g - w) <= atol + rtol * std::fabs(w);
    if (!ok && ++bad <= 3)
      first += " [" + std::to_string(i) + "] got " + std::to_string(g) + " want " +
               std::to_string(w) + ";";
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " wrong:" << first;
}

/// Float kernels accumulate in double but round inputs, products and results to float.
template <class T> double rtolFor() { return std::is_same_v<T, float> ? 4e-6 : 1e-12; }
template <class T> double atolFor() { return std::is_same_v<T, float> ? 2e-6 : 1e-12; }

/// Central differences (f(x + h e_i) - f(x - h e_i)) / 2h of a scalar function.
/// With h = 1e-6 in double the truncation error is h^2 |f'''| / 6 ~ 1e-13 and
/// the rounding error about eps |f| / h ~ 1e-9 for |f| ~ 10, so an analytic
/// gradient must agree to 1e-6 relative (1e-6 absolute near zero); a wrong
/// formula misses by orders of magnitude more.
inline Vec numericGrad(const std::function<double(const Vec &)> &f, Vec x, double h = 1e-6) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

constexpr double kFdTol = 1e-6;

inline double dot(const Vec &a, const Vec &b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i)
    s += a[i] * b[i];
  return s;
}

} // namespace kernels_test

#endif // CARVE_RUNTIME_TESTS_KERNELSTESTING_H
