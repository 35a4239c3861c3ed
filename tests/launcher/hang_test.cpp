// Every hang explains itself (docs/design.md, "The four hangs this design rules out":
// the silent loader): real jobs under
// distill-run that hang on purpose, one way each; the watchdog must notice
// within run.hang_timeout_s, print the hang table naming the right rank and
// wait, and tear the job down — all within hang_timeout + 10 s. Ranks are this
// test binary in the `hang` role (teacher.kind self).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <regex>

#include "distill/distill.h"
#include "launch.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

constexpr int kHangS = 3; // run.hang_timeout_s in these tests

// Blocks in "user code" (a frozen data loader, a stuck forward) until `fifo`
// is written or 30 s pass; never forever.
void blockInUserCode(const std::string& fifo = "") {
  std::printf("BLOCKED in user code\n");
  std::fflush(stdout);
  int fd = fifo.empty() ? -1 : ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  pollfd p{fd, POLLIN, 0};
  ::poll(fd >= 0 ? &p : nullptr, fd >= 0 ? 1 : 0, 30000);
  if (fd >= 0) ::close(fd);
  std::printf("UNBLOCKED\n");
  std::fflush(stdout);
}

at::Tensor ask(distill::Session& s, int64_t step) {
  auto x = torch::arange(4, torch::kLong) + step;
  auto y = s.client->get(s.client->submit(x, step, 0)).tensor(distill::protocol::kLogits);
  DISTILL_CHECK(torch::equal(y, x.to(torch::kFloat) * 2), "wrong answer at step ", step);
  return y;
}

} // namespace

// args[0] = scenario, args[1] = a FIFO that releases a blocked rank (optional).
//   frozen-loader    student 1 blocks before the barrier of step 2
//   stop-sending     no collectives; student 1 stops after step 3, student 0 runs 8 steps and finishes
//   never-starts     student 1 never calls distill::init
//   teacher-stall    the teacher blocks inside its 3rd forward
//   skip-collective  student 1 skips the all_reduce of step 3 (an uneven shard), asks for step 4, then blocks
//   busy             students ask and barrier for up to 30 s, leaving when a stop is requested
//   prefetch-acc     train.cpp's loop (2 micro-batches, prefetch); student 1 blocks before step 3 opens
DISTILL_TEST_ROLE(hang) {
  const std::string scenario = args.at(0);
  const std::string fifo = args.size() > 1 ? args[1] : "";
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int local = std::atoi(std::getenv("DISTILL_LOCAL_RANK"));
  const bool teacher = std::string(std::getenv("DISTILL_ROLE")) == "teacher";
  if (scenario == "never-starts" && !teacher && local == 1) {
    blockInUserCode();
    return 0;
  }
  int argc = 1;
  char arg0[] = "hang_test";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  if (s.isTeacher()) {
    std::printf("TEACHER pid %d\n", static_cast<int>(::getpid()));
    int calls = 0;
    auto doubler = distill::teacherFromFunction([&](const std::vector<at::Tensor>& in) {
      if (scenario == "teacher-stall" && ++calls == 3) blockInUserCode(fifo);
      return in.at(0).to(torch::kFloat) * 2;
    });
    distill::serve(*s.teacher, doubler);
    return 0;
  }
  const int rank = s.topology.studentRank;
  auto& group = s.student->group();
  if (scenario == "stop-sending") {
    for (int64_t step = 0; step < 8; ++step) {
      if (rank == 1 && step == 4) blockInUserCode(fifo);
      ask(s, step);
      distill::StudentStatus st;
      st.step = step;
      s.client->publishStatus(st);
    }
  } else if (scenario == "prefetch-acc") {
    // examples/gpt/train.cpp's loop: 2 micro-batches a step, each one's
    // successor submitted before its answer is taken (step 3's first before
    // step 2's last); stepTokenCount opens a step, a "grads" all-reduce closes it.
    // Student 1 blocks in user code before step 3 opens.
    constexpr int kAcc = 2, kSteps = 4;
    auto submit = [&](int64_t step, int acc) {
      return s.client->submit(torch::arange(4, torch::kLong) + step, step, acc);
    };
    distill::Handle h = submit(1, 0);
    for (int64_t step = 1; step <= kSteps; ++step) {
      if (rank == 1 && step == 3) blockInUserCode(fifo);
      std::vector<at::Tensor> labels(kAcc, torch::ones({4}, torch::kLong));
      distill::stepTokenCount(group, labels, -100);
      for (int acc = 0; acc < kAcc; ++acc) {
        std::optional<distill::Handle> next;
        if (acc + 1 < kAcc)
          next = submit(step, acc + 1);
        else if (step < kSteps)
          next = submit(step + 1, 0);
        s.client->get(h);
        if (next) h = *next;
      }
      auto grads = torch::ones({3});
      group.allReduce(grads, distill::ReduceOp::kSum, "grads");
    }
  } else if (scenario == "busy") {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (int64_t step = 0; std::chrono::steady_clock::now() < deadline; ++step) {
      ask(s, step);
      if (step == 0) std::printf("READY student %d pid %d\n", rank, static_cast<int>(::getpid()));
      auto stop = torch::tensor({s.client->stopRequested() ? 1.0 : 0.0});
      group.allReduce(stop, distill::ReduceOp::kMax, "stop flag");
      if (stop.item<double>() > 0) break;
    }
  } else {
    for (int64_t step = 0; step < 4; ++step) {
      ask(s, step);
      if (scenario == "frozen-loader" && rank == 1 && step == 2) blockInUserCode(fifo);
      if (scenario == "skip-collective" && rank == 1 && step == 3) {
        ask(s, step + 1); // it moved on; the others wait in the collective it skipped
        blockInUserCode(fifo);
      } else if (scenario == "skip-collective") {
        auto t = torch::ones({3});
        group.allReduce(t, distill::ReduceOp::kSum, "grads");
      } else {
        group.barrier("step barrier");
      }
    }
  }
  s.client->finish();
  return 0;
}

