// Death and silence are told apart (issue: no healthy job killed by a late
// heartbeat). Real jobs under distill-run with the default transport settings
// (heartbeat_ms 100, stall_timeout_s 60):
//   - a teacher or a student stopped (SIGSTOP) for 1, 3 and 10 s, then
//     continued: the job finishes with the same result as an undisturbed one;
//   - a SIGKILLed teacher is still reported within 1 s;
//   - a stopped peer past transport.stall_timeout_s is lost, naming the stall;
//   - jobs under four times the cores' load (busy loops) all finish.
// Ranks are this test binary in the `live` role (teacher.kind self).
#include <cstdlib>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <regex>
#include <thread>

#include "distill/distill.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

constexpr int kSteps = 30;
constexpr int kGateStep = 5; // student 0 prints "AT 5" and waits for the test at this step

int envInt(const char* name) { return std::atoi(std::getenv(name)); }

// Blocks until `fifo` can be opened for reading and is written to; the test
// writes it after it has stopped its target. Bounded by 60 s.
void waitForGate(const std::string& fifo, const std::string& at) {
  std::printf("AT %s\n", at.c_str());
  std::fflush(stdout);
  const int fd = ::open(fifo.c_str(), O_RDONLY); // blocks until the test opens it for writing
  if (fd < 0) return;
  char c;
  (void)!::read(fd, &c, 1);
  ::close(fd);
}

} // namespace

// args[0] = a FIFO the test writes to release student 0 at step kGateStep ("" = no gate);
// args[1] (optional) = one that holds student 0 after its last step, before it finishes ("AT END").
// Every rank prints "PID <role> <pid>"; each student "RESULT <sum of its answers, all-reduced>".
DISTILL_TEST_ROLE(live) {
  const std::string fifo = args.empty() ? "" : args[0];
  const std::string endGate = args.size() > 1 ? args[1] : "";
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int argc = 1;
  char arg0[] = "liveness_test";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  std::printf("PID %s %d\n", s.isTeacher() ? "teacher" : ("student" + std::to_string(envInt("DISTILL_LOCAL_RANK"))).c_str(),
              static_cast<int>(::getpid()));
  if (s.isTeacher()) {
    distill::serve(*s.teacher, doublerTeacher());
    return 0;
  }
  const int rank = s.topology.studentRank;
  auto sum = torch::zeros({1}, torch::kDouble);
  for (int64_t step = 0; step < kSteps; ++step) {
    if (rank == 0 && step == kGateStep && !fifo.empty()) waitForGate(fifo, std::to_string(kGateStep));
    doublerStep(*s.client, rank, step, 1);
    auto x = torch::arange(4, torch::kLong) + 1000 * rank + 10 * step;
    auto t = torch::full({1}, double(x.sum().item<int64_t>() * 2), torch::kDouble);
    s.student->group().allReduce(t, distill::ReduceOp::kSum, "sum");
    sum += t;
  }
  if (rank == 0 && !endGate.empty()) waitForGate(endGate, "END");
  s.client->finish();
  std::printf("RESULT %.1f\n", sum.item<double>());
  return 0;
}

namespace {

class Liveness : public LauncherFixture {
 protected:
  std::string fifo() {
    const std::string f = dir_ + "/gate";
    ::unlink(f.c_str());
    EXPECT_EQ(::mkfifo(f.c_str(), 0600), 0);
    return f;
  }
  static void release(const std::string& f) {
    const int fd = ::open(f.c_str(), O_WRONLY); // the student has it open for reading: no block
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, "x", 1), 1);
    ::close(fd);
  }
  // The pid a rank printed as "PID <who> <pid>".
  static int pidOf(const Launch& l, const std::string& who) {
    std::smatch m;
    const std::string t = l.text();
    if (!std::regex_search(t, m, std::regex("PID " + who + " ([0-9]+)"))) return -1;
    return std::stoi(m[1]);
  }
  static std::string result(const std::string& text) {
    std::smatch m;
    return std::regex_search(text, m, std::regex("RESULT ([0-9.]+)")) ? m[1].str() : "";
  }
  // The result of a job that nobody disturbs (computed once).
  std::string baseline() {
    static std::string r;
    if (r.empty()) {
      Launch l(jobArgs({}, {""}, "live"));
      EXPECT_EQ(l.finish(Ms(120000)).code, 0) << l.text();
      r = result(l.text());
    }
    return r;
  }
  // Stops `who` for `seconds` at step kGateStep, continues it, and expects
  // the job to finish with the baseline's result.
  void stopAndContinue(const std::string& who, int seconds) {
    const std::string expected = baseline();
    ASSERT_FALSE(expected.empty());
    const std::string gate = fifo();
    Launch l(jobArgs({}, {gate}, "live"));
    ASSERT_TRUE(l.waitFor("AT " + std::to_string(kGateStep), Ms(60000))) << l.text();
    const int pid = pidOf(l, who);
    ASSERT_GT(pid, 0) << l.text();
    ASSERT_EQ(::kill(pid, SIGSTOP), 0);
    release(gate); // student 0 goes on and waits on the stopped peer
    std::this_thread::sleep_for(std::chrono::seconds(seconds)); // the scenario: a stop of this length
    ASSERT_EQ(::kill(pid, SIGCONT), 0);
    const auto st = l.finish(Ms(120000));
    EXPECT_EQ(st.code, 0) << who << " stopped " << seconds << " s\n" << l.text();
    EXPECT_EQ(result(l.text()), expected) << l.text();
    EXPECT_FALSE(has(l.text(), "stalled (no heartbeat for")) << "no PeerLostError\n" << l.text();
    EXPECT_TRUE(has(l.text(), "stalled: no heartbeat for")) << "the stall is reported\n" << l.text();
    EXPECT_TRUE(has(l.text(), "resumed after a stall of")) << l.text();
  }
};

