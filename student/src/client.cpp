#include "distill/student/client.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <sstream>

#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/answer_kinds.h"
#include "distill/core/trace.h"
#include "distill/ipc/channel.h"
#include "distill/student/teacher_head.h"

namespace distill {
namespace {

std::string tagStr(const Tag& t) { return "(" + describe(t) + ")"; }
} // namespace

// ---- TeacherReply ----

TeacherReply::TeacherReply() = default;
TeacherReply::~TeacherReply() = default;
TeacherReply::TeacherReply(TeacherReply&&) noexcept = default;
TeacherReply& TeacherReply::operator=(TeacherReply&&) noexcept = default;

bool TeacherReply::has(const std::string& name) const {
  for (auto& kv : tensors_) {
    if (kv.first == name) return true;
  }
  return false;
}

at::Tensor TeacherReply::tensor(const std::string& name) const {
  for (auto& kv : tensors_) {
    if (kv.first == name) return kv.second;
  }
  DISTILL_THROW(ProtocolError, "the teacher's answer has no tensor '", name, "'");
}

TeacherOutput TeacherReply::output() const {
  // The kind the message said, checked against its tensors when it arrived (Client::get).
  TeacherOutput o = teacherOutputFrom(
      kind_, [&](const std::string& name) { return has(name) ? tensor(name) : at::Tensor(); }, vocab_);
  if (HiddenAnswer* h = o.hidden()) h->head = head_;
  if (IdsAnswer* a = o.ids()) a->ids = ids_; // the request's: the answer does not carry them back
  return o;
}

void TeacherReply::release() {
  tensors_.clear();
  if (held_) held_->release();
  held_.reset();
}

// ---- Client ----

struct Client::Impl {
  Topology topo;
  Config cfg;
  std::optional<ipc::Segment> segment;
  std::optional<ipc::StudentEndpoint> endpoint;
  uint64_t nextSeq = 1;
  std::atomic<bool> stopAsked{false}; // requestStop()
  std::deque<Handle> inFlight; // sent, answer not yet received
  std::map<uint64_t, ipc::ReceivedMessage> received; // received, not yet taken by get()
  std::map<uint64_t, at::Tensor> requestIds; // by seq: the ids a request asked an answer at (ids answers)
  uint64_t teacherSeen = 0; // the fingerprint of the teacher answering (0: no answer yet)
  Tag teacherSince; // the first request it answered
  bool finished = false;
  // Time blocked on the teacher: waiting for an answer, or for a free request
  // slot. publishStatus() turns it into the step's teacher wait share.
  Clock::duration waited{0};
  Clock::duration waitedAtPublish{0};
  Clock::time_point lastPublish = Clock::now();
  std::optional<MappedTeacherHead> mapped; // teacher.answer hidden
  std::shared_ptr<const TeacherHead> head; // mapped's head, while it is the one held
  // teacherHeadOn's: the head it was made from, and its copy on each device.
  std::shared_ptr<const TeacherHead> onDeviceOf;
  std::map<std::string, std::shared_ptr<const TeacherHead>> onDevice;

  // teacher.answer hidden: the head published beside the segment, mapped; logged.
  void mapHead(Deadline deadline) {
    const ipc::HeadReader reader{topo.globalRank, "student"};
    const HeadChange onChange =
        cfg.teacher.head.on_change == HeadOnChange::kAdopt ? HeadChange::kAdopt : HeadChange::kRefuse;
    mapped.emplace(MappedTeacherHead::open(topo.segment, reader, deadline, onChange));
    head = std::make_shared<const TeacherHead>(mapped->head());
    logHead("mapped the teacher's head");
  }
  void logHead(const char* what) const {
    const ipc::SharedHead& s = mapped->shared();
    DISTILL_LOG(kInfo) << "student rank " << topo.globalRank << " " << what << " /dev/shm/"
                       << s.objectName() << " (generation " << s.generation() << ", [" << s.vocab() << ", "
                       << s.dim() << "] " << ipc::headDTypeName(s.dtype()) << ", fingerprint " << s.fingerprint()
                       << ")";
  }
  // Before an answer is read: a head a restarted teacher published since (refused or adopted, teacher_head.h).
  void checkHead() {
    if (!mapped || !mapped->shared().replaced()) return;
    const uint64_t before = mapped->shared().generation();
    const bool changed = mapped->checkForChange();
    if (mapped->shared().generation() == before) return;
    head = std::make_shared<const TeacherHead>(mapped->head());
    logHead(changed ? "adopted the teacher's changed head" : "mapped the teacher's republished head");
  }

