#pragma once

// The state behind an endpoint of channel.h, shared with the messages it
// received (they may outlive the endpoint). Internal to ipc/. Its methods are
// implemented by role in separate files:
//   channel.cpp    construction, the endpoints and ReceivedMessage
//   producer.cpp   send / allocate / publish into the out rings
//   consumer.cpp   take / receive / tryReceive / waitAny / release from the in rings
//   admission.cpp  the teacher's admission of its students, a student's wait for it
//   replay.h       what a restarted teacher skips in its in rings
// The two ends differ only in data fixed at construction (Role, the rings and
// the peer of each), never in branches on the role.

#include <ATen/core/Tensor.h>

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "distill/core/errors.h"
#include "distill/core/trace.h"
#include "distill/ipc/channel.h"
#include "port.h"
#include "replay.h"
#include "ring.h"
#include "slot_memory.h"

namespace distill::ipc::detail {

// What differs between a student's end (requests out, responses in) and a
// teacher's end (the reverse).
struct Role {
  const char* outName; // "request" | "response": what this end produces
  const char* capacityKey; // the option that sizes those slots
  wire::WaitWhat outSlot; // waiting for a free slot to produce into
  trace::Op sendOp; // flight-recorder op of a message sent ...
  trace::Op takeOp; // ... and of one taken
  bool producesResponses; // the out rings are response rings
  static Role student();
  static Role teacher();
};

// Flight-recorder label of a message kind: only the unusual ones get one.
inline const char* kindLabel(uint32_t kind) {
  return kind == uint32_t(wire::Kind::kFinish) ? "finish" : kind == uint32_t(wire::Kind::kError) ? "error" : "";
}

class ChannelCore : public std::enable_shared_from_this<ChannelCore> {
  using Desc = ReceivedMessage::Desc;
  static_assert(sizeof(Desc::name) == wire::kNameBytes && sizeof(Desc::shape) == wire::kMaxDims * sizeof(int64_t),
                "ReceivedMessage::Desc must hold what wire.h allows");

 public:
  ChannelCore(const Segment& seg, int index, const EndpointOptions& opt);

  Port& port() { return port_; }
  const Segment& segment() const { return segment_; }
  int numRings() const { return int(in_.size()); }
  // Ring index of local student `student` (-1: not one of this end's rings).
  int ringOf(int student) const;
  // Process index on the other side of ring r, and the student ring r belongs to.
  int peerOf(int r) const { return peers_[size_t(r)]; }
  int studentOf(int r) const { return in_[size_t(r)].student(); }

  // ---- producer.cpp ----
  void send(int r, const OutMessage& msg, Deadline deadline);
  std::vector<at::Tensor> allocate(int r, const Tag& tag, MsgKind kind, const std::vector<TensorSpec>& specs,
                                   Deadline deadline);
  void publish(int r);

  // ---- consumer.cpp ----
  std::optional<ReceivedMessage> tryReceive(int r);
  ReceivedMessage receive(int r, Deadline deadline, const std::optional<Tag>& expect);
  std::optional<ReceivedMessage> tryWaitAny(Deadline deadline);
  ReceivedMessage waitAny(Deadline deadline);
  // Ring r's student detached cleanly and left nothing to read.
  bool studentDone(int r);
  // Frees the slot of `seq` in in ring r; `device`: the message had tensors in
  // device slot memory (their reads are ordered before the producer's next
  // writes first: SlotMemory::readsDone, called on every release).
  void releaseSlot(int r, uint64_t seq, bool device = false);
  // Request rings (a teacher): notes that a forward raised on `seq` of in ring
  // r; true if it was already noted (RingSide::markFailed).
  bool markFailed(int r, uint64_t seq);

  // ---- admission.cpp ----
  void teacherAdmission(Deadline deadline, const AdmissionCheck& check);
  void studentAdmission(Deadline deadline);

 private:
  // What plan() needs of one tensor; points into the caller's objects (no
  // copies of names or shapes on the per-message path).
  struct PlanItem {
    const std::string* name = nullptr;
    at::ScalarType dtype = at::kFloat;
    c10::IntArrayRef shape;
    wire::Location location = wire::Location::kHost;
  };
  wire::SlotHeader plan(int r, const Tag& tag, MsgKind kind, const PlanItem* items, size_t count,
                        const std::string& errorText);
  void planTensor(int r, const Tag& tag, const PlanItem* items, size_t i, wire::TensorDesc& t, uint64_t* used);
  uint64_t acquire(int r, const Tag& tag, Deadline deadline);
  void commit(int r, wire::SlotHeader& hdr);
  bool canRead(int r);
  ReceivedMessage take(int r, int64_t startNs = 0);
  wire::SlotHeader copyHeader(int r, uint64_t* seq);
  void describeTensors(int r, uint64_t seq, const wire::SlotHeader& h, ReceivedMessage& m);
  SlotMemory& outMemory(int r, wire::Location l) {
    return l == wire::Location::kHost ? outHost_[size_t(r)] : *device_.out[size_t(r)];
  }

  void rethrowIfPoisoned() {
    if (poison_) std::rethrow_exception(poison_);
  }
  // Runs f; a PeerLostError or ProtocolError poisons the endpoint (every later call rethrows it).
  template <typename F>
  auto guarded(F f) -> decltype(f()) {
    rethrowIfPoisoned();
    try {
      return f();
    } catch (const PeerLostError&) {
      poison_ = std::current_exception();
      throw;
    } catch (const ProtocolError&) {
      poison_ = std::current_exception();
      throw;
    }
  }

  Segment segment_;
  EndpointOptions opt_;
  Port port_;
  Role role_;
  std::vector<RingSide> in_, out_; // ring r of each: the same student
  std::vector<int> peers_; // per ring: the process on the other side
  std::vector<HostSlotMemory> inHost_, outHost_;
  DeviceSlotMemory device_; // per ring, when CUDA IPC is used
  Replay replay_; // teacher: what an earlier incarnation answered
  std::mutex inMutex_; // consumer cursors: messages may be released from other threads
  std::exception_ptr poison_;
  int pending_ = -1; // out ring with an unpublished allocate()
  wire::SlotHeader pendingHdr_{};
  int lastAny_ = -1;
};

} // namespace distill::ipc::detail
