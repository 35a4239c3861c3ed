// distill-run's options and config handling (launcher/src/args.cpp): each option checked as
// its config key, --log-dir, trainer keys, a config that reaches the students only, uncaught
// errors and exit code 2, a segment too big for /dev/shm, the summary's headline. Real
// launchers with distill-test-trainer or this binary in the `job` role (launcher_test.cpp).

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

// ---- config handling (issue 14 items 12, 13, 15) ----

// A config for distill-test-trainer in `dir`: teacher.kind self unless `teacher` says otherwise.
std::string trainerConfig(const std::string& dir, const std::string& extra, const std::string& teacher = "kind: self") {
  const std::string path = dir + "/trainer.yaml";
  std::ofstream(path) << "run:\n  name: config-test\n  nproc_per_node: 3\n  log_dir: " << dir
                      << "/logs\n  startup_timeout_s: 30\n  collective_timeout_s: 30\n  hang_timeout_s: 30\n"
                      << "teacher:\n  " << teacher << "\n"
                      << extra;
  return path;
}

// Item 12: each option stands for its config key and is refused as the key
// would be, naming the option; before, --nproc-per-node 2000000000 allocated
// until bad_alloc, --nnodes 2147483647 gave WORLD_SIZE -2 and --master-port
// 70000 wrapped to 4464. Refused before anything starts.
TEST_F(LauncherTest, OptionsAreValidatedAsTheirConfigKeys) {
  struct Case {
    std::vector<std::string> options;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {{"--nproc-per-node", "2000000000"},
       "run.nproc_per_node: must be in [2, 256], found 2000000000 (from --nproc-per-node)"},
      {{"--nnodes", "2147483647"},
       "run.nnodes: run.nnodes x run.nproc_per_node must be <= 2147483647 (every rank of the job is an int), "
       "found 2147483647 x 3 (from --nnodes)"},
      {{"--master-port", "70000"}, "run.master_port: must be in [0, 65535], found 70000 (from --master-port)"},
      {{"--node-rank", "2", "--nnodes", "2"}, "run.node_rank: must be < run.nnodes (2), found 2 (from --node-rank)"},
      {{"--stop-grace-s", "1e300"}, "run.stop_grace_s: must be in [0, 2592000], found 1e300 (from --stop-grace-s)"},
      {{"--status-every-s", "soon"},
       "run.status_every_s: expected a number, found string \"soon\" (from --status-every-s)"},
      {{"--set", "run.hang_timeout_s=5e9"}, "run.hang_timeout_s: must be in [0.001, 2592000], found 5e9 (from --set)"},
      {{"--set", "run.name=a\nrun.seed=3"},
       "run.name: an override must be one line of printable text, found the control character \\n at byte 10 "
       "(a double-quoted YAML value can carry it escaped) (from --set)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.problem);
    std::vector<std::string> args = {"--config", config()};
    args.insert(args.end(), c.options.begin(), c.options.end());
    args.insert(args.end(), {"--dry-run", "--", binPath("distill-test-trainer")});
    Launch l(args);
    auto st = l.finish(Ms(10000));
    EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << l.text();
    EXPECT_TRUE(has(l.text(), c.problem)) << l.text();
    EXPECT_FALSE(has(l.text(), "distill-run plan")) << l.text();
  }
  // The ones in range reach the plan, and the ranks through DISTILL_SET.
  Launch ok({"--config", config(), "--nproc-per-node", "4", "--master-port", "29999", "--log-dir", dir_ + "/a: b",
             "--dry-run", "--", binPath("distill-test-trainer")});
  auto st = ok.finish(Ms(10000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << ok.text();
  EXPECT_TRUE(has(ok.text(), "4 processes") && has(ok.text(), "[r3 teacher]")) << ok.text();
  EXPECT_TRUE(has(ok.text(), "MASTER_PORT=29999")) << ok.text();
  EXPECT_TRUE(has(ok.text(), "run.nproc_per_node=4\nrun.master_port=29999\nrun.log_dir=\"" + dir_ + "/a: b\"\n"))
      << ok.text();
}

// Item 13: --log-dir is run.log_dir for every rank (two runs given different
// --log-dir once wrote one metrics.jsonl: the ranks kept the file's log_dir).
TEST_F(LauncherTest, LogDirReachesEveryRank) {
  const std::string other = dir_ + "/elsewhere";
  Launch l({"--config", trainerConfig(dir_, ""), "--master-port", std::to_string(freePort()), "--log-dir", other, "--",
            binPath("distill-test-trainer"), "logdir"});
  auto st = l.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  for (int r = 0; r < 3; ++r) {
    const std::string rankLog = readFile(other + "/rank_" + std::to_string(r) + ".log");
    EXPECT_TRUE(has(rankLog, "LOG_DIR=" + other + "\n")) << "rank " << r << ":\n" << rankLog;
  }
  EXPECT_TRUE(readFile(dir_ + "/logs/rank_0.log").empty());
  expectSegmentGone(l);
}

// Item 13: a --set after `--` reaches the trainer's processes only, here the
// students (the teacher is distill-teacher): the teacher compares each
// student's config with its own before admitting it, and the job fails at
// once naming the key, on the teacher and on every student, instead of
// running with teacher.topk silently ignored.
TEST_F(LauncherTest, ConfigReachingTheStudentsOnlyIsRefusedAtAdmission) {
  const std::string cfg = trainerConfig(
      dir_, "", "kind: registered\n  library: " DISTILL_TEST_TEACHER_LIB "\n  module: tiny_mlp\n  inputs: [x]");
  Launch l({"--config", cfg, "--master-port", std::to_string(freePort()), "--", binPath("distill-test-trainer"),
            "serve", "--set", "teacher.topk=8", "--set", "student.grad_acc_steps=2"});
  auto st = l.finish();
  std::printf("student-only --set -> distill-run exit: %lld ms\n", static_cast<long long>(l.elapsedMs()));
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  EXPECT_LT(l.elapsedMs(), 15000) << "refused after a timeout (run.startup_timeout_s is 30 s), not at admission\n"
                                  << l.text();
  const std::string diff =
      "runs a config that differs from its teacher's in 2 key(s): teacher.topk (teacher 0, student 8); "
      "student.grad_acc_steps (teacher 1, student 2); every process of a job must run one config";
  const std::string teacherLog = log(2);
  EXPECT_TRUE(has(teacherLog, diff)) << teacherLog;
  int refused = 0;
  for (int r = 0; r < 2; ++r) {
    const std::string studentLog = log(r);
    if (has(studentLog, "uncaught ConfigError (exit code 2): admission refused by the teacher (teacher rank 2") &&
        has(studentLog, diff)) {
      ++refused;
    }
  }
  // Both read the refusal, unless the teardown reached one first.
  EXPECT_GE(refused, 1) << log(0) << "\n" << log(1);
  EXPECT_FALSE(has(l.text(), "SIGABRT")) << l.text();
  expectSegmentGone(l);
}

// Item 15: a typo in the trainer's own section, with the trainer's keys given
// to init: every rank ends at init, before any waits on another, with exit
// code 2 and the message (the nearest key is `lr`, not `data`).
TEST_F(LauncherTest, TrainerKeyTypoEndsEveryRankBeforeAdmission) {
  Launch l({"--config", trainerConfig(dir_, "trainer:\n  lrate: 0.1\n"), "--master-port", std::to_string(freePort()),
            "--", binPath("distill-test-trainer"), "strict"});
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  EXPECT_LT(l.elapsedMs(), 15000) << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t, "job failed: [r") && has(t, "exit code 2\n")) << t;
  EXPECT_TRUE(has(t, "    | ") && has(t, "trainer.lrate: unknown key; did you mean trainer.lr?")) << t;
  for (int r = 0; r < 3; ++r) {
    // No rank got as far as waiting for another (attach, admission).
    EXPECT_FALSE(has(log(r), "admission")) << log(r);
  }
  EXPECT_FALSE(has(t, "SIGABRT")) << t;
  expectSegmentGone(l);
}

// Item 15: a ConfigError the trainer does not catch (a bad value read after
// admission) ends the rank with exit code 2 and its message in the summary's
// last lines; before, std::terminate made it SIGABRT.
TEST_F(LauncherTest, UncaughtErrorEndsTheRankWithExitCode2AndItsMessage) {
  Launch l({"--config", trainerConfig(dir_, "trainer:\n  steps: many\n"), "--master-port", std::to_string(freePort()),
            "--", binPath("distill-test-trainer"), "value"});
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t, "\n  [r0 student] exit code 2\n")) << t;
  EXPECT_TRUE(has(log(0),
                  "uncaught ConfigError (exit code 2): config " + dir_ +
                      "/trainer.yaml: 1 problem(s):\n"
                      "trainer.steps: expected an integer, found \"many\""))
      << log(0);
  // The summary headlines the first failure it reaps: usually r0, with the
  // message in its last lines. The teacher (it sees r0 die) can be reaped
  // first, while r0's threads are still exiting: which failure to headline
  // then is the summary's business (issue 14 item 23), not this test's.
  if (has(t, "job failed: [r0 student] exit code 2")) {
    EXPECT_TRUE(has(t, "last lines of [r0 student]:\n") &&
                has(t, "    | trainer.steps: expected an integer, found \"many\""))
        << t;
  }
  EXPECT_FALSE(has(t, "SIGABRT")) << t;
  expectSegmentGone(l);
}

