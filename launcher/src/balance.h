#pragma once

// Is the job teacher-bound? What distill-run says at the end of a job, from
// what it sampled on its status ticks: the students' teacher wait share
// (Client::publishStatus fills it in) and the teacher's busy share and cache
// hit share (published by the teacher server in the segment).

#include <optional>
#include <string>
#include <vector>

#include "distill/core/options.h"
#include "ranks.h"

namespace distill::launcher {

// What the node has and already runs: bounds the teacher.procs advice (more
// teacher processes than the node's cores or GPUs hold share them, and the
// job gets slower, as measured: 2 teachers on 2 cores, 83.0 s vs 66.6 s).
// 0 in `cores` or `gpus`: unknown (no bound from it).
struct NodeShape {
  int teachers = 1; // teacher.procs
  int students = 0; // student processes on the node
  int cores = 0; // CPUs the node's processes may run on (sched_getaffinity)
  int teacherThreads = 0; // teacher.threads (0: torch's default; counted as one core)
  int gpus = 0; // GPUs the node shows
  bool teacherOnGpu = false; // the teachers run on GPUs (teacher.device / teacher.devices)
  // What the config already does, which advice does not suggest again:
  int64_t topk = 0; // teacher.topk (> 0: the answers are top-k already)
  bool cacheOn = false; // teacher.cache.mode is not off
};

// This node's shape under `cfg`: cores from sched_getaffinity
// (std::thread::hardware_concurrency when it fails), GPUs from
// CUDA_VISIBLE_DEVICES when set, else the /dev/nvidiaN devices.
NodeShape nodeShape(const Config& cfg);

// How many teacher processes the node holds next to its students, one core
// each (teacher.threads each when set) or one GPU each; -1: unknown.
int teacherRoom(const NodeShape& node);

// One line: "teacher-bound: ...", "balanced: ..." or "student-bound: ...".
//   wait   the students' mean share of a step spent waiting for the teacher (0..1)
//   busy   the teacher's busy share (0..1), when known
//   hits   the teachers' cache hit share over the job (0..1: hits / rows looked
//          up, as the teacher's summary and the status line count it), when on
//   node   the node's shape; node.teachers: teacher processes per node
//          (teacher.procs), busy is their mean
//   cacheNote  "" or what the cache says of itself (full, bytes per stored token)
// Teacher-bound, it names what would help: how many teacher processes would
// keep up (from busy and wait) as far as the node's cores (or GPUs) hold
// them — or that more cannot help there —, the cache, a smaller teacher,
// teacher.topk — only what the config does not already do (no teacher.topk
// when node.topk > 0, no cache when node.cacheOn). Any verdict says so when
// the node runs more teachers than it holds.
std::string balanceVerdict(double wait, std::optional<double> busy, std::optional<double> hits,
                           const NodeShape& node, const std::string& cacheNote = "");
// The same without the node's shape (no bound from cores or GPUs).
std::string balanceVerdict(double wait, std::optional<double> busy, std::optional<double> hits, int teachers = 1,
                           const std::string& cacheNote = "");

// Means over the status ticks on which the students had published a wait
// share; the cache hit share is the last one (it counts since the job began).
class Balance {
 public:
  void sample(const std::vector<Rank>& ranks, std::optional<double> busy, std::optional<double> hits);
  // "" when nothing was sampled.
  std::string verdict(const NodeShape& node, const std::string& cacheNote = "") const;
  std::string verdict(int teachers = 1, const std::string& cacheNote = "") const;

 private:
  int samples_ = 0, busySamples_ = 0, hitSamples_ = 0;
  double wait_ = 0, busy_ = 0, hits_ = 0;
};

} // namespace distill::launcher
