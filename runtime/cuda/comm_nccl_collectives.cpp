//===- comm_nccl_collectives.cpp - the NCCL communicator's operations ----===//
//
// The operations of NcclCommunicator (comm_nccl.h; the design is described
// at the top of comm_nccl.cpp): the collectives, point-to-point messages
// (a rank's messages to itself matched and copied on the group's stream),
// wait, broadcast and barrier. Each but the barrier (which orders hosts, not
// kernels) starts by making the group's stream wait for the compute stream,
// stages host memory through pinned buffers, enqueues the NCCL call and ends
// with a done event that the wait makes the compute stream (and, for staged
// host memory, the host) wait for. The events, slots and staging buffers they
// take are reused from operation to operation.
//
//===----------------------------------------------------------------------===//

#include "comm_nccl.h"

#include "carve/rt/kernels.h"
#include "carve/rt/metrics.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace carve::gpu {
namespace {

using carve::rt::commTypeBytes;
using carve::rt::formatBytes;

ncclDataType_t ncclType(CommType t) {
  switch (t) {
  case CommType::F32:
    return ncclFloat;
  case CommType::F64:
    return ncclDouble;
  case CommType::I64:
    return ncclInt64;
  case CommType::I32:
    return ncclInt32;
  case CommType::U8:
    return ncclUint8;
  case CommType::BF16:
    return ncclBfloat16;
  case CommType::F16:
    return ncclFloat16;
  }
  fatal("collective: unknown element type %d", static_cast<int>(t));
}

ncclRedOp_t ncclOp(ReduceOp op) { return op == ReduceOp::Max ? ncclMax : ncclSum; }

void checkCount(const char *op, int64_t n) {
  if (n < 0)
    fatal("%s of %lld elements", op, static_cast<long long>(n));
}

/// Memory NCCL cannot use directly: pageable or pinned host memory (device
/// and managed memory it can).
bool isHost(const void *p) {
  if (!p)
    return false;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    // Older drivers fail on unregistered host memory; clear the error.
    cudaGetLastError();
    return true;
  }
  return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
}

} // namespace

//===--- Operations --------------------------------------------------------===//

CommHandle NcclCommunicator::allReduceAsync(void *buf, int64_t n, CommType t, ReduceOp op) {
  checkCount("all-reduce", n);
  if (n == 0)
    return {};
  const int64_t bytes = n * commTypeBytes(t);
  Op o = begin(OpInfo{"all-reduce", bytes});
  int b = o.stage.add(buf, bytes, true, true);
  stageIn(o);
  void *d = o.stage.dev(b, buf);
  settle(ncclAllReduce(d, d, static_cast<size_t>(n), ncclType(t), ncclOp(op), comm, groupStream),
         o.info);
  return end(o);
}

CommHandle NcclCommunicator::allGatherAsync(const void *send, void *recv, int64_t nPerRank,
                                            CommType t) {
  checkCount("all-gather", nPerRank);
  if (nPerRank == 0)
    return {};
  const int64_t block = nPerRank * commTypeBytes(t);
  Op o = begin(OpInfo{"all-gather", block * size()});
  // The receive buffer first: an in-place send lies inside it.
  int r = o.stage.add(recv, block * size(), true, true);
  int s = o.stage.add(send, block, true, false);
  stageIn(o);
  settle(ncclAllGather(o.stage.dev(s, send), o.stage.dev(r, recv), static_cast<size_t>(nPerRank),
                       ncclType(t), comm, groupStream),
         o.info);
  return end(o);
}

CommHandle NcclCommunicator::reduceScatterAsync(const void *send, void *recv, const int64_t *counts,
                                                CommType t, ReduceOp op) {
  const int n = size();
  int64_t total = 0;
  bool equal = true;
  for (int r = 0; r < n; ++r) {
    checkCount("reduce-scatter", counts[r]);
    total += counts[r];
    equal = equal && counts[r] == counts[0];
  }
  if (total == 0)
    return {};
  const int es = commTypeBytes(t);
  Op o = begin(OpInfo{"reduce-scatter", total * es});
  int s = o.stage.add(send, total * es, true, false);
  int r = counts[myRank] > 0 ? o.stage.add(recv, counts[myRank] * es, false, true) : -1;
  stageIn(o);
  const char *dSend = static_cast<const char *>(o.stage.dev(s, send));
  void *dRecv = o.stage.dev(r, recv);
  if (equal) {
    settle(ncclReduceScatter(dSend, dRecv, static_cast<size_t>(counts[0]), ncclType(t), ncclOp(op),
                             comm, groupStream),
           o.info);
  } else {
    // One reduction to each rank, grouped into one launch. Non-root ranks
    // never write their receive pointer; they get a valid one anyway.
    settle(ncclGroupStart(), o.info);
    int64_t offset = 0;
    for (int root = 0; root < n; ++root) {
      if (counts[root] > 0) {
        const char *part = dSend + offset * es;
        void *out = root == myRank ? dRecv : const_cast<char *>(part);
        ncclResult_t res = ncclReduce(part, out, static_cast<size_t>(counts[root]), ncclType(t),
                                      ncclOp(op), root, comm, groupStream);
        if (res != ncclSuccess && res != ncclInProgress) {
          ncclGroupEnd();
          fail(o.info, ncclCause(res, comm));
        }
      }
      offset += counts[root];
    }
    settle(ncclGroupEnd(), o.info);
  }
  return end(o);
}

