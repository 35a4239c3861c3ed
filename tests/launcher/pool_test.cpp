// The teacher pool (teacher.procs) end to end: distill-run with 3 students and
// 2 teachers on one node, this binary in the `pool` role (teacher.kind self).
// Student local i is served by teacher i % 2: teacher 0 serves students 0 and
// 2, teacher 1 student 1. Every answer is checked against its own request;
// each teacher prints how many requests it served, so "each request served
// once, by its student's teacher" is a count per teacher.
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <regex>
#include <string>

#include "distill/distill.h"
#include "launch.h"
#include "support/doubler.h"
#include "support/process.h"
#include "support/roles.h"

using namespace distill::testing;

namespace {

constexpr int kSteps = 10, kAcc = 2; // per student: 20 requests

distill::Session initSession() {
  int argc = 1;
  char arg0[] = "pool_test";
  char* argv[] = {arg0, nullptr};
  return distill::init(argc, argv);
}

// Doubles its input. With `killAt` > 0, teacher `victim` SIGKILLs itself in
// its killAt-th forward (a batch in flight), first incarnation only.
int serveDoubler(distill::Session& s, int victim, int killAt) {
  const int me = s.topology.teacherIndex;
  const char* restart = std::getenv("DISTILL_TEACHER_RESTART");
  std::printf("teacher %d incarnation %s device %s\n", me, restart ? restart : "0", s.teacher->device().c_str());
  int calls = 0;
  auto doubler = distill::teacherFromFunction([&](const std::vector<at::Tensor>& in) {
    if (me == victim && ++calls == killAt && !restart) {
      std::printf("teacher %d: SIGKILL inside forward %d\n", me, calls);
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    return in.at(0).to(torch::kFloat) * 2;
  });
  auto stats = distill::serve(*s.teacher, doubler);
  std::printf("teacher %d served %lld requests\n", me, static_cast<long long>(stats.requests));
  return 0;
}

} // namespace

// args: [victim killAt] — without them no teacher dies.
DISTILL_TEST_ROLE(pool) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  distill::Session s = initSession();
  if (s.isTeacher())
    return serveDoubler(s, args.size() > 1 ? std::stoi(args[0]) : -1, args.size() > 1 ? std::stoi(args[1]) : 0);
  const int rank = s.topology.studentRank;
  int answers = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    answers += distill::testing::doublerStep(*s.client, rank, step, kAcc);
    s.student->group().barrier("step");
  }
  std::printf("ANSWERS rank=%d n=%d of %d\n", rank, answers, kSteps * kAcc);
  s.client->finish();
  return 0;
}

namespace {

class PoolTest : public LauncherFixture {
 protected:
  // 5 processes, 2 of them teachers; `options` after those, so they can override them.
  std::vector<std::string> poolArgs(const std::vector<std::string>& options, const std::vector<std::string>& roleArgs) {
    std::vector<std::string> all = {"--nproc-per-node", "5",     "--set",
                                    "teacher.procs=2",  "--set", "student.grad_acc_steps=2",
                                    "--status-every-s", "3600"};
    all.insert(all.end(), options.begin(), options.end());
    return jobArgs(all, roleArgs, "pool");
  }

  // "teacher T served N requests" from rank `rank`'s log; -1 if absent.
  int served(int rank, int teacher) {
    std::smatch m;
    const std::string text = log(rank);
    const std::regex re("teacher " + std::to_string(teacher) + " served ([0-9]+) requests");
    return std::regex_search(text, m, re) ? std::stoi(m[1]) : -1;
  }

