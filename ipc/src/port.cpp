#include "port.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "ring.h"
#include "sys.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DISTILL_CPU_RELAX() _mm_pause()
#else
#define DISTILL_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace distill::ipc {

using wire::ProcState;

namespace {
// The recorder area of local index `index`, after checking the index (the
// recorder is built before the constructor body runs).
wire::RecorderArea* checkedRecorder(const SegmentImpl& seg, int index) {
  DISTILL_CHECK_T(IpcError, index >= 0 && index < seg.numProcesses(), "segment '", seg.name, "': local index ", index,
                  " outside 0..", seg.numProcesses() - 1);
  return &seg.recorder(index);
}
} // namespace

Port::Port(std::shared_ptr<SegmentImpl> seg, int index, int rank, int spinUs, const std::string& config)
    : seg_(std::move(seg)), index_(index), rank_(rank), recorder_(checkedRecorder(*seg_, index)), spinUs_(spinUs) {
  DISTILL_CHECK_T(ConfigError, config.size() <= wire::kConfigTextBytes, "segment '", seg_->name, "': local ",
                  roleName(), " ", index_, ": the description of its config is ", config.size(),
                  " bytes, the segment holds ", wire::kConfigTextBytes,
                  " per process (a trainer section of that many keys cannot be compared at admission)");
  auto& e = self();
  const int old = e.pid.load(std::memory_order_acquire);
  const auto oldState = ProcState(e.state.load(std::memory_order_acquire));
  if (old > 0 && old != ::getpid() && oldState != ProcState::kFinished && oldState != ProcState::kDead &&
      sys::pidState(old) != sys::PidState::kGone)
    DISTILL_THROW(IpcError, "segment '", seg_->name, "': local ", roleName(), " ", index_,
                  " is already attached by live pid ", old);
  recorder_.reset(); // before the new pid is published: no reader pairs it with the old history
  // The config before the state: the teacher reads it once it sees us attached.
  auto& area = seg_->config(index_);
  std::memcpy(area.text, config.data(), config.size());
  area.bytes.store(uint32_t(config.size()), std::memory_order_release);
  e.heartbeatNs.store(monotonicNs(), std::memory_order_relaxed);
  e.rank.store(rank_, std::memory_order_relaxed);
  e.waitWhat.store(0, std::memory_order_relaxed);
  e.endedNs.store(0, std::memory_order_relaxed);
  e.incarnation.fetch_add(1, std::memory_order_relaxed);
  e.pid.store(::getpid(), std::memory_order_relaxed);
  e.state.store(uint32_t(ProcState::kAttached), std::memory_order_release);
  heartbeat_ = std::thread([this] { heartbeatLoop(); });
  recorder_.complete(trace::Op::kAttach, -1, -1, -1, 0);
  trace::setSink(&recorder_);
  if (!isTeacher()) seg_->notify(teacherOf(*seg_, index_)); // its teacher may be waiting for it to attach
}

Port::~Port() {
  trace::clearSink(&recorder_);
  {
    std::lock_guard<std::mutex> lock(hbMutex_);
    hbStop_ = true;
  }
  hbCv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  self().endedNs.store(monotonicNs(), std::memory_order_relaxed); // published by the state's release store
  setState(finished_ ? ProcState::kFinished : ProcState::kDead);
  self().waitWhat.store(0, std::memory_order_relaxed);
  seg_->notifyAll(); // peers waiting on us re-check and see finished/dead
}

std::string Port::publishedConfig(int index) const {
  const auto& area = seg_->config(index);
  const uint32_t n = area.bytes.load(std::memory_order_acquire);
  return std::string(area.text, std::min<size_t>(n, wire::kConfigTextBytes));
}

void Port::heartbeatLoop() {
  const auto period = std::chrono::milliseconds(seg_->layout.heartbeatMs);
  std::unique_lock<std::mutex> lock(hbMutex_);
  while (!hbStop_) {
    self().heartbeatNs.store(monotonicNs(), std::memory_order_relaxed);
    hbCv_.wait_for(lock, period, [this] { return hbStop_; });
  }
}

std::string Port::describeProcess(int index) const {
  const auto& e = seg_->process(index);
  const bool teacher = seg_->isTeacher(index);
  return detail::str(teacher ? "teacher" : "student", " rank ", e.rank.load(std::memory_order_relaxed), " (local ",
                     index, ", pid ", e.pid.load(std::memory_order_relaxed), ")");
}