// Issue 14 item 17: on an 8 MiB /dev/shm the default transport (2 students x
// 4 slots x (4 + 64) MiB) used to be accepted, and a rank died of SIGBUS once
// the pages it touched no longer fitted. Now distill-run refuses at once,
// before any rank starts, naming the bytes needed and free and the keys; a
// transport that fits runs to the end on the same 8 MiB.
TEST_F(LauncherTest, SegmentTooBigForDevShmFailsAtOnceNamingBytesAndKeys) {
  const std::vector<std::string> wrapper{selfExe(), "--distill-role=small_shm"};
  // The sizes auto took before issue 28 (full logits of an unknown vocabulary: 64 MiB).
  Launch l(
      jobArgs({"--set", "transport.max_request_bytes=4MiB", "--set", "transport.max_response_bytes=64MiB"}, {"ok"}),
      false, wrapper);
  auto st = l.finish(Ms(30000));
  if (has(l.text(), "SKIP: no mount namespace")) GTEST_SKIP() << l.text();
  std::printf("segment too big for /dev/shm -> distill-run exit: %lld ms\n", static_cast<long long>(l.elapsedMs()));
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << l.text();
  EXPECT_LT(l.elapsedMs(), 10000) << l.text();
  const std::string& t = l.text();
  for (const char* part :
       {"needs 570", "of shared memory but /dev/shm has only 8388608 bytes (8.0 MiB) free", "transport.slots (4)",
        "transport.max_request_bytes (4194304)", "transport.max_response_bytes (67108864)", "students per node (2"})
    EXPECT_TRUE(has(t, part)) << part << "\n" << t;
  EXPECT_FALSE(has(t, "[r0 student]") || has(t, "[r2 teacher]")) << "a rank started:\n" << t;

  Launch fits(jobArgs({"--set", "teacher.max_batch_tokens=4096", "--set", "transport.max_request_bytes=64KiB", "--set",
                       "transport.max_response_bytes=256KiB"},
                      {"ok"}),
              false, wrapper);
  auto st2 = fits.finish();
  EXPECT_TRUE(st2.exited && st2.code == 0) << st2.describe() << "\n" << fits.text();
  EXPECT_TRUE(has(fits.text(), "[r2 teacher] teacher served 6 requests")) << fits.text();
}

