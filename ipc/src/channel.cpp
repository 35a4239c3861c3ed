// channel.h: the endpoints and ReceivedMessage over a ChannelCore (channel_core.h).
#include "distill/ipc/channel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>

#include "channel_core.h"
#include "distill/build_config.h"
#include "distill/core/errors.h"
#include "distill/core/options.h"
#if DISTILL_CUDA
#include "cuda/cuda_ipc.h"
#endif

namespace distill::ipc {

const char* msgKindName(MsgKind k) { return wire::kindName(uint32_t(k)); }

EndpointOptions EndpointOptions::fromOptions(const TransportOptions& t, int rank, const std::string& device) {
  EndpointOptions o;
  o.rank = rank;
  o.spinUs = t.spin_us;
  o.cudaIpc = t.cuda_ipc;
  const DeviceSpec d = parseDevice(device);
#if DISTILL_CUDA
  o.cudaDevice = !d.cuda ? -1 : d.index >= 0 ? d.index : cuda::currentDevice();
#else
  o.cudaDevice = d.cuda ? std::max(0, d.index) : -1; // refused later with transport.cuda_ipc=on
#endif
  return o;
}

namespace detail {

static_assert(kMaxTensors == wire::kMaxTensors, "channel.h's kMaxTensors is the layout's");

Role Role::student() {
  return {"request",        "transport.max_request_bytes", wire::WaitWhat::kRequestSlot,
          trace::Op::kSend, trace::Op::kReceive,           false};
}
Role Role::teacher() {
  return {
      "response", "transport.max_response_bytes", wire::WaitWhat::kResponseSlot, trace::Op::kReply, trace::Op::kRequest,
      true};
}

// Process `index` of the segment as one end of its rings: a student has the
// ring pair of its own index; a teacher the pairs of the students it serves
// (ring r of each side belongs to the same student), and replays what an
// earlier incarnation left in them (replay.h).
ChannelCore::ChannelCore(const Segment& seg, int index, const EndpointOptions& opt)
    : segment_(seg),
      opt_(opt),
      port_(seg.impl(), index, opt.rank, opt.spinUs, opt.config),
      role_(port_.isTeacher() ? Role::teacher() : Role::student()) {
  const auto& s = port_.seg();
  const bool teacher = role_.producesResponses;
  const std::vector<int> students = teacher ? studentsServedBy(s, index) : std::vector<int>{index};
  for (int student : students) {
    in_.emplace_back(s, student, !teacher);
    out_.emplace_back(s, student, teacher);
    peers_.push_back(teacher ? student : teacherOf(s, student));
  }
  for (size_t r = 0; r < in_.size(); ++r) { // after the rings: they hold pointers into them
    inHost_.emplace_back(in_[r]);
    outHost_.emplace_back(out_[r]);
  }
  if (teacher) replay_ = Replay::plan(in_, out_, port_.describeSelf());
  device_ = makeDeviceSlotMemory(port_, in_, out_, opt_);
}

int ChannelCore::ringOf(int student) const {
  for (int r = 0; r < numRings(); ++r)
    if (studentOf(r) == student) return r;
  return -1;
}

} // namespace detail

// ---- ReceivedMessage ------------------------------------------------------------------------------

ReceivedMessage::ReceivedMessage() = default;
ReceivedMessage::~ReceivedMessage() { release(); }
ReceivedMessage::ReceivedMessage(ReceivedMessage&& o) noexcept { *this = std::move(o); }
ReceivedMessage& ReceivedMessage::operator=(ReceivedMessage&& o) noexcept {
  if (this != &o) {
    release();
    core_ = std::move(o.core_);
    ring_ = o.ring_;
    seq_ = o.seq_;
    tag_ = o.tag_;
    kind_ = o.kind_;
    senderRank_ = o.senderRank_;
    student_ = o.student_;
    errorText_ = std::move(o.errorText_);
    vocab_ = o.vocab_;
    teacher_ = o.teacher_;
    answer_ = o.answer_;
    tensors_ = o.tensors_;
    ntensors_ = o.ntensors_;
    o.ntensors_ = 0;
  }
  return *this;
}

void ReceivedMessage::release() {
  if (core_) {
    bool device = false; // any tensor in device slot memory
    for (int i = 0; i < ntensors_; ++i) device = device || tensors_[size_t(i)].device >= 0;
    core_->releaseSlot(ring_, seq_, device);
    core_.reset();
  }
}

void ReceivedMessage::abandon() {
  core_.reset(); // the slot stays taken: a later consumer of the ring reads the message again
  ntensors_ = 0;
}

bool ReceivedMessage::markFailed() {
  DISTILL_CHECK_T(IpcError, held(), "markFailed() on a released message");
  return core_->markFailed(ring_, seq_);
}

std::vector<std::string> ReceivedMessage::names() const {
  std::vector<std::string> out;
  for (int i = 0; i < ntensors_; ++i) out.emplace_back(tensors_[size_t(i)].name);
  return out;
}

std::vector<TensorFacts> ReceivedMessage::facts() const {
  std::vector<TensorFacts> out;
  for (int i = 0; i < ntensors_; ++i) {
    const Desc& d = tensors_[size_t(i)];
    out.push_back({d.name, d.dtype, std::vector<int64_t>(d.shape, d.shape + d.ndim)});
  }
  return out;
}

bool ReceivedMessage::has(const std::string& name) const {
  for (int i = 0; i < ntensors_; ++i)
    if (name == tensors_[size_t(i)].name) return true;
  return false;
}

const ReceivedMessage::Desc& ReceivedMessage::find(const std::string& name) const {
  for (int i = 0; i < ntensors_; ++i)
    if (name == tensors_[size_t(i)].name) return tensors_[size_t(i)];
  std::string all;
  for (int i = 0; i < ntensors_; ++i) all += (all.empty() ? "" : ", ") + std::string(tensors_[size_t(i)].name);
  DISTILL_THROW(ProtocolError, at(tag_.step, tag_.accStep), "message seq ", tag_.seq, " from rank ", senderRank_,
                " has no tensor '", name, "' (has: ", all, ")");
}

at::Tensor ReceivedMessage::view(const std::string& name) const {
  DISTILL_CHECK_T(IpcError, held(), "view('", name, "') on a released message (use copy() to keep data)");
  const auto& d = find(name);
  auto opts = at::TensorOptions().dtype(d.dtype);
  if (d.device >= 0) opts = opts.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d.device)));
  return at::from_blob(d.data, c10::IntArrayRef(d.shape, size_t(d.ndim)), opts);
}

