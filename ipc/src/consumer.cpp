// The consuming side of an endpoint: takes messages from its in rings (one, or
// any of them), validates each header before any tensor is made on it, and
// frees slots when messages are released. See channel_core.h.
#include <ATen/ATen.h>

#include <cstddef>
#include <cstring>

#include "channel_core.h"
#include "distill/core/errors.h"

namespace distill::ipc::detail {
namespace {

at::ScalarType fromWire(uint32_t d) {
  switch (wire::DType(d)) {
    case wire::DType::kInt32:
      return at::kInt;
    case wire::DType::kInt64:
      return at::kLong;
    case wire::DType::kFloat32:
      return at::kFloat;
    case wire::DType::kFloat16:
      return at::kHalf;
    case wire::DType::kBFloat16:
      return at::kBFloat16;
    case wire::DType::kBool:
      return at::kBool;
    case wire::DType::kInt16:
      return at::kShort;
  }
  return at::kByte; // unreachable after validateHeader
}

} // namespace

// A private copy of the header at in ring r's read cursor (its sequence in
// *seq), and the cursor moved past it. Validating the copy means the producer
// cannot change what was checked. Only the used prefix is copied
// (wire::headerBytes, sized from the copied fixed fields); the rest is zero.
wire::SlotHeader ChannelCore::copyHeader(int r, uint64_t* seq) {
  auto& ring = in_[size_t(r)];
  wire::SlotHeader h;
  std::lock_guard<std::mutex> lock(inMutex_);
  *seq = ring.readSeq();
  const auto* shared = reinterpret_cast<const unsigned char*>(ring.slot(*seq));
  constexpr size_t fixed = offsetof(wire::SlotHeader, tensors);
  std::memcpy(&h, shared, fixed);
  const size_t used = wire::headerBytes(h);
  std::memcpy(reinterpret_cast<unsigned char*>(&h) + fixed, shared + fixed, used - fixed);
  std::memset(reinterpret_cast<unsigned char*>(&h) + used, 0, sizeof h - used);
  ring.consumed();
  return h;
}

// Fills m's tensor descriptions from validated header h (slot of `seq` of in ring r).
void ChannelCore::describeTensors(int r, uint64_t seq, const wire::SlotHeader& h, ReceivedMessage& m) {
  bool deviceReadable = false; // the device memory's readable() was called for this message
  for (uint32_t i = 0; i < h.ntensors; ++i) {
    const auto& t = h.tensors[i];
    SlotMemory::Place place{nullptr, -1};
    if (t.location == uint32_t(wire::Location::kHost)) {
      place = inHost_[size_t(r)].place(seq, t.offset);
    } else {
      if (!deviceReadable && !device_.in.empty()) deviceReadable = device_.in[size_t(r)]->readable(seq);
      if (!deviceReadable) {
        m.core_.reset();
        releaseSlot(r, seq);
        DISTILL_THROW(ProtocolError, port_.describeSelf(), ": tensor '", t.name, "' from ",
                      port_.describeProcess(peerOf(r)),
                      " is in a CUDA buffer but no CUDA IPC buffer/event is set up on this ring");
      }
      place = device_.in[size_t(r)]->place(seq, t.offset);
    }
    auto& desc = m.tensors_[i];
    std::memcpy(desc.name, t.name, sizeof desc.name);
    desc.dtype = fromWire(t.dtype);
    desc.ndim = int(t.ndim);
    std::memcpy(desc.shape, t.shape, sizeof desc.shape);
    desc.data = place.data;
    desc.device = place.device;
  }
  m.ntensors_ = int(h.ntensors);
}

// Takes the message at the read cursor of in ring r (which must be readable);
// the flight recorder notes it as begun at `startNs` (when the wait for it
// began; 0 = it was already there).
ReceivedMessage ChannelCore::take(int r, int64_t startNs) {
  uint64_t seq = 0;
  const wire::SlotHeader h = copyHeader(r, &seq);
  std::string why;
  if (!wire::validateHeader(h, size_t(in_[size_t(r)].capacity()), &why)) {
    releaseSlot(r, seq);
    DISTILL_THROW(ProtocolError, port_.describeSelf(), ": invalid ", in_[size_t(r)].response() ? "response" : "request",
                  " header from ", port_.describeProcess(peerOf(r)), ": ", why, " (segment '", port_.seg().name,
                  "', ring seq ", seq, ")");
  }
  ReceivedMessage m;
  m.core_ = shared_from_this();
  m.ring_ = r;
  m.seq_ = seq;
  m.tag_ = Tag{h.seq, h.step, h.accStep};
  m.kind_ = MsgKind(h.kind);
  m.senderRank_ = h.senderRank;
  m.vocab_ = h.vocab;
  m.teacher_ = h.teacher;
  m.answer_ = h.answer;
  m.student_ = studentOf(r);
  if (h.kind == uint32_t(wire::Kind::kError)) m.errorText_ = h.errorText;
  describeTensors(r, seq, h, m);
  port_.recorder().complete(role_.takeOp, h.senderRank, h.step, h.accStep, h.seq, startNs, kindLabel(h.kind));
  return m;
}

void ChannelCore::releaseSlot(int r, uint64_t seq, bool device) {
  if (!device_.in.empty()) device_.in[size_t(r)]->readsDone(seq, device);
  std::lock_guard<std::mutex> lock(inMutex_);
  in_[size_t(r)].release(seq, peerOf(r));
}

bool ChannelCore::markFailed(int r, uint64_t seq) {
  std::lock_guard<std::mutex> lock(inMutex_);
  return in_[size_t(r)].markFailed(seq);
}

bool ChannelCore::canRead(int r) {
  std::lock_guard<std::mutex> lock(inMutex_);
  auto& ring = in_[size_t(r)];
  replay_.skipAnswered(r, ring, peerOf(r));
  return ring.canRead();
}

bool ChannelCore::studentDone(int r) {
  const auto st = wire::ProcState(port_.seg().process(studentOf(r)).state.load(std::memory_order_acquire));
  return st == wire::ProcState::kFinished && !canRead(r);
}

std::optional<ReceivedMessage> ChannelCore::tryReceive(int r) {
  return guarded([&]() -> std::optional<ReceivedMessage> {
    if (!canRead(r)) return std::nullopt;
    return take(r);
  });
}

ReceivedMessage ChannelCore::receive(int r, Deadline deadline, const std::optional<Tag>& expect) {
  return guarded([&] {
    if (canRead(r)) return take(r); // already there: no clock, no wait bookkeeping
    const WaitDesc d{wire::WaitWhat::kResponse, peerOf(r), expect};
    const auto start = Clock::now();
    const int64_t startNs = monotonicNs();
    if (!port_.waitUntil([&] { return canRead(r); }, d, {peerOf(r)}, true, deadline)) {
      ErrorWhere w = expect ? at(expect->step, expect->accStep) : ErrorWhere{};
      w.awaited = distill::detail::str("response from ", port_.describeProcess(peerOf(r)));
      DISTILL_THROW(TimeoutError, w, port_.describeSelf(), ": no response from ", port_.describeProcess(peerOf(r)),
                    " after ", toMs(Clock::now() - start), " ms",
                    expect ? distill::detail::str(" (awaiting seq ", expect->seq, ")") : std::string(), ", segment '",
                    port_.seg().name, "'");
    }
    return take(r, startNs);
  });
}

std::optional<ReceivedMessage> ChannelCore::tryWaitAny(Deadline deadline) {
  return guarded([&]() -> std::optional<ReceivedMessage> {
    const int n = numRings();
    int found = -1;
    auto any = [&] {
      for (int k = 1; k <= n; ++k) {
        const int r = (lastAny_ + k) % n;
        if (canRead(r)) {
          found = r;
          return true;
        }
      }
      return false;
    };
    if (any()) { // already there: no clock, no wait bookkeeping
      lastAny_ = found;
      return take(found);
    }
    std::vector<int> peers;
    for (int r = 0; r < n; ++r) peers.push_back(peerOf(r));
    const int64_t startNs = monotonicNs();
    if (!port_.waitUntil(any, WaitDesc{wire::WaitWhat::kRequest, -1, std::nullopt}, peers, false, deadline)) return std::nullopt;
    lastAny_ = found;
    return take(found, startNs);
  });
}

ReceivedMessage ChannelCore::waitAny(Deadline deadline) {
  const auto start = Clock::now();
  if (auto m = tryWaitAny(deadline)) return std::move(*m);
  DISTILL_THROW(TimeoutError, awaiting("request from any student"), port_.describeSelf(), ": no request from any of ",
                numRings(), " students after ", toMs(Clock::now() - start), " ms (segment '", port_.seg().name, "')");
}

} // namespace distill::ipc::detail
