// The segment's mutable, shared gauges: the students' status areas (a seqlock
// each), the per-teacher busy shares, cache counters and restart counters, and
// the process table's snapshot for the hang report and the launcher.
#include <algorithm>
#include <cstring>

#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/ipc/segment.h"
#include "segment_impl.h"
#include "sys.h"

namespace distill::ipc {

namespace {

// Teacher `t` of the segment, or an IpcError naming the valid range.
wire::ControlBlock::TeacherState& teacherAt(const SegmentImpl& s, int t) {
  DISTILL_CHECK_T(IpcError, t >= 0 && t < s.numTeachers(), "segment '", s.name, "': no teacher ", t, " (it has ",
                  s.numTeachers(), ")");
  return s.control().teachers[t];
}

uint32_t permille(double share) { return static_cast<uint32_t>((share < 0 ? 0 : share > 1 ? 1 : share) * 1000 + 0.5); }

// The mean over the teachers of one of their permille gauges, as a share.
template <typename F>
double meanShare(const SegmentImpl& s, F gauge) {
  double sum = 0;
  for (int t = 0; t < s.numTeachers(); ++t) sum += gauge(s.control().teachers[t]).load(std::memory_order_relaxed);
  return sum / 1000.0 / s.numTeachers();
}

} // namespace

void Segment::setTeacherBusy(int teacher, double share) const {
  teacherAt(*impl_, teacher).busyPermille.store(permille(share), std::memory_order_relaxed);
}
double Segment::teacherBusy(int teacher) const {
  return teacherAt(*impl_, teacher).busyPermille.load(std::memory_order_relaxed) / 1000.0;
}
double Segment::teacherBusy() const {
  return meanShare(
      *impl_, [](auto& t) -> auto& { return t.busyPermille; });
}

void Segment::publishStatus(int localIndex, const StudentStatus& st) const {
  DISTILL_CHECK_T(IpcError, localIndex >= 0 && localIndex < impl_->numProcesses(), "segment '", impl_->name,
                  "': no process ", localIndex, " to publish a status for");
  wire::StatusArea& a = impl_->status(localIndex);
  // Seqlock, one writer (the owner): odd while the fields change.
  const uint64_t seq = a.seq.load(std::memory_order_relaxed);
  a.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  a.step.store(st.step, std::memory_order_relaxed);
  const double values[wire::kStatusUsed] = {st.loss, st.kd, st.ce, st.tokens_per_s, st.teacher_wait_share,
                                                st.truncated_mass, st.masked_tokens, st.skipped_steps};
  for (uint32_t i = 0; i < wire::kStatusUsed; ++i) a.values[i].store(values[i], std::memory_order_relaxed);
  a.count.store(wire::kStatusUsed, std::memory_order_relaxed);
  a.seq.store(seq + 2, std::memory_order_release);
}

std::optional<StudentStatus> Segment::status(int localIndex) const {
  if (localIndex < 0 || localIndex >= impl_->numProcesses()) return std::nullopt;
  const wire::StatusArea& a = impl_->status(localIndex);
  // A writer stopped (SIGSTOP) or killed mid-write leaves seq odd: give up
  // after a few tries rather than spin; the caller keeps what it had.
  for (int attempt = 0; attempt < 64; ++attempt) {
    const uint64_t before = a.seq.load(std::memory_order_acquire);
    if (before == 0) return std::nullopt;
    if (before & 1) continue;
    StudentStatus st;
    st.step = a.step.load(std::memory_order_relaxed);
    double v[wire::kStatusUsed];
    const uint32_t count = std::min<uint32_t>(a.count.load(std::memory_order_relaxed), wire::kStatusUsed);
    for (uint32_t i = 0; i < wire::kStatusUsed; ++i)
      v[i] = i < count ? a.values[i].load(std::memory_order_relaxed) : StudentStatus::kUnset;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (a.seq.load(std::memory_order_relaxed) != before) continue;
    st.loss = v[wire::kStatusLoss];
    st.kd = v[wire::kStatusKd];
    st.ce = v[wire::kStatusCe];
    st.tokens_per_s = v[wire::kStatusTokensPerS];
    st.teacher_wait_share = v[wire::kStatusTeacherWait];
    st.truncated_mass = v[wire::kStatusTruncatedMass];
    st.masked_tokens = v[wire::kStatusMasked];
    st.skipped_steps = v[wire::kStatusSkipped];
    return st;
  }
  return std::nullopt;
}

void Segment::setTeacherCache(int teacher, const TeacherCacheGauge& g) const {
  auto& t = teacherAt(*impl_, teacher);
  t.cacheLookups.store(uint64_t(g.lookups), std::memory_order_relaxed);
  t.cacheHits.store(uint64_t(g.hits), std::memory_order_relaxed);
  t.cacheStoredTokens.store(uint64_t(g.storedTokens), std::memory_order_relaxed);
  t.cacheStoredBytes.store(uint64_t(g.storedBytes), std::memory_order_relaxed);
  t.cacheFull.store(static_cast<uint32_t>(g.full), std::memory_order_relaxed);
}
TeacherCacheGauge Segment::teacherCache(int teacher) const {
  const auto& t = teacherAt(*impl_, teacher);
  TeacherCacheGauge g;
  g.lookups = int64_t(t.cacheLookups.load(std::memory_order_relaxed));
  g.hits = int64_t(t.cacheHits.load(std::memory_order_relaxed));
  g.storedTokens = int64_t(t.cacheStoredTokens.load(std::memory_order_relaxed));
  g.storedBytes = int64_t(t.cacheStoredBytes.load(std::memory_order_relaxed));
  const uint32_t full = t.cacheFull.load(std::memory_order_relaxed);
  g.full = full <= 2 ? static_cast<TeacherCacheGauge::Full>(full) : TeacherCacheGauge::Full::kWriteFailed;
  return g;
}
TeacherCacheGauge Segment::teacherCache() const {
  TeacherCacheGauge sum;
  for (int t = 0; t < impl_->numTeachers(); ++t) {
    const TeacherCacheGauge g = teacherCache(t);
    sum.lookups += g.lookups;
    sum.hits += g.hits;
    sum.storedTokens += g.storedTokens;
    sum.storedBytes += g.storedBytes;
    sum.full = std::max(sum.full, g.full);
  }
  return sum;
}
double Segment::teacherCacheHits(int teacher) const { return teacherCache(teacher).hitShare().value_or(0.0); }
double Segment::teacherCacheHits() const { return teacherCache().hitShare().value_or(0.0); }

void Segment::setTeacherMaxRestarts(int n) const {
  impl_->control().teacherMaxRestarts.store(n, std::memory_order_release);
}
int Segment::teacherMaxRestarts() const { return impl_->control().teacherMaxRestarts.load(std::memory_order_acquire); }
int Segment::noteTeacherRestart(int teacher, int deadPid) const {
  auto& t = teacherAt(*impl_, teacher);
  t.replacedPid.store(deadPid, std::memory_order_relaxed); // published by the increment
  return t.restarts.fetch_add(1, std::memory_order_acq_rel) + 1;
}
int Segment::teacherRestarts(int teacher) const {
  return teacherAt(*impl_, teacher).restarts.load(std::memory_order_acquire);
}
int Segment::teacherRestarts() const {
  int sum = 0;
  for (int t = 0; t < impl_->numTeachers(); ++t) sum += teacherRestarts(t);
  return sum;
}

void Segment::noteTeacherGaveUp(int teacher, const std::string& why) const {
  auto& t = teacherAt(*impl_, teacher);
  auto& c = impl_->control();
  uint32_t none = 0;
  if (c.gaveUpState.compare_exchange_strong(none, 1, std::memory_order_acq_rel)) {
    const std::string text = wire::fitErrorText(why); // < kErrorTextBytes <= kGaveUpTextBytes
    std::memcpy(c.gaveUpText, text.c_str(), text.size() + 1);
    c.gaveUpState.store(2, std::memory_order_release);
  }
  t.gaveUp.store(1, std::memory_order_release);
}
bool Segment::teacherGaveUp(int teacher) const {
  return teacherAt(*impl_, teacher).gaveUp.load(std::memory_order_acquire) != 0;
}
std::string Segment::teacherGaveUpReason() const {
  const auto& c = impl_->control();
  if (c.gaveUpState.load(std::memory_order_acquire) != 2) return "";
  return std::string(c.gaveUpText, strnlen(c.gaveUpText, sizeof c.gaveUpText));
}

std::vector<ProcessSnapshot> Segment::processes() const {
  std::vector<ProcessSnapshot> out;
  const int64_t now = monotonicNs();
  for (int i = 0; i < impl_->numProcesses(); ++i) {
    const auto& e = impl_->process(i);
    ProcessSnapshot s;
    s.localIndex = i;
    s.pid = e.pid.load(std::memory_order_acquire);
    s.rank = e.rank.load(std::memory_order_relaxed);
    s.role = e.role.load(std::memory_order_relaxed) ? "teacher" : "student";
    const uint32_t st = e.state.load(std::memory_order_acquire);
    s.state = wire::stateName(st);
    s.incarnation = e.incarnation.load(std::memory_order_relaxed);
    if (s.pid) {
      s.heartbeatNs = e.heartbeatNs.load(std::memory_order_relaxed);
      s.heartbeatAgeMs = toMs(std::chrono::nanoseconds(now - s.heartbeatNs));
      s.endedNs = e.endedNs.load(std::memory_order_relaxed);
    }
    const uint32_t what = e.waitWhat.load(std::memory_order_relaxed);
    s.waitWhat = wire::waitName(what);
    s.waitPeer = e.waitPeer.load(std::memory_order_relaxed);
    s.waitStep = e.waitStep.load(std::memory_order_relaxed);
    s.waitAccStep = e.waitAccStep.load(std::memory_order_relaxed);
    s.waitSeq = e.waitSeq.load(std::memory_order_relaxed);
    if (what != 0) s.waitForMs = toMs(std::chrono::nanoseconds(now - e.waitSinceNs.load(std::memory_order_relaxed)));
    out.push_back(std::move(s));
  }
  return out;
}

} // namespace distill::ipc