std::string Port::describeSelf() const { return detail::str(roleName(), " rank ", rank_, " (local ", index_, ")"); }

bool Port::teacherMayRestart(int index, int pid) const {
  const auto& t = seg_->teacherState(index);
  if (t.gaveUp.load(std::memory_order_acquire) != 0) return false; // failed twice on one request: no restart comes
  if (t.restarts.load(std::memory_order_acquire) < seg_->control().teacherMaxRestarts.load(std::memory_order_acquire))
    return true;
  return pid != 0 && t.replacedPid.load(std::memory_order_relaxed) == pid; // being replaced right now
}

void Port::checkPeer(int index, const WaitDesc& desc, bool finishedIsLost) const {
  const auto& e = seg_->process(index);
  const int pid = e.pid.load(std::memory_order_acquire);
  if (pid == 0) return; // never attached: only a deadline can end this wait
  // Elastic teacher: a dead or stalled teacher that the launcher will restart
  // is awaited (the requests stay in their slots; the next incarnation serves
  // them). Only the wait's own deadline or an abort ends this wait then.
  const auto state = ProcState(e.state.load(std::memory_order_acquire));
  if (seg_->isTeacher(index) && index != index_ && state != ProcState::kFinished && teacherMayRestart(index, pid))
    return;
  ErrorWhere where;
  if (desc.tag) where = at(desc.tag->step, desc.tag->accStep);
  where.awaited = wire::waitName(uint32_t(desc.what));
  if (state == ProcState::kDead)
    DISTILL_THROW(PeerLostError, where, describeSelf(), ": peer ", describeProcess(index),
                  " detached abnormally (state dead) in segment '", seg_->name, "'");
  if (state == ProcState::kFinished) {
    if (finishedIsLost)
      DISTILL_THROW(PeerLostError, where, describeSelf(), ": peer ", describeProcess(index),
                    " has finished and detached from segment '", seg_->name, "'");
    noteStall(index, false, 0, false, where); // it ran again: a stall noted before has ended
    return;
  }
  const auto ps = sys::pidState(pid);
  if (ps == sys::PidState::kGone)
    DISTILL_THROW(PeerLostError, where, describeSelf(), ": peer ", describeProcess(index), " died (pid ", pid,
                  " no longer runs) in segment '", seg_->name, "'");
  // Alive (the kernel says so): a missing heartbeat is a stall — a stopped,
  // descheduled or paused process — reported, and fatal only after
  // transport.stall_timeout_s. Death was ruled out above, within one check.
  const int64_t ageNs = monotonicNs() - e.heartbeatNs.load(std::memory_order_relaxed);
  const bool stopped = ps == sys::PidState::kStopped;
  if (ageNs > seg_->layout.stallTimeoutMs * 1000000)
    DISTILL_THROW(PeerLostError, where, describeSelf(), ": peer ", describeProcess(index),
                  " stalled (no heartbeat for ", toMs(std::chrono::nanoseconds(ageNs)), " ms > transport.stall_timeout_s=",
                  double(seg_->layout.stallTimeoutMs) / 1000, " s, heartbeat_ms=", seg_->layout.heartbeatMs,
                  stopped ? "; process is stopped" : "", ") in segment '", seg_->name, "'");
  noteStall(index, ageNs > 2 * int64_t(seg_->layout.heartbeatMs) * 1000000, ageNs, stopped, where);
}

void Port::noteStall(int index, bool stalled, int64_t ageNs, bool stopped, const ErrorWhere& where) const {
  if (stalledSince_.size() < size_t(seg_->numProcesses())) stalledSince_.resize(size_t(seg_->numProcesses()), 0);
  int64_t& since = stalledSince_[size_t(index)];
  const int64_t now = monotonicNs();
  if (stalled && since == 0) {
    since = now - ageNs;
    DISTILL_LOG(kWarning) << describeSelf() << ": peer " << describeProcess(index) << " stalled: no heartbeat for "
                          << toMs(std::chrono::nanoseconds(ageNs)) << " ms" << (stopped ? " (process is stopped)" : "")
                          << "; waiting up to transport.stall_timeout_s=" << double(seg_->layout.stallTimeoutMs) / 1000
                          << " s [" << (where.step ? "step=" + std::to_string(*where.step) + " acc_step=" +
                                                 std::to_string(where.accStep.value_or(0)) + " "
                                           : std::string())
                          << "awaiting: " << where.awaited << "]";
  } else if (!stalled && since != 0) {
    DISTILL_LOG(kInfo) << describeSelf() << ": peer " << describeProcess(index) << " resumed after a stall of "
                       << toMs(std::chrono::nanoseconds(now - since)) << " ms";
    since = 0;
  }
}

