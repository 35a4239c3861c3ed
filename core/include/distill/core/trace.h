#pragma once

// The flight recorder's entry point for code below ipc/ and for layers that do
// not hold an endpoint (the student group's collectives, the teacher's forward).
//
// A process has at most one Sink: ipc/'s recorder, installed while the process
// is attached to its node's segment (docs/design.md, "The four hangs this design rules out":
// a hang names who waits on whom). With no sink installed (unit tests, a group without a
// segment) recording costs one relaxed load and does nothing.
//
// It also keeps the step state: the (step, acc_step) this process is working
// on, which labels the events it records and every error that names no step
// itself (errors.cpp reads it).
//
// Thread safety: events are recorded by the one thread that drives distill in
// a process (the trainer's loop, the teacher's serve loop), like endpoints.
// setSink() is called by that thread too. The step state is atomics (relaxed):
// any thread may read it.

#include <cstdint>
#include <string>

namespace distill::trace {

// What an event was. Stored in shared memory: values never change meaning.
enum class Op : uint32_t {
  kNone = 0,
  kAttach = 1, // attached to the segment
  kAdmission = 2, // waited for admission (student: by the teacher; teacher: of all students)
  kSend = 3, // student: sent a request (or finish) to the teacher
  kReceive = 4, // student: received the teacher's answer
  kRequest = 5, // teacher: took a request from a student
  kReply = 6, // teacher: answered a student
  kForward = 7, // teacher: the model's forward on a batch (user code)
  kCollective = 8, // student: a student-group collective (seq = collective number)
  kCheckpoint = 9, // student: a checkpoint save or load
};
const char* opName(Op op);

struct Event {
  Op op = Op::kNone;
  int peer = -1; // global rank of the peer, -1 = none or any
  int64_t step = -1; // -1 = not known
  int64_t accStep = -1;
  uint64_t seq = 0; // message seq, or collective number
  std::string label; // e.g. the collective's name ("checkpoint barrier"); cut to 55 bytes
};

class Sink {
 public:
  virtual ~Sink() = default;
  // Records the start of `e`; returns a token for end(). Never throws.
  virtual uint64_t begin(const Event& e) = 0;
  // Records the end of the event begun with `token`. Never throws.
  virtual void end(uint64_t token) = 0;
};

// Installs `sink` for this process (nullptr: none). The caller keeps it alive
// until it is uninstalled.
void setSink(Sink* sink);
// Uninstalls `sink` if it is the one installed.
void clearSink(Sink* sink);
Sink* sink();

// The step state: the (step, acc_step) this process is working on, if known; an error that
// names none itself reports this one, and the flight recorder labels a
// collective with it. Set by the student client per request.
void setCurrentStep(int64_t step, int64_t accStep);
bool currentStep(int64_t* step, int64_t* accStep);
// The student client, when the trainer takes the answer of (step, accStep):
// the current step becomes that micro-batch.
void noteAnswered(int64_t step, int64_t accStep);
// A step of `microBatches` micro-batches opens (stepTokenCount, which a
// trainer calls before it takes the step's first answer). If the last answer
// taken was the previous step's last micro-batch, the current step becomes
// (that step + 1, 0): the collectives that open step 20 are step 20's, not
// "(step 19, acc_step 1)" — the tag of the last answer, which a prefetched
// request of step 20 does not change either.
void noteStepOpens(int64_t microBatches);

// Records an event from construction to destruction (also when an exception
// leaves the scope: the event then ends where the failure surfaced).
class Scope {
 public:
  explicit Scope(const Event& e) : sink_(sink()), token_(sink_ ? sink_->begin(e) : 0) {}
  ~Scope() {
    if (sink_) sink_->end(token_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Sink* sink_;
  uint64_t token_;
};

} // namespace distill::trace
