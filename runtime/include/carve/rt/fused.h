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
// What depends on the functor is only the loop over one run of the output's
// innermost dimension (fusedContiguous, fusedStrided below): the generated
// program instantiates those two per chain. Broadcasting, the walk over the
// outer dimensions and the OpenMP split are fusedRun's, compiled once in the
// runtime library. With all of it instantiated per chain, a ResNet-18
// program (148 chains) took 55 s to compile at -O3, against 21 s like this
// (docs/performance.md); the loops are the same code.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_FUSED_H
#define CARVE_RT_FUSED_H

#include "carve/rt/elementwise.h"

#include <cstdint>

namespace carve::rt {

/// The most inputs and outputs of one chain (the compiler's
/// carve-fuse-elementwise stops a chain before it needs more).
constexpr int kMaxFusedInputs = 8, kMaxFusedOutputs = 4;

/// One run of `len` output elements: q[j][i] = f(p[0][i * s[0]], ...)[j].
/// `f` points to the functor; s holds each input's stride along the run
/// (1, or 0 for an input broadcast along it).
using FusedRun = void (*)(const void *f, const float *const *p, const int64_t *s, float *const *q,
                          int64_t len);

/// The part of fused() that does not depend on the chain: broadcasts the ni
/// input shapes to `ys` (a fatal error naming `what` if one does not),
/// splits the output over the OpenMP team above 32768 elements of traffic
/// (never inside an enclosing parallel region), and calls `contiguous` for
/// each run of the innermost dimension when every input's stride along it is
/// 1, `strided` otherwise.
void fusedRun(const char *what, int ni, int no, const float *const *in, const Dims *shapes,
              float *const *out, const Dims &ys, const void *f, FusedRun contiguous,
              FusedRun strided);

/// One run, its inputs contiguous along it (Strided false: fusedContiguous)
/// or some broadcast along it (stride 0; Strided true: fusedStrided).
template <int NI, int NO, class F, bool Strided>
void fusedLoop(const void *f, const float *const *p, const int64_t *s, float *const *q,
               int64_t len) {
  // Local copies: state reached through a pointer could alias an output,
  // which would keep the loop from vectorizing.
  const F g = *static_cast<const F *>(f);
  const float *pk[NI];
  int64_t sk[NI];
  float *qj[NO];
  for (int k = 0; k < NI; ++k)
    pk[k] = p[k], sk[k] = Strided ? s[k] : 1;
  for (int j = 0; j < NO; ++j)
    qj[j] = q[j];
  for (int64_t i = 0; i < len; ++i) {
    float x[NI], y[NO];
    for (int k = 0; k < NI; ++k)
      x[k] = pk[k][Strided ? i * sk[k] : i];
    g(x, y);
    for (int j = 0; j < NO; ++j)
      qj[j][i] = y[j];
  }
}
template <int NI, int NO, class F>
constexpr FusedRun fusedContiguous = &fusedLoop<NI, NO, F, false>;
template <int NI, int NO, class F> constexpr FusedRun fusedStrided = &fusedLoop<NI, NO, F, true>;

/// out[j][e] = f(in[0][e'], ..., in[NI-1][e'])[j] for every element e of the
/// output shape `ys` (e' the broadcast position in each input). `what` names
/// the chain in error messages (a shape that does not broadcast).
template <int NI, int NO, class F>
void fused(const char *what, F f, const float *const (&in)[NI], const Dims (&shapes)[NI],
           float *const (&out)[NO], Dims ys) {
  static_assert(NI >= 1 && NI <= kMaxFusedInputs && NO >= 1 && NO <= kMaxFusedOutputs,
                "a fused chain's inputs and outputs exceed fused.h's limits");
  fusedRun(what, NI, NO, in, shapes, out, ys, &f, fusedContiguous<NI, NO, F>,
           fusedStrided<NI, NO, F>);
}

} // namespace carve::rt

#endif // CARVE_RT_FUSED_H
