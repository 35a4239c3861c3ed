// distill-run end to end: a launcher per test with real ranks — this test
// binary in the `job` role (teacher.kind self, so the teacher is this binary
// too) or distill-hello. The test reads distill-run's console through a pipe,
// so every wait is on output or on the process, with a deadline.
//
// This file: the supervisor (launcher/src/supervisor.cpp, console.cpp): start,
// teardown, teacher restarts, stop requests, signals, status lines, two nodes.
// launcher_config_test.cpp: options and config handling; launcher_store_test.cpp:
// the rendezvous store; launcher_balance_test.cpp: the balance verdict;
// launcher_roles.cpp: the `job` and `small_shm` roles the tests run.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <sys/stat.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>

#include "balance.h"
#include "console.h"
#include "distill/distill.h"
#include "distill/ipc/segment.h"
#include "job_store.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/process.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

using LauncherTest = LauncherFixture;

TEST_F(LauncherTest, HelloEndsCleanlyWithLogsPerRank) {
  Launch l({"--config", sourcePath("configs/hello.yaml"), "--log-dir", dir_ + "/logs", "--master-port",
            std::to_string(freePort()), "--", binPath("distill-hello")});
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(has(log(r), "hello done")) << "rank " << r << ": " << log(r);
  EXPECT_TRUE(has(log(2), "served")) << log(2);
  EXPECT_TRUE(has(l.text(), "[n0 r0 student]") && has(l.text(), "[n0 r2 teacher]")) << l.text();
  expectSegmentGone(l);
}

// The permission bits of `path` (-1: no such file).
int modeOf(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int>(st.st_mode & 07777) : -1;
}

// Issue 27 (4.11): the log folder and the rank logs were 0755 / 0644, readable
// by every user; they are owner-only by default, group-readable with
// run.file_mode: group (both less the umask, as the folder's mkdir has it).
TEST_F(LauncherTest, LogsAreOwnerOnlyByDefaultAndGroupReadableWithFileModeGroup) {
  const mode_t mask = ::umask(022);
  ::umask(mask);
  for (const std::string mode : {"private", "group"}) {
    SCOPED_TRACE(mode);
    const std::string logs = dir_ + "/logs-" + mode + "/nested";
    Launch l({"--config", sourcePath("configs/hello.yaml"), "--log-dir", logs, "--master-port",
              std::to_string(freePort()), "--set", "run.file_mode=" + mode, "--", binPath("distill-hello")});
    auto st = l.finish();
    ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
    const int dirMode = (mode == "group" ? 0750 : 0700) & ~mask, fileMode = (mode == "group" ? 0640 : 0600) & ~mask;
    EXPECT_EQ(modeOf(logs), dirMode) << logs;
    EXPECT_EQ(modeOf(dir_ + "/logs-" + mode), dirMode) << "the parent mkdir -p made";
    for (int r = 0; r < 3; ++r) EXPECT_EQ(modeOf(logs + "/rank_" + std::to_string(r) + ".log"), fileMode) << r;
  }
}

TEST_F(LauncherTest, PrefixesRawLinesAndShowsStatus) {
  Launch l(jobArgs({"--status-every-s", "3600"}, {"ok"}));
  auto st = l.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  for (int r = 0; r < 2; ++r) {
    // The console prefixes a rank's raw lines; its log keeps them as written.
    EXPECT_TRUE(
        has(l.text(), "[r" + std::to_string(r) + " student] plain line from student " + std::to_string(r) + " step 2"))
        << l.text();
    EXPECT_TRUE(has(log(r), "\nplain line from student " + std::to_string(r) + " step 1\n")) << log(r);
  }
  EXPECT_TRUE(has(l.text(), "[r2 teacher] teacher served 6 requests")) << l.text();
  // The status comes through the segment, not the output; the final status
  // line aggregates it (not a terminal).
  EXPECT_FALSE(has(l.text(), "DISTILL_STATUS")) << l.text();
  EXPECT_TRUE(has(l.text(), "status: step=2 loss=1.5 tokens/s=2000")) << l.text();
  expectSegmentGone(l);
}

