//===- checkpoint_save.h - train --save: every rank writes its shards -----===//
//
// A checkpoint of the whole world: every rank writes its own shards of the
// weights and optimizer state, world rank 0 the manifest and DIR/latest; a
// temporary folder, fsync and renames make every save atomic. The format:
// carve/rt/checkpoint.h, docs/checkpoints.md.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_SRC_CHECKPOINT_SAVE_H
#define CARVE_RT_SRC_CHECKPOINT_SAVE_H

#include "carve/rt/comm.h"
#include "carve/rt/program.h"

#include <cstdint>
#include <string>

namespace carve::rt {

/// Checks that `dir` exists as a writable folder or could be created, without
/// changing anything on disk.
bool checkSaveDir(const std::string &dir, std::string &error);

/// Writes checkpoint `step` of the whole world into `dir` (see checkpoint.h):
/// every rank writes its shards into DIR/.tmp-step-N, world rank 0 writes the
/// manifest, renames the folder to DIR/step-N, then rewrites DIR/latest and
/// removes the oldest step folders beyond `keep` (0: none). Every rank joins.
/// `lossScale` and `lossScaleGoodSteps` go into the manifest for fp16
/// programs (`lossScale` 0: not one, nothing recorded), and the run's
/// hyperparameters `hyper` (null: not recorded), and the dropout seed
/// `seed` where a program of the plan draws dropout masks.
void saveCheckpoint(Communicator &world, const Program &p, const char *arena,
                    const std::string &dir, int64_t step, int64_t keep, double lossScale,
                    int64_t lossScaleGoodSteps, const Hyperparameters *hyper, uint64_t seed);

} // namespace carve::rt

#endif // CARVE_RT_SRC_CHECKPOINT_SAVE_H
