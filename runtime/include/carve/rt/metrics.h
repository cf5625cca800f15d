//===- metrics.h - JSONL metrics and the progress line --------------------===//
//
// Rank 0 writes one JSON object per step to the --log file (JSON Lines, each
// line flushed as it is written, so a crashed run keeps every finished step)
// and prints one progress line per step. Floating-point values keep 9
// significant digits: enough to tell float losses apart.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_RT_METRICS_H
#define CARVE_RT_METRICS_H

#include <cstdint>
#include <string>

namespace carve::rt {

/// One JSON object, built field by field in insertion order.
class JsonLine {
public:
  JsonLine &add(const char *key, int64_t value);
  /// Written with %.9g; NaN and infinities (not JSON) are written as null.
  JsonLine &add(const char *key, double value);
  JsonLine &add(const char *key, const std::string &value);
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

/// "step 3/20  loss 4.12345648  12345 tokens/s  elapsed 1.23s": `done` steps
/// of `total`, `rate` items per second of `unit` ("tokens", "samples").
std::string formatProgress(int64_t done, int64_t total, double loss, double rate, const char *unit,
                           double elapsedSeconds);

} // namespace carve::rt

#endif // CARVE_RT_METRICS_H
