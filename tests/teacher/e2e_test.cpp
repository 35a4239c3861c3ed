// Distillation end to end on one node, with gradient accumulation: real
// processes (the students are this binary in role distill_student; the teacher
// is bin/distill-teacher or this binary in role self_teacher), a real segment,
// the real client and server. Each student compares the loss computed with
// the ring's answer to the loss with the same teacher run in its own process.
#include <gtest/gtest.h>

#include <torch/torch.h>
#include "distill/core/clock.h"
#include "distill/ipc/segment.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "e2e_common.h"
#include "job_fixture.h"
#include "tiny_mlp.h"

using namespace std::chrono;
namespace dt = distill::testing;
using distill::testing::e2e::jobYaml;

namespace {

// Runs `students` distill_student roles for `steps` steps of grad_acc_steps 4
// against `teacherKind` (script | mlp: bin/distill-teacher; self: role
// self_teacher) and checks every student's result and the teacher's count.
void runJob(const std::string& teacherYaml, const std::string& teacherKind, int students, int steps) {
  const int G = 4;
  dt::Job job(students, jobYaml(teacherYaml, G, 2));
  const auto start = steady_clock::now();
  std::vector<dt::Child> kids;
  kids.push_back(teacherKind == "self" ? job.spawnRole("self_teacher", job.teacherRank()) : job.spawnTeacherBinary());
  for (int i = 0; i < students; ++i) {
    kids.push_back(job.spawnRole("distill_student", i, {teacherKind, std::to_string(steps)}));
  }
  auto st = dt::joinAll(kids, seconds(50));
  const auto wallMs = distill::msSince(start);
  const std::string teacherLog = job.log(job.teacherRank());
  EXPECT_TRUE(st[0].exited && st[0].code == 0) << "teacher: " << st[0].describe() << "\n" << teacherLog;
  const int64_t requests = int64_t(students) * steps * G;
  EXPECT_TRUE(dt::contains(teacherLog, "teacher done: " + std::to_string(requests) + " requests ")) << teacherLog;
  EXPECT_TRUE(dt::contains(teacherLog, " 0 errors")) << teacherLog;
  // The teacher published how busy it was through the segment.
  double busy =
      distill::ipc::Segment::attach(job.segment(), job.jobId(), std::nullopt, distill::Deadline::after(seconds(5)))
          .teacherBusy();
  EXPECT_GT(busy, 0.0);
  EXPECT_LE(busy, 1.0);
  for (int i = 0; i < students; ++i) {
    const std::string log = job.log(i);
    EXPECT_TRUE(st[i + 1].exited && st[i + 1].code == 0) << "student " << i << ": " << st[i + 1].describe() << "\n"
                                                         << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT gets="), double(steps * G)) << log;
    const double diff = dt::numberAfter(log, "max_loss_diff=");
    EXPECT_LE(diff, 1e-6) << log; // NaN (no RESULT line) fails too
    std::printf("student %d: %s", i, log.substr(log.find("RESULT")).c_str());
  }
  std::printf("%s teacher, %d student(s) x %d steps x %d micro-batches: wall %lld ms\n", teacherKind.c_str(), students,
              steps, G, static_cast<long long>(wallMs));
  ::testing::Test::RecordProperty("wall_ms", std::to_string(wallMs));
}

std::string scriptTeacher(int topk) {
  return "  kind: torchscript\n  path: " DISTILL_TINY_LM "\n  topk: " + std::to_string(topk) + "\n";
}

} // namespace

TEST(TeacherEndToEnd, TorchScriptTwoStudentsGradAccFullLogits) { runJob(scriptTeacher(0), "script", 2, 25); }

TEST(TeacherEndToEnd, TorchScriptTwoStudentsGradAccTopK) { runJob(scriptTeacher(8), "script", 2, 25); }

TEST(TeacherEndToEnd, RegisteredCppTeacher) {
  const std::string weights = ::testing::TempDir() + dt::uniqueName("tiny-mlp") + ".pt";
  torch::manual_seed(99);
  std::shared_ptr<torch::nn::Module> mlp = std::make_shared<dt::TinyMlp>();
  torch::save(mlp, weights);
  runJob(
      "  kind: registered\n  library: " DISTILL_TEST_TEACHER_LIB "\n  module: tiny_mlp\n  weights: " + weights + "\n",
      "mlp", 1, 3);
  std::remove(weights.c_str());
}

TEST(TeacherEndToEnd, SelfTeacherInTrainerBinary) { runJob("  kind: self\n", "self", 2, 3); }