  Deadline responseDeadline() const { return Deadline::afterSeconds(cfg.run.peerWaitS()); }

  // Receives the answer to the oldest request in flight and checks its tag.
  void receiveOldest() {
    DISTILL_INTERNAL_ASSERT(!inFlight.empty(), "no request in flight");
    Handle want = inFlight.front();
    const auto t0 = Clock::now();
    ipc::ReceivedMessage m = endpoint->receive(responseDeadline(), want);
    waited += Clock::now() - t0;
    inFlight.pop_front();
    const auto& t = m.tag();
    if (m.kind() == ipc::MsgKind::kError) {
      DISTILL_THROW(ProtocolError, at(want.step, want.accStep, "teacher answer"), "the teacher refused request ",
                    tagStr(want), ": ", m.errorText());
    }
    DISTILL_CHECK_T(ProtocolError, m.kind() == ipc::MsgKind::kResponse, at(want.step, want.accStep, "teacher answer"),
                    "expected a response, got ", ipc::msgKindName(m.kind()));
    if (t != want) {
      DISTILL_THROW(ProtocolError, at(want.step, want.accStep, "teacher answer"), "answer tag ", tagStr(t),
                    " does not match request ", tagStr(want));
    }
    // Read by the kind it says it is (core/answer_kinds.h), never by guessing from names.
    if (const std::string why = answerMismatch(m.answer(), m.facts()); !why.empty()) {
      DISTILL_THROW(ProtocolError, at(want.step, want.accStep, "teacher answer"), "the answer of teacher rank ",
                    m.senderRank(), " to request ", tagStr(want), " is ", why);
    }
    checkTeacher(m.teacher(), want, m.senderRank());
    received.emplace(want.seq, std::move(m));
  }

  // One teacher answers a run: an answer from another (a restarted teacher that loaded other
  // weights) is refused, or adopted with teacher.head.on_change adopt (a head swapped on purpose).
  void checkTeacher(uint64_t fingerprint, const Tag& want, int rank) {
    if (fingerprint == 0 || fingerprint == teacherSeen) return;
    if (teacherSeen != 0) {
      checkHead(); // hidden answers: a changed head is named as such (refused, or adopted) first
      std::ostringstream was, now;
      was << std::hex << teacherSeen;
      now << std::hex << fingerprint;
      DISTILL_CHECK_T(ProtocolError, cfg.teacher.head.on_change == HeadOnChange::kAdopt,
                      at(want.step, want.accStep, "teacher answer"), "teacher rank ", rank, " answered request ",
                      tagStr(want), " as teacher ", now.str(), ", where teacher ", was.str(),
                      " answered this student since ", tagStr(teacherSince),
                      ": a restarted teacher loaded other weights; one run trains on one teacher (restart the job "
                      "from its checkpoint to change teachers, or set teacher.head.on_change: adopt)");
      DISTILL_LOG(kWarning) << "student rank " << topo.globalRank << " adopts teacher " << now.str() << " at request "
                            << tagStr(want) << " (was " << was.str() << "): teacher.head.on_change adopt";
    }
    teacherSeen = fingerprint;
    teacherSince = want;
  }
};

Client::Client(const Topology& topo, const Config& config) : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.topo = topo;
  s.cfg = config;
  DISTILL_CHECK_T(ConfigError, topo.isStudent(), "a Client needs a student's topology, got ", topo.describe());
  DISTILL_CHECK_T(ConfigError, !topo.segment.empty(),
                  "no segment for this node (DISTILL_SEGMENT is not set): start the job with distill-run");
  auto startup = Deadline::afterSeconds(config.run.startup_timeout_s);
  auto layout = ipc::SegmentLayout::expectedFromConfig(config, topo.studentsPerNode(), topo.teachersPerNode);
  s.segment = ipc::Segment::attach(topo.segment, topo.jobId, layout, startup);
  auto options = ipc::EndpointOptions::fromOptions(config.transport, topo.globalRank, config.student.device);
  options.config = configDescription(config); // the teacher compares it with its own before admitting us
  s.endpoint.emplace(*s.segment, topo.studentLocalRank, options);
  s.endpoint->waitAdmission(startup);
  if (answerKindOf(config.teacher) == AnswerKind::kHidden) s.mapHead(startup);
}

