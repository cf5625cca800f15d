//===- Build.cpp - compiling and linking the generated programs -----------===//

#include "tools/carve/Build.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <thread>

#ifndef CARVE_RUNTIME_CONFIG
#error "CARVE_RUNTIME_CONFIG must name build/lib/carve-runtime.txt"
#endif

using namespace llvm;

namespace carve {

std::map<std::string, std::string> runtimeConfig() {
  std::string path = CARVE_RUNTIME_CONFIG;
  if (const char *env = getenv("CARVE_RUNTIME_CONFIG"))
    path = env;
  auto buf = MemoryBuffer::getFile(path);
  if (!buf)
    fail(path + ": cannot read the runtime's build settings (" + buf.getError().message() +
         "); build the runtime (ninja carve_rt) or set CARVE_RUNTIME_CONFIG");
  std::map<std::string, std::string> cfg;
  std::istringstream in((*buf)->getBuffer().str());
  std::string line;
  while (std::getline(in, line)) {
    size_t eq = line.find('=');
    if (eq != std::string::npos)
      cfg[line.substr(0, eq)] = line.substr(eq + 1);
  }
  for (const char *k : {"cxx", "cxxflags", "include", "libs"})
    if (!cfg.count(k))
      fail(path + ": missing '" + k + "'");
  // carve's own tests: CARVE_CUDA_EMULATION names build/lib/carve-runtime-emu.txt,
  // whose keys (cuda_emulation, cuda_emu_flags, cuda_libs) build --target cuda
  // programs as host C++ against the CPU emulation of tests/gpu-emu.
  if (const char *emu = getenv("CARVE_CUDA_EMULATION")) {
    auto ebuf = MemoryBuffer::getFile(emu);
    if (!ebuf)
      fail(std::string(emu) + " (CARVE_CUDA_EMULATION): cannot read (" + ebuf.getError().message() +
           ")");
    std::istringstream ein((*ebuf)->getBuffer().str());
    while (std::getline(ein, line)) {
      size_t eq = line.find('=');
      if (eq != std::string::npos)
        cfg[line.substr(0, eq)] = line.substr(eq + 1);
    }
    for (const char *k : {"cuda_emulation", "cuda_emu_flags", "cuda_libs"})
      if (!cfg.count(k))
        fail(std::string(emu) + " (CARVE_CUDA_EMULATION): missing '" + k + "'");
  }
  return cfg;
}

std::vector<std::string> cudaArchitectures(const std::string &given) {
  auto cfg = runtimeConfig();
  if (cfg.count("cuda_missing"))
    die("--target cuda: this carve was built without the CUDA target (" + cfg["cuda_missing"] +
        "); install a CUDA toolkit with cuBLAS and NCCL and rebuild carve");
  std::string list = given.empty() ? cfg["cuda_archs"] : given;
  std::vector<std::string> archs;
  std::istringstream in(list);
  std::string a;
  while (std::getline(in, a, ',')) {
    if (a.empty() || a.size() > 3 || a.find_first_not_of("0123456789") != std::string::npos ||
        std::stoi(a) < 50)
      die("--cuda-arch " + list + ": '" + a +
          "' is not a GPU architecture number (e.g. 80 for sm_80, 90 for sm_90)");
    archs.push_back(a);
  }
  if (archs.empty())
    die("--cuda-arch: no architecture given (e.g. --cuda-arch 80,90)");
  return archs;
}

namespace {

std::vector<std::string> splitWords(const std::string &s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  std::string w;
  while (in >> w)
    out.push_back(w);
  return out;
}

/// One run of the C++ (or CUDA) compiler: its command line, the file its
/// output goes to, and what it builds (for the error message).
struct CompilerRun {
  std::vector<std::string> argv;
  std::string log;
  std::string what;
  std::string linkHint; // appended when the log names an undefined symbol
};

/// The message of a compiler run that failed: the compiler's "error:" line,
/// or the linker's line naming a missing symbol ("collect2: error" does
/// not); its log is kept as OUT.build.log.
[[noreturn]] void compilerFailed(const CompilerRun &run, const std::string &out,
                                 const std::string &execError) {
  std::string text;
  if (auto buf = MemoryBuffer::getFile(run.log))
    text = (*buf)->getBuffer().str();
  std::string first, undefined;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (undefined.empty() && line.find("undefined reference") != std::string::npos)
      undefined = line;
    if (first.empty() && line.find("error:") != std::string::npos)
      first = line;
  }
  // Keep the log where the user can read it.
  std::string kept = out + ".build.log";
  sys::fs::copy_file(run.log, kept);
  fail(std::string(StringRef(run.argv[0]).contains("nvcc") ? "the CUDA compiler (nvcc)"
                                                           : "the C++ compiler") +
       " failed on " + run.what + " (" +
       (!execError.empty()   ? execError
        : !undefined.empty() ? undefined
                             : first) +
       ")" + (undefined.empty() ? "" : run.linkHint) + "; full log: " + kept);
}

/// Runs the compiler runs, at most `parallel` at once, in order. On the first
/// that fails, waits for those still running, then fails naming it.
void runCompilers(const std::vector<CompilerRun> &runs, unsigned parallel, const std::string &out) {
  struct Running {
    size_t index;
    sys::ProcessInfo pi;
  };
  std::vector<Running> running;
  std::optional<size_t> failed;
  std::string failedError;
  size_t next = 0;
  while (next < runs.size() || !running.empty()) {
    while (!failed && next < runs.size() && running.size() < std::max(1u, parallel)) {
      const CompilerRun &r = runs[next];
      auto exe = sys::findProgramByName(r.argv[0]);
      if (!exe)
        fail("the C++ compiler '" + r.argv[0] + "' was not found");
      std::vector<StringRef> refs(r.argv.begin(), r.argv.end());
      std::optional<StringRef> redirects[] = {std::nullopt, StringRef(r.log), StringRef(r.log)};
      std::string execError;
      bool execFailed = false;
      sys::ProcessInfo pi =
          sys::ExecuteNoWait(*exe, refs, std::nullopt, redirects, 0, &execError, &execFailed);
      if (execFailed) {
        failed = next;
        failedError = execError;
        ++next;
        break;
      }
      running.push_back({next++, pi});
    }
    if (running.empty())
      break;
    // The oldest first: its output is what the user waits for.
    std::string waitError;
    sys::ProcessInfo done = sys::Wait(running.front().pi, std::nullopt, &waitError);
    const size_t index = running.front().index;
    running.erase(running.begin());
    if (done.ReturnCode != 0 && (!failed || index < *failed)) {
      failed = index;
      failedError = done.ReturnCode < 0 ? waitError : "";
    }
  }
  if (failed)
    compilerFailed(runs[*failed], out, failedError);
}

/// How many compilers run at once on a plan of several programs: the
/// hardware threads, or CARVE_BUILD_JOBS.
unsigned buildJobs() {
  if (const char *env = getenv("CARVE_BUILD_JOBS")) {
    char *end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end || n < 1 || n > 1024)
      fail(std::string("CARVE_BUILD_JOBS=") + env + ": not a number of jobs from 1 to 1024");
    return static_cast<unsigned>(n);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

/// Under CARVE_CUDA_EMULATION: `kernel<<<config>>>(` becomes
/// `CARVE_KERNEL(config, kernel)(`, the launch the CPU emulation runs
/// (tests/gpu-emu/cuda_emu.h); the rest of the source is left as it is.
std::string emulatedLaunches(const std::string &src) {
  std::string out;
  size_t at = 0;
  for (;;) {
    const size_t open = src.find("<<<", at);
    const size_t close = open == std::string::npos ? open : src.find(">>>", open + 3);
    if (close == std::string::npos) {
      out += src.substr(at);
      return out;
    }
    // The kernel: an identifier (qualified), then template arguments if any.
    size_t b = open;
    if (b > at && src[b - 1] == '>') {
      int depth = 0;
      do {
        const char c = src[--b];
        depth += c == '>' ? 1 : c == '<' ? -1 : 0;
      } while (b > at && depth > 0);
    }
    while (b > at && (std::isalnum(static_cast<unsigned char>(src[b - 1])) || src[b - 1] == '_' ||
                      src[b - 1] == ':'))
      --b;
    out += src.substr(at, b - at);
    out += "CARVE_KERNEL(" + src.substr(open + 3, close - open - 3) + ", " +
           src.substr(b, open - b) + ")";
    at = close + 3;
  }
}

/// Whether the precompiled runtime headers at `gch` (cfg program_pch,
/// cuda_emu_program_pch: cmake/CarvePch.cmake) can be used: they exist, and
/// no header they were built from (the list GCC wrote beside them, gch.deps)
/// changed after them. GCC itself checks the flags, not the headers, so a
/// stale one would build the program against the old headers; carve then
/// parses the headers instead and says once why.
bool precompiledHeadersFresh(const std::string &gch) {
  sys::fs::file_status st;
  if (gch.empty() || sys::fs::status(gch, st) || !sys::fs::exists(st))
    return false;
  const auto built = st.getLastModificationTime();
  std::string stale;
  auto deps = MemoryBuffer::getFile(gch + ".deps");
  if (!deps) {
    stale = gch + ".deps cannot be read (" + deps.getError().message() + ")";
  } else {
    // make's format: "TARGET: DEP DEP \\\n DEP ..."; a space in a path is "\ ".
    StringRef text = (*deps)->getBuffer();
    size_t colon = text.find(": ");
    std::string dep;
    auto check = [&]() {
      sys::fs::file_status ds;
      if (!dep.empty() && stale.empty() &&
          (sys::fs::status(dep, ds) || ds.getLastModificationTime() > built))
        stale = dep + " changed after it was built";
      dep.clear();
    };
    for (size_t i = colon == StringRef::npos ? text.size() : colon + 2; i < text.size(); ++i) {
      const char c = text[i];
      if (c == '\\' && i + 1 < text.size() && text[i + 1] == ' ') {
        dep += ' ';
        ++i;
      } else if (c == '\\' && i + 1 < text.size() && text[i + 1] == '\n') {
        ++i;
        check();
      } else if (std::isspace(static_cast<unsigned char>(c))) {
        check();
      } else {
        dep += c;
      }
    }
    check();
  }
  if (stale.empty())
    return true;
  static bool said = false;
  if (!said)
    errs() << "carve: note: not using the precompiled runtime headers " << gch << ": " << stale
           << "; the build parses the headers instead (slower). Rebuild carve (ninja) to "
              "refresh them.\n";
  said = true;
  return false;
}

} // namespace

void buildExecutable(const BuildInputs &in, Progress &progress) {
  auto cfg = runtimeConfig();
  std::vector<std::string> flags = splitWords(cfg["cxxflags"]);
  flags.push_back("-I" + cfg["include"]);
  // The generated C++ sources (not the custom ops' kernels) load the
  // runtime's headers precompiled where they are fresh (program_flags).
  std::vector<std::string> programFlags;
  if (cfg.count("program_flags") && precompiledHeadersFresh(cfg["program_pch"]))
    programFlags = splitWords(cfg["program_flags"]);
  const bool emulatedPch =
      cfg.count("cuda_emu_program_flags") && precompiledHeadersFresh(cfg["cuda_emu_program_pch"]);
  // The command for one source: nvcc with device code for every architecture
  // asked for, or the C++ compiler; `generated`: a generated program.
  auto compilerArgs = [&](bool generated) {
    if (!in.cuda) {
      std::vector<std::string> argv = {cfg["cxx"]};
      argv.insert(argv.end(), flags.begin(), flags.end());
      if (generated)
        argv.insert(argv.end(), programFlags.begin(), programFlags.end());
      return argv;
    }
    if (cfg.count("cuda_emulation")) {
      std::vector<std::string> argv = {cfg["cxx"]};
      argv.insert(argv.end(), flags.begin(), flags.end());
      for (auto &w :
           splitWords(cfg[generated && emulatedPch ? "cuda_emu_program_flags" : "cuda_emu_flags"]))
        argv.push_back(w);
      return argv;
    }
    std::vector<std::string> argv = {
        cfg["nvcc"],        "-std=c++17",         "-O3", "--expt-relaxed-constexpr",
        "-Xcompiler=-fPIC", "-I" + cfg["include"]};
    for (auto &w : splitWords(cfg["cuda_include"]))
      argv.push_back("-I" + w);
    for (const std::string &a : in.archs)
      argv.push_back("-gencode=arch=compute_" + a + ",code=sm_" + a);
    return argv;
  };
  const std::string &dir = in.dir;
  const std::string ext = in.cuda ? ".cu" : ".cpp";
  const std::string kind = in.cuda ? "CUDA build " : "C++ build ";
  std::string log = dir + "/build.log";
  std::vector<std::string> objects;
  if (std::error_code ec = sys::fs::create_directories(dir + "/obj"))
    fail(dir + "/obj: " + ec.message());
  if (!in.kernelSources.empty())
    if (std::error_code ec = sys::fs::create_directories(dir + "/src/custom"))
      fail(dir + "/src/custom: " + ec.message());
  // The custom ops' kernels, from their own paths (so that their includes
  // resolve and errors name the user's files); OUT/src/custom keeps copies.
  const bool emulated = in.cuda && cfg.count("cuda_emulation");
  for (const std::string &src : in.kernelSources) {
    std::string name = sys::path::filename(src).str();
    progress.start(kind + name);
    if (std::error_code ec = sys::fs::copy_file(src, dir + "/src/custom/" + name))
      fail(src + ": cannot copy into " + in.out + "/src/custom: " + ec.message());
    std::vector<std::string> argv = compilerArgs(false);
    std::string compiled = src;
    if (emulated) {
      // The CPU emulation (carve's tests): the launches rewritten into
      // OUT/src/custom/NAME.emu.cpp, compiled with the source's folder on the
      // include path so that its includes still resolve.
      auto text = MemoryBuffer::getFile(src);
      if (!text)
        fail(src + ": cannot read: " + text.getError().message());
      compiled = dir + "/src/custom/" + name + ".emu.cpp";
      std::error_code ec;
      raw_fd_ostream os(compiled, ec);
      if (ec)
        fail(compiled + ": cannot write: " + ec.message());
      os << emulatedLaunches((*text)->getBuffer().str());
      argv.push_back("-I" + sys::path::parent_path(src).str());
    } else if (in.cuda) {
      argv.push_back("-x");
      argv.push_back("cu"); // whatever the file's extension
    }
    objects.push_back(dir + "/obj/" + name + ".o");
    for (const std::string &a : {std::string("-c"), compiled, std::string("-o"), objects.back()})
      argv.push_back(a);
    runCompilers({{argv, log,
                   src + std::string(in.cuda ? ", a CUDA" : ", a") +
                       " kernel source of the rules file " + in.rulesPath,
                   ""}},
                 1, in.out);
    progress.done("custom op kernels");
  }
  // One object per program. Several programs (pipeline stages, expert
  // groups) compile at once, up to buildJobs(), each with its own log; the
  // progress then names them together.
  const unsigned jobs = std::min<size_t>(buildJobs(), in.programs.size());
  std::vector<CompilerRun> runs;
  for (size_t r = 0; r < in.programs.size(); ++r) {
    const std::string &n = in.programs[r];
    std::vector<std::string> argv = compilerArgs(true);
    objects.push_back(dir + "/obj/" + n + ".o");
    for (const std::string &a :
         {std::string("-c"), dir + "/src/" + n + ext, std::string("-o"), objects.back()})
      argv.push_back(a);
    runs.push_back({argv, jobs > 1 ? dir + "/build-" + n + ".log" : log,
                    "the generated program (src/" + n + ext + ")", ""});
  }
  if (jobs <= 1) {
    for (size_t r = 0; r < runs.size(); ++r) {
      progress.start(kind + in.programs[r]);
      runCompilers({runs[r]}, 1, in.out);
      progress.done(in.programNote(r));
    }
  } else {
    progress.start(kind + std::to_string(runs.size()) + " programs");
    runCompilers(runs, jobs, in.out);
    for (const CompilerRun &r : runs)
      sys::fs::remove(r.log);
    progress.done(std::to_string(jobs) + " at a time");
  }
  progress.start("C++ link");
  // programs.cpp on its own (with the C++ target's precompiled headers,
  // which the link line's flags, e.g. the emulation's -fsanitize=address,
  // would not match), then the link.
  std::vector<std::string> tables = {cfg["cxx"]};
  tables.insert(tables.end(), flags.begin(), flags.end());
  tables.insert(tables.end(), programFlags.begin(), programFlags.end());
  for (const std::string &a :
       {std::string("-c"), dir + "/src/programs.cpp", std::string("-o"), dir + "/obj/programs.o"})
    tables.push_back(a);
  runCompilers({{tables, log, "the generated program (src/programs.cpp)", ""}}, 1, in.out);
  std::vector<std::string> argv = {cfg["cxx"]};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(dir + "/obj/programs.o");
  argv.insert(argv.end(), objects.begin(), objects.end());
  if (in.cuda)
    for (auto &w : splitWords(cfg["cuda_libs"]))
      argv.push_back(w);
  for (auto &w : splitWords(cfg["libs"]))
    argv.push_back(w);
  argv.push_back("-o");
  argv.push_back(dir + "/bin/train");
  runCompilers(
      {{argv, log, "the generated program",
        in.kernelSources.empty()
            ? ""
            : "; do the " + std::string(in.cuda ? "\"cuda\"" : "\"cpu\"") + " sources of " +
                  in.rulesPath + " define every kernel it names, as extern \"C\"?"}},
      1, in.out);
  sys::fs::remove_directories(dir + "/obj");
  progress.done("bin/train");
}

} // namespace carve