TEST_F(LauncherTest, DryRunPrintsThePlanAndStartsNothing) {
  Launch l(jobArgs({"--dry-run"}, {"ok"}));
  auto st = l.finish(Ms(10000));
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t, "[r0 student]") && has(t, "[r1 student]") && has(t, "[r2 teacher]")) << t;
  EXPECT_TRUE(has(t, "DISTILL_ROLE=teacher") && has(t, "DISTILL_CONFIG=") && has(t, "--distill-role=job")) << t;
  const std::string seg = l.segment();
  ASSERT_FALSE(seg.empty()) << t;
  EXPECT_FALSE(distill::ipc::Segment::exists(seg));
  EXPECT_FALSE(has(t, "served")) << "a rank ran:\n" << t;
  EXPECT_TRUE(readFile(dir_ + "/logs/rank_0.log").empty());
}

// Issue 15: --help prints the options with their keys' defaults and the
// trainer's part, and exits 0 (before, it was an unknown option: exit 2);
// `--set key value` says the right form instead of reading "value" as an option.
TEST_F(LauncherTest, HelpListsTheOptionsAndSetInTwoWordsNamesTheRightForm) {
  Launch help({"--help"});
  auto st = help.finish(Ms(10000));
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << help.text();
  for (const char* want : {"Usage: distill-run [OPTIONS] --config F -- TRAINER ARGS...", "--nproc-per-node N",
                           "run.nproc_per_node (default 3)", "--set KEY=VALUE", "--dry-run", "--log-dir D",
                           "run.status_every_s (default 30)"})
    EXPECT_TRUE(has(help.text(), want)) << want << "\n" << help.text();
  // Issue 27: which local ranks run the teachers, with a pool (teacher.procs) too.
  EXPECT_TRUE(has(help.text(), "With teacher.procs: K")) << help.text();
  EXPECT_TRUE(has(help.text(), "ranks, N-K..N-1, run the teachers")) << help.text();
  EXPECT_FALSE(has(help.text(), "local rank N-1 runs the teacher")) << help.text();

  Launch two({"--config", config(), "--set", "run.steps", "3", "--dry-run", "--", binPath("distill-test-trainer")});
  st = two.finish(Ms(10000));
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << two.text();
  EXPECT_TRUE(has(two.text(), "--set takes key=value as one word: --set run.steps=3, not --set run.steps 3"))
      << two.text();
  EXPECT_FALSE(has(two.text(), "distill-run plan")) << two.text();

  Launch extra(
      {"--config", config(), "--set", "run.steps=3", "run.seed=4", "--dry-run", "--", binPath("distill-test-trainer")});
  st = extra.finish(Ms(10000));
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << extra.text();
  EXPECT_TRUE(has(extra.text(), "run.seed=4")) << extra.text();
  EXPECT_FALSE(has(extra.text(), "distill-run plan")) << extra.text();
}

TEST_F(LauncherTest, FailingStudentTearsDownWithSummary) {
  Launch l(jobArgs({}, {"fail", "stubborn"}));
  ASSERT_TRUE(l.waitFor("fail-line 29")) << l.text();
  const auto t0 = SteadyClock::now();
  auto st = l.finish();
  const int64_t ms = msSince(t0);
  std::printf("failing student -> distill-run exit: %lld ms (student 1 ignores SIGTERM)\n", static_cast<long long>(ms));
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  EXPECT_LT(ms, 10000) << l.text();
  EXPECT_GE(ms, 4500) << "SIGKILL came before the grace period\n" << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t, "job failed: [r0 student] exit code 3")) << t;
  EXPECT_TRUE(has(t, "[r1 student] signal SIGKILL")) << t; // ignored SIGTERM, killed after the grace
  EXPECT_TRUE(has(t, "    | fail-line 29") && has(t, "    | fail-line 10") && !has(t, "    | fail-line 9\n")) << t;
  expectSegmentGone(l);
}