CommHandle NcclCommunicator::allToAllAsync(const void *send, void *recv, int64_t nPerRank,
                                           CommType t) {
  checkCount("all-to-all", nPerRank);
  if (nPerRank == 0)
    return {};
  const int n = size();
  const int64_t block = nPerRank * commTypeBytes(t);
  Op o = begin(OpInfo{"all-to-all", block * n});
  int s = o.stage.add(send, block * n, true, false);
  int r = o.stage.add(recv, block * n, false, true);
  stageIn(o);
  const char *dSend = static_cast<const char *>(o.stage.dev(s, send));
  char *dRecv = static_cast<char *>(o.stage.dev(r, recv));
  if (n > 1) {
    settle(ncclGroupStart(), o.info);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == myRank)
        continue;
      ncclResult_t a = ncclSend(dSend + peer * block, static_cast<size_t>(nPerRank), ncclType(t),
                                peer, comm, groupStream);
      ncclResult_t b = ncclRecv(dRecv + peer * block, static_cast<size_t>(nPerRank), ncclType(t),
                                peer, comm, groupStream);
      for (ncclResult_t res : {a, b})
        if (res != ncclSuccess && res != ncclInProgress) {
          ncclGroupEnd();
          fail(o.info, ncclCause(res, comm));
        }
    }
    settle(ncclGroupEnd(), o.info);
  }
  cudaCheck(cudaMemcpyAsync(dRecv + myRank * block, dSend + myRank * block,
                            static_cast<size_t>(block), cudaMemcpyDefault, groupStream),
            o.info);
  return end(o);
}

CommHandle NcclCommunicator::sendAsync(const void *buf, int64_t bytes, int peer, int tag) {
  checkPeer("send", bytes, peer, tag);
  if (bytes == 0)
    return {};
  if (peer == myRank)
    return postSelf(true, const_cast<void *>(buf), bytes, tag);
  Op o = begin(OpInfo{"send", bytes, peer});
  int b = o.stage.add(buf, bytes, true, false);
  stageIn(o);
  settle(
      ncclSend(o.stage.dev(b, buf), static_cast<size_t>(bytes), ncclUint8, peer, comm, groupStream),
      o.info);
  return end(o);
}

CommHandle NcclCommunicator::recvAsync(void *buf, int64_t bytes, int peer, int tag) {
  checkPeer("receive", bytes, peer, tag);
  if (bytes == 0)
    return {};
  if (peer == myRank)
    return postSelf(false, buf, bytes, tag);
  Op o = begin(OpInfo{"receive", bytes, peer});
  int b = o.stage.add(buf, bytes, false, true);
  stageIn(o);
  settle(
      ncclRecv(o.stage.dev(b, buf), static_cast<size_t>(bytes), ncclUint8, peer, comm, groupStream),
      o.info);
  return end(o);
}

void NcclCommunicator::wait(CommHandle h) {
  if (h.id < 0)
    return;
  if (h.id >= static_cast<int64_t>(slots.size()) || !slots[h.id].active)
    fatal("wait on unknown or already completed communication handle %lld",
          static_cast<long long>(h.id));
  Slot &s = slots[h.id];
  if (s.selfPending)
    fatal("wait on a %s with tag %d to this same rank that no %s matches: it would never "
          "complete",
          s.info.op, s.selfTag, std::strcmp(s.info.op, "send") == 0 ? "receive" : "send");
  if (s.staging >= 0) {
    hostWait(s.done, s.info);
    Staging &st = staging[s.staging];
    for (const Copy &c : s.outs)
      std::memcpy(c.host, static_cast<char *>(st.pinned) + c.offset, static_cast<size_t>(c.bytes));
    st.busy = false;
  }
  cudaCheck(cudaStreamWaitEvent(compute(), s.done, 0), s.info);
  freeSlot(h.id);
}

