//===- faults.cpp - test-only fault injection from the environment --------===//

#include "faults.h"

#include "nan_guard.h"
#include "rank_errors.h"
#include "train_args.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// The hooks are in unless a build leaves them out (CMake: CARVE_TEST_HOOKS).
#ifndef CARVE_TEST_HOOKS
#define CARVE_TEST_HOOKS 1
#endif

namespace carve::rt {

#if CARVE_TEST_HOOKS

namespace {

bool parseFaultEnv(int64_t &rank, int64_t &step, std::string &error) {
  const char *r = std::getenv("CARVE_FAULT_RANK");
  const char *s = std::getenv("CARVE_FAULT_STEP");
  if (!r && !s)
    return true;
  if (!r || !s || !parseInt(r, rank) || !parseInt(s, step) || rank < 0 || step < 1) {
    error = "fault injection needs both CARVE_FAULT_RANK (a rank >= 0) and CARVE_FAULT_STEP (a "
            "step >= 1, numbered as the log numbers them)";
    return false;
  }
  return true;
}

bool parseFaultSignal(int &signal, std::string &error) {
  const char *s = std::getenv("CARVE_FAULT_SIGNAL");
  if (!s)
    return true;
  std::string v = s;
  signal = v == "KILL" ? SIGKILL : v == "STOP" ? SIGSTOP : v == "SEGV" ? SIGSEGV : 0;
  if (signal == 0) {
    error = "CARVE_FAULT_SIGNAL is KILL, STOP or SEGV, not '" + v + "'";
    return false;
  }
  return true;
}

bool parseNanFaultEnv(int64_t &nanStep, std::string &nanTensor, int64_t &nanRank,
                      std::string &error) {
  const char *s = std::getenv("CARVE_FAULT_NAN_STEP");
  const char *t = std::getenv("CARVE_FAULT_NAN_TENSOR");
  const char *r = std::getenv("CARVE_FAULT_NAN_RANK");
  if (!s && !t && !r)
    return true;
  if (!s || !t || !*t || !parseInt(s, nanStep) || nanStep < 1 ||
      (r && (!parseInt(r, nanRank) || nanRank < 0))) {
    error = "NaN injection needs CARVE_FAULT_NAN_STEP (a step >= 1) and CARVE_FAULT_NAN_TENSOR "
            "(loss or a parameter name); CARVE_FAULT_NAN_RANK is optional";
    return false;
  }
  nanTensor = t;
  return true;
}

/// CARVE_FAULT_NAN_TENSOR must be "loss" or a trainable parameter of some
/// rank's program, CARVE_FAULT_NAN_RANK a rank of the plan.
bool checkNanFault(const std::string &nanTensor, int64_t nanRank, std::string &error) {
  if (nanRank >= carve_world_size()) {
    error = "CARVE_FAULT_NAN_RANK=" + std::to_string(nanRank) + " is not a rank of the plan";
    return false;
  }
  if (nanTensor.empty() || nanTensor == "loss")
    return true;
  for (int r = 0; r < carve_world_size(); ++r)
    if (const Program *q = carve_program_for_rank(r))
      for (int i = 0; i < q->numParams; ++i)
        if (q->params[i].trainable && nanTensor == q->params[i].name)
          return true;
  error = "CARVE_FAULT_NAN_TENSOR: '" + nanTensor +
          "' is neither loss nor a trainable parameter of the compiled model";
  return false;
}

} // namespace

bool FaultInjection::readEnvironment(std::string &error) {
  return parseFaultEnv(rank, step, error) && parseFaultSignal(signal, error) &&
         parseNanFaultEnv(nanStep, nanTensor, nanRank, error) &&
         checkNanFault(nanTensor, nanRank, error);
}

void FaultInjection::atStepStart(int worldRank, int64_t k) const {
  if (worldRank == rank && k + 1 == step) {
    std::fflush(stdout);
    std::raise(signal);
  }
}

void FaultInjection::poisonGradient(StepContext &ctx, const Program &p, int worldRank,
                                    int dpRank) const {
  if (ctx.step + 1 != nanStep || (nanRank >= 0 && nanRank != worldRank))
    return;
  if (nanTensor == "loss") {
    ctx.loss = std::nanf("");
    return;
  }
  for (int i = 0; i < p.numParams; ++i)
    if (p.params[i].trainable && nanTensor == p.params[i].name &&
        heldGradientCount(p, p.params[i], dpRank) > 0) {
      // A quiet NaN in the gradient's own format (16 bits where it is 16-bit).
      const float nan = std::nanf("");
      const uint16_t nan16 = p.params[i].gradType == DType::F16 ? 0x7E00u : 0x7FC0u;
      const bool h = p.params[i].gradType != DType::F32;
      const char *bits =
          h ? reinterpret_cast<const char *>(&nan16) : reinterpret_cast<const char *>(&nan);
      const size_t size = h ? sizeof nan16 : sizeof nan;
      std::string error;
      char *at = ctx.arena + p.params[i].gradOffset;
      if (!p.device)
        std::memcpy(at, bits, size);
      else if (!p.device->toDevice(at, bits, size, error))
        die(error);
    }
}

int64_t FaultInjection::saveDelayMs() {
  const char *v = std::getenv("CARVE_TEST_SAVE_DELAY_MS");
  int64_t ms = 0;
  return v && parseInt(v, ms) && ms > 0 ? ms : 0;
}

#else // !CARVE_TEST_HOOKS

bool FaultInjection::readEnvironment(std::string &) { return true; }

void FaultInjection::atStepStart(int, int64_t) const {}

void FaultInjection::poisonGradient(StepContext &, const Program &, int, int) const {}

int64_t FaultInjection::saveDelayMs() { return 0; }

#endif // CARVE_TEST_HOOKS

} // namespace carve::rt