namespace {

class HangTest : public LauncherFixture {
 protected:
  // Runs `scenario` with the watchdog at kHangS and `onHang`; returns the launch.
  std::unique_ptr<Launch> start(const std::string& scenario, const std::string& onHang = "teardown",
                                const std::string& fifo = "", const std::vector<std::string>& more = {}) {
    std::vector<std::string> roleArgs{scenario};
    if (!fifo.empty()) roleArgs.push_back(fifo);
    std::vector<std::string> options{"--set", "run.hang_timeout_s=" + std::to_string(kHangS),
                                     "--set", "run.on_hang=" + onHang,
                                     "--set", "run.collective_timeout_s=60",
                                     "--set", "run.startup_timeout_s=60"};
    options.insert(options.end(), more.begin(), more.end());
    return std::make_unique<Launch>(jobArgs(options, roleArgs, "hang"));
  }

  // The report's row of a rank ("  r1     student  1234 ..." up to the line end).
  static std::string row(const std::string& text, const std::string& rank) {
    std::smatch m;
    std::regex re("\n  " + rank + " +[^\n]*");
    return std::regex_search(text, m, re) ? m[0].str().substr(1) : "(no row for " + rank + ")";
  }

  // Waits for the teardown after a hang and checks the common parts: the
  // report's title, the time bound, the exit status, the report file, no segment left.
  void expectHangTeardown(Launch& l) {
    auto st = l.finish(Ms((kHangS + 25) * 1000));
    EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << l.text();
    EXPECT_TRUE(has(l.text(), "hang: no rank made progress for")) << l.text();
    EXPECT_TRUE(has(l.text(), "job failed: hang")) << l.text();
    const int64_t bound = (kHangS + 10) * 1000;
    std::printf("hang reported and torn down: distill-run ran %lld ms after the hang began (bound %lld ms)\n",
                static_cast<long long>(l.elapsedMs() - blockedAtMs_), static_cast<long long>(bound));
    EXPECT_LT(l.elapsedMs() - blockedAtMs_, bound) << l.text();
    EXPECT_TRUE(has(readFile(dir_ + "/logs/hang_report.txt"), "hang: no rank made progress")) << l.text();
    expectSegmentGone(l);
  }

