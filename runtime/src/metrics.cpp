//===- metrics.cpp - JSONL metrics and the progress line ------------------===//

#include "carve/rt/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

namespace carve::rt {

namespace {

std::string quote(const std::string &s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

} // namespace

void JsonLine::key(const char *k) {
  if (body.size() > 1)
    body += ", ";
  body += quote(k) + ": ";
}

JsonLine &JsonLine::add(const char *k, int64_t value) {
  key(k);
  body += std::to_string(value);
  return *this;
}

JsonLine &JsonLine::add(const char *k, double value) {
  key(k);
  if (!std::isfinite(value)) {
    body += "null";
    return *this;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", value);
  body += buf;
  return *this;
}

JsonLine &JsonLine::add(const char *k, const std::string &value) {
  key(k);
  body += quote(value);
  return *this;
}

JsonLine &JsonLine::add(const char *k, bool value) {
  key(k);
  body += value ? "true" : "false";
  return *this;
}

MetricsLog::~MetricsLog() {
  if (fd >= 0)
    ::close(fd);
}

bool MetricsLog::checkWritable(const std::string &path, std::string &error) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      error = path + ": the log path exists and is not a regular file";
      return false;
    }
    int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) {
      error = path + ": cannot write the log: " + std::strerror(errno);
      return false;
    }
    ::close(fd);
    return true;
  }
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = path + ": cannot create the log: " + std::strerror(errno);
    return false;
  }
  ::close(fd);
  ::unlink(path.c_str());
  return true;
}

uint32_t crc32c(const void *data, size_t n) {
  static uint32_t table[256];
  static bool built = false;
  if (!built) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      table[i] = c;
    }
    built = true;
  }
  const unsigned char *p = static_cast<const unsigned char *>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i)
    c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t maskedCrc32c(const void *data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

namespace {

// Protocol-buffer encoding of the few fields an Event needs.
void varint(std::string &out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
template <typename T> void fixed(std::string &out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T)); // little-endian hosts only (x86-64, aarch64)
  out.append(b, sizeof(T));
}
void lengthDelimited(std::string &out, int field, const std::string &bytes) {
  varint(out, static_cast<uint64_t>(field) << 3 | 2);
  varint(out, bytes.size());
  out += bytes;
}

double wallTime() {
  struct timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

/// tensorflow.Event { double wall_time = 1; int64 step = 2; string
/// file_version = 3; Summary summary = 5; }
std::string eventBytes(double wall, int64_t step, const std::string &fileVersion,
                       const std::vector<std::pair<std::string, float>> &scalars) {
  std::string e;
  varint(e, 1 << 3 | 1);
  fixed(e, wall);
  varint(e, 2 << 3 | 0);
  varint(e, static_cast<uint64_t>(step));
  if (!fileVersion.empty())
    lengthDelimited(e, 3, fileVersion);
  if (!scalars.empty()) {
    // Summary { repeated Value value = 1; } Value { string tag = 1; float simple_value = 2; }
    std::string summary;
    for (const auto &[tag, v] : scalars) {
      std::string value;
      lengthDelimited(value, 1, tag);
      varint(value, 2 << 3 | 5);
      fixed(value, v);
      lengthDelimited(summary, 1, value);
    }
    lengthDelimited(e, 5, summary);
  }
  return e;
}

} // namespace

TensorBoardLog::~TensorBoardLog() {
  if (fd >= 0)
    ::close(fd);
}

bool TensorBoardLog::checkWritable(const std::string &dir, std::string &error) {
  struct stat st;
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      error = dir + ": the --tensorboard path exists and is not a folder";
      return false;
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      error = dir + ": cannot write into the --tensorboard folder: " + std::strerror(errno);
      return false;
    }
    return true;
  }
  std::string parent = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
  if (parent.empty())
    parent = "/";
  if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      ::access(parent.c_str(), W_OK | X_OK) != 0) {
    error =
        dir + ": cannot create the --tensorboard folder: " + parent + " is not a writable folder";
    return false;
  }
  return true;
}

bool TensorBoardLog::open(const std::string &dir, std::string &error) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    error = dir + ": cannot create the --tensorboard folder: " + std::strerror(errno);
    return false;
  }
  char host[64] = "host";
  ::gethostname(host, sizeof host - 1);
  filePath = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(wallTime())) +
             "." + host + "." + std::to_string(static_cast<long long>(::getpid()));
  fd = ::open(filePath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = filePath + ": cannot create the event file: " + std::strerror(errno);
    return false;
  }
  return writeRecord(eventBytes(wallTime(), 0, "brain.Event:2", {}), error);
}

bool TensorBoardLog::write(int64_t step, const std::vector<std::pair<std::string, float>> &scalars,
                           std::string &error) {
  return writeRecord(eventBytes(wallTime(), step, "", scalars), error);
}