TEST_F(Liveness, TeacherStoppedOneSecond) { stopAndContinue("teacher", 1); }
TEST_F(Liveness, TeacherStoppedThreeSeconds) { stopAndContinue("teacher", 3); }
TEST_F(Liveness, TeacherStoppedTenSeconds) { stopAndContinue("teacher", 10); }
TEST_F(Liveness, StudentStoppedOneSecond) { stopAndContinue("student1", 1); }
TEST_F(Liveness, StudentStoppedThreeSeconds) { stopAndContinue("student1", 3); }
TEST_F(Liveness, StudentStoppedTenSeconds) { stopAndContinue("student1", 10); }

// Death is known from the kernel, not from a timeout: a SIGKILLed teacher is
// reported by its students within 1 s, with the default 60 s stall timeout.
TEST_F(Liveness, KilledTeacherIsReportedWithinOneSecond) {
  const std::string gate = fifo();
  Launch l(jobArgs({}, {gate}, "live"));
  ASSERT_TRUE(l.waitFor("AT " + std::to_string(kGateStep), Ms(60000))) << l.text();
  const int pid = pidOf(l, "teacher");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  const auto killedAt = SteadyClock::now();
  release(gate);
  ASSERT_TRUE(l.waitFor("exited: signal SIGKILL", Ms(20000))) << l.text();
  EXPECT_LT(msSince(killedAt), 1000) << l.text();
  EXPECT_NE(l.finish().code, 0);
}

// Past transport.stall_timeout_s a live but silent peer is lost, and the
// error says it stalled (and that it is stopped), not that it died.
TEST_F(Liveness, StoppedPastTheStallTimeoutIsLost) {
  const std::string gate = fifo();
  Launch l(jobArgs({"--set", "transport.stall_timeout_s=1.5"}, {gate}, "live"));
  ASSERT_TRUE(l.waitFor("AT " + std::to_string(kGateStep), Ms(60000))) << l.text();
  const int pid = pidOf(l, "teacher");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const auto stoppedAt = SteadyClock::now();
  release(gate);
  ASSERT_TRUE(l.waitFor("stalled (no heartbeat for", Ms(20000))) << l.text(); // the PeerLostError
  const int64_t ms = msSince(stoppedAt);
  EXPECT_GE(ms, 1400) << l.text();
  EXPECT_LT(ms, 6000) << l.text();
  EXPECT_TRUE(has(l.text(), "> transport.stall_timeout_s=1.5 s")) << l.text();
  EXPECT_TRUE(has(l.text(), "process is stopped")) << l.text();
  EXPECT_NE(l.finish().code, 0);
}

// A teacher stopped just after the last step (a scheduler's suspend): the
// students finish and exit 0, distill-run continues the teacher so it can end,
// and the job is a success — not a hang, not a failure.
TEST_F(Liveness, TeacherStoppedAfterTheLastStepDoesNotFailTheJob) {
  const std::string expected = baseline();
  const std::string end = dir_ + "/end";
  ASSERT_EQ(::mkfifo(end.c_str(), 0600), 0);
  Launch l(jobArgs({}, {"", end}, "live"));
  ASSERT_TRUE(l.waitFor("AT END", Ms(60000))) << l.text();
  const int pid = pidOf(l, "teacher");
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  release(end);
  const auto st = l.finish(Ms(60000));
  EXPECT_EQ(st.code, 0) << l.text();
  EXPECT_EQ(result(l.text()), expected) << l.text();
  EXPECT_TRUE(has(l.text(), "is stopped (SIGSTOP) after every student finished")) << l.text();
  EXPECT_FALSE(has(l.text(), "hang:")) << l.text();
  EXPECT_TRUE(has(l.text(), "job finished: every rank exited 0")) << l.text();
}

// Jobs under four times the cores' load, default settings: every one finishes
// with the undisturbed result. Busy loops are children of this test, ended
// with it.
TEST_F(Liveness, JobsUnderFourTimesTheCoresLoadAllFinish) {
  const std::string expected = baseline();
  ASSERT_FALSE(expected.empty());
  const int loaders = 4 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<pid_t> busy;
  for (int i = 0; i < loaders; ++i) {
    const pid_t p = ::fork();
    ASSERT_GE(p, 0);
    if (p == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      for (volatile uint64_t x = 0;; x = x + 1) {
      }
    }
    busy.push_back(p);
  }
  struct Reap {
    std::vector<pid_t>& pids;
    ~Reap() {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
    }
  } reap{busy};
  int ok = 0;
  const char* stress = std::getenv("DISTILL_STRESS"); // docs/building.md, "Tests": 10 jobs, else 2
  const int kJobs = stress && std::string(stress) == "1" ? 10 : 2;
  for (int i = 0; i < kJobs; ++i) {
    Launch l(jobArgs({}, {""}, "live"));
    const auto st = l.finish(Ms(180000));
    const bool good = st.code == 0 && result(l.text()) == expected;
    ok += good ? 1 : 0;
    EXPECT_TRUE(good) << "job " << i << " under load\n" << l.text();
  }
  EXPECT_EQ(ok, kJobs);
}

} // namespace