TEST_F(LauncherTest, KilledStudentTearsDownNamingTheSignal) {
  Launch l(jobArgs({}, {"kill"}));
  ASSERT_TRUE(l.waitFor("fail-line 29")) << l.text();
  const auto t0 = SteadyClock::now();
  auto st = l.finish();
  const int64_t ms = msSince(t0);
  std::printf("SIGKILLed student -> distill-run exit: %lld ms\n", static_cast<long long>(ms));
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  EXPECT_LT(ms, 10000);
  EXPECT_TRUE(has(l.text(), "job failed: [r0 student] signal SIGKILL")) << l.text();
  EXPECT_TRUE(has(l.text(), "[r1 student] signal SIGTERM")) << l.text();
  expectSegmentGone(l);
}

// Elastic teacher: SIGKILLed inside a forward with requests in flight, it is
// restarted once; the new incarnation serves what was left in the rings and
// every request of every step is answered exactly once (each answer is
// checked against its request by the students and by the Client's tag check).
TEST_F(LauncherTest, KilledTeacherIsRestartedAndEveryRequestAnsweredOnce) {
  Launch l(jobArgs({"--set", "teacher.max_restarts=1", "--set", "student.grad_acc_steps=2", "--status-every-s", "3600"},
                   {"elastic"}));
  auto st = l.finish(Ms(90000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  EXPECT_TRUE(has(l.text(), "teacher: SIGKILL inside forward 5")) << l.text();
  EXPECT_TRUE(has(l.text(), "[r2 teacher] died (signal SIGKILL (Killed)); restarting it (1 of 1 restarts)"))
      << l.text();
  EXPECT_TRUE(has(l.text(), "teacher restarted (1 of 1 restarts)")) << l.text();
  EXPECT_TRUE(has(l.text(), "job finished: every rank exited 0, teacher restarted 1 of 1 times")) << l.text();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(has(log(r), "ANSWERS rank=" + std::to_string(r) + " n=20 of 20")) << "rank " << r << ": " << log(r);
    EXPECT_TRUE(has(log(r), "WAITED rank=" + std::to_string(r) + " positive=1")) << "rank " << r << ": " << log(r);
  }
  // Both incarnations wrote the same log, the restart marked in it.
  EXPECT_TRUE(has(log(2), "teacher incarnation 0") && has(log(2), "==== distill-run: restart 1 of 1") &&
              has(log(2), "teacher incarnation 1"))
      << log(2);
  // The restarted teacher served the rest: 40 requests in all, minus what the
  // first one answered before it died (4 forwards, each batching at most
  // students x in_flight = 4 requests).
  std::smatch m;
  const std::string teacherLog = log(2);
  ASSERT_TRUE(std::regex_search(teacherLog, m, std::regex("teacher served ([0-9]+) requests"))) << teacherLog;
  const int served = std::stoi(m[1]);
  EXPECT_GE(served, 40 - 4 * 4);
  EXPECT_LT(served, 40);
  expectSegmentGone(l);
}

// Restarts are bounded: a teacher that dies again once max_restarts is used up
// tears the job down, the summary counts the restarts.
TEST_F(LauncherTest, TeacherDyingBeyondMaxRestartsTearsDown) {
  Launch l(jobArgs({"--set", "teacher.max_restarts=1", "--set", "student.grad_acc_steps=2"}, {"elastic-always"}));
  ASSERT_TRUE(l.waitFor("restarting it (1 of 1 restarts)")) << l.text();
  const auto t0 = SteadyClock::now();
  auto st = l.finish();
  EXPECT_LT(msSince(t0), 10000);
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  EXPECT_TRUE(has(l.text(), "job failed: [r2 teacher] signal SIGKILL")) << l.text();
  EXPECT_TRUE(has(l.text(), "teacher restarts: 1 of 1 (signal SIGKILL (Killed))")) << l.text();
  expectSegmentGone(l);
}

TEST_F(LauncherTest, StopRequestLetsStudentsLeaveCleanly) {
  Launch l(jobArgs({}, {"stop"}));
  ASSERT_TRUE(l.waitFor("READY student 0") && l.waitFor("READY student 1")) << l.text();
  const auto t0 = SteadyClock::now();
  l.kill(SIGTERM);
  auto st = l.finish();
  const int64_t ms = msSince(t0);
  std::printf("SIGTERM -> students checkpointed and left, distill-run exit: %lld ms\n", static_cast<long long>(ms));
  EXPECT_TRUE(st.exited && st.code == 128 + SIGTERM) << st.describe() << "\n" << l.text();
  EXPECT_LT(ms, 10000); // before the launcher would forward SIGTERM
  EXPECT_TRUE(has(l.text(), "[r0 student] checkpoint at step") && has(l.text(), "[r1 student] checkpoint at step"))
      << l.text();
  for (const char* r : {"[r0 student] exit code 0", "[r1 student] exit code 0", "[r2 teacher] exit code 0"})
    EXPECT_TRUE(has(l.text(), r)) << r << "\n" << l.text();
  expectSegmentGone(l);
}

TEST_F(LauncherTest, SigtermIsForwardedAfterTheStopGrace) {
  Launch l(jobArgs({"--stop-grace-s", "1"}, {"ignore"}));
  ASSERT_TRUE(l.waitFor("READY student 0") && l.waitFor("READY student 1")) << l.text();
  const auto t0 = SteadyClock::now();
  l.kill(SIGTERM);
  auto st = l.finish();
  const int64_t ms = msSince(t0);
  std::printf("SIGTERM (ranks ignore the stop flag, grace 1 s) -> distill-run exit: %lld ms\n",
              static_cast<long long>(ms));
  EXPECT_TRUE(st.exited && st.code == 128 + SIGTERM) << st.describe() << "\n" << l.text();
  EXPECT_GE(ms, 1000);
  EXPECT_LT(ms, 10000);
  EXPECT_TRUE(has(l.text(), "job stopped: received Terminated")) << l.text();
  EXPECT_TRUE(has(l.text(), "[r0 student] signal SIGTERM") && has(l.text(), "[r1 student] signal SIGTERM")) << l.text();
  expectSegmentGone(l);
}

TEST_F(LauncherTest, LiveStatusLineOnATerminal) {
  Launch l(jobArgs({"--stop-grace-s", "0"}, {"ignore"}), /*tty=*/true);
  // Redrawn in place (carriage return, erase line) once both students reported
  // and the teacher's state was sampled.
  EXPECT_TRUE(l.waitFor("\r\033[K[distill-run] step=7 loss=0.25 tokens/s=100 teacher busy=")) << l.text();
  l.kill(SIGTERM);
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 128 + SIGTERM) << st.describe() << "\n" << l.text();
  EXPECT_FALSE(has(l.text(), "DISTILL_STATUS")) << l.text();
  expectSegmentGone(l);
}

