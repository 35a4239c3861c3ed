#pragma once

// Test support for distill-run end to end: one real distill-run per test, its
// console (stdout + stderr) read through a pipe or a pseudo-terminal, so every
// wait is on output or on the process, with a deadline; and a fixture that
// writes a config for this test binary in a role (teacher.kind self).

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "support/process.h"

namespace distill::testing {

using Ms = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

using distill::msSince; // core/clock.h
bool has(const std::string& text, const std::string& needle);

class Launch {
 public:
  // distill-run `args`. `wrapper`: a command that runs distill-run, given
  // distill-run's path and `args` after its own (e.g. this binary in a role
  // that sets up a mount namespace first). `env`: added to the environment.
  explicit Launch(const std::vector<std::string>& args, bool tty = false, const std::vector<std::string>& wrapper = {},
                  const std::map<std::string, std::string>& env = {});
  ~Launch();
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  // Reads until the console contains `needle` (true) or EOF / `timeout` (false).
  bool waitFor(const std::string& needle, Ms timeout = Ms(30000));
  // Reads to EOF, then reaps distill-run; both within `timeout`.
  ExitStatus finish(Ms timeout = Ms(40000));

  void kill(int sig) { child_.kill(sig); }
  const std::string& text() const { return text_; }
  int64_t elapsedMs() const { return elapsed_; } // start to exit, after finish()
  int64_t sinceStartMs() const { return msSince(started_); }
  // The node's segment, from distill-run's log line.
  std::string segment() const;

 private:
  bool readSome(SteadyClock::time_point deadline);

  Child child_;
  int out_ = -1;
  std::string text_;
  SteadyClock::time_point started_;
  int64_t elapsed_ = -1;
};

class LauncherFixture : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  // A config for a role of this binary: teacher.kind self, short timeouts.
  std::string config(int nproc = 3);
  // distill-run arguments for this test binary in `role`.
  std::vector<std::string> jobArgs(const std::vector<std::string>& options, const std::vector<std::string>& roleArgs,
                                   const std::string& role = "job");
  static void expectSegmentGone(const Launch& l);
  std::string log(int rank) const;

  std::string dir_;
};

} // namespace distill::testing
