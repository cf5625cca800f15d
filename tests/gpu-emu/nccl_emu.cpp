//===- nccl_emu.cpp - NCCL for one rank, on the CPU -----------------------===//
//
// The emulated build links this instead of libnccl, so that comm_nccl.cpp
// (the NCCL communicator carve ships) runs as it is. One rank per
// communicator for now: every collective of one rank is a copy (or
// nothing, in place), and a send to itself is received by its matching
// receive, in order. A communicator of several ranks is refused at
// ncclCommInitRankConfig with an error that says so (README.md, "Not yet").
// Every buffer must be device memory, as NCCL requires.
//
//===----------------------------------------------------------------------===//

#include "cuda_emu.h"

#include "emu_internal.h"

#include <nccl.h>

#include <cstring>
#include <deque>
#include <string>
#include <vector>

struct ncclComm {
  int rank = 0, nranks = 1;
  std::string lastError;
  std::deque<std::vector<char>> selfMessages; // sent to itself, not yet received
};

namespace {

size_t typeBytes(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8:
    return 1;
  case ncclFloat16:
  case ncclBfloat16:
    return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32:
    return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64:
    return 8;
  default:
    carve_emu::fatalCall("NCCL: data type %d is not one carve uses", static_cast<int>(t));
  }
}

void needDevice(const char *call, const void *p, size_t bytes) {
  if (bytes && !carve_emu::isDeviceMemory(p, bytes))
    carve_emu::fatalCall("%s: %p (%zu bytes) is not inside one device allocation", call, p, bytes);
}

/// A one-rank collective: recv = send.
ncclResult_t copyOp(const char *call, const void *send, void *recv, size_t bytes, ncclComm_t comm,
                    cudaStream_t s) {
  if (!comm)
    return ncclInvalidArgument;
  needDevice(call, send, bytes);
  needDevice(call, recv, bytes);
  // One operation (one node of a captured graph) per call, in place or not.
  carve_emu::enqueue(s, [=]() {
    if (send != recv)
      std::memmove(recv, send, bytes);
  });
  return ncclSuccess;
}

} // namespace

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  std::memset(id, 0, sizeof *id);
  std::snprintf(id->internal, sizeof id->internal, "carve-emu one-rank communicator");
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId, int rank,
                                    ncclConfig_t *) {
  *comm = nullptr;
  if (nranks != 1 || rank != 0)
    return ncclInvalidUsage;
  *comm = new ncclComm;
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int, ncclComm_t *newcomm, ncclConfig_t *) {
  *newcomm = nullptr;
  if (!comm)
    return ncclInvalidArgument;
  if (color != NCCL_SPLIT_NOCOLOR)
    *newcomm = new ncclComm;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!comm)
    return ncclInvalidArgument;
  *asyncError = ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (comm && !comm->selfMessages.empty())
    carve_emu::fatalCall("ncclCommFinalize: %zu message(s) this rank sent itself were never "
                         "received",
                         comm->selfMessages.size());
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess:
    return "no error";
  case ncclInvalidUsage:
    return "invalid usage (the CPU emulation runs one-rank NCCL communicators only, for now)";
  case ncclInvalidArgument:
    return "invalid argument";
  default:
    return "an NCCL error of the CPU emulation";
  }
}

const char *ncclGetLastError(ncclComm_t) { return ""; }

ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclRedOp_t, ncclComm_t comm, cudaStream_t s) {
  return copyOp("ncclAllReduce", send, recv, count * typeBytes(t), comm, s);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t,
                           ncclComm_t comm, cudaStream_t s) {
  return copyOp("ncclAllGather", send, recv, count * typeBytes(t), comm, s);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t,
                               ncclRedOp_t, ncclComm_t comm, cudaStream_t s) {
  return copyOp("ncclReduceScatter", send, recv, count * typeBytes(t), comm, s);
}

ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t,
                        int root, ncclComm_t comm, cudaStream_t s) {
  if (root != 0)
    return ncclInvalidArgument;
  return copyOp("ncclReduce", send, recv, count * typeBytes(t), comm, s);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root,
                           ncclComm_t comm, cudaStream_t s) {
  if (root != 0)
    return ncclInvalidArgument;
  return copyOp("ncclBroadcast", send, recv, count * typeBytes(t), comm, s);
}

ncclResult_t ncclSend(const void *send, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  if (!comm || peer != 0)
    return ncclInvalidArgument;
  const size_t bytes = count * typeBytes(t);
  needDevice("ncclSend", send, bytes);
  carve_emu::enqueue(s, [=]() {
    const char *p = static_cast<const char *>(send);
    comm->selfMessages.emplace_back(p, p + bytes);
  });
  return ncclSuccess;
}

ncclResult_t ncclRecv(void *recv, size_t count, ncclDataType_t t, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  if (!comm || peer != 0)
    return ncclInvalidArgument;
  const size_t bytes = count * typeBytes(t);
  needDevice("ncclRecv", recv, bytes);
  carve_emu::enqueue(s, [=]() {
    if (comm->selfMessages.empty())
      carve_emu::fatalCall("ncclRecv from rank 0 (itself): no message was sent");
    std::vector<char> m = std::move(comm->selfMessages.front());
    comm->selfMessages.pop_front();
    if (m.size() != bytes)
      carve_emu::fatalCall("ncclRecv: %zu bytes expected, the matching ncclSend sent %zu", bytes,
                           m.size());
    std::memcpy(recv, m.data(), bytes);
  });
  return ncclSuccess;
}

} // extern "C"
