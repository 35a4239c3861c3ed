// The step drift of docs/design.md, "The four hangs this design rules out", and its relatives, with real processes: a
// student whose tags skip an acc_step, a request with a wrong dtype, one with
// a missing input — each gets at once an error naming what was expected and
// found, while the teacher keeps serving the others — and a teacher killed
// mid-run, which every student notices within about two heartbeats.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdio>

#include "e2e_common.h"
#include "job_fixture.h"

using namespace std::chrono;
namespace dt = distill::testing;
using distill::testing::e2e::jobYaml;

TEST(TeacherFaults, StepDriftAndBadInputsAreAnsweredWithErrors) {
  dt::Job job(3, jobYaml("  kind: self\n", 4, 2, 30));
  std::vector<dt::Child> kids;
  kids.push_back(job.spawnRole("self_teacher", job.teacherRank()));
  const char* modes[] = {"skip", "dtype", "name"};
  for (int i = 0; i < 3; ++i) kids.push_back(job.spawnRole("bad_student", i, {modes[i]}));
  auto st = dt::joinAll(kids, seconds(40));
  const std::string teacherLog = job.log(job.teacherRank());
  EXPECT_TRUE(st[0].exited && st[0].code == 0) << st[0].describe() << "\n" << teacherLog;
  // The valid requests were served (2 + 1 + 1, and the one after each bad
  // input), the three bad ones answered with errors.
  EXPECT_TRUE(dt::contains(teacherLog, "teacher done: 6 requests ")) << teacherLog;
  EXPECT_TRUE(dt::contains(teacherLog, " 3 errors")) << teacherLog;
  std::vector<std::vector<std::string>> expected = {
      {"ProtocolError", "student rank 0", "request (step 0, acc_step 3, seq 3) after (step 0, acc_step 1, seq 2)",
       "acc_step 2 skipped", "grad_acc_steps=4"},
      {"ProtocolError", "student rank 1", "input 'input_ids': expected Long with 2 dims", "found Float [2, 16]"},
      {"ProtocolError", "student rank 2", "missing input 'input_ids' (teacher.inputs); found: tokens"},
  };
  for (int i = 0; i < 3; ++i) {
    const std::string log = job.log(i);
    EXPECT_TRUE(st[i + 1].exited && st[i + 1].code == 0) << modes[i] << ": " << st[i + 1].describe() << "\n" << log;
    for (auto& part : expected[size_t(i)]) EXPECT_TRUE(dt::contains(log, part)) << "no '" << part << "' in\n" << log;
    const double ms = dt::numberAfter(log, "REJECTED after ");
    EXPECT_LT(ms, 2000) << "the refusal must come at once, not after a timeout (30 s)\n" << log;
    if (i > 0) {
      EXPECT_TRUE(dt::contains(log, "SERVED after the refusal")) << log;
    }
    std::printf("%s: refused after %.0f ms\n", modes[i], ms);
  }
}

TEST(TeacherFaults, KilledTeacherIsPeerLostForEveryStudent) {
  dt::Job job(2, jobYaml("  kind: self\n", 4, 1, 30));
  std::vector<dt::Child> kids;
  for (int i = 0; i < 2; ++i) kids.push_back(job.spawnRole("orphan_student", i));
  kids.push_back(job.spawnRole("self_teacher", job.teacherRank(), {"5"})); // SIGKILLs itself on forward 5
  auto st = dt::joinAll(kids, seconds(40));
  EXPECT_TRUE(!st[2].exited && st[2].signal == SIGKILL) << st[2].describe() << "\n" << job.log(2);
  for (int i = 0; i < 2; ++i) {
    const std::string log = job.log(i);
    EXPECT_TRUE(st[size_t(i)].exited && st[size_t(i)].code == 4) << st[size_t(i)].describe() << "\n" << log;
    EXPECT_TRUE(dt::contains(log, "PeerLostError")) << log;
    EXPECT_TRUE(dt::contains(log, "peer teacher rank 2 ")) << log;
    const double ms = dt::numberAfter(log, "PEERLOST in get after ");
    EXPECT_LT(ms, 1000) << "heartbeat_ms 100: the teacher's death must be seen within ~2 heartbeats\n" << log;
    std::printf("student %d: teacher loss seen %.0f ms after get() started\n", i, ms);
  }
}
