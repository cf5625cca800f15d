//===- data.cpp - deterministic training data for each rank ---------------===//

#include "carve/rt/data.h"

#include "carve/rt/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace carve::rt {

namespace {

std::vector<int64_t> specShape(const TensorSpec &s) {
  return std::vector<int64_t>(s.dims, s.dims + s.rank);
}

/// The batch split every loader relies on; a failure here is a compiler bug,
/// so the message names the program rather than the data.
bool checkBatch(const Program &p, int dpRank, std::string &error) {
  std::string where = std::string("program '") + p.name + "': ";
  if (p.dp < 1 || dpRank < 0 || dpRank >= p.dp) {
    error = where + "dp rank " + std::to_string(dpRank) + " outside a dp group of " +
            std::to_string(p.dp);
    return false;
  }
  if (p.localBatch < 1 || p.localBatch * p.dp != p.globalBatch) {
    error = where + "global batch " + std::to_string(p.globalBatch) + " is not local batch " +
            std::to_string(p.localBatch) + " times dp " + std::to_string(p.dp);
    return false;
  }
  for (int i = 0; i < p.numInputs; ++i) {
    const TensorSpec &in = p.inputs[i];
    if (in.rank < 1 || in.dims[0] != p.localBatch) {
      error = where + "input '" + in.name + "' has local shape " + formatShape(specShape(in)) +
              ", whose first dimension should be the local batch " + std::to_string(p.localBatch);
      return false;
    }
  }
  return true;
}

/// pread of exactly `bytes` bytes; errors name the cause only.
bool preadAll(int fd, void *dst, int64_t bytes, int64_t offset, std::string &cause) {
  char *p = static_cast<char *>(dst);
  while (bytes > 0) {
    ssize_t got = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(bytes, 1 << 30)), offset);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0) {
      cause = got < 0 ? std::string("read failed: ") + std::strerror(errno)
                      : "unexpected end of file (was it truncated while in use?)";
      return false;
    }
    p += got;
    bytes -= got;
    offset += got;
  }
  return true;
}

/// DataKind::Tokens: reads T+1 tokens per local sequence with one pread each.
class TokenLoader : public DataLoader {
public:
  ~TokenLoader() override {
    if (fd >= 0)
      ::close(fd);
  }