Client::~Client() {
  if (impl_ && impl_->endpoint && !impl_->finished && std::uncaught_exceptions() == 0) {
    try {
      finish();
    } catch (const std::exception& e) {
      DISTILL_LOG(kWarning) << "could not tell the teacher this student finished: " << e.what();
    }
  }
}

Handle Client::submit(const std::vector<std::pair<std::string, at::Tensor>>& inputs, int64_t step, int64_t accStep) {
  auto& s = *impl_;
  DISTILL_CHECK_T(UsageError, !s.finished, "submit() after finish(): this student told its teacher it sends nothing more");
  trace::setCurrentStep(step, accStep);
  while (static_cast<int64_t>(s.inFlight.size()) >= s.cfg.student.in_flight) s.receiveOldest();
  std::vector<std::pair<std::string, at::Tensor>> tensors = inputs;
  at::Tensor ids;
  for (auto& [name, t] : tensors) {
    if (name != protocol::kRequestIds) continue;
    DISTILL_CHECK_T(UsageError, t.defined() && t.dim() == 3 && !at::isFloatingType(t.scalar_type()),
                    at(step, accStep, "submit"), "'", name, "': expected integer ids [B, T, k], found ",
                    t.defined() ? t.sizes() : at::IntArrayRef{}, " ", t.defined() ? c10::toString(t.scalar_type()) : "");
    DISTILL_CHECK_T(UsageError, t.size(2) >= 1 && t.size(2) <= s.cfg.teacher.request_ids, at(step, accStep, "submit"),
                    "'", name, "': ", t.size(2), " ids per position; teacher.request_ids (", s.cfg.teacher.request_ids,
                    ") says how many a request may carry (it sizes the slots): raise it");
    t = t.to(at::kInt).contiguous(); // int32 on the wire (teacher.request_ids sizes the slot at 4 bytes an id)
    ids = t;
  }
  const Handle h{s.nextSeq++, step, accStep};
  ipc::OutMessage msg;
  msg.tag = h;
  msg.kind = ipc::MsgKind::kRequest;
  msg.tensors = std::move(tensors);
  const auto t0 = Clock::now();
  s.endpoint->send(msg, s.responseDeadline()); // waits while every request slot is taken
  s.waited += Clock::now() - t0;
  s.inFlight.push_back(h);
  if (ids.defined()) s.requestIds[h.seq] = ids;
  return h;
}

Handle Client::submit(const at::Tensor& input, int64_t step, int64_t accStep) {
  return submit({{impl_->cfg.teacher.inputs.at(0), input}}, step, accStep);
}