at::Tensor ReceivedMessage::copy(const std::string& name) const { return view(name).clone(); }

// ---- StudentEndpoint ------------------------------------------------------------------------------

StudentEndpoint::StudentEndpoint(const Segment& segment, int localIndex, EndpointOptions options)
    : uncaught_(std::uncaught_exceptions()) {
  DISTILL_CHECK_T(IpcError, localIndex >= 0 && localIndex < segment.layout().numStudents, "local student index ",
                  localIndex, " outside 0..", segment.layout().numStudents - 1, " (segment '", segment.name(), "')");
  core_ = std::make_shared<detail::ChannelCore>(segment, localIndex, options);
}
StudentEndpoint::StudentEndpoint(StudentEndpoint&&) noexcept = default;
StudentEndpoint::~StudentEndpoint() {
  if (core_ && std::uncaught_exceptions() == uncaught_) core_->port().markFinished();
}
void StudentEndpoint::waitAdmission(Deadline d) { core_->studentAdmission(d); }
void StudentEndpoint::send(const OutMessage& msg, Deadline d) { core_->send(0, msg, d); }
std::vector<at::Tensor> StudentEndpoint::allocate(const Tag& tag, const std::vector<TensorSpec>& specs, Deadline d,
                                                  MsgKind kind) {
  return core_->allocate(0, tag, kind, specs, d);
}
void StudentEndpoint::publish() { core_->publish(0); }
ReceivedMessage StudentEndpoint::receive(Deadline d, const std::optional<Tag>& expect) {
  return core_->receive(0, d, expect);
}
std::optional<ReceivedMessage> StudentEndpoint::tryReceive() { return core_->tryReceive(0); }
int StudentEndpoint::localIndex() const { return core_->port().index(); }
int StudentEndpoint::rank() const { return core_->port().rank(); }
Segment StudentEndpoint::segment() const { return core_->segment(); }

