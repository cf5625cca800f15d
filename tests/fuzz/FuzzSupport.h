//===- FuzzSupport.h - what every carve fuzz target shares ----------------===//
//
// A parser under fuzzing must return an error or succeed; it must never crash,
// hang, leak or leave its error empty. `checkFailure` turns an empty error into
// an abort, so libFuzzer records the input; `CARVE_FUZZ_PRINT=1` prints each
// error, which is how the regression replay (run_fuzz.py) checks the expected
// message of a committed reproducer.
//
//===----------------------------------------------------------------------===//

#ifndef CARVE_TESTS_FUZZ_FUZZSUPPORT_H
#define CARVE_TESTS_FUZZ_FUZZSUPPORT_H

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

namespace carve::fuzz {

/// Aborts if a failed parse left no error; prints the error when asked to.
inline void checkFailure(const char *parser, const std::string &error) {
  if (error.empty()) {
    std::fprintf(stderr, "carve-fuzz: %s failed with an empty error message\n", parser);
    std::abort();
  }
  static const bool print = std::getenv("CARVE_FUZZ_PRINT") != nullptr;
  if (print)
    std::fprintf(stderr, "carve-fuzz: %s: error: %s\n", parser, error.c_str());
}

/// A private folder for the files a file-reading parser needs, made once per
/// process (under $TMPDIR, else /tmp) and removed with its files at exit.
class ScratchDir {
public:
  static ScratchDir &get() {
    static ScratchDir dir;
    return dir;
  }
  const std::string &path() const { return root; }
  /// Makes the folder `name` inside the folder (once); returns its path.
  std::string subdir(const std::string &name) {
    std::string p = root + "/" + name;
    if (::mkdir(p.c_str(), 0700) == 0)
      dirs.insert(dirs.begin(), p);
    return p;
  }
  /// Records a file written by other means, for removal at exit.
  void track(const std::string &path) { files.insert(path); }
  /// Writes `size` bytes to `name` inside the folder; returns its path.
  std::string write(const std::string &name, const void *data, size_t size) {
    std::string p = root + "/" + name;
    FILE *f = std::fopen(p.c_str(), "wb");
    if (!f || (size && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
      std::fprintf(stderr, "carve-fuzz: cannot write %s\n", p.c_str());
      std::abort();
    }
    files.insert(p);
    return p;
  }

private:
  ScratchDir() {
    const char *tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/carve-fuzz-XXXXXX";
    if (!mkdtemp(pattern.data())) {
      std::fprintf(stderr, "carve-fuzz: cannot make a folder from %s\n", pattern.c_str());
      std::abort();
    }
    root = pattern;
  }
  ~ScratchDir() {
    for (const std::string &f : files)
      ::unlink(f.c_str());
    for (const std::string &d : dirs)
      ::rmdir(d.c_str());
    ::rmdir(root.c_str());
  }
  std::string root;
  std::set<std::string> files;   // every file written
  std::vector<std::string> dirs; // subfolders, newest first
};

} // namespace carve::fuzz

#endif // CARVE_TESTS_FUZZ_FUZZSUPPORT_H
