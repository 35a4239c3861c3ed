#pragma once

// The watchdog: when no process of the node begins or ends an event (flight
// recorder, ipc/hang_report.h) for run.hang_timeout_s, it returns a verdict —
// a hang, with its title and the hang table (every rank's state, current wait
// on whom, for which tag, since when, or "busy in user code since", and its
// last 5 events). It never acts on it: the supervisor prints the table and,
// per run.on_hang, tears the job down or lets it run.

#include <cstdint>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/core/options.h"
#include "distill/ipc/segment.h"
#include "ranks.h"

namespace distill::launcher {

struct Verdict {
  bool hang = false;
  std::string title; // "hang: no rank made progress for 5.0 s (...)"
  std::string table; // the hang table, title first
};

class Watchdog {
 public:
  Watchdog(double timeoutS, OnHang onHang) : timeoutS_(timeoutS), onHang_(toString(onHang)) {}

  // Progress is any event begun or ended by any process (its flight recorder),
  // an attach, a clean detach or a rank's exit; heartbeats are not. A hang is
  // no progress for run.hang_timeout_s; `quiet` (a teardown under way) only
  // records progress. While a running rank has not attached yet, nothing is a
  // hang (start-up is bounded by run.startup_timeout_s). After a hang verdict
  // the next one comes after another period without progress.
  Verdict check(const ipc::Segment& seg, const std::vector<Rank>& ranks, bool quiet);

 private:
  double timeoutS_;
  std::string onHang_;
  uint64_t lastProgress_ = ~uint64_t(0);
  Clock::time_point lastProgressAt_ = Clock::now();
};

// The hang table of the node under `title`: every process of the segment, with
// what distill-run knows of its rank (exited how, running but never attached).
std::string hangTable(const ipc::Segment& seg, const std::vector<Rank>& ranks, const std::string& title);

} // namespace distill::launcher