// Issue 28 item 2: a response slot set below what teacher.max_batch_tokens
// tokens of the teacher's payload need was a failure at the first large batch;
// now distill-run refuses it before any rank starts, naming the size needed,
// the key and the token budget that would fit. Sizes left auto are computed
// and said in one line.
TEST_F(LauncherTest, SlotBelowWhatTheConfigNeedsIsRefusedBeforeAnyRankStarts) {
  Launch l(jobArgs({"--set", "teacher.topk=64", "--set", "transport.max_response_bytes=1MiB"}, {"ok"}));
  auto st = l.finish(Ms(30000));
  const std::string& t = l.text();
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << t;
  for (const char* part :
       {"transport.max_response_bytes: 1048576 bytes is below the 8519680 bytes", "teacher.max_batch_tokens=16384",
        "at least 8519680 (or auto)", "lower teacher.max_batch_tokens to 2016 or fewer"})
    EXPECT_TRUE(has(t, part)) << part << "\n" << t;
  EXPECT_FALSE(has(t, "[r0 student]") || has(t, "[r2 teacher]")) << "a rank started:\n" << t;
  EXPECT_TRUE(readFile(dir_ + "/logs/rank_0.log").empty());
  // --dry-run checks it too.
  Launch dry(jobArgs({"--dry-run", "--set", "teacher.topk=64", "--set", "transport.max_response_bytes=1MiB"}, {"ok"}));
  auto st2 = dry.finish(Ms(30000));
  EXPECT_TRUE(st2.exited && st2.code == 2 && has(dry.text(), "is below the 8519680 bytes")) << dry.text();

  // Sizes that fit: said in one line (a dry run starts nothing; the ok job's teacher answers full logits).
  Launch plan(jobArgs({"--dry-run", "--set", "teacher.topk=64", "--set", "teacher.max_batch_tokens=2016"}, {"ok"}));
  auto st3 = plan.finish(Ms(30000));
  EXPECT_TRUE(st3.exited && st3.code == 0) << st3.describe() << "\n" << plan.text();
  EXPECT_TRUE(has(plan.text(),
                  "slots: request 16128 B (auto; 8 B/token x teacher.max_batch_tokens=2016 = 0.02 MiB "
                  "needed), response 1048320 B (auto; top-64 in 32-bit values, 520 B/token = 1.00 MiB "
                  "needed); x 4 slots per student"))
      << plan.text();
  Launch fits(jobArgs({"--set", "transport.max_response_bytes=1MiB"}, {"ok"}));
  auto st4 = fits.finish();
  EXPECT_TRUE(st4.exited && st4.code == 0) << st4.describe() << "\n" << fits.text();
  EXPECT_TRUE(has(fits.text(),
                  "slots: request 131072 B (auto; 8 B/token x teacher.max_batch_tokens=16384 = 0.12 MiB "
                  "needed), response 1048576 B (transport.max_response_bytes; full logits of an unknown "
                  "vocabulary (teacher.vocab_size: 0))"))
      << fits.text();
  EXPECT_TRUE(has(fits.text(), "[r2 teacher] teacher served 6 requests")) << fits.text();
}