bool TensorBoardLog::writeRecord(const std::string &data, std::string &error) {
  std::string rec;
  const uint64_t n = data.size();
  fixed(rec, n);
  fixed(rec, maskedCrc32c(rec.data(), 8));
  rec += data;
  fixed(rec, maskedCrc32c(data.data(), data.size()));
  const char *p = rec.data();
  size_t left = rec.size();
  while (left > 0) {
    ssize_t put = ::write(fd, p, left);
    if (put < 0 && errno == EINTR)
      continue;
    if (put < 0) {
      error = filePath + ": cannot write the event file: " + std::strerror(errno);
      return false;
    }
    p += put;
    left -= static_cast<size_t>(put);
  }
  return true;
}

bool MetricsLog::open(const std::string &path, std::string &error) {
  filePath = path;
  fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = path + ": cannot open the log: " + std::strerror(errno);
    return false;
  }
  return true;
}

bool MetricsLog::write(const JsonLine &line, std::string &error) {
  std::string text = line.str() + "\n";
  const char *p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t put = ::write(fd, p, left);
    if (put < 0 && errno == EINTR)
      continue;
    if (put < 0) {
      error = filePath + ": cannot write the log: " + std::strerror(errno);
      return false;
    }
    p += put;
    left -= static_cast<size_t>(put);
  }
  return true;
}

std::string formatBytes(int64_t bytes) {
  char buf[64];
  if (bytes < 1000)
    std::snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(bytes));
  else if (bytes < 1000 * 1000)
    std::snprintf(buf, sizeof buf, "%.1f kB", bytes / 1e3);
  else if (bytes < int64_t(1000) * 1000 * 1000)
    std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

std::string formatDuration(double seconds) {
  char buf[64];
  if (!(seconds >= 0) || seconds > 1e9)
    return "?";
  if (seconds < 60)
    std::snprintf(buf, sizeof buf, "%.1fs", seconds);
  else if (seconds < 3600)
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(seconds) / 60,
                  static_cast<int>(seconds) % 60);
  else
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(seconds) / 3600,
                  static_cast<int>(seconds) / 60 % 60);
  return buf;
}

int64_t peakRssBytes() {
  struct rusage u;
  if (::getrusage(RUSAGE_SELF, &u) != 0)
    return 0;
  return static_cast<int64_t>(u.ru_maxrss) * 1024; // Linux reports kilobytes
}

std::string formatProgress(int64_t done, int64_t total, double loss, double rate, const char *unit,
                           double elapsedSeconds, double etaSeconds, int64_t memoryBytes) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "step %lld/%lld  loss %.9g  %.0f %s/s  elapsed %.2fs",
                static_cast<long long>(done), static_cast<long long>(total), loss, rate, unit,
                elapsedSeconds);
  std::string line = buf;
  if (etaSeconds >= 0)
    line += "  eta " + formatDuration(etaSeconds);
  if (memoryBytes > 0)
    line += "  peak rss " + formatBytes(memoryBytes);
  return line;
}

namespace {
double monotonicSeconds() {
  struct timespec t;
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}
} // namespace

ProgressDisplay::ProgressDisplay(ProgressMode mode, int64_t firstStep, int64_t endStep,
                                 const char *unit, double itemsPerStep, int64_t every)
    : mode(mode), first(firstStep), end(endStep), every(every), unit(unit),
      itemsPerStep(itemsPerStep), startTime(monotonicSeconds()) {}

void ProgressDisplay::step(int64_t k, double loss, double stepSeconds, const std::string &note) {
  if (mode == ProgressMode::None)
    return;
  const double now = monotonicSeconds();
  const double elapsed = now - startTime;
  const bool last = k + 1 == end;
  const bool skipped = !note.empty();
  bool show;
  if (mode == ProgressMode::Bar)
    show = last || skipped || lastShown < 0 || now - lastShown >= 0.1;
  else
    show = last || skipped || k - first < 10 ||
           (every > 0 ? (k + 1) % every == 0 : now - lastShown >= 10);
  if (!show)
    return;
  lastShown = now;
  const int64_t done = k + 1 - first;
  const double eta =
      done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(end - k - 1) : -1;
  const double rate = stepSeconds > 0 ? itemsPerStep / stepSeconds : 0;
  std::string line = formatProgress(k + 1, end, loss, rate, unit, elapsed, eta, peakRssBytes());
  if (skipped)
    line += "  (" + note + ")";
  if (mode == ProgressMode::Bar) {
    // Rewrite the line in place; erase what a longer previous line left.
    std::printf("\r%s\033[K", line.c_str());
    barOpen = true;
    if (last)
      interrupt();
  } else {
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

void ProgressDisplay::interrupt() {
  if (!barOpen)
    return;
  std::printf("\n");
  std::fflush(stdout);
  barOpen = false;
}

} // namespace carve::rt
