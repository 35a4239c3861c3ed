#pragma once

// One single-node distill job for multi-process tests, set up as distill-run
// does: a unique segment and job id, the YAML config in a temp file, a free
// rendezvous port, the environment of each local rank (topologyEnv +
// DISTILL_CONFIG), one log file per rank. The destructor removes the segment
// and the config file and checks that /dev/shm holds nothing of the job.
// Declare children after the Job: they are killed before the segment goes.

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "distill/core/options.h"
#include "support/process.h"

namespace distill::testing {

class Job {
 public:
  // `students` local students + 1 teacher (local rank `students`). Without
  // `withSegment` no segment is made (students that only use their group).
  Job(int students, const std::string& yaml, bool withSegment = true);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  int students() const { return students_; }
  int teacherRank() const { return students_; }
  const Config& config() const { return config_; }
  const std::string& segment() const { return segment_; }
  const std::string& jobId() const { return jobId_; }
  // Environment of local rank `local` (the teacher is local rank students()).
  std::map<std::string, std::string> env(int local) const;
  std::string logPath(int local) const;
  std::string log(int local) const { return readFile(logPath(local)); }

  // bin/distill-teacher as the teacher of this job.
  Child spawnTeacherBinary() const;
  // This test binary in `role` as local rank `local`.
  Child spawnRole(const std::string& role, int local, const std::vector<std::string>& args = {}) const;

 private:
  int students_;
  bool withSegment_;
  int port_;
  std::string segment_, jobId_, configPath_, logBase_;
  Config config_;
};

// Joins every child with one shared deadline; a child still running then is
// killed and the test fails (Child::join). Returns the statuses in order.
std::vector<ExitStatus> joinAll(std::vector<Child>& children, std::chrono::milliseconds timeout);

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The number after `key` in `text` (e.g. "RESULT gets=" -> 100); NaN if absent.
double numberAfter(const std::string& text, const std::string& key);

} // namespace distill::testing