  // The pid a rank printed after `label` ("READY student 1 pid 1234").
  static int pidAfter(Launch& l, const std::string& label) {
    if (!l.waitFor(label)) return -1;
    std::smatch m;
    const std::string& t = l.text();
    if (!std::regex_search(t, m, std::regex(label + "([0-9]+)"))) return -1;
    return std::stoi(m[1]);
  }

  // A `busy` job (students ask and all-reduce) whose peers cannot call a
  // stopped process lost for 40 s (heartbeat 20 s), so the watchdog (3 s) reports first.
  std::unique_ptr<Launch> startBusy() {
    return std::make_unique<Launch>(
        jobArgs({"--set", "run.hang_timeout_s=" + std::to_string(kHangS), "--set", "transport.heartbeat_ms=20000",
                 "--set", "run.collective_timeout_s=60", "--set", "run.startup_timeout_s=60"},
                {"busy"}, "hang"));
  }

  // Waits until a rank says it is blocked; notes when (ms since the launch).
  void waitBlocked(Launch& l) {
    ASSERT_TRUE(l.waitFor("BLOCKED in user code")) << l.text();
    blockedAtMs_ = l.sinceStartMs();
  }

  int64_t blockedAtMs_ = 0;
};

TEST_F(HangTest, FrozenDataLoaderBeforeABarrier) {
  auto l = start("frozen-loader");
  waitBlocked(*l);
  expectHangTeardown(*l);
  const std::string t = l->text();
  EXPECT_TRUE(std::regex_search(row(t, "r1"),
                                std::regex("busy in user code for [0-9.]+ s \\(since its last distill call "
                                           "ended: receive at step 2")))
      << row(t, "r1") << "\n"
      << t;
  EXPECT_TRUE(has(row(t, "r0"), "in student group step barrier #3 at step 2") &&
              has(row(t, "r0"), "not entered by student rank 1 (its last: #2)"))
      << row(t, "r0") << "\n"
      << t;
  EXPECT_TRUE(has(row(t, "r2"), "waiting for request from any student")) << row(t, "r2") << "\n" << t;
}

TEST_F(HangTest, StudentStopsSendingWhileTheTeacherWaits) {
  auto l = start("stop-sending");
  waitBlocked(*l);
  expectHangTeardown(*l);
  const std::string t = l->text();
  const auto table = t.find("hang: no rank made progress");
  if (table != std::string::npos) std::printf("%s\n", t.substr(table, t.find("[launcher]", table) - table).c_str());
  EXPECT_TRUE(has(row(t, "r1"), "busy in user code") && has(row(t, "r1"), "receive at step 3")) << row(t, "r1") << "\n"
                                                                                                << t;
  EXPECT_TRUE(has(row(t, "r0"), "finished")) << row(t, "r0") << "\n" << t;
  EXPECT_TRUE(has(row(t, "r2"), "waiting for request from any student")) << row(t, "r2") << "\n" << t;
  // Its last events show the teacher answered it up to step 3.
  EXPECT_TRUE(has(t, "receive from teacher rank 2 (step 3, acc_step 0, seq 4)")) << t;
}

// Start-up is run.startup_timeout_s's to bound, not the watchdog's (issue 27
// item 4.6: a job whose ranks were still importing was torn down as a hang):
// with hang_timeout_s 3 and startup_timeout_s 6, a student that never starts
// is no hang verdict; the admission deadlines end the job (the teacher's names it).
TEST_F(HangTest, StudentThatNeverStartsIsStartupTimeoutsNotAHang) {
  auto l = start("never-starts", "teardown", "", {"--set", "run.startup_timeout_s=6"});
  waitBlocked(*l);
  auto st = l->finish(Ms(60000));
  const std::string t = l->text();
  EXPECT_TRUE(st.exited && st.code == 1) << st.describe() << "\n" << t;
  // Whichever deadline comes first: the teacher's (naming the student) or a student's.
  EXPECT_TRUE(has(t, "students [local 1] did not attach to segment") || has(t, "not admitted by the teacher")) << t;
  EXPECT_FALSE(has(t, "hang: no rank made progress")) << t;
  expectSegmentGone(*l);
}

TEST_F(HangTest, TeacherStalledInsideForward) {
  auto l = start("teacher-stall");
  waitBlocked(*l);
  expectHangTeardown(*l);
  const std::string t = l->text();
  EXPECT_TRUE(has(row(t, "r2"), "busy in user code: the model's forward")) << row(t, "r2") << "\n" << t;
  // The stalled forward holds the request of at least one student (the other
  // may have been answered in an earlier batch and wait in the barrier).
  const std::regex waiting(
      "waiting for response from teacher rank 2 \\(step [0-9]+, acc_step 0, seq [0-9]+\\) for "
      "[0-9.]+ s");
  EXPECT_TRUE(std::regex_search(row(t, "r0"), waiting) || std::regex_search(row(t, "r1"), waiting)) << t;
}

TEST_F(HangTest, StudentSkippingACollectiveTheOthersEntered) {
  auto l = start("skip-collective");
  waitBlocked(*l);
  expectHangTeardown(*l);
  const std::string t = l->text();
  EXPECT_TRUE(has(row(t, "r0"), "in student group grads #4 at step 3") &&
              has(row(t, "r0"), "not entered by student rank 1 (its last: #3)"))
      << row(t, "r0") << "\n"
      << t;
  EXPECT_TRUE(has(row(t, "r1"), "busy in user code") && has(row(t, "r1"), "receive at step 4")) << row(t, "r1") << "\n"
                                                                                                << t;
}

// on_hang: wait — the table is printed, nothing is torn down, and the job
// finishes once the stalled teacher goes on.
TEST_F(HangTest, OnHangWaitReportsAndKeepsTheJob) {
  const std::string fifo = dir_ + "/release";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto l = start("teacher-stall", "wait", fifo);
  ASSERT_TRUE(l->waitFor("BLOCKED in user code")) << l->text();
  ASSERT_TRUE(l->waitFor("on_hang=wait: the job keeps running", Ms((kHangS + 10) * 1000))) << l->text();
  EXPECT_TRUE(has(row(l->text(), "r2"), "busy in user code: the model's forward")) << l->text();
  int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK); // the teacher holds the read end open
  ASSERT_GE(fd, 0) << "the stalled teacher is not reading " << fifo;
  ASSERT_EQ(::write(fd, "x", 1), 1);
  ::close(fd);
  auto st = l->finish();
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l->text();
  EXPECT_TRUE(has(l->text(), "job finished: every rank exited 0")) << l->text();
  expectSegmentGone(*l);
}

