#pragma once

// Messages between the local students and the teachers of a node, over the
// shared-memory rings of a Segment (docs/design.md, "The segment (ipc/)").
//
//   student i ── request ring i ──▶ its teacher
//   student i ◀── response ring i ── its teacher
//
// With teacher.procs K teachers per node, student i is served by teacher
// i % K (TeacherEndpoint::students() lists a teacher's).
//
// Each ring is single-producer single-consumer with `slots` slots; a producer
// that finds every slot taken waits (with its deadline) — nothing is dropped.
// Every header read from a ring is validated (wire::validateHeader) before any
// tensor is made on it; a bad one is a ProtocolError naming the field.
// Tags are carried, not interpreted: the layers above check them.
//
// Thread safety: an endpoint is used by one thread at a time. ReceivedMessage
// may be released from any thread. Errors: TimeoutError (deadline), PeerLostError
// (peer died / stalled / detached), ProtocolError (bad header), IpcError (the
// rest: oversize tensor, abort, unsupported dtype). A PeerLostError or
// ProtocolError poisons the endpoint: every later call rethrows it.

#include <ATen/Tensor.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distill/core/answer_kinds.h"
#include "distill/core/clock.h"
#include "distill/core/options.h"
#include "distill/core/tag.h"
#include "distill/ipc/segment.h"

namespace distill::ipc {

namespace detail {
class ChannelCore;
}

enum class MsgKind : uint32_t { kRequest = 1, kResponse = 2, kError = 3, kFinish = 4 }; // == wire::Kind
const char* msgKindName(MsgKind k);

// Tensors per message (the segment layout's limit; checked against it in ipc/src).
constexpr int kMaxTensors = 4;

// A message's identity is distill::Tag (core/tag.h): set by the student, echoed by the teacher.

struct OutMessage {
  Tag tag;
  MsgKind kind = MsgKind::kRequest;
  // Up to 4 named tensors of int32/int64/float32/float16/bfloat16/bool, at
  // most 8 dims, names < 32 bytes. Non-contiguous tensors are made contiguous;
  // CUDA tensors go through CUDA IPC buffers when set up, else via the host.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string errorText; // kind == kError: the message (truncated to 463 bytes)
  int64_t vocab = 0; // kind == kResponse: the teacher's vocabulary size (0 = not stated; < 2^32)
  uint64_t teacher = 0; // kind == kResponse: the teacher's fingerprint (0 = not stated)
  AnswerKind answer{}; // kind == kResponse: what its tensors are (core/answer_kinds.h); 0 otherwise
};

// A tensor to build directly in a (host) slot (in-slot allocation).
struct TensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

struct EndpointOptions {
  int rank = -1; // this process's global rank (messages, process table)
  int spinUs = 20; // transport.spin_us: spin before sleeping on the futex
  CudaIpc cudaIpc = CudaIpc::kAuto; // transport.cuda_ipc: auto | on | off
  int cudaDevice = -1; // this process's GPU for CUDA IPC buffers; -1: none (CUDA tensors are
                       // staged through the host slots). "on" with no usable device: IpcError
  std::string config; // published in the segment at attach for the teacher's admission check
                      // (core's configDescription; opaque here). "" = nothing published
  // device: this process's student.device / teacher.device ("cpu", "cuda" = the current device,
  // "cuda:N"): a CUDA device there gets the CUDA IPC buffers (cudaDevice).
  static EndpointOptions fromOptions(const TransportOptions& t, int rank, const std::string& device = "cpu");
};

// The teacher's admission check of one local student: given its local index
// and the config it published at attach ("" if none), "" admits it; anything
// else is why not, and refuses the job (see TeacherEndpoint::waitAdmission).
using AdmissionCheck = std::function<std::string(int localIndex, const std::string& config)>;

// A received message; holds its slot until release() or destruction.
class ReceivedMessage {
 public:
  ReceivedMessage();
  ~ReceivedMessage();
  ReceivedMessage(ReceivedMessage&&) noexcept;
  ReceivedMessage& operator=(ReceivedMessage&&) noexcept;
  ReceivedMessage(const ReceivedMessage&) = delete;
  ReceivedMessage& operator=(const ReceivedMessage&) = delete;

  bool held() const { return core_ != nullptr; }
  const Tag& tag() const { return tag_; }
  MsgKind kind() const { return kind_; }
  int senderRank() const { return senderRank_; }
  int student() const { return student_; } // local student index of the ring it came from
  const std::string& errorText() const { return errorText_; }
  int64_t vocab() const { return vocab_; } // the teacher's vocabulary size it stated (0: none)
  uint64_t teacher() const { return teacher_; } // the teacher's fingerprint it stated (0: none)
  // A response's answer kind as sent: a code of core/answer_kinds.h, unchecked here
  // (findAnswerKind, answerMismatch); 0 for other kinds of message.
  uint8_t answer() const { return answer_; }
  std::vector<std::string> names() const;
  bool has(const std::string& name) const;
  // Every tensor's name, dtype and shape, from the header (no tensor is made): answerMismatch's input.
  std::vector<TensorFacts> facts() const;

