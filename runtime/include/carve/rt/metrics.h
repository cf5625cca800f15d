//===- metrics.h - JSONL metrics and the progress line --------------------===//
//
// Rank 0 writes one JSON object per step to the --log file (JSON Lines, each
// line flushed as it is written, so a crashed run keeps every finished step)
// and shows the progress (a line rewritten in place on a terminal, plain
// lines otherwise). Floating-point values keep 9 significant digits: enough to
// tell float losses apart.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_METRICS_H
#define CARVE_RT_METRICS_H

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace carve::rt {

/// One JSON object, built field by field in insertion order.
class JsonLine {
public:
  JsonLine &add(const char *key, int64_t value);
  /// Written with %.9g; NaN and infinities (not JSON) are written as null.
  JsonLine &add(const char *key, double value);
  JsonLine &add(const char *key, const std::string &value);
  JsonLine &add(const char *key, bool value);
  /// The object, without a newline.
  std::string str() const { return body + "}"; }

private:
  void key(const char *k);
  std::string body = "{";
};

/// A JSON Lines file that receives one object per call.
class MetricsLog {
public:
  MetricsLog() = default;
  MetricsLog(const MetricsLog &) = delete;
  MetricsLog &operator=(const MetricsLog &) = delete;
  ~MetricsLog();

  /// Checks that `path` can be written without changing anything on disk (an
  /// existing file is opened for appending, a missing one is created and
  /// removed again). On failure sets `error` to "PATH: cause".
  static bool checkWritable(const std::string &path, std::string &error);
  /// Creates or truncates `path`.
  bool open(const std::string &path, std::string &error);
  bool isOpen() const { return fd >= 0; }
  /// Appends `line` and a newline with a single write.
  bool write(const JsonLine &line, std::string &error);

private:
  std::string filePath;
  int fd = -1;
};

/// TensorBoard's event files (train --tensorboard DIR): TFRecord framing
/// (length, masked CRC-32C of the length, the record, masked CRC-32C of the
/// record) around tensorflow.Event protocol buffers, encoded by hand: the
/// first event carries file_version "brain.Event:2", each later one a step,
/// its wall time and a Summary of simple scalar values. Stock TensorBoard
/// reads the folder (tensorboard --logdir DIR).
class TensorBoardLog {
public:
  TensorBoardLog() = default;
  TensorBoardLog(const TensorBoardLog &) = delete;
  TensorBoardLog &operator=(const TensorBoardLog &) = delete;
  ~TensorBoardLog();

  /// Checks that `dir` is a writable folder or can be created, changing
  /// nothing. On failure sets `error` to "DIR: cause".
  static bool checkWritable(const std::string &dir, std::string &error);
  /// Creates `dir` if needed and a new events.out.tfevents.SECONDS.HOST.PID
  /// file in it, with the file-version event.
  bool open(const std::string &dir, std::string &error);
  bool isOpen() const { return fd >= 0; }
  /// One event: `step`, the wall time now, and the scalars (tag, value).
  bool write(int64_t step, const std::vector<std::pair<std::string, float>> &scalars,
             std::string &error);
  const std::string &path() const { return filePath; }

private:
  bool writeRecord(const std::string &data, std::string &error);
  std::string filePath;
  int fd = -1;
};

/// CRC-32C (Castagnoli) of `n` bytes, and TFRecord's mask of it.
uint32_t crc32c(const void *data, size_t n);
uint32_t maskedCrc32c(const void *data, size_t n);

/// "step 3/20  loss 4.12345648  12345 tokens/s  elapsed 1.23s  eta 8.1s  peak rss 51.2 MB":
/// `done` steps of `total`, `rate` items per second of `unit` ("tokens",
/// "samples"); the ETA is left out when negative, the memory when 0.
std::string formatProgress(int64_t done, int64_t total, double loss, double rate, const char *unit,
                           double elapsedSeconds, double etaSeconds = -1, int64_t memoryBytes = 0);

/// "51.2 MB", "3.0 kB", "12 bytes" (decimal units).
std::string formatBytes(int64_t bytes);
/// "8.1s", "4m05s", "2h03m".
std::string formatDuration(double seconds);
/// This process's peak resident set size in bytes (0 if unknown).
int64_t peakRssBytes();

/// How rank 0 shows progress (train --progress): a line rewritten in place
/// (`Bar`, for a terminal), plain lines (`Lines`: each of the first 10 steps,
/// then every `every` steps or, with every == 0, one at least every 10 s, and
/// always the last step and one with a note), or nothing.
enum class ProgressMode { Bar, Lines, None };

class ProgressDisplay {
public:
  ProgressDisplay(ProgressMode mode, int64_t firstStep, int64_t endStep, const char *unit,
                  double itemsPerStep, int64_t every);
  /// After 0-based step k, which took `stepSeconds`; a non-empty `note`
  /// ("update skipped") is appended and always shown.
  void step(int64_t k, double loss, double stepSeconds, const std::string &note = "");
  /// Ends a bar's line so that other output starts on a fresh one.
  void interrupt();

private:
  ProgressMode mode;
  int64_t first, end, every;
  const char *unit;
  double itemsPerStep;
  double startTime, lastShown = -1;
  bool barOpen = false;
};

} // namespace carve::rt

#endif // CARVE_RT_METRICS_H