// Issue 14 item 22: a trainer that exits 0 without attaching made the job wait
// the whole run.startup_timeout_s; distill-run knows it exited, so it fails at
// once naming it.
TEST_F(LauncherTest, RankThatExitsZeroWithoutAttachingFailsTheJobAtOnce) {
  Launch l(jobArgs({"--set", "run.startup_timeout_s=60"}, {"exit0-early"}));
  ASSERT_TRUE(l.waitFor("nothing to train")) << l.text();
  const auto t0 = SteadyClock::now();
  auto st = l.finish(Ms(90000));
  const int64_t ms = msSince(t0);
  std::printf("rank exited 0 without attaching -> distill-run exit: %lld ms (startup_timeout_s 60)\n",
              static_cast<long long>(ms));
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  EXPECT_LT(ms, 10000) << l.text();
  EXPECT_TRUE(has(l.text(), "job failed: [r1 student] exit code 0 without attaching to the segment")) << l.text();
  expectSegmentGone(l);
}

// Issue 14 item 23: the summary headlined the rank whose exit distill-run
// noticed first (here the teacher, which left as soon as student 0 detached
// abnormally) rather than the rank that failed first (student 0, which
// exited last).
TEST_F(LauncherTest, SummaryHeadlinesTheRankThatFailedFirstNotTheFirstToExit) {
  Launch l(jobArgs({}, {"detach-first"}));
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t,
                  "job failed: [r0 student] detached abnormally from the segment (then exit code 1); "
                  "distill-run noticed "))
      << t;
  EXPECT_TRUE(has(t, "last lines of [r0 student]:\n") && has(t, "    | FAILED student 0: a bad batch at step 1")) << t;
  expectSegmentGone(l);
}

} // namespace