// SIGUSR1 prints the same table at any time without disturbing the run.
TEST_F(HangTest, Sigusr1PrintsTheTableWithoutDisturbingTheRun) {
  auto l = std::make_unique<Launch>(jobArgs({}, {"busy"}, "hang"));
  ASSERT_TRUE(l->waitFor("READY student 0") && l->waitFor("READY student 1")) << l->text();
  l->kill(SIGUSR1);
  ASSERT_TRUE(l->waitFor("hang table (SIGUSR1)")) << l->text();
  ASSERT_TRUE(l->waitFor("last 5 events of r2 teacher")) << l->text();
  const std::string t = l->text();
  for (const char* r : {"r0", "r1", "r2"}) EXPECT_FALSE(has(row(t, r), "(no row")) << t;
  l->kill(SIGTERM); // the students agree to stop and leave cleanly
  auto st = l->finish();
  EXPECT_TRUE(st.exited && st.code == 128 + SIGTERM) << st.describe() << "\n" << l->text();
  for (const char* r : {"[r0 student] exit code 0", "[r1 student] exit code 0", "[r2 teacher] exit code 0"})
    EXPECT_TRUE(has(l->text(), r)) << r << "\n" << l->text();
  expectSegmentGone(*l);
}

// Issue 14 item 20: the table never said a process was stopped. A SIGSTOPped
// student showed as waiting for the teacher (blaming it); now its row says
// "stopped", a "stopped:" line names it, and its peers say they wait on it.
TEST_F(HangTest, StoppedStudentIsNamedAndItsPeersWaitOnAStoppedPeer) {
  auto l = startBusy();
  ASSERT_TRUE(l->waitFor("READY student 0")) << l->text();
  const int pid = pidAfter(*l, "READY student 1 pid ");
  ASSERT_GT(pid, 0) << l->text();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  blockedAtMs_ = l->sinceStartMs();
  expectHangTeardown(*l);
  const std::string t = l->text();
  EXPECT_TRUE(std::regex_search(
      row(t, "r1"),
      std::regex("student +" + std::to_string(pid) + " +stopped +stopped \\(SIGSTOP\\): no heartbeat for")))
      << row(t, "r1") << "\n"
      << t;
  EXPECT_TRUE(has(t, "stopped: r1 student (pid " + std::to_string(pid) + ") is stopped (SIGSTOP)")) << t;
  EXPECT_TRUE(has(row(t, "r0"), "student rank 1") && has(row(t, "r0"), "stopped")) << row(t, "r0") << "\n" << t;
  EXPECT_TRUE(has(row(t, "r2"), "waiting for request from any student") &&
              has(row(t, "r2"), "waits on a stopped peer: student rank 1 is stopped (SIGSTOP)"))
      << row(t, "r2") << "\n"
      << t;
}

