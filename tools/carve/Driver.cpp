//===- Driver.cpp - what the `carve` subcommands share --------------------===//

#include "tools/carve/Driver.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <cstdlib>

using namespace llvm;

namespace carve {

namespace {
/// A progress line is open on stdout (its stage has started, not finished).
bool progressLineOpen = false;
TempDir *activeTemp = nullptr;
} // namespace

[[noreturn]] void die(const std::string &msg) {
  if (progressLineOpen) {
    outs() << "\n";
    outs().flush();
    progressLineOpen = false;
  }
  errs() << "carve: error: " << msg << "\n";
  errs().flush();
  std::exit(1);
}

[[noreturn]] void fail(const std::string &msg) {
  if (activeTemp && !activeTemp->path.empty() && !getenv("CARVE_KEEP_TEMP"))
    sys::fs::remove_directories(activeTemp->path);
  die(msg);
}

std::string readFileOrDie(const std::string &path, const std::string &what) {
  if (sys::fs::is_directory(path))
    die(path + ": is a directory, expected " + what);
  auto buf = MemoryBuffer::getFile(path);
  if (!buf)
    die(path + ": cannot read " + what + ": " + buf.getError().message());
  return (*buf)->getBuffer().str();
}

void writeFileOrDie(const std::string &path, const std::string &text) {
  std::error_code ec;
  raw_fd_ostream os(path, ec);
  if (ec)
    die(path + ": cannot write: " + ec.message());
  os << text;
  os.close();
  if (os.has_error())
    die(path + ": cannot write: " + os.error().message());
}

void writeAtomically(const std::string &path, const std::string &text) {
  if (path == "-") {
    outs() << text;
    outs().flush();
    return;
  }
  SmallString<256> dir(path);
  sys::path::remove_filename(dir);
  if (dir.empty())
    dir = ".";
  SmallString<256> tmp;
  int fd;
  if (std::error_code ec =
          sys::fs::createUniqueFile(dir + "/" + sys::path::filename(path) + ".tmp-%%%%%%", fd, tmp))
    die(path + ": cannot write: " + ec.message());
  {
    raw_fd_ostream os(fd, /*shouldClose=*/true);
    os << text;
    os.close();
    if (os.has_error()) {
      sys::fs::remove(tmp);
      die(path + ": cannot write: " + os.error().message());
    }
  }
  if (std::error_code ec = sys::fs::rename(tmp, path)) {
    sys::fs::remove(tmp);
    die(path + ": cannot write: " + ec.message());
  }
}

void Progress::start(const std::string &stage) {
  t0 = std::chrono::steady_clock::now();
  if (quiet)
    return;
  outs() << "carve: " << left_justify(stage, 26);
  outs().flush();
  progressLineOpen = true;
}

void Progress::done(const std::string &note) {
  if (quiet)
    return;
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  outs() << format("%6.2f s", s) << (note.empty() ? "" : "  " + note) << "\n";
  outs().flush();
  progressLineOpen = false;
}

TempDir::TempDir(const std::string &out) {
  SmallString<256> parent(out);
  sys::path::remove_filename(parent);
  if (parent.empty())
    parent = ".";
  if (std::error_code ec = sys::fs::create_directories(parent))
    die(out + ": cannot create the parent directory: " + ec.message());
  // createUniqueDirectory puts a relative prefix under the system's temporary
  // directory; the temporary output must be beside OUT.
  sys::fs::make_absolute(parent);
  SmallString<256> t;
  if (std::error_code ec =
          sys::fs::createUniqueDirectory(parent + "/." + sys::path::filename(out) + ".tmp", t))
    die(out + ": cannot create a temporary directory: " + ec.message());
  path = t.str().str();
  activeTemp = this;
}

TempDir::~TempDir() {
  if (activeTemp == this)
    activeTemp = nullptr;
  if (!keep && !path.empty() && !getenv("CARVE_KEEP_TEMP"))
    sys::fs::remove_directories(path);
}

void TempDir::moveInto(const std::string &out) {
  if (sys::fs::exists(out))
    if (std::error_code ec = sys::fs::remove_directories(out))
      fail(out + ": cannot replace the previous output: " + ec.message());
  if (std::error_code ec = sys::fs::rename(path, out))
    fail(out + ": cannot move the output into place: " + ec.message());
  keep = true;
  activeTemp = nullptr;
}

} // namespace carve