void Port::noteResumed(const std::vector<int>& peers) const {
  for (int p : peers) {
    if (size_t(p) >= stalledSince_.size() || stalledSince_[size_t(p)] == 0) continue;
    const auto& e = seg_->process(p);
    const int64_t ageNs = monotonicNs() - e.heartbeatNs.load(std::memory_order_relaxed);
    const bool finished = ProcState(e.state.load(std::memory_order_acquire)) == ProcState::kFinished;
    if (finished || ageNs <= 2 * int64_t(seg_->layout.heartbeatMs) * 1000000) noteStall(p, false, ageNs, false, {});
  }
}

bool Port::waitUntil(const std::function<bool()>& cond, const WaitDesc& desc, const std::vector<int>& peers,
                     bool finishedIsLost, Deadline deadline) {
  if (cond()) {
    if (!stalledSince_.empty()) noteResumed(peers);
    return true;
  }
  auto& ctl = seg_->control();
  auto checkAll = [&] {
    if (ctl.abort.load(std::memory_order_acquire))
      DISTILL_THROW(IpcError, awaiting(wire::waitName(uint32_t(desc.what))), describeSelf(), ": segment '", seg_->name,
                    "' was aborted");
    for (int p : peers) checkPeer(p, desc, finishedIsLost);
  };
  // Spin briefly: a ping-pong partner on another core answers in ~1 us, far
  // below the cost of a futex sleep + wake.
  if (spinUs_ > 0) {
    const auto spinEnd = Clock::now() + std::chrono::microseconds(spinUs_);
    for (int i = 0;; ++i) {
      if (cond()) return true;
      if ((i & 63) == 63 && Clock::now() >= spinEnd) break;
      DISTILL_CPU_RELAX();
    }
  }
  auto& e = self();
  const uint32_t prevState = e.state.load(std::memory_order_relaxed);
  e.waitWhat.store(uint32_t(desc.what), std::memory_order_relaxed);
  e.waitPeer.store(desc.peerIndex >= 0 ? seg_->process(desc.peerIndex).rank.load(std::memory_order_relaxed) : -1,
                   std::memory_order_relaxed);
  const Tag tag = desc.tag.value_or(Tag{});
  e.waitStep.store(tag.step, std::memory_order_relaxed);
  e.waitAccStep.store(tag.accStep, std::memory_order_relaxed);
  e.waitSeq.store(tag.seq, std::memory_order_relaxed);
  e.waitSinceNs.store(monotonicNs(), std::memory_order_relaxed);
  e.state.store(uint32_t(ProcState::kWaiting), std::memory_order_release);
  struct Restore {
    wire::ProcessEntry& e;
    uint32_t prev;
    ~Restore() {
      e.waitWhat.store(0, std::memory_order_relaxed);
      e.state.store(prev, std::memory_order_release);
    }
  } restore{e, prevState};

  const auto livenessPeriod = std::chrono::milliseconds(std::max(1, seg_->layout.heartbeatMs / 4));
  auto nextCheck = Clock::now();
  for (;;) {
    const uint32_t seq = e.doorbell.load(std::memory_order_acquire);
    e.sleepers.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    struct Leave {
      std::atomic<uint32_t>& s;
      ~Leave() { s.fetch_sub(1, std::memory_order_relaxed); }
    } leave{e.sleepers};
    if (cond()) {
      if (!stalledSince_.empty()) noteResumed(peers);
      return true;
    }
    auto now = Clock::now();
    if (now >= nextCheck) {
      checkAll();
      nextCheck = now + livenessPeriod;
    }
    if (now >= deadline.when()) return cond();
    const auto until = std::min(deadline.when(), nextCheck);
    sys::futexWait(&e.doorbell, seq, until - now);
  }
}

} // namespace distill::ipc
