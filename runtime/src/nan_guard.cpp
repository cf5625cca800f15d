//===- nan_guard.cpp - --on-nan: the check between gradients and optimizer ===//

#include "nan_guard.h"

#include "rank_errors.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

namespace carve::rt {

int64_t heldGradientCount(const Program &p, const TensorSpec &s, int dpRank) {
  if (p.zeroStage < 2 || s.zeroChunk <= 0)
    return s.numel;
  return std::max<int64_t>(0, std::min<int64_t>(s.zeroChunk, s.numel - dpRank * s.zeroChunk));
}

NanGuard::NanGuard(Communicator &world, const Program &p, const Mesh &m, const FaultInjection &f,
                   char *hostArena)
    : world(world), program(p), mesh(m), faults(f), host(hostArena) {
  // Model order: every program's trainable parameters, lowest rank first
  // (pipeline stages in order), each name once.
  std::set<std::string> seen;
  for (int r = 0; r < carve_world_size(); ++r)
    if (const Program *q = carve_program_for_rank(r))
      for (int i = 0; i < q->numParams; ++i)
        if (q->params[i].trainable && seen.insert(q->params[i].name).second)
          order.push_back(q->params[i].name);
}

void NanGuard::beginStep() {
  asked = false;
  nonFinite = false;
  culprit.clear();
}

void NanGuard::gradientsReady(StepContext &ctx) {
  faults.poisonGradient(ctx, program, world.rank(), mesh.dpRank);
}

bool NanGuard::updateAllowed(StepContext &ctx, double gradNorm) {
  asked = true;
  return check(ctx, std::isfinite(gradNorm));
}

bool NanGuard::everyRank(bool ok) {
  int64_t failed = ok ? 0 : 1;
  world.allReduce(&failed, 1, CommType::I64, ReduceOp::Max);
  return failed == 0;
}

bool NanGuard::check(StepContext &ctx, bool normFinite) {
  int64_t flag = std::isfinite(ctx.loss) && normFinite ? 0 : 1;
  world.allReduce(&flag, 1, CommType::I64, ReduceOp::Max);
  if (flag == 0)
    return true;
  nonFinite = true;
  // The first tensor at fault, as (count - position): the largest wins.
  const int64_t count = static_cast<int64_t>(order.size()) + 1;
  int64_t first[2] = {0, 0}; // gradients (loss = position 0), then weights
  if (!std::isfinite(ctx.loss))
    first[0] = count;
  // On a device the tensors are looked at in the host copy of the arena
  // (only now, when something is known to be wrong).
  const char *arena = ctx.arena;
  if (program.device) {
    std::string error;
    if (!program.device->toHost(host, ctx.arena, program.arenaBytes, error))
      die(error);
    arena = host;
  }
  for (int pass = 0; pass < 2; ++pass)
    for (int i = 0; i < program.numParams && first[pass] == 0; ++i) {
      const TensorSpec &s = program.params[i];
      if (!s.trainable)
        continue;
      // A 16-bit copy's weights are looked at in its fp32 master.
      const bool master = s.masterOffset >= 0;
      const char *at = arena + (pass == 0 ? s.gradOffset : master ? s.masterOffset : s.offset);
      const float *v = reinterpret_cast<const float *>(at);
      // A 16-bit gradient (its exponent all ones: not finite).
      const uint16_t *h = reinterpret_cast<const uint16_t *>(at);
      const bool grad16 = pass == 0 && s.gradType != DType::F32;
      const uint16_t expMask = s.gradType == DType::F16 ? 0x7C00u : 0x7F80u;
      const int64_t n = pass == 0 ? heldGradientCount(program, s, mesh.dpRank)
                        : (master ? s.stateZero : s.paramZero) ? s.zeroChunk
                                                               : s.numel;
      if (pass == 1 && s.dtype != DType::F32)
        continue;
      for (int64_t j = 0; j < n; ++j)
        if (grad16 ? (h[j] & expMask) == expMask : !std::isfinite(v[j])) {
          first[pass] = count - 1 - positionOf(s.name);
          break;
        }
    }
  world.allReduce(first, 2, CommType::I64, ReduceOp::Max);
  culprit = first[0] == count ? "loss" : first[0] > 0 ? order[count - 1 - first[0]] : "";
  weightHint = first[1] > 0 ? order[count - 1 - first[1]] : "";
  if (culprit.empty()) // the norm overflowed with finite elements
    culprit = "the gradient norm";
  return false;
}

int64_t NanGuard::positionOf(const char *name) const {
  return std::find(order.begin(), order.end(), name) - order.begin();
}

std::string describeNonFinite(const NanGuard &g, const StepContext &ctx) {
  char loss[32];
  std::snprintf(loss, sizeof loss, "%.9g", static_cast<double>(ctx.loss));
  std::string text;
  if (g.culprit == "loss")
    text = std::isfinite(ctx.loss) ? std::string("the loss is not finite on another rank")
                                   : std::string("the loss is ") + loss;
  else if (g.culprit == "the gradient norm")
    text = "the gradient norm overflowed (loss " + std::string(loss) + ")";
  else
    text =
        "non-finite gradient of '" + g.culprit + "' (the first in model order; loss " + loss + ")";
  if (!g.weightHint.empty())
    text += "; the first non-finite parameter is '" + g.weightHint + "'";
  return text;
}

} // namespace carve::rt
