//===- fused.h - fused elementwise chains (CPU) ----------------------------===//
//
// A generated program computes a chain of elementwise ops whose
// intermediates nothing else reads (bias-add then GELU, SiLU times a gate,
// sums of gradient contributions, rotary embeddings) as one pass over memory:
// the code generator writes the chain as a functor
//
//   struct Fused3 {
//     CARVE_HD void operator()(const float (&x)[2], float (&y)[2]) const {
//       const float t0 = ew::binary<Binary::Add>(x[0], x[1]);
//       y[0] = t0;
//       y[1] = ew::unary<Unary::Gelu>(t0);
//     }
//   };
//
// and calls `fused(...)` with its NI inputs (each broadcast to the output
// shape, NumPy rules) and NO outputs (the chain's result and any intermediate
// read later, e.g. by backward). The functor calls the scalar functions of
// elementwise.h, which the unfused kernels call too, and the runtime and the
// programs are built without FMA contraction, so a fused program computes
// bit for bit what the unfused one does. gpu_fused.cuh is the CUDA twin.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_FUSED_H
#define CARVE_RT_FUSED_H

#include "carve/rt/elementwise.h"

#include <omp.h>

#include <cstdint>

namespace carve::rt {

/// out[j][e] = f(in[0][e'], ..., in[NI-1][e'])[j] for every element e of the
/// output shape `ys` (e' the broadcast position in each input). `what` names
/// the chain in error messages (a shape that does not broadcast).
template <int NI, int NO, class F>
void fused(const char *what, F f, const float *const (&in)[NI], const Dims (&shapes)[NI],
           float *const (&out)[NO], Dims ys) {
  const int64_t total = ys.numel();
  if (total == 0)
    return;
  const ew::Nest<NI> n = ew::broadcastNest<NI>(what, shapes, ys);
  bool contiguous = true; // every input's innermost stride is 1 (0 otherwise)
  for (int k = 0; k < NI; ++k)
    contiguous = contiguous && n.inner(k) == 1;
  auto run = [&](int64_t e0, int64_t e1) {
    // A local copy: state reached through a reference could alias an output,
    // which would keep the loops from vectorizing.
    const F g = f;
    ew::forRange(n, e0, e1, [&](const int64_t *off, int64_t e, int64_t len) {
      const float *p[NI];
      int64_t s[NI];
      for (int k = 0; k < NI; ++k)
        p[k] = in[k] + off[k], s[k] = n.inner(k);
      float *q[NO];
      for (int j = 0; j < NO; ++j)
        q[j] = out[j] + e;
      if (contiguous) {
        for (int64_t i = 0; i < len; ++i) {
          float x[NI], y[NO];
          for (int k = 0; k < NI; ++k)
            x[k] = p[k][i];
          g(x, y);
          for (int j = 0; j < NO; ++j)
            q[j][i] = y[j];
        }
      } else {
        for (int64_t i = 0; i < len; ++i) {
          float x[NI], y[NO];
          for (int k = 0; k < NI; ++k)
            x[k] = p[k][i * s[k]];
          g(x, y);
          for (int j = 0; j < NO; ++j)
            q[j][i] = y[j];
        }
      }
    });
  };
  // As the kernels: the OpenMP team only above 32768 elements of traffic,
  // never inside an enclosing parallel region.
  if (total * (NI + NO) < 32768 * 2 || omp_in_parallel() || omp_get_max_threads() < 2) {
    run(0, total);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t b = total * t / nt, e = total * (t + 1) / nt;
    if (b < e)
      run(b, e);
  }
}

} // namespace carve::rt

#endif // CARVE_RT_FUSED_H