  void expectEveryAnswer() {
    for (int r = 0; r < 3; ++r)
      EXPECT_TRUE(has(log(r), "ANSWERS rank=" + std::to_string(r) + " n=20 of 20")) << "rank " << r << ": " << log(r);
  }
};

TEST_F(PoolTest, DryRunShowsWhichTeacherServesWhichStudents) {
  Launch l(poolArgs({"--dry-run", "--set", "teacher.devices=[cpu, cpu]"}, {}));
  auto st = l.finish(Ms(10000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t, "[r3 teacher 0]") && has(t, "[r4 teacher 1]") && has(t, "[r2 student]")) << t;
  EXPECT_TRUE(has(t, "teacher 0 of 2: rank 3 (local 3), device cpu, serves students local 0, 2 (ranks 0, 2)")) << t;
  EXPECT_TRUE(has(t, "teacher 1 of 2: rank 4 (local 4), device cpu, serves students local 1 (ranks 1)")) << t;
  EXPECT_TRUE(has(t, "DISTILL_TEACHERS=2")) << t;
  EXPECT_FALSE(has(t, "served")) << "a rank ran:\n" << t;
}

TEST_F(PoolTest, TwoTeachersServeThreeStudentsEachRequestOnce) {
  Launch l(poolArgs({}, {}));
  auto st = l.finish(Ms(90000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  expectEveryAnswer();
  EXPECT_EQ(served(3, 0), 2 * kSteps * kAcc) << log(3); // students 0 and 2
  EXPECT_EQ(served(4, 1), kSteps * kAcc) << log(4); // student 1
  EXPECT_TRUE(has(l.text(), "teacher pool:")) << l.text();
  EXPECT_TRUE(has(l.text(), "job finished: every rank exited 0")) << l.text();
  expectSegmentGone(l);
}

// Teacher 1 dies with a batch in flight and is restarted on its own restart
// budget; teacher 0 and its students never notice (one incarnation, every
// request of theirs served by it), and every request of student 1 is answered
// exactly once across teacher 1's two incarnations.
TEST_F(PoolTest, OneOfTwoTeachersKilledIsRestartedAndOnlyItsStudentWaits) {
  Launch l(poolArgs({"--set", "teacher.max_restarts=1"}, {"1", "4"}));
  auto st = l.finish(Ms(90000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  const std::string& t = l.text();
  EXPECT_TRUE(has(t, "teacher 1: SIGKILL inside forward 4")) << t;
  EXPECT_TRUE(has(t, "[r4 teacher 1] died (signal SIGKILL (Killed)); restarting it (1 of 1 restarts)")) << t;
  EXPECT_TRUE(has(t, "teachers restarted 1 time, at most 1 each (teacher 1: signal SIGKILL (Killed))")) << t;
  expectEveryAnswer();
  EXPECT_EQ(served(3, 0), 2 * kSteps * kAcc) << log(3);
  EXPECT_FALSE(has(log(3), "restart")) << log(3);
  EXPECT_TRUE(has(log(4), "teacher 1 incarnation 0") && has(log(4), "teacher 1 incarnation 1")) << log(4);
  // The restarted incarnation served the rest: student 1's 20 requests minus
  // what the first answered in its 3 completed forwards (at most in_flight = 2
  // requests each); it printed only its own count.
  const int rest = served(4, 1);
  EXPECT_GE(rest, kSteps * kAcc - 3 * 2) << log(4);
  EXPECT_LT(rest, kSteps * kAcc) << log(4);
  expectSegmentGone(l);
}

// A pool bigger than the node, or devices that do not match it, is refused
// before anything starts, naming the keys.
TEST_F(PoolTest, BadPoolConfigIsRefusedNamingTheKeys) {
  Launch big(poolArgs({"--set", "teacher.procs=5", "--dry-run"}, {}));
  auto st = big.finish(Ms(10000));
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << big.text();
  EXPECT_TRUE(has(big.text(), "teacher.procs")) << big.text();
  EXPECT_FALSE(has(big.text(), "distill-run plan")) << big.text();

  Launch devices(poolArgs({"--set", "teacher.devices=[cpu, cpu, cpu]", "--dry-run"}, {}));
  st = devices.finish(Ms(10000));
  EXPECT_TRUE(st.exited && st.code == 2) << st.describe() << "\n" << devices.text();
  EXPECT_TRUE(has(devices.text(), "teacher.devices")) << devices.text();
  EXPECT_FALSE(has(devices.text(), "distill-run plan")) << devices.text();
}

} // namespace