  bool open(const Program &p, int dpRank, const std::string &file, TokenFileType type,
            bool checkWhole, std::string &error) {
    path = file;
    tokenType = type;
    elemSize = type == TokenFileType::UInt16 ? 2 : 4;
    globalBatch = p.globalBatch;
    localBatch = p.localBatch;
    seqLen = p.seqLen;
    firstRow = dpRank * p.localBatch;
    std::string where = std::string("program '") + p.name + "': ";
    if (p.numInputs != 2) {
      error = where + "token data needs exactly two inputs (token ids, targets), it has " +
              std::to_string(p.numInputs);
      return false;
    }
    for (int i = 0; i < 2; ++i) {
      const TensorSpec &in = p.inputs[i];
      if (in.dtype != DType::I64 || in.rank != 2 || in.dims[0] != p.localBatch ||
          in.dims[1] != p.seqLen || p.seqLen < 1) {
        error = where + "token input '" + in.name + "' must be I64 [" +
                std::to_string(p.localBatch) + ", " + std::to_string(p.seqLen) + "], it is " +
                dtypeName(in.dtype) + " " + formatShape(specShape(in));
        return false;
      }
    }
    idsOffset = p.inputs[0].offset;
    targetsOffset = p.inputs[1].offset;

    const char *typeName = type == TokenFileType::UInt16 ? "uint16" : "int32";
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      error = "token file " + path + ": cannot open: " + std::strerror(errno);
      return false;
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      error = "token file " + path + ": not a regular file";
      return false;
    }
    int64_t bytes = st.st_size;
    if (bytes == 0) {
      error = "token file " + path + ": empty file";
      return false;
    }
    if (bytes % elemSize != 0) {
      error = "token file " + path + ": " + std::to_string(bytes) +
              " bytes is not a whole number of " + typeName + " tokens (" +
              std::to_string(elemSize) + " bytes each)" +
              (type == TokenFileType::Int32 ? "; for uint16 tokens pass --data-dtype uint16" : "");
      return false;
    }
    numTokens = bytes / elemSize;
    if (numTokens < seqLen + 2) {
      error = "token file " + path + ": " + std::to_string(numTokens) + " " + typeName +
              " tokens is too short for sequence length " + std::to_string(seqLen) +
              " (needs at least " + std::to_string(seqLen + 2) + " tokens)";
      return false;
    }
    scratch.resize(static_cast<size_t>((seqLen + 1) * elemSize));
    vocab = p.vocab;
    // Every id must index the embedding: a file up to 1 GiB is checked
    // whole now, before anything is written; every batch is checked as it
    // is read (a larger file fails at the step that reads the bad id).
    if (vocab > 0 && (checkWhole || bytes <= (int64_t(1) << 30))) {
      std::vector<unsigned char> chunk(static_cast<size_t>(1) << 22);
      for (int64_t at = 0; at < numTokens;) {
        const int64_t n = std::min<int64_t>(numTokens - at, (int64_t)chunk.size() / elemSize);
        std::string cause;
        if (!preadAll(fd, chunk.data(), n * elemSize, at * elemSize, cause)) {
          error = "token file " + path + ": " + cause;
          return false;
        }
        for (int64_t k = 0; k < n; ++k) {
          const int64_t tok = decode(chunk.data(), k);
          if (tok < 0 || tok >= vocab) {
            error = "token file " + path + ": token " + std::to_string(at + k) +
                    " (0-based, in file order) is " + std::to_string(tok) +
                    ", outside the model's vocabulary of " + std::to_string(vocab) + " (ids 0 to " +
                    std::to_string(vocab - 1) + ")" +
                    (tokenType == TokenFileType::Int32 && tok > 65535
                         ? "; a file of uint16 tokens needs --data-dtype uint16"
                         : "");
            return false;
          }
        }
        at += n;
      }
    }
    return true;
  }

  /// Token k of `b` in the file's type.
  int64_t decode(const unsigned char *b, int64_t k) const {
    if (tokenType == TokenFileType::UInt16)
      return static_cast<uint16_t>(b[2 * k] | b[2 * k + 1] << 8);
    uint32_t u = uint32_t(b[4 * k]) | uint32_t(b[4 * k + 1]) << 8 | uint32_t(b[4 * k + 2]) << 16 |
                 uint32_t(b[4 * k + 3]) << 24;
    return static_cast<int32_t>(u);
  }

  bool load(int64_t step, char *arena, std::string &error) override {
    auto *ids = reinterpret_cast<int64_t *>(arena + idsOffset);
    auto *targets = reinterpret_cast<int64_t *>(arena + targetsOffset);
    for (int64_t i = 0; i < localBatch; ++i) {
      int64_t o = tokenOffset(step, firstRow + i, globalBatch, seqLen, numTokens);
      std::string cause;
      if (!preadAll(fd, scratch.data(), (seqLen + 1) * elemSize, o * elemSize, cause)) {
        error = "token file " + path + ": step " + std::to_string(step) + ": " + cause;
        return false;
      }
      int64_t *row = ids + i * seqLen;
      int64_t *next = targets + i * seqLen;
      const unsigned char *b = scratch.data();
      for (int64_t t = 0; t <= seqLen; ++t) {
        const int64_t tok = decode(b, t);
        if (vocab > 0 && (tok < 0 || tok >= vocab)) {
          error = "token file " + path + ": step " + std::to_string(step) + ", sequence " +
                  std::to_string(firstRow + i) + " reads token " + std::to_string(o + t) +
                  " (0-based, in file order): " + std::to_string(tok) +
                  ", outside the model's vocabulary of " + std::to_string(vocab);
          return false;
        }
        if (t < seqLen)
          row[t] = tok;
        if (t > 0)
          next[t - 1] = tok;
      }
    }
    return true;
  }

  std::string describe() const override {
    return path + ": " + std::to_string(numTokens) + " " +
           (tokenType == TokenFileType::UInt16 ? "uint16" : "int32") + " tokens";
  }

private:
  std::string path;
  int fd = -1;
  TokenFileType tokenType = TokenFileType::Int32;
  int elemSize = 4;
  int64_t numTokens = 0, vocab = 0;
  int64_t globalBatch = 0, localBatch = 0, seqLen = 0, firstRow = 0;
  int64_t idsOffset = 0, targetsOffset = 0;
  std::vector<unsigned char> scratch;
};

