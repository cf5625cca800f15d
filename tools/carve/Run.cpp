//===- Run.cpp - `carve run OUT -n N -- ARGS` -----------------------------===//
//
// Starts OUT/bin/train on N ranks: directly for one, through mpirun for
// more, and turns mpirun's failure noise into one error line.
//
//===----------------------------------------------------------------------===//

#include "tools/carve/Compile.h"
#include "tools/carve/Driver.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

using namespace llvm;

namespace carve {

int runRun(const std::string &outDir, int ranks, const std::vector<std::string> &trainArgs) {
  std::string out = outDir;
  std::string planPath = out + "/plan.json";
  std::string train = out + "/bin/train";
  if (sys::fs::exists(planPath) && sys::fs::exists(out + "/src") && !sys::fs::exists(train))
    die(out + ": bin/train was not built (compiled with --no-build); compile without it to "
              "train");
  if (!sys::fs::exists(planPath) || !sys::fs::exists(train))
    die(out +
        ": not a carve output directory (expected plan.json and bin/train; create it "
        "with `carve compile MODEL -o " +
        out + "`)");
  int world = 0;
  std::string planText;
  try {
    auto j = nlohmann::json::parse(readFileOrDie(planPath, "plan.json"));
    world = j.at("world_size").get<int>();
    planText = j.at("plan").dump();
  } catch (const std::exception &) {
    die(planPath + ": unreadable (recompile with `carve compile`)");
  }
  if (ranks <= 0)
    die("-n must be a positive number of ranks");
  if (ranks != world)
    die(out + " was compiled for " + std::to_string(world) + " rank" + (world > 1 ? "s" : "") +
        " (plan " + planText + "), not " + std::to_string(ranks) + "; run it with -n " +
        std::to_string(world) + " or recompile with another plan");

  unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::string threads = getenv("OMP_NUM_THREADS")
                            ? std::string(getenv("OMP_NUM_THREADS"))
                            : std::to_string(std::max(1u, cores / (unsigned)ranks));
  setenv("OMP_NUM_THREADS", threads.c_str(), 1);
  setenv("OPENBLAS_NUM_THREADS", threads.c_str(), 1);
  // Under mpirun a rank's stdout is a pseudo-terminal whatever ours is; tell
  // the ranks whether a person watches (train --progress auto).
  setenv("CARVE_STDOUT_TTY", isatty(STDOUT_FILENO) ? "1" : "0", 1);

  std::vector<std::string> argv;
  if (ranks == 1) {
    argv.push_back(train);
  } else {
    auto mpirun = sys::findProgramByName("mpirun");
    if (!mpirun)
      die("mpirun was not found on PATH (Debian package openmpi-bin)");
    argv = {*mpirun, "-n", std::to_string(ranks)};
    if (geteuid() == 0)
      argv.push_back("--allow-run-as-root");
    for (const char *a :
         {"--oversubscribe", "--bind-to", "none", "--mca", "btl_vader_single_copy_mechanism",
          "none", "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS", "-x", "CARVE_STDOUT_TTY"})
      argv.push_back(a);
    argv.push_back(train);
  }
  for (const std::string &a : trainArgs)
    argv.push_back(a);
  std::vector<char *> cargv;
  for (std::string &a : argv)
    cargv.push_back(a.data());
  cargv.push_back(nullptr);
  fflush(stdout);

  // Run mpirun (or, for one rank, the program itself) as a child, pass its
  // stderr through, and when the job fails say which rank took it down and how
  // (mpirun's notice names it).
  int fds[2];
  if (pipe(fds) != 0)
    die("cannot create a pipe: " + std::string(strerror(errno)));
  pid_t child = fork();
  if (child < 0)
    die("cannot fork: " + std::string(strerror(errno)));
  if (child == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    execv(cargv[0], cargv.data());
    fprintf(stderr, "carve: error: cannot start %s: %s\n", cargv[0], strerror(errno));
    _exit(127);
  }
  close(fds[1]);
  static pid_t runningChild;
  runningChild = child;
  auto forward = [](int sig) { kill(runningChild, sig); };
  signal(SIGINT, forward);
  signal(SIGTERM, forward);
  std::string captured;
  // mpirun frames its notices between lines of dashes. The two it prints
  // after a rank exits non-zero only repeat that a rank failed: once a rank
  // has said why ("carve: error: ..."), they are dropped, so that a start-up
  // error is one line. Every other notice (no slots, a rank killed by a
  // signal, a launch failure) is passed through.
  std::string line, notice;
  bool inNotice = false;
  auto emit = [](const std::string &text) {
    fwrite(text.data(), 1, text.size(), stderr);
    fflush(stderr);
  };
  auto onLine = [&](const std::string &l) {
    const bool rule = l.size() > 40 && l.find_first_not_of("-\n") == std::string::npos;
    if (!inNotice && !rule) {
      emit(l);
      return;
    }
    notice += l;
    if (!rule || !inNotice) {
      inNotice = true;
      return;
    }
    inNotice = false;
    const bool repeat = notice.find("Primary job  terminated normally") != std::string::npos ||
                        notice.find("exited with non-zero status") != std::string::npos;
    if (!(repeat && captured.find("carve: error") != std::string::npos))
      emit(notice);
    notice.clear();
  };
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n <= 0)
      continue;
    captured.append(buf, n);
    if (captured.size() > (1 << 20))
      captured.erase(0, captured.size() - (1 << 19));
    for (ssize_t i = 0; i < n; ++i) {
      line += buf[i];
      if (buf[i] == '\n') {
        onLine(line);
        line.clear();
      }
    }
  }
  if (!line.empty())
    onLine(line);
  if (!notice.empty())
    emit(notice);
  close(fds[0]);
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (rc == 0)
    return 0;
  if (ranks == 1) {
    if (WIFSIGNALED(status)) {
      const int sig = WTERMSIG(status);
      const char *abbrev = sigabbrev_np(sig);
      errs() << "carve: error: rank 0 (the only one, pid " << child << ") was killed by signal "
             << sig << " (SIG" << (abbrev ? abbrev : "?") << ": " << strsignal(sig) << ")\n";
    }
    return rc;
  }
  // A rank that gave up waiting (--collective-timeout) printed what it waited
  // for: "carve: rank 0: all-reduce over dp (...) did not complete in 30 s; ...".
  size_t timedOut = captured.find(" did not complete in ");
  size_t at = captured.find("process rank ");
  int deadRank = -1, pid = 0, sig = 0;
  char node[256] = "";
  if (at != std::string::npos)
    std::sscanf(captured.c_str() + at,
                "process rank %d with PID %d on node %255s exited on signal %d", &deadRank, &pid,
                node, &sig);
  if (timedOut != std::string::npos) {
    size_t begin = captured.rfind("carve: rank ", timedOut);
    std::string what = begin == std::string::npos
                           ? std::string("a collective")
                           : captured.substr(begin + 7, timedOut - begin - 7);
    errs() << "carve: error: " << what
           << " timed out (--collective-timeout); the job was aborted and every rank stopped\n";
  } else if (sig > 0) {
    const char *abbrev = sigabbrev_np(sig);
    errs() << "carve: error: rank " << deadRank;
    if (pid > 0)
      errs() << " (pid " << pid << " on " << node << ")";
    errs() << " was killed by signal " << sig << " (SIG" << (abbrev ? abbrev : "?") << ": "
           << strsignal(sig) << "); mpirun stopped every other rank\n";
  } else if (at != std::string::npos) {
    // "process rank 1 with PID 123 on node x exiting improperly" and the like.
    size_t end = captured.find('\n', at);
    std::string what =
        captured.substr(at + 8, end == std::string::npos ? std::string::npos : end - at - 8);
    while (!what.empty() && (what.back() == '.' || what.back() == ' '))
      what.pop_back();
    errs() << "carve: error: " << what << "; every rank of the job was stopped\n";
  } else if (captured.find("carve: error") == std::string::npos) {
    errs() << "carve: error: the job failed (mpirun exit status " << rc << ")\n";
  }
  return rc;
}

} // namespace carve
