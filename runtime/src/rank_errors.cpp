//===- rank_errors.cpp - error lines of the training executable -----------===//

#include "rank_errors.h"

#include <cstdio>

namespace carve::rt {

namespace {

int errorRank = 0;
int errorWorldSize = 1;

} // namespace

void setErrorRank(int rank, int size) {
  errorRank = rank;
  errorWorldSize = size;
}

void printError(const std::string &message) {
  std::fflush(stdout);
  if (errorWorldSize > 1)
    std::fprintf(stderr, "[rank %d] carve: error: %s\n", errorRank, message.c_str());
  else
    std::fprintf(stderr, "carve: error: %s\n", message.c_str());
  std::fflush(stderr);
}

void die(const std::string &message) {
  printError(message);
  abortAll(1);
}

bool agree(Communicator &world, const std::string &error) {
  int64_t flag = error.empty() ? 0 : world.size() - world.rank();
  world.allReduce(&flag, 1, CommType::I64, ReduceOp::Max);
  if (flag != 0 && world.size() - flag == world.rank())
    printError(error);
  return flag == 0;
}

} // namespace carve::rt
