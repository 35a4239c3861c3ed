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
// self_teacher) and checks every student's result and the teacher's count:
// the answers arrived in `payload` (c10's dtype name), and each loss is within
// `tol` of the one with the teacher run in the student's process. Returns
// student 0's mean step loss and the teacher's log.
struct JobResult {
  double meanLoss = 0;
  std::string teacherLog;
};
JobResult runJob(const std::string& teacherYaml, const std::string& teacherKind, int students, int steps,
                 const std::string& payload = "Float", double tol = 1e-6) {
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
    EXPECT_LE(diff, tol) << log; // NaN (no RESULT line) fails too
    EXPECT_TRUE(dt::contains(log, " payload=" + payload + "\n")) << "expected payload " << payload << "\n" << log;
    std::printf("student %d: %s", i, log.substr(log.find("RESULT")).c_str());
  }
  std::printf("%s teacher, %d student(s) x %d steps x %d micro-batches: wall %lld ms\n", teacherKind.c_str(), students,
              steps, G, static_cast<long long>(wallMs));
  ::testing::Test::RecordProperty("wall_ms", std::to_string(wallMs));
  return {dt::numberAfter(job.log(0), "mean_step_loss="), teacherLog};
}

std::string scriptTeacher(int topk) {
  return "  kind: torchscript\n  path: " DISTILL_TINY_LM "\n  topk: " + std::to_string(topk) + "\n";
}

} // namespace

TEST(TeacherEndToEnd, TorchScriptTwoStudentsGradAccFullLogits) { runJob(scriptTeacher(0), "script", 2, 25); }

TEST(TeacherEndToEnd, TorchScriptTwoStudentsGradAccTopK) { runJob(scriptTeacher(8), "script", 2, 25); }

// Issue 43: the TorchScript teacher answers with its final hidden states (method `hidden`) and
// publishes its head (head.weight, head.bias, scale 3: its forward's logits); each student's loss
// from them and the mapped head equals the loss from the in-process teacher's full logits.
TEST(TeacherEndToEnd, TorchScriptHiddenStatesWithItsHead) {
  const auto r = runJob(scriptTeacher(0) +
                            "  answer: hidden\n  method: hidden\n  hidden_size: 32\n  head:\n    weight: head.weight\n"
                            "    bias: head.bias\n    scale: 3\n",
                        "script", 2, 5, "Float", 1e-5);
  EXPECT_TRUE(dt::contains(r.teacherLog, "published its head")) << r.teacherLog;
}

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

// Issue 28 item 2: logits and top-k values travel in teacher.payload_dtype
// (indices int32, logsumexp and log tail float32), and the student's loss,
// computed in float32 from what arrives, stays within the dtype's rounding of
// the float32 job's.
TEST(TeacherEndToEnd, PayloadDtypesOfTopKAndFullLogits) {
  for (int topk : {8, 0}) {
    const double f32 = runJob(scriptTeacher(topk) + "  payload_dtype: float32\n", "script", 1, 3).meanLoss;
    for (auto [dtype, name] : {std::pair{"bfloat16", "BFloat16"}, {"float16", "Half"}}) {
      SCOPED_TRACE(std::string(dtype) + (topk > 0 ? " top-k" : " full logits"));
      // The in-process reference rounds the same way; a batch of other rows may flip a rounding.
      const double m =
          runJob(scriptTeacher(topk) + "  payload_dtype: " + dtype + "\n", "script", 1, 3, name, 1e-3).meanLoss;
      std::printf("topk %d payload %s: mean step loss %.6f (float32 %.6f)\n", topk, dtype, m, f32);
      EXPECT_NEAR(m, f32, 1e-2 * std::abs(f32)) << dtype;
    }
  }
}

// Issue 28 item 2: teacher.autocast bfloat16 runs a CPU teacher's forward
// under torch's CPU autocast (it was refused off the GPU), and its top-k values
// arrive as bfloat16 (payload_dtype auto); the loss is within bfloat16's
// rounding of the float32 job's.
TEST(TeacherEndToEnd, CpuBFloat16AutocastTeacherTopK) {
  const double f32 = runJob(scriptTeacher(8), "script", 1, 3).meanLoss;
  // The in-process reference runs under the same autocast; batching may round differently.
  const double bf16 = runJob(scriptTeacher(8) + "  autocast: bfloat16\n", "script", 1, 3, "BFloat16", 1e-3).meanLoss;
  std::printf("cpu bf16 autocast teacher: mean step loss %.6f (float32 %.6f)\n", bf16, f32);
  EXPECT_NEAR(bf16, f32, 2e-2 * std::abs(f32));
  EXPECT_NE(bf16, f32); // the forward ran in bfloat16
  // The forward itself runs under the autocast (a self teacher reports what it sees).
  const auto self = runJob("  kind: self\n  autocast: bfloat16\n  topk: 8\n", "self", 1, 2, "BFloat16", 1e-3);
  EXPECT_TRUE(dt::contains(self.teacherLog, "FORWARD autocast cpu=1 dtype=BFloat16")) << self.teacherLog;
}
