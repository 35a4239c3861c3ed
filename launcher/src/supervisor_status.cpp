// The supervisor's view of the job while it runs (supervisor.h): every
// kSampleEvery the watchdog's verdict, the students' published statuses, the
// teachers' busy and cache gauges, and the status line and balance verdict
// made of them.
#include <cmath>
#include <string>
#include <vector>

#include "supervisor.h"

namespace distill::launcher {

// Every kSampleEvery: the watchdog, then the status line.
void Supervisor::tick() {
  if (!seg_ || nextSample_.when() > Clock::now()) return;
  nextSample_ = Deadline::after(kSampleEvery);
  onVerdict(watchdog_.check(*seg_, ranks_, teardownDeadline_.has_value() || studentsDoneDeadline_.has_value()));
  if (!readStatuses()) return;
  if (!teacherAttached_) {
    for (auto& p : seg_->processes()) teacherAttached_ |= p.role == "teacher" && p.pid != 0;
  }
  // The balance verdict takes the teachers' mean busy share; the status line shows each.
  console_.showStatus(status());
  if (teacherAttached_) balance_.sample(ranks_, seg_->teacherBusy(), cacheHits());
}

// The teachers' cache hit share (hits / rows looked up, since the job began), when their cache looks rows up.
std::optional<double> Supervisor::cacheHits() const {
  if (cfg_.teacher.cache.mode == CacheMode::kOff || !teacherAttached_) return std::nullopt;
  return seg_->teacherCache().hitShare();
}

// "" until the teachers' cache stores no more rows; then, for the status line,
// "cache full (6316 B/token)", and for the verdict a sentence with max_bytes.
std::string Supervisor::cacheNote(bool verdict) const {
  if (cfg_.teacher.cache.mode == CacheMode::kOff || !teacherAttached_) return "";
  const ipc::TeacherCacheGauge g = seg_->teacherCache();
  if (g.full == ipc::TeacherCacheGauge::Full::kNo) return "";
  const auto perToken = std::to_string(std::lround(g.bytesPerToken()));
  if (g.full == ipc::TeacherCacheGauge::Full::kWriteFailed) {
    return verdict ? "the cache stopped storing rows: a write to " + cfg_.teacher.cache.path +
            " failed (the teacher's log says why)"
                   : "cache stopped storing (a write failed)";
  }
  if (!verdict) return "cache full (" + perToken + " B/token)";
  return "the cache is full (teacher.cache.max_bytes=" + std::to_string(cfg_.teacher.cache.max_bytes) + " at " +
      perToken + " bytes per stored token): rows past it are computed again in every epoch";
}

// Each student's last published status (Client::publishStatus); true once any published one.
bool Supervisor::readStatuses() {
  for (auto& r : ranks_) {
    if (!r.topo.isStudent()) continue;
    if (auto s = seg_->status(r.topo.localRank)) r.published = s;
    statusSeen_ |= r.published.has_value();
  }
  return statusSeen_;
}

std::string Supervisor::status() const {
  std::vector<double> busy;
  for (int t = 0; teacherAttached_ && t < seg_->numTeachers(); ++t) busy.push_back(seg_->teacherBusy(t));
  return statusText(ranks_, busy, cacheHits(), cacheNote(false)) +
      stallText(seg_->processes(), cfg_.transport.heartbeat_ms);
}

} // namespace distill::launcher