// Issue 15: students publish their status through the segment
// (Client::publishStatus), not a stdout protocol; off a terminal the periodic
// status line shows it while the job runs, and the summary each student's
// last step.
TEST_F(LauncherTest, PublishedStatusReachesThePeriodicLineAndTheSummary) {
  Launch l(jobArgs({"--stop-grace-s", "0", "--status-every-s", "1"}, {"ignore", "wait-share"}));
  // Once both students published and the teacher attached (one write per line).
  ASSERT_TRUE(l.waitFor("status: step=7 loss=0.25 tokens/s=100 teacher busy=")) << l.text();
  EXPECT_TRUE(
      std::regex_search(l.text(),
                        std::regex("\\[distill-run\\] status: step=7 loss=0\\.25 tokens/s=100 teacher busy=[0-9]+% "
                                   "teacher wait=20%\n")))
      << l.text();
  l.kill(SIGTERM);
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 128 + SIGTERM) << st.describe() << "\n" << l.text();
  // Issue 16: the end-of-job verdict from the sampled wait and busy shares.
  EXPECT_TRUE(std::regex_search(l.text(),
                                std::regex("balance: teacher-bound: students waited 20 % of each step, "
                                           "the teacher [0-9]+ % busy; a teacher that kept up would make "
                                           "each step 20 % shorter \\(1\\.25x the throughput\\)")))
      << l.text();
  for (const char* r : {"r0", "r1"})
    EXPECT_TRUE(
        std::regex_search(l.text(), std::regex(std::string("\\n  \\[") + r + " student\\] [^\n]*, last step 7\n")))
        << r << "\n"
        << l.text();
  EXPECT_FALSE(has(l.text(), "DISTILL_STATUS")) << l.text();
  expectSegmentGone(l);
}