/// DataKind::Tensors: one pread per input per step, straight into the arena.
class TensorLoader : public DataLoader {
public:
  bool open(const Program &p, int dpRank, const std::string &file, std::string &error) {
    if (!reader.open(file, error)) {
      error = "data file " + error;
      return false;
    }
    if (p.numInputs < 1) {
      error = std::string("program '") + p.name + "' has no inputs to read data for";
      return false;
    }
    for (int i = 0; i < p.numInputs; ++i) {
      const TensorSpec &in = p.inputs[i];
      const SafetensorsTensor *t = reader.find(in.name);
      if (!t) {
        std::string names;
        for (const SafetensorsTensor &e : reader.tensors())
          names += (names.empty() ? "" : ", ") + e.name;
        error = "data file " + file + ": no tensor '" + in.name +
                "' for the model input of that name (the file has: " +
                (names.empty() ? "no tensors" : names) + ")";
        return false;
      }
      if (t->dtype != dtypeName(in.dtype)) {
        error = "data file " + file + ": tensor '" + in.name + "' is " + t->dtype +
                ", the model input needs " + dtypeName(in.dtype);
        return false;
      }
      std::vector<int64_t> global = specShape(in);
      global[0] = p.globalBatch;
      bool shapeOk = t->shape.size() == global.size() + 1 && t->shape[0] >= 1 &&
                     std::equal(global.begin(), global.end(), t->shape.begin() + 1);
      if (!shapeOk) {
        std::string want = "[S, " + formatShape(global).substr(1);
        error = "data file " + file + ": tensor '" + in.name + "' has shape " +
                formatShape(t->shape) + ", expected " + want +
                " (S steps, then the input's global shape " + formatShape(global) + ")";
        return false;
      }
      if (!slots.empty() && t->shape[0] != slots.front().tensor->shape[0]) {
        error = "data file " + file + ": tensor '" + in.name + "' holds " +
                std::to_string(t->shape[0]) + " steps, tensor '" + slots.front().tensor->name +
                "' holds " + std::to_string(slots.front().tensor->shape[0]) + "; they must agree";
        return false;
      }
      int64_t rowBytes = (t->numel / (t->shape[0] * p.globalBatch)) * dtypeSize(in.dtype);
      slots.push_back({t, in.offset, rowBytes});
    }
    globalBatch = p.globalBatch;
    localBatch = p.localBatch;
    firstRow = dpRank * p.localBatch;
    return true;
  }

  bool load(int64_t step, char *arena, std::string &error) override {
    for (const Slot &s : slots) {
      int64_t index = step % s.tensor->shape[0];
      int64_t at = (index * globalBatch + firstRow) * s.rowBytes;
      if (!reader.read(*s.tensor, at, localBatch * s.rowBytes, arena + s.arenaOffset, error)) {
        error = "data file " + error;
        return false;
      }
    }
    return true;
  }

  std::string describe() const override {
    return reader.path() + ": " + std::to_string(slots.size()) + " input tensors, " +
           std::to_string(slots.front().tensor->shape[0]) + " steps";
  }

private:
  struct Slot {
    const SafetensorsTensor *tensor;
    int64_t arenaOffset;
    int64_t rowBytes;
  };
  SafetensorsReader reader;
  std::vector<Slot> slots;
  int64_t globalBatch = 0, localBatch = 0, firstRow = 0;
};

} // namespace

int64_t tokenOffset(int64_t step, int64_t j, int64_t globalBatch, int64_t seqLen,
                    int64_t numTokens) {
  // 128-bit so that long runs on long sequences cannot overflow before the mod.
  __int128 start = (static_cast<__int128>(step) * globalBatch + j) * seqLen;
  return static_cast<int64_t>(start % (numTokens - seqLen - 1));
}

std::unique_ptr<DataLoader> openDataLoader(const Program &program, int dpRank,
                                           const std::string &path, TokenFileType tokenType,
                                           std::string &error, bool checkWhole) {
  if (!checkBatch(program, dpRank, error))
    return nullptr;
  if (program.dataKind == DataKind::Tokens) {
    auto loader = std::make_unique<TokenLoader>();
    if (!loader->open(program, dpRank, path, tokenType, checkWhole, error))
      return nullptr;
    return loader;
  }
  auto loader = std::make_unique<TensorLoader>();
  if (!loader->open(program, dpRank, path, error))
    return nullptr;
  return loader;
}

} // namespace carve::rt
