//===- data.h - deterministic training data for each rank -----------------===//
//
// Which sample a rank sees at which step is a pure function of the step, the
// global batch and the rank's place in the data-parallel group, so a run on
// any number of ranks (and a PyTorch script replaying the same formula) sees
// exactly the same global batches.
//
// DataKind::Tokens: a flat little-endian file of N token ids (int32 or
// uint16). Global sequence j (0 <= j < B) of step k starts at
//   o = ((k*B + j) * T) mod (N - T - 1)
// with inputs = tokens[o, o+T) and targets = tokens[o+1, o+T+1). The program's
// first input receives the inputs, its second the targets (both int64 [B/D, T]).
//
// DataKind::Tensors: a safetensors file with one tensor per graph input,
// named after it, of shape [S, B, ...rest] where [B, ...rest] is the input's
// global shape and S the number of distinct steps; step k uses index k mod S.
//
// With data parallelism of degree D, dp rank r takes global rows
// [r*B/D, (r+1)*B/D) of each batch.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_DATA_H
#define CARVE_RT_DATA_H

#include "carve/rt/program.h"

#include <cstdint>
#include <memory>
#include <string>

namespace carve::rt {

/// Element type of a token file.
enum class TokenFileType : int { Int32 = 0, UInt16 = 1 };

/// Start (in tokens) of global sequence `j` of step `step` in a file of
/// `numTokens` tokens; requires numTokens >= seqLen + 2.
int64_t tokenOffset(int64_t step, int64_t j, int64_t globalBatch, int64_t seqLen,
                    int64_t numTokens);

/// One rank's view of the training data.
class DataLoader {
public:
  virtual ~DataLoader() = default;
  /// Writes this rank's slice of step `step` into every input's place in
  /// `arena` (TensorSpec::offset). Fails only on an I/O error, with `error`
  /// naming the file and the cause.
  virtual bool load(int64_t step, char *arena, std::string &error) = 0;
  /// One line for the log, e.g. "tokens.bin: 1000000 int32 tokens".
  virtual std::string describe() const = 0;
};

/// Opens and validates the data of `program` for dp rank `dpRank` (of
/// program.dp): the file exists and has the layout above, every input is
/// there with the right dtype and shape, the file is long enough. On failure
/// returns null with `error` naming the file (and tensor) and the cause.
/// `tokenType` applies to DataKind::Tokens only. Token ids are checked
/// against Program::vocab: the whole file when it is at most 1 GiB or
/// `checkWhole` (train --check-data), else each batch as it is read.
std::unique_ptr<DataLoader> openDataLoader(const Program &program, int dpRank,
                                           const std::string &path, TokenFileType tokenType,
                                           std::string &error, bool checkWhole = false);

} // namespace carve::rt

#endif // CARVE_RT_DATA_H