TEST_F(LauncherTest, TwoNodesFormOneJobWithAgreeingGradients) {
  const std::string port = std::to_string(freePort());
  const std::string cfg = config(2);
  auto node = [&](int k) {
    return std::vector<std::string>{"--nproc-per-node",
                                    "2",
                                    "--nnodes",
                                    "2",
                                    "--node-rank",
                                    std::to_string(k),
                                    "--master-addr",
                                    "127.0.0.1",
                                    "--master-port",
                                    port,
                                    "--config",
                                    cfg,
                                    "--log-dir",
                                    dir_ + "/logs" + std::to_string(k),
                                    "--",
                                    selfExe(),
                                    "--distill-role=job",
                                    "grad"};
  };
  const std::map<std::string, std::string> secret{{"DISTILL_JOB_SECRET", "two-nodes-of-one-job-0123456789abcdef"}};
  Launch n0(node(0), false, {}, secret), n1(node(1), false, {}, secret);
  auto s0 = n0.finish(), s1 = n1.finish();
  ASSERT_TRUE(s0.exited && s0.code == 0) << s0.describe() << "\n" << n0.text();
  ASSERT_TRUE(s1.exited && s1.code == 0) << s1.describe() << "\n" << n1.text();
  std::regex re("GRADSUM rank=(\\d) size=(\\d) local=(\\S+) reduced=(\\S+)");
  std::smatch m0, m1;
  ASSERT_TRUE(std::regex_search(n0.text(), m0, re)) << n0.text();
  ASSERT_TRUE(std::regex_search(n1.text(), m1, re)) << n1.text();
  EXPECT_EQ(m0[1].str(), "0");
  EXPECT_EQ(m1[1].str(), "1"); // node 1's student is student rank 1
  EXPECT_EQ(m0[2].str(), "2");
  EXPECT_NE(m0[3].str(), m1[3].str()) << "the students' data should differ";
  EXPECT_EQ(m0[4].str(), m1[4].str()) << "averaged gradients differ across nodes";
  EXPECT_NE(n0.segment(), n1.segment());
  expectSegmentGone(n0);
  expectSegmentGone(n1);
}

// distill-run SIGKILLed cannot remove its segment; its ranks go with it
// (PDEATHSIG), and the next distill-run on the node removes the segment.
TEST_F(LauncherTest, SegmentOfAKilledLauncherIsRemovedByTheNextRun) {
  Launch l(jobArgs({}, {"ignore"}));
  ASSERT_TRUE(l.waitFor("READY student 0") && l.waitFor("READY student 1")) << l.text();
  const std::string seg = l.segment();
  l.kill(SIGKILL);
  auto st = l.finish();
  EXPECT_TRUE(!st.exited && st.signal == SIGKILL) << st.describe();
  ASSERT_TRUE(distill::ipc::Segment::exists(seg)) << "a SIGKILLed distill-run cannot remove " << seg;
  Launch next({"--config", sourcePath("configs/hello.yaml"), "--log-dir", dir_ + "/logs2", "--master-port",
               std::to_string(freePort()), "--", binPath("distill-hello")});
  auto st2 = next.finish();
  EXPECT_TRUE(st2.exited && st2.code == 0) << st2.describe() << "\n" << next.text();
  EXPECT_TRUE(has(next.text(), "removed stale segment /dev/shm/" + seg + " (creator pid")) << next.text();
  EXPECT_FALSE(distill::ipc::Segment::exists(seg)) << seg << " left in /dev/shm";
  expectSegmentGone(next);
}

} // namespace