void NcclCommunicator::broadcast(void *buf, int64_t bytes, int root) {
  if (bytes < 0 || root < 0 || root >= size())
    fatal("broadcast of %lld bytes from rank %d in a group of %d ranks",
          static_cast<long long>(bytes), root, size());
  if (bytes == 0)
    return;
  Op o = begin(OpInfo{"broadcast", bytes});
  int b = o.stage.add(buf, bytes, myRank == root, myRank != root);
  stageIn(o);
  void *d = o.stage.dev(b, buf);
  settle(ncclBroadcast(d, d, static_cast<size_t>(bytes), ncclUint8, root, comm, groupStream),
         o.info);
  CommHandle h = end(o);
  const OpInfo info = slots[h.id].info;
  cudaEvent_t done = slots[h.id].done;
  hostWait(done, info);
  wait(h);
}

void NcclCommunicator::barrier() {
  OpInfo info{"barrier", 0};
  // No compute-stream dependency: a barrier orders hosts, not kernels.
  settle(ncclAllReduce(barrierBuf, barrierBuf, 1, ncclFloat, ncclSum, comm, groupStream), info);
  cudaEvent_t ev = takeEvent();
  cudaCheck(cudaEventRecord(ev, groupStream), info);
  watchOp(info);
  hostWait(ev, info);
  freeEvents.push_back(ev);
}

//===--- Staging host memory -----------------------------------------------===//

int NcclCommunicator::Stager::add(const void *p, int64_t bytes, bool in, bool out) {
  if (bytes <= 0 || !isHost(p))
    return -1;
  const char *c = static_cast<const char *>(p);
  for (size_t i = 0; i < regions.size(); ++i) {
    Region &r = regions[i];
    if (c >= r.host && c + bytes <= r.host + r.bytes) {
      r.in = r.in || in;
      r.out = r.out || out;
      refs.push_back({static_cast<int>(i), c - r.host});
      return static_cast<int>(refs.size()) - 1;
    }
  }
  regions.push_back({c, bytes, total, in, out});
  total += (bytes + 255) & ~int64_t(255);
  refs.push_back({static_cast<int>(regions.size()) - 1, 0});
  return static_cast<int>(refs.size()) - 1;
}

//===--- Starting and ending operations ------------------------------------===//

NcclCommunicator::Op NcclCommunicator::begin(OpInfo info) {
  Op o;
  o.info = info;
  // The operation reads what the compute stream has written so far.
  cudaCheck(cudaEventRecord(ready, compute()), info);
  cudaCheck(cudaStreamWaitEvent(groupStream, ready, 0), info);
  return o;
}

void NcclCommunicator::stageIn(Op &o) {
  if (o.stage.empty())
    return;
  if (carve::gpu::capturing())
    fail(o.info, "host memory cannot take part in a collective captured in a CUDA graph (the "
                 "copy to the device would not be repeated)");
  o.staging = takeStaging(static_cast<size_t>(o.stage.total), o.info);
  Staging &st = staging[o.staging];
  o.stage.base = static_cast<char *>(st.dev);
  for (const Stager::Region &r : o.stage.regions)
    if (r.in)
      std::memcpy(static_cast<char *>(st.pinned) + r.offset, r.host, static_cast<size_t>(r.bytes));
  cudaCheck(cudaMemcpyAsync(st.dev, st.pinned, static_cast<size_t>(o.stage.total),
                            cudaMemcpyHostToDevice, groupStream),
            o.info);
}

CommHandle NcclCommunicator::end(Op &o) {
  const int64_t id = takeSlot();
  Slot &s = slots[id];
  s.info = o.info;
  s.staging = o.staging;
  s.captured = carve::gpu::capturing();
  s.outs.clear();
  if (o.staging >= 0) {
    Staging &st = staging[o.staging];
    cudaCheck(cudaMemcpyAsync(st.pinned, st.dev, static_cast<size_t>(o.stage.total),
                              cudaMemcpyDeviceToHost, groupStream),
              o.info);
    for (const Stager::Region &r : o.stage.regions)
      if (r.out)
        s.outs.push_back(Copy{const_cast<char *>(r.host), r.offset, r.bytes});
  }
  cudaCheck(cudaEventRecord(s.done, groupStream), o.info);
  watchOp(o.info);
  return CommHandle{id};
}