// ---- TeacherEndpoint ------------------------------------------------------------------------------

namespace {
// The process index of teacher `teacher` of the segment; IpcError naming the valid range otherwise.
int teacherIndexOf(const Segment& segment, int teacher) {
  const SegmentLayout l = segment.layout();
  DISTILL_CHECK_T(IpcError, teacher >= 0 && teacher < l.numTeachers, "segment '", segment.name(), "': no teacher ",
                  teacher, " (it has ", l.numTeachers, ", teacher.procs)");
  return l.numStudents + teacher;
}
} // namespace

TeacherEndpoint::TeacherEndpoint(const Segment& segment, EndpointOptions options, int teacher)
    : core_(std::make_shared<detail::ChannelCore>(segment, teacherIndexOf(segment, teacher), options)),
      uncaught_(std::uncaught_exceptions()) {}
TeacherEndpoint::TeacherEndpoint(TeacherEndpoint&&) noexcept = default;
TeacherEndpoint::~TeacherEndpoint() {
  if (core_ && std::uncaught_exceptions() == uncaught_) core_->port().markFinished();
}
namespace {
// The ring of local student `student` on a teacher's end; IpcError naming the call if it serves no such student.
int ringOf(detail::ChannelCore& core, const char* call, int student) {
  const int r = core.ringOf(student);
  DISTILL_CHECK_T(IpcError, r >= 0, call, "(", student, "): no such local student");
  return r;
}
} // namespace

void TeacherEndpoint::waitAdmission(Deadline d, const AdmissionCheck& check) { core_->teacherAdmission(d, check); }
bool TeacherEndpoint::studentDone(int student) { return core_->studentDone(ringOf(*core_, "studentDone", student)); }
int TeacherEndpoint::numStudents() const { return core_->numRings(); }
std::vector<int> TeacherEndpoint::students() const {
  std::vector<int> out;
  for (int r = 0; r < core_->numRings(); ++r) out.push_back(core_->studentOf(r));
  return out;
}
int TeacherEndpoint::teacher() const { return core_->port().index() - core_->port().seg().layout.numStudents; }
std::optional<ReceivedMessage> TeacherEndpoint::poll(int student) {
  return core_->tryReceive(ringOf(*core_, "poll", student));
}
ReceivedMessage TeacherEndpoint::waitAny(Deadline d) { return core_->waitAny(d); }
std::optional<ReceivedMessage> TeacherEndpoint::tryWaitAny(Deadline d) { return core_->tryWaitAny(d); }
void TeacherEndpoint::reply(int student, const OutMessage& msg, Deadline d) {
  core_->send(ringOf(*core_, "reply", student), msg, d);
}
std::vector<at::Tensor> TeacherEndpoint::allocateReply(int student, const Tag& tag,
                                                       const std::vector<TensorSpec>& specs, Deadline d, MsgKind kind) {
  return core_->allocate(ringOf(*core_, "allocateReply", student), tag, kind, specs, d);
}
void TeacherEndpoint::publishReply(int student) { core_->publish(ringOf(*core_, "publishReply", student)); }
int TeacherEndpoint::rank() const { return core_->port().rank(); }
Segment TeacherEndpoint::segment() const { return core_->segment(); }

} // namespace distill::ipc