TeacherReply Client::get(const Handle& h, ReplyMode mode) {
  auto& s = *impl_;
  trace::noteAnswered(h.step, h.accStep);
  while (!s.received.count(h.seq)) {
    DISTILL_CHECK_T(ProtocolError, !s.inFlight.empty() && s.inFlight.front().seq <= h.seq, at(h.step, h.accStep),
                    "get(): request seq ", h.seq, " is not in flight (already taken, or never submitted)");
    s.receiveOldest();
  }
  auto node = s.received.extract(h.seq);
  ipc::ReceivedMessage& m = node.mapped();
  s.checkHead(); // after the answer arrived: a restarted teacher published its head before answering
  TeacherReply r;
  r.handle_ = h;
  r.head_ = s.head;
  r.vocab_ = m.vocab();
  r.teacher_ = m.teacher();
  r.kind_ = static_cast<AnswerKind>(m.answer()); // known: receiveOldest checked it
  if (auto ids = s.requestIds.extract(h.seq)) r.ids_ = ids.mapped();
  for (auto& name : m.names()) {
    r.tensors_.emplace_back(name, mode == ReplyMode::kCopy ? m.copy(name) : m.view(name));
  }
  if (mode == ReplyMode::kCopy) {
    m.release();
  } else {
    r.held_ = std::make_unique<ipc::ReceivedMessage>(std::move(m));
  }
  return r;
}

void Client::finish() {
  auto& s = *impl_;
  if (s.finished) return;
  s.finished = true;
  s.received.clear();
  s.requestIds.clear();
  ipc::OutMessage msg;
  msg.kind = ipc::MsgKind::kFinish;
  msg.tag = Tag{s.nextSeq++, 0, 0};
  s.endpoint->send(msg, s.responseDeadline());
}

void Client::publishStatus(const StudentStatus& status) {
  auto& s = *impl_;
  StudentStatus out = status;
  const auto now = Clock::now();
  if (std::isnan(out.teacher_wait_share) && now > s.lastPublish) {
    // The share of the time since the last publishStatus spent blocked on the teacher.
    const double waited = std::chrono::duration<double>(s.waited - s.waitedAtPublish).count();
    const double span = std::chrono::duration<double>(now - s.lastPublish).count();
    out.teacher_wait_share = std::min(1.0, waited / span);
  }
  s.lastPublish = now;
  s.waitedAtPublish = s.waited;
  if (s.segment) s.segment->publishStatus(s.topo.studentLocalRank, out);
}

double Client::teacherWaitSeconds() const { return std::chrono::duration<double>(impl_->waited).count(); }

double Client::teacherCacheHitShare() const {
  return impl_->segment ? impl_->segment->teacherCacheHits(impl_->topo.studentLocalRank % impl_->topo.teachersPerNode)
                        : 0.0;
}

bool Client::stopRequested() const {
  return impl_->stopAsked.load(std::memory_order_relaxed) || (impl_->segment && impl_->segment->stopRequested());
}
void Client::requestStop() { impl_->stopAsked.store(true, std::memory_order_relaxed); }
std::shared_ptr<const TeacherHead> Client::teacherHead() const { return impl_->head; }
std::shared_ptr<const TeacherHead> Client::teacherHeadOn(const at::Device& device) {
  auto& s = *impl_;
  if (!s.head || device.is_cpu()) return s.head;
  if (s.onDeviceOf != s.head) { // a republished head: its own copies
    s.onDevice.clear();
    s.onDeviceOf = s.head;
  }
  auto& copy = s.onDevice[device.str()];
  if (!copy) {
    copy = std::make_shared<const TeacherHead>(distill::teacherHeadOn(s.mapped->shared(), *s.head, device, s.topo.segment,
                                                             ipc::HeadReader{s.topo.globalRank, "student"},
                                                             Deadline::afterSeconds(s.cfg.run.startup_timeout_s)));
  }
  return copy;
}
int64_t Client::outstanding() const { return static_cast<int64_t>(impl_->inFlight.size()); }
const Config& Client::config() const { return impl_->cfg; }

} // namespace distill
