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
