#pragma once

// Is the job teacher-bound? What distill-run says at the end of a job, from
// what it sampled on its status ticks: the students' teacher wait share
// (Client::publishStatus fills it in) and the teacher's busy share and cache
// hit share (published by the teacher server in the segment).

#include <optional>
#include <string>
#include <vector>

#include "ranks.h"

namespace distill::launcher {

// One line: "teacher-bound: ...", "balanced: ..." or "student-bound: ...".
//   wait   the students' mean share of a step spent waiting for the teacher (0..1)
//   busy   the teacher's busy share (0..1), when known
//   hits   the teachers' cache hit share over the job (0..1: hits / rows looked
//          up, as the teacher's summary and the status line count it), when on
//   teachers  teacher processes per node (teacher.procs); busy is their mean
//   cacheNote  "" or what the cache says of itself (full, bytes per stored token)
// Teacher-bound, it names what would help: how many teacher processes would
// keep up (from busy and wait), the cache, a smaller teacher, teacher.topk.
std::string balanceVerdict(double wait, std::optional<double> busy, std::optional<double> hits, int teachers = 1,
                           const std::string& cacheNote = "");

// Means over the status ticks on which the students had published a wait
// share; the cache hit share is the last one (it counts since the job began).
class Balance {
 public:
  void sample(const std::vector<Rank>& ranks, std::optional<double> busy, std::optional<double> hits);
  // "" when nothing was sampled.
  std::string verdict(int teachers = 1, const std::string& cacheNote = "") const;

 private:
  int samples_ = 0, busySamples_ = 0, hitSamples_ = 0;
  double wait_ = 0, busy_ = 0, hits_ = 0;
};

} // namespace distill::launcher
