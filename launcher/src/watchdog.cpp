#include "watchdog.h"

#include <cstdio>
#include <map>

#include "distill/ipc/hang_report.h"

namespace distill::launcher {

Verdict Watchdog::check(const ipc::Segment& seg, const std::vector<Rank>& ranks, bool quiet) {
  uint64_t progress = ipc::progressCount(seg);
  for (auto& r : ranks) progress += r.exited ? 1 : 0;
  const auto now = Clock::now();
  // Start-up is run.startup_timeout_s's to bound, not the watchdog's: while a
  // running rank has not attached yet (importing torch, loading a model, a
  // restarted teacher coming up), the admission waits have their own deadline.
  const auto procs = seg.processes();
  bool starting = false;
  for (auto& r : ranks) {
    const size_t local = size_t(r.topo.localRank);
    starting |= !r.exited && r.pid > 0 && local < procs.size() && procs[local].pid != r.pid;
  }
  if (progress != lastProgress_ || starting) {
    lastProgress_ = progress;
    lastProgressAt_ = now;
    return {};
  }
  const auto idle = now - lastProgressAt_;
  if (quiet || idle < std::chrono::duration<double>(timeoutS_)) return {};
  char title[200];
  std::snprintf(title, sizeof title, "hang: no rank made progress for %.1f s (run.hang_timeout_s=%g, on_hang=%s)",
                std::chrono::duration<double>(idle).count(), timeoutS_, onHang_.c_str());
  lastProgressAt_ = now; // the next verdict after another period without progress
  return {true, title, hangTable(seg, ranks, title)};
}

std::string hangTable(const ipc::Segment& seg, const std::vector<Rank>& ranks, const std::string& title) {
  std::map<int, std::string> notes;
  const auto procs = seg.processes();
  for (auto& r : ranks) {
    const int local = r.topo.localRank;
    if (r.exited) {
      notes[local] = "exited: " + describeStatus(r.status);
    } else if (local < static_cast<int>(procs.size()) && procs[size_t(local)].pid != r.pid) {
      notes[local] = "pid " + std::to_string(r.pid) + " running, never attached (global rank " +
          std::to_string(r.topo.globalRank) + ")";
    }
  }
  return ipc::formatHangTable(seg, title, notes);
}

} // namespace distill::launcher
