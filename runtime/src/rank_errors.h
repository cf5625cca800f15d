//===- rank_errors.h - how the training executable reports an error -------===//
//
// Every error is one line on stderr, `carve: error: ...`, prefixed
// `[rank R]` when there are several ranks (runtime/README.md#errors). Before
// the first step all ranks agree on the outcome, so that they stop together
// and only the lowest failing rank reports; after that an error brings every
// rank down.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_RANK_ERRORS_H
#define CARVE_RT_SRC_RANK_ERRORS_H

#include "carve/rt/comm.h"

#include <string>

namespace carve::rt {

/// Sets the rank and world size that error lines name (rank 0 of 1 until set).
void setErrorRank(int rank, int size);

/// Prints `message` as this rank's error line (stdout flushed first).
void printError(const std::string &message);

/// An error once work has started: no agreement is possible any more, so
/// every rank is brought down.
[[noreturn]] void die(const std::string &message);

/// All ranks call this once with their own validation result (empty: passed);
/// true when all passed. Only the lowest failing rank prints, so a problem
/// every rank has is reported once.
bool agree(Communicator &world, const std::string &error);

} // namespace carve::rt

#endif // CARVE_RT_SRC_RANK_ERRORS_H
