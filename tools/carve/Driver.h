//===- Driver.h - what the `carve` subcommands share ----------------------===//
//
// One-line errors (die), progress lines, reading and writing whole files,
// and the temporary output folder that a failure removes.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TOOLS_CARVE_DRIVER_H
#define CARVE_TOOLS_CARVE_DRIVER_H

#include <chrono>
#include <string>

namespace carve {

/// Prints "carve: error: MSG" (closing an open progress line) and exits 1.
[[noreturn]] void die(const std::string &msg);
/// die, after removing the temporary output folder (TempDir) in use.
[[noreturn]] void fail(const std::string &msg);

/// The whole file at `path`; dies naming `what` the file should be.
std::string readFileOrDie(const std::string &path, const std::string &what);
/// Writes `text` to `path`; dies on any error.
void writeFileOrDie(const std::string &path, const std::string &text);
/// Writes `text` to `path` through a temporary file and a rename, so a
/// failure never leaves a half-written output behind ("-": stdout); dies on
/// any error.
void writeAtomically(const std::string &path, const std::string &text);

/// One line per compile stage on stdout: its name when it starts, its time
/// (and a note) when it ends, so a slow stage shows which one it is.
class Progress {
public:
  explicit Progress(bool quiet) : quiet(quiet) {}
  void start(const std::string &stage);
  void done(const std::string &note = "");

private:
  bool quiet;
  std::chrono::steady_clock::time_point t0;
};

/// A temporary output folder, removed on every exit path (fail too) unless
/// kept or CARVE_KEEP_TEMP is set. At most one is active.
struct TempDir {
  /// Creates it beside `out` (so that renaming it into place is atomic).
  explicit TempDir(const std::string &out);
  ~TempDir();
  /// Replaces `out` with the folder.
  void moveInto(const std::string &out);
  std::string path;
  bool keep = false;
};

} // namespace carve

#endif // CARVE_TOOLS_CARVE_DRIVER_H