// Issue 14 item 20: a stopped teacher showed as "busy in user code"; now it
// is the stopped row, and the students waiting for it say they wait on a
// stopped peer.
TEST_F(HangTest, StoppedTeacherIsNamedNotBusy) {
  auto l = startBusy();
  ASSERT_TRUE(l->waitFor("READY student 0") && l->waitFor("READY student 1")) << l->text();
  const int pid = pidAfter(*l, "TEACHER pid ");
  ASSERT_GT(pid, 0) << l->text();
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  blockedAtMs_ = l->sinceStartMs();
  expectHangTeardown(*l);
  const std::string t = l->text();
  EXPECT_TRUE(has(row(t, "r2"), " stopped   stopped (SIGSTOP): no heartbeat for")) << row(t, "r2") << "\n" << t;
  EXPECT_TRUE(has(t, "stopped: r2 teacher (pid " + std::to_string(pid) + ") is stopped (SIGSTOP)")) << t;
  const std::string waits = "waits on a stopped peer: teacher rank 2 is stopped (SIGSTOP)";
  EXPECT_TRUE((has(row(t, "r0"), "waiting for response from teacher rank 2") && has(row(t, "r0"), waits)) ||
              (has(row(t, "r1"), "waiting for response from teacher rank 2") && has(row(t, "r1"), waits)))
      << t;
}

// Issue 14 item 24: with train.cpp's loop (gradient accumulation, the next
// micro-batch submitted before the current answer is taken) the collectives
// that open step N were labelled "(step N-1, acc_step 1)", the tag of the last
// answer. Student 0 waits in step 3's token count for student 1.
TEST_F(HangTest, CollectiveThatOpensAStepIsLabelledWithThatStep) {
  auto l = start("prefetch-acc", "teardown", "", {"--set", "student.grad_acc_steps=2"});
  waitBlocked(*l);
  expectHangTeardown(*l);
  const std::string t = l->text();
  EXPECT_TRUE(has(row(t, "r0"), "in student group step token count #5 at step 3 acc_step 0") &&
              has(row(t, "r0"), "not entered by student rank 1 (its last: #4)"))
      << row(t, "r0") << "\n"
      << t;
  EXPECT_TRUE(has(t, "collective 'step token count' #5 (step 3, acc_step 0), still open")) << t;
  // The step's other collectives keep their step: step 2's gradients after its last answer.
  EXPECT_TRUE(has(t, "collective 'grads' #4 (step 2, acc_step 1)")) << t;
  EXPECT_TRUE(has(row(t, "r1"), "busy in user code")) << row(t, "r1") << "\n" << t;
}

} // namespace