  // The tensor in place (no copy); valid only while the message is held.
  at::Tensor view(const std::string& name) const;
  // An owned copy, valid after release().
  at::Tensor copy(const std::string& name) const;
  // Frees the slot for the producer. Idempotent.
  void release();
  // Lets go of the message without freeing its slot: the ring's next consumer
  // (a restarted teacher, which starts at the oldest unfreed message) reads it
  // again. A teacher whose forward raised abandons what it had not answered.
  void abandon();
  // Teacher: notes in the ring that a forward raised on this request; true if
  // it was already noted (by an earlier incarnation): the failure repeats.
  bool markFailed();

 private:
  friend class detail::ChannelCore;
  // Fixed-size (sizes of wire.h): building a message allocates nothing.
  struct Desc {
    char name[32]; // NUL-terminated
    at::ScalarType dtype = at::kFloat;
    int ndim = 0;
    int64_t shape[8] = {};
    void* data = nullptr; // in the slot (host) or the slot's CUDA buffer
    int device = -1; // -1: host, else CUDA device ordinal
  };
  const Desc& find(const std::string& name) const;

  std::shared_ptr<detail::ChannelCore> core_;
  int ring_ = -1; // index of the consumer ring inside core_
  uint64_t seq_ = 0;
  Tag tag_;
  MsgKind kind_ = MsgKind::kRequest;
  int senderRank_ = -1;
  int student_ = -1;
  std::string errorText_;
  int64_t vocab_ = 0;
  uint64_t teacher_ = 0;
  uint8_t answer_ = 0;
  std::array<Desc, kMaxTensors> tensors_{};
  int ntensors_ = 0;
};

// Local student `localIndex` (0 .. numStudents-1) of the segment.
class StudentEndpoint {
 public:
  StudentEndpoint(const Segment& segment, int localIndex, EndpointOptions options = {});
  // Detaches: state finished, or dead when destroyed during stack unwinding.
  ~StudentEndpoint();
  StudentEndpoint(StudentEndpoint&&) noexcept;
  StudentEndpoint& operator=(StudentEndpoint&&) = delete;

  // Waits until the teacher has admitted every local student; TimeoutError
  // naming the teacher's state otherwise; ConfigError with the teacher's
  // reason, as soon as it refused (a config that differs from its own). Call
  // before any collective.
  void waitAdmission(Deadline deadline);
  // Copies msg's tensors into the next request slot (waits for a free slot).
  void send(const OutMessage& msg, Deadline deadline);
  // In-slot allocation: reserves the next request slot and returns tensors
  // living in it; fill them, then publish(). At most one allocation pending.
  std::vector<at::Tensor> allocate(const Tag& tag, const std::vector<TensorSpec>& specs, Deadline deadline,
                                   MsgKind kind = MsgKind::kRequest);
  void publish();
  // Waits for the next response (or error) from the teacher. `expect`, if
  // given, only labels the wait (process table, TimeoutError); not checked.
  ReceivedMessage receive(Deadline deadline, const std::optional<Tag>& expect = std::nullopt);
  std::optional<ReceivedMessage> tryReceive();

  int localIndex() const;
  int rank() const;
  Segment segment() const;

 private:
  std::shared_ptr<detail::ChannelCore> core_;
  int uncaught_;
};

// Teacher `teacher` (0 .. numTeachers-1; local index numStudents + teacher) of
// the segment, serving the rings of its students only.
class TeacherEndpoint {
 public:
  explicit TeacherEndpoint(const Segment& segment, EndpointOptions options = {}, int teacher = 0);
  ~TeacherEndpoint();
  TeacherEndpoint(TeacherEndpoint&&) noexcept;
  TeacherEndpoint& operator=(TeacherEndpoint&&) = delete;

  // Waits until every local student it serves attached, then admits them (students'
  // waitAdmission returns). TimeoutError names the students that never came.
  // With `check`, each student is checked as soon as it attached: the first
  // refusal is written to the segment (every student's waitAdmission throws
  // ConfigError with it, those still to attach too) and thrown here as
  // ConfigError, without waiting for the others.
  void waitAdmission(Deadline deadline, const AdmissionCheck& check = {});
  int numStudents() const; // the students it serves
  std::vector<int> students() const; // their local indices, ascending
  int teacher() const; // its index among the node's teachers
  // True if local student `student` detached cleanly and left nothing unread:
  // it will send nothing more (a restarted teacher uses this for students whose
  // finish message the previous incarnation consumed).
  bool studentDone(int student);
  // The next request of student i if one is there.
  std::optional<ReceivedMessage> poll(int student);
  // The next request of any student (round robin); PeerLostError if a student
  // that has not finished dies meanwhile, TimeoutError at the deadline.
  ReceivedMessage waitAny(Deadline deadline);
  // The same for a wait that may well end empty (a server's idle loop):
  // nullopt at the deadline; exceptions only for failures (PeerLostError, ...).
  std::optional<ReceivedMessage> tryWaitAny(Deadline deadline);
  void reply(int student, const OutMessage& msg, Deadline deadline);
  std::vector<at::Tensor> allocateReply(int student, const Tag& tag, const std::vector<TensorSpec>& specs,
                                        Deadline deadline, MsgKind kind = MsgKind::kResponse);
  void publishReply(int student);

  int rank() const;
  Segment segment() const;

 private:
  std::shared_ptr<detail::ChannelCore> core_;
  int uncaught_;
};

} // namespace distill::ipc
