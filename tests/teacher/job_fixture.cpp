#include "job_fixture.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "distill/core/config.h"
#include "distill/core/topology.h"
#include "distill/ipc/segment.h"
#include "support/roles.h"

namespace distill::testing {

Job::Job(int students, const std::string& yaml, bool withSegment)
    : students_(students),
      withSegment_(withSegment),
      port_(freePort()),
      segment_(uniqueName("distill-e2e")),
      jobId_("job-" + segment_),
      configPath_(::testing::TempDir() + segment_ + ".yaml"),
      logBase_(::testing::TempDir() + segment_) {
  config_ = parseConfig(yaml, {}, configPath_);
  std::ofstream(configPath_) << yaml;
  if (withSegment_) ipc::Segment::create(segment_, ipc::SegmentLayout::fromConfig(config_, students_), jobId_);
}

Job::~Job() {
  ipc::Segment::remove(segment_);
  struct stat st;
  EXPECT_NE(::stat(("/dev/shm/" + segment_).c_str(), &st), 0) << "/dev/shm/" << segment_ << " left behind";
  std::remove(configPath_.c_str());
  if (!::testing::Test::HasFailure()) {
    for (int i = 0; i <= students_; ++i) std::remove(logPath(i).c_str());
  }
}

std::map<std::string, std::string> Job::env(int local) const {
  Topology t = Topology::forLocalRank(0, 1, local, students_ + 1);
  t.masterPort = port_;
  if (withSegment_) t.segment = segment_;
  t.jobId = jobId_;
  t.configPath = configPath_;
  auto env = topologyEnv(t);
  env["DISTILL_CONFIG"] = configPath_;
  // Several torch processes share few cores: one intra-op thread each, or
  // their spinning OpenMP pools make a 3 s job take 30 s.
  env["OMP_NUM_THREADS"] = "1";
  return env;
}

std::string Job::logPath(int local) const { return logBase_ + "-r" + std::to_string(local) + ".log"; }

Child Job::spawnTeacherBinary() const {
  return spawn({binPath("distill-teacher")}, env(teacherRank()), logPath(teacherRank()));
}

Child Job::spawnRole(const std::string& role, int local, const std::vector<std::string>& args) const {
  return ::distill::testing::spawnRole(role, args, env(local), logPath(local));
}

std::vector<ExitStatus> joinAll(std::vector<Child>& children, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<ExitStatus> out;
  for (auto& c : children) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    out.push_back(c.join(std::max(left, std::chrono::milliseconds(1))));
  }
  return out;
}

double numberAfter(const std::string& text, const std::string& key) {
  auto pos = text.find(key);
  if (pos == std::string::npos) return std::nan("");
  return std::strtod(text.c_str() + pos + key.size(), nullptr);
}

} // namespace distill::testing
