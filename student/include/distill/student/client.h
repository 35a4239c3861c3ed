#pragma once

// The student's side of the rings: hand the teacher micro-batches, get its
// outputs back.
//
//   auto h = client.submit({{"input_ids", ids}}, step, accStep);  // returns at once
//   ... compute the student's forward meanwhile ...
//   TeacherReply r = client.get(h);                              // waits, checks the tag
//   auto loss = distillLoss(logits, labels, r.output(), opts, normalizer);
//
// Up to student.in_flight requests may be outstanding; submit() waits (with
// the response deadline) only when that many are. Every answer is checked
// against the request it answers: same seq, step and acc_step, or a
// ProtocolError naming both. An error answer from the teacher (a skipped
// acc_step, a wrong shape) is a ProtocolError carrying the teacher's words. A
// dead or stalled teacher is a PeerLostError within about two heartbeats.
//
// Thread safety: one thread per client. Lifetime: the client must outlive the
// TeacherReply objects it returned in view mode.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "distill/core/options.h"
#include "distill/core/status.h"
#include "distill/core/tag.h"
#include "distill/core/topology.h"
#include "distill/loss/losses.h"

namespace distill {

namespace ipc {
class ReceivedMessage;
}

// A request in flight: its tag (seq, step, acc_step), the name the student API
// gives it (submit() returns one, get() takes it).
using Handle = Tag;

enum class ReplyMode {
  kCopy, // owned tensors; the slot is freed at once
  kView, // tensors in place in the slot (zero copy); valid while the reply lives
};

class TeacherReply {
 public:
  TeacherReply();
  ~TeacherReply();
  TeacherReply(TeacherReply&&) noexcept;
  TeacherReply& operator=(TeacherReply&&) noexcept;

  const Handle& handle() const { return handle_; }
  // The teacher's output for the loss: full logits, top-k + logsumexp + log
  // tail, or hidden states with the node's mapped head attached (HiddenAnswer),
  // and the teacher's vocabulary size (the loss checks it, loss.vocab).
  TeacherOutput output() const;
  // The teacher's vocabulary size as it stated it (0: not stated).
  int64_t vocab() const { return vocab_; }
  // The fingerprint of the teacher that answered (model.h's teacherFingerprint; 0: not stated).
  // One teacher answers a run: get() refuses an answer of another.
  uint64_t teacherFingerprint() const { return teacher_; }
  // The answer's kind (core/answer_kinds.h), as the message said and its tensors match.
  AnswerKind kind() const { return kind_; }
  // Any named tensor of the answer (hidden states).
  at::Tensor tensor(const std::string& name) const;
  bool has(const std::string& name) const;
  // Frees the slot (view mode); the tensors must not be used after.
  void release();

 private:
  friend class Client;
  Handle handle_;
  int64_t vocab_ = 0;
  uint64_t teacher_ = 0;
  AnswerKind kind_ = AnswerKind::kLogits;
  std::vector<std::pair<std::string, at::Tensor>> tensors_;
  std::shared_ptr<const TeacherHead> head_; // hidden-state answers: the head they were made for
  at::Tensor ids_; // the request's ids (protocol::kRequestIds), which an ids answer is at
  std::unique_ptr<ipc::ReceivedMessage> held_; // view mode only
};

class Client {
 public:
  // Attaches to this node's segment as local student topo.studentLocalRank and
  // waits (run.startup_timeout_s) until the teacher has admitted every local
  // student. Call before any collective. teacher.answer hidden: then maps the
  // head the node's first teacher published (MappedTeacherHead::open, the same
  // deadline; student/teacher_head.h): one read-only copy per node.
  Client(const Topology& topo, const Config& config);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends the inputs named by teacher.inputs; returns at once unless
  // student.in_flight requests are already outstanding. With a tensor named
  // protocol::kRequestIds ("request_ids": integer [B, T, k], k <=
  // teacher.request_ids) the teacher answers its logits at those ids (an ids
  // answer, core/answer_kinds.h); output() attaches the ids to it.
  Handle submit(const std::vector<std::pair<std::string, at::Tensor>>& inputs, int64_t step, int64_t accStep);
  // The same with one input, named teacher.inputs[0].
  Handle submit(const at::Tensor& input, int64_t step, int64_t accStep);
  // Waits for the answer to `h` (answers come in request order).
  TeacherReply get(const Handle& h, ReplyMode mode = ReplyMode::kCopy);
  // Tells the teacher this student is done. Outstanding answers are dropped.
  void finish();

  // True once distill-run was asked to stop (SIGINT/SIGTERM): checkpoint and
  // leave cleanly (finish()) before the launcher forwards SIGTERM (10 s later).
  // One atomic load of the segment's control block; cheap enough every step.
  bool stopRequested() const;
  // Asks this student to stop as distill-run's stop request does (the Python
  // binding calls it on Ctrl-C): stopRequested() is true from now on, so the
  // step API agrees with the other students to stop after the current step.
  // Async-signal-safe (one atomic store).
  void requestStop();

  // Reports this student's training status (step, loss, tokens/s, the share
  // of the step spent waiting for the teacher, ...; core/status.h) to
  // distill-run, which shows it in its status line and summary. Written into
  // this student's area of the segment: a few relaxed stores, no system call;
  // call it every step if you like. Fields left unset are not shown, but for
  // teacher_wait_share: left unset, the client fills it in with the share of
  // the time since the previous publishStatus() that it spent blocked on the
  // teacher (get() waiting for an answer, submit() for a free request slot).
  void publishStatus(const StudentStatus& status);

  // Seconds this client has spent blocked on the teacher so far (get()
  // waiting for an answer, submit() waiting for a free request slot).
  double teacherWaitSeconds() const;

  // The share of rows (0..1) that this student's teacher has answered from its
  // output cache (teacher.cache) since it started, as it published after its
  // last batch; 0 with the cache off.
  double teacherCacheHitShare() const;

  // teacher.answer hidden: the teacher's head, mapped (CPU tensors over the
  // node's one copy; null for other answers). get() looks for a head a
  // restarted teacher published (one stat(2)) before it hands out an answer:
  // the same fingerprint is mapped anew, another is refused or adopted by
  // teacher.head.on_change; so the pointer changes then.
  std::shared_ptr<const TeacherHead> teacherHead() const;
  // The same head on `device` (teacherHeadOn, student/teacher_head.h: on a GPU,
  // one copy per node and device), made once per head and device; null for
  // other answers.
  std::shared_ptr<const TeacherHead> teacherHeadOn(const at::Device& device);

  int64_t outstanding() const;
  const Config& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace distill
