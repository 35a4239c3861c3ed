#pragma once

// The end of a job that did not end normally: the summary naming the rank that
// failed first and how, every rank's end, the teacher's restarts and the last
// lines of the rank in the headline.

#include <cstdint>
#include <string>
#include <vector>

#include "distill/ipc/segment.h"
#include "ranks.h"

namespace distill::launcher {

struct Ending {
  std::string reason; // why the job did not end normally
  const Rank* failedRank = nullptr; // the failed rank distill-run noticed first
  bool hung = false; // torn down for a hang
  int64_t teardownStartNs = 0; // monotonicNs() when the teardown began (0: none)
  int restarts = 0; // teacher restarts so far
  int maxRestarts = 0; // teacher.max_restarts
};

// "signal SIGKILL (Killed); exit code 3": how each restarted teacher ended.
std::string deathsText(const std::vector<Rank>& ranks);
// ", teacher restarted 1 of 2 times (signal SIGKILL (Killed))" or "".
std::string restartsText(const std::vector<Rank>& ranks, int restarts, int maxRestarts);
// The summary, "\n==== distill-run: job failed: ..." and its lines. `seg` may be null.
std::string summaryText(const std::vector<Rank>& ranks, const ipc::Segment* seg, const Ending& e);

} // namespace distill::launcher