CommHandle NcclCommunicator::postSelf(bool isSend, void *buf, int64_t bytes, int tag) {
  OpInfo info{isSend ? "send" : "receive", bytes, myRank};
  const int64_t id = takeSlot();
  slots[id].info = info;
  slots[id].staging = -1;
  slots[id].captured = carve::gpu::capturing();
  slots[id].outs.clear();
  for (auto it = selfOps.begin(); it != selfOps.end(); ++it) {
    if (it->isSend == isSend || it->tag != tag)
      continue;
    const SelfOp other = *it;
    selfOps.erase(it);
    const SelfOp &send = isSend ? SelfOp{id, true, buf, bytes, tag} : other;
    const SelfOp &recv = isSend ? other : SelfOp{id, false, buf, bytes, tag};
    if (send.bytes != recv.bytes)
      fatal("a send of %lld bytes to this same rank meets a receive of %lld bytes (tag %d)",
            static_cast<long long>(send.bytes), static_cast<long long>(recv.bytes), tag);
    begin(info);
    cudaCheck(cudaMemcpyAsync(recv.buf, send.buf, static_cast<size_t>(bytes), cudaMemcpyDefault,
                              groupStream),
              info);
    for (int64_t s : {id, other.slot}) {
      slots[s].selfPending = false;
      cudaCheck(cudaEventRecord(slots[s].done, groupStream), info);
    }
    // Host memory is not staged here, and wait() orders only the compute
    // stream: the host waits for the copy now (bounded like every host wait).
    if (isHost(send.buf) || isHost(recv.buf))
      hostWait(slots[id].done, info);
    return CommHandle{id};
  }
  slots[id].selfPending = true;
  slots[id].selfTag = tag;
  selfOps.push_back(SelfOp{id, isSend, buf, bytes, tag});
  return CommHandle{id};
}

//===--- Resources ---------------------------------------------------------===//

cudaError_t NcclCommunicator::addStaging(size_t bytes) {
  Staging s;
  s.cap = bytes;
  cudaError_t e = cudaMalloc(&s.dev, bytes);
  if (e != cudaSuccess)
    return e;
  e = cudaMallocHost(&s.pinned, bytes);
  if (e != cudaSuccess) {
    cudaFree(s.dev);
    return e;
  }
  staging.push_back(s);
  return cudaSuccess;
}

int NcclCommunicator::takeStaging(size_t bytes, const OpInfo &info) {
  for (size_t i = 0; i < staging.size(); ++i)
    if (!staging[i].busy && staging[i].cap >= bytes) {
      staging[i].busy = true;
      return static_cast<int>(i);
    }
  cudaError_t e = addStaging(std::max<size_t>(bytes, 64 << 10));
  if (e != cudaSuccess)
    fail(info, "staging " + formatBytes(static_cast<int64_t>(bytes)) +
                   " of host memory for the device: " + cudaGetErrorString(e));
  staging.back().busy = true;
  return static_cast<int>(staging.size()) - 1;
}

cudaEvent_t NcclCommunicator::takeEvent() {
  if (!freeEvents.empty()) {
    cudaEvent_t ev = freeEvents.back();
    freeEvents.pop_back();
    return ev;
  }
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e != cudaSuccess)
    fatal("CUDA: cudaEventCreateWithFlags failed: %s", cudaGetErrorString(e));
  return ev;
}

int64_t NcclCommunicator::takeSlot() {
  int64_t id;
  if (!freeSlots.empty()) {
    id = freeSlots.back();
    freeSlots.pop_back();
  } else {
    slots.emplace_back();
    id = static_cast<int64_t>(slots.size()) - 1;
  }
  Slot &s = slots[id];
  s.active = true;
  s.selfPending = false;
  if (!s.done)
    s.done = takeEvent();
  return id;
}

void NcclCommunicator::discardCaptured() {
  for (int64_t id = 0; id < static_cast<int64_t>(slots.size()); ++id) {
    Slot &s = slots[id];
    if (!s.active || !s.captured)
      continue;
    // Fails where the capture is already invalidated: it ends anyway.
    (void)cudaStreamWaitEvent(compute(), s.done, 0);
    s.captured = false;
    freeSlot(id);
  }
  for (auto it = selfOps.begin(); it != selfOps.end();)
    it = slots[it->slot].active ? std::next(it) : selfOps.erase(it);
  (void)cudaGetLastError();
}

void NcclCommunicator::freeSlot(int64_t id) {
  slots[id].active = false;
  slots[id].outs.clear();
  slots[id].staging = -1;
  freeSlots.push_back(id);
}

} // namespace carve::gpu
