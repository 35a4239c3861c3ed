// distill::Steps (docs/cpp.md, "The step API") with real processes: 2 students and
// a teacher (this binary in the `steps` role, teacher.kind self) under
// distill-run, grad_acc_steps 2 and in_flight 2. The teacher's answer is a
// function of the micro-batch's inputs, so a mismatched answer changes the loss.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <regex>
#include <thread>

#include "distill/distill.h"
#include "launch.h"
#include "support/process.h"
#include "support/roles.h"
#include "support/tiny_net.h"

using namespace distill::testing;

namespace {

constexpr int64_t kVocab = 16, kDim = 8, kSeq = 6, kRows = 3, kIgnore = -100;

struct Net : distill::testing::TinyNet {
  Net() : TinyNet(kVocab, kDim) {}
};

// Micro-batch (step, acc) of student `rank`; some labels ignored.
distill::MicroBatch microBatch(int rank, int64_t step, int64_t acc) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(uint64_t(1000 * rank + 10 * step + acc + 1));
  distill::MicroBatch mb;
  mb.inputs = at::randint(0, kVocab, {kRows, kSeq}, g, at::kLong);
  mb.labels = at::randint(0, kVocab, {kRows, kSeq}, g, at::kLong);
  mb.labels.masked_fill_(at::rand({kRows, kSeq}, g, at::kDouble) < 0.25, kIgnore);
  return mb;
}

// The teacher: logits that depend on the inputs only.
at::Tensor teacherLogits(const at::Tensor& ids) {
  return at::one_hot((ids * 5 + 3) % kVocab, kVocab).to(at::kFloat) * 4 - 1;
}

void printStep(int64_t step, double loss, double kd, double ce) {
  std::printf("LOSS step=%lld loss=%.17g kd=%.17g ce=%.17g\n", static_cast<long long>(step), loss, kd, ce);
}

// The README's low-level loop (submit/get, stepTokenCount, distillLoss,
// allReduceGradients, the stop all-reduce), one request ahead.
int lowLevel(distill::Session& s, Net& net, torch::optim::SGD& opt) {
  const int G = s.config.student.grad_acc_steps, rank = s.topology.studentRank;
  auto& group = s.student->group();
  const int64_t steps = s.config.run.steps;
  distill::Handle inFlight = s.client->submit(microBatch(rank, 1, 0).inputs, 1, 0);
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<at::Tensor> labels;
    for (int acc = 0; acc < G; ++acc) labels.push_back(microBatch(rank, step, acc).labels);
    const double tokens = distill::stepTokenCount(group, labels, s.config.loss.ignore_index);
    double loss = 0, kd = 0, ce = 0;
    for (int acc = 0; acc < G; ++acc) {
      at::Tensor logits = net.forward(microBatch(rank, step, acc).inputs);
      const distill::Handle h = inFlight;
      if (acc + 1 < G)
        inFlight = s.client->submit(microBatch(rank, step, acc + 1).inputs, step, acc + 1);
      else if (step < steps)
        inFlight = s.client->submit(microBatch(rank, step + 1, 0).inputs, step + 1, 0);
      distill::TeacherReply reply = s.client->get(h, distill::ReplyMode::kView);
      auto r = distill::distillLoss(logits, labels[acc], reply.output(), s.config.loss, tokens);
      r.loss.backward();
      loss += r.loss.item<double>(), kd += r.kd.item<double>(), ce += r.ce.item<double>();
    }
    distill::allReduceGradients(group, net.parameters(), s.config.student.bucket_mb);
    opt.step();
    opt.zero_grad();
    auto stats = torch::tensor({loss, kd, ce}, torch::kDouble);
    group.allReduce(stats, distill::ReduceOp::kSum, "test: step stats");
    printStep(step, stats[0].item<double>(), stats[1].item<double>(), stats[2].item<double>());
  }
  s.client->finish();
  return 0;
}

// The step API. `dryAfter` > 0: student 1's loader ends after that many
// micro-batches. `readyAt`: after that step's optimizer step both print READY;
// student 0 goes on at once (it reads the stop flag, still down, at once),
// student 1 waits for distill-run's stop request before its next next(): the
// students see the flag at different steps and must still agree.
// `leaveAfter` > 0: the trainer leaves the loop itself after that step (run.steps
// 0), then calls finish() when `finishIt`.
// `fused`: backward(hidden, {fc weight, fc bias}), the fused linear loss.
int withSteps(distill::Session& s, Net& net, torch::optim::SGD& opt, int64_t dryAfter, int64_t readyAt,
              int64_t leaveAfter = 0, bool finishIt = false, bool fused = false) {
  const int rank = s.topology.studentRank, G = s.config.student.grad_acc_steps;
  const int64_t inFlight = s.config.student.in_flight, steps = s.config.run.steps;
  distill::StepsOptions hooks;
  hooks.onStep = [&](const distill::StepReport& r) { printStep(r.step, r.loss, r.kd, r.ce); };
  hooks.onCheckpoint = [&](const distill::CheckpointReport& c) {
    std::printf("CKPT step=%lld saved=%d error=%s\n", static_cast<long long>(c.step), c.saved ? 1 : 0,
                c.error.c_str());
  };
  distill::Steps train(s, net, opt, hooks);
  std::printf("RESUMED %lld\n", static_cast<long long>(train.resumedStep()));
  int64_t read = 0;
  auto loader = [&]() -> std::optional<distill::MicroBatch> {
    if (dryAfter > 0 && rank == 1 && read == dryAfter) return std::nullopt;
    const int64_t k = read++ + train.resumedStep() * G; // from the step after the checkpoint
    return microBatch(rank, k / G + 1, k % G);
  };
  try { // backward() before next(): API misuse, refused before anything changes
    train.backward(at::zeros({1}));
    std::printf("MISUSE none\n");
  } catch (const distill::UsageError& e) {
    std::printf("MISUSE UsageError: %s\n", e.message().c_str());
  }
  while (auto mb = train.next(loader)) {
    // The teacher holds the current micro-batch and the next ones, in_flight deep (fewer at the end).
    const bool last = mb->step == steps && mb->accStep + 1 == G;
    if (s.client->outstanding() != (last ? 1 : inFlight) && dryAfter == 0)
      std::printf("DEPTH %lld at step %lld acc %lld\n", static_cast<long long>(s.client->outstanding()),
                  static_cast<long long>(mb->step), static_cast<long long>(mb->accStep));
    DISTILL_CHECK(torch::equal(mb->inputs, microBatch(rank, mb->step, mb->accStep).inputs), "micro-batch order");
    if (fused) {
      train.backward(torch::tanh(net.emb(mb->inputs)), distill::OutputHead{net.fc->weight, net.fc->bias, 5});
    } else {
      train.backward(net.forward(mb->inputs));
    }
    if (train.stepEnds()) opt.step(), opt.zero_grad();
    if (train.stepEnds() && mb->step == leaveAfter) break;
    if (train.stepEnds() && mb->step == readyAt) {
      std::printf("READY student %d\n", rank);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (rank == 1 && !s.client->stopRequested()) { // the segment's flag: polled, with a deadline
        DISTILL_CHECK(std::chrono::steady_clock::now() < deadline, "student 1: no stop request within 30 s");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  if (finishIt) train.finish();
  std::printf("STOPPED step=%lld stopped=%d saved=%d\n", static_cast<long long>(train.step()), train.stopped() ? 1 : 0,
              train.saved() ? 1 : 0);
  return 0;
}

} // namespace

// args: mode (steps | fused | lowlevel | stop | dry)
DISTILL_TEST_ROLE(steps) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int argc = 1;
  char arg0[] = "train_steps_test";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  if (s.isTeacher()) {
    distill::serve(*s.teacher, distill::teacherFromFunction([](const std::vector<at::Tensor>& in) {
      return teacherLogits(in.at(0));
    }));
    return 0;
  }
  torch::manual_seed(7);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.5));
  const std::string mode = args.at(0);
  if (mode == "lowlevel") return lowLevel(s, net, opt);
  if (mode == "leave" || mode == "leave-finish") return withSteps(s, net, opt, 0, -1, 3, mode == "leave-finish");
  if (mode == "fused") return withSteps(s, net, opt, 0, -1, 0, false, /*fused=*/true);
  return withSteps(s, net, opt, mode == "dry" ? 5 : 0, mode == "stop" ? 2 : -1);
}

namespace {

class StepsTest : public LauncherFixture {
 protected:
  std::vector<std::string> args(const std::string& mode, int64_t steps, std::vector<std::string> more = {}) {
    std::vector<std::string> sets = {"--set", "student.grad_acc_steps=2", "--set", "student.in_flight=2", "--set",
                                     "run.steps=" + std::to_string(steps), "--set", "checkpoint.dir=" + dir_ + "/ckpt",
                                     "--set", "checkpoint.every_steps=0", "--set", "loss.alpha=0.6", "--set",
                                     "loss.temperature=2"};
    for (auto& m : more) sets.insert(sets.end(), {"--set", m}); // later ones win
    return jobArgs(sets, {mode}, "steps");
  }
  // The LOSS lines of student `rank`, in order.
  std::vector<std::string> losses(const std::string& text, int rank) {
    std::vector<std::string> out;
    const std::regex re("\\[r" + std::to_string(rank) + " student\\] (LOSS [^\n]*)");
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) out.push_back((*it)[1]);
    return out;
  }
  int64_t publishedStep() {
    auto scan = distill::scanCheckpoints(dir_ + "/ckpt", *distill::posixFileSystem());
    return scan.chosen ? scan.chosen->step : -1;
  }
};

TEST_F(StepsTest, LossesEqualTheLowLevelLoopAndEveryAnswerIsItsMicroBatchs) {
  Launch low(args("lowlevel", 6));
  auto st = low.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << low.text();
  Launch api(args("steps", 6));
  st = api.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << api.text();
  EXPECT_FALSE(has(api.text(), "DEPTH")) << api.text();
  EXPECT_TRUE(has(api.text(), "[r0 student] MISUSE UsageError: distill::Steps::backward() without a micro-batch"))
      << api.text();
  for (int r : {0, 1}) {
    const auto a = losses(low.text(), r), b = losses(api.text(), r);
    ASSERT_EQ(a.size(), 6u) << low.text();
    EXPECT_EQ(a, b) << api.text();
  }
  EXPECT_EQ(losses(api.text(), 0), losses(api.text(), 1));
  EXPECT_TRUE(has(api.text(), "[r0 student] STOPPED step=6 stopped=0 saved=1")) << api.text();
  EXPECT_EQ(publishedStep(), 6);
}

// backward(hidden, head): fusedLinearLoss on the model's last hidden states and
// its output projection trains the same model as backward(logits) (the same
// losses, step after step, to float32 rounding).
TEST_F(StepsTest, FusedOutputHeadTrainsAsTheLogitsDo) {
  Launch low(args("lowlevel", 6));
  auto st = low.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << low.text();
  Launch fused(args("fused", 6));
  st = fused.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << fused.text();
  const std::regex num("loss=([^ ]+) kd=([^ ]+) ce=([^ ]+)");
  for (int r : {0, 1}) {
    const auto a = losses(low.text(), r), b = losses(fused.text(), r);
    ASSERT_EQ(a.size(), 6u) << low.text();
    ASSERT_EQ(b.size(), 6u) << fused.text();
    for (size_t i = 0; i < a.size(); ++i) {
      std::smatch ma, mb;
      ASSERT_TRUE(std::regex_search(a[i], ma, num) && std::regex_search(b[i], mb, num)) << a[i] << " / " << b[i];
      for (int k = 1; k <= 3; ++k) {
        const double x = std::stod(ma[k]), y = std::stod(mb[k]);
        EXPECT_NEAR(y, x, 1e-5 * std::abs(x)) << "student " << r << ": " << a[i] << " / " << b[i];
      }
    }
  }
}

TEST_F(StepsTest, StopRequestStopsBothStudentsAfterTheSameStepWithAPublishedCheckpoint) {
  Launch l(args("stop", 100000));
  ASSERT_TRUE(l.waitFor("READY student 0") && l.waitFor("READY student 1")) << l.text();
  l.kill(SIGTERM);
  auto st = l.finish();
  EXPECT_TRUE(st.exited && st.code == 128 + SIGTERM) << st.describe() << "\n" << l.text();
  std::smatch m0, m1;
  const std::string text = l.text();
  ASSERT_TRUE(std::regex_search(text, m0, std::regex("\\[r0 student\\] STOPPED step=([0-9]+) stopped=1 saved=1")))
      << text;
  ASSERT_TRUE(std::regex_search(text, m1, std::regex("\\[r1 student\\] STOPPED step=([0-9]+) stopped=1 saved=1")))
      << text;
  EXPECT_EQ(m0[1].str(), "2");
  EXPECT_EQ(m1[1].str(), "2");
  EXPECT_EQ(publishedStep(), std::stoll(m0[1].str()));
  for (const char* r : {"[r0 student] exit code 0", "[r1 student] exit code 0", "[r2 teacher] exit code 0"})
    EXPECT_TRUE(has(text, r)) << r << "\n" << text;
}

// Student 1's loader ends after 5 micro-batches: step 3 lacks its second.
TEST_F(StepsTest, LoaderRunningDryOnOneStudentStopsBothWithoutAHang) {
  Launch l(args("dry", 10));
  auto st = l.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << l.text();
  EXPECT_TRUE(has(l.text(), "[r0 student] STOPPED step=2 stopped=1 saved=1")) << l.text();
  EXPECT_TRUE(has(l.text(), "[r1 student] STOPPED step=2 stopped=1 saved=1")) << l.text();
  EXPECT_TRUE(has(l.text(), "the loader ran dry before step 3 on 1 of 2 students")) << l.text();
  EXPECT_EQ(publishedStep(), 2);
}

// A run stopped by a dry loader at step 2 goes on from its checkpoint: steps
// 3..6 give the losses of an uninterrupted run.
TEST_F(StepsTest, ResumesFromTheCheckpointOfAStopWithTheUninterruptedLosses) {
  Launch whole(args("lowlevel", 6));
  auto st = whole.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << whole.text();
  std::system(("rm -rf " + dir_ + "/ckpt").c_str());
  Launch first(args("dry", 6));
  st = first.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << first.text();
  ASSERT_EQ(publishedStep(), 2);
  Launch rest(args("steps", 6));
  st = rest.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << rest.text();
  EXPECT_TRUE(has(rest.text(), "[r0 student] RESUMED 2") && has(rest.text(), "[r1 student] RESUMED 2")) << rest.text();
  for (int r : {0, 1}) {
    auto expected = losses(whole.text(), r);
    ASSERT_EQ(expected.size(), 6u) << whole.text();
    expected.erase(expected.begin(), expected.begin() + 2);
    EXPECT_EQ(losses(rest.text(), r), expected) << rest.text();
  }
  EXPECT_EQ(publishedStep(), 6);
}

// Issue 27: with checkpoints off no save is attempted and none is reported
// (the demo printed "a save failed" for each); a save that fails says which
// file and why in its report.
TEST_F(StepsTest, NoCheckpointIsReportedWithCheckpointsOffAndAFailedOneSaysWhichFileAndWhy) {
  Launch off(args("steps", 3, {"checkpoint.dir=\"\""}));
  auto st = off.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << off.text();
  EXPECT_FALSE(has(off.text(), "CKPT")) << off.text();
  EXPECT_TRUE(has(off.text(), "[r0 student] STOPPED step=3 stopped=0 saved=1")) << off.text();

  // step_2.tmp is a file: every rank's save of step 2 fails to make its folder.
  ASSERT_EQ(std::system(("mkdir -p " + dir_ + "/ckpt && touch " + dir_ + "/ckpt/step_2.tmp").c_str()), 0);
  Launch bad(args("steps", 4, {"checkpoint.every_steps=2", "checkpoint.on_error=continue"}));
  st = bad.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << bad.text();
  EXPECT_TRUE(has(bad.text(), "[r0 student] CKPT step=2 saved=0 error=checkpoint step 2 not saved: cannot create "
                              "directory " +
                                  dir_ + "/ckpt/step_2.tmp: Not a directory"))
      << bad.text();
  EXPECT_TRUE(has(bad.text(), "[r0 student] CKPT step=4 saved=1 error=\n")) << bad.text();
  EXPECT_EQ(publishedStep(), 4);
}

// Issue 27: run.steps 0 and a trainer that leaves the loop itself left an
// empty checkpoint folder without a word; now ~Steps warns, and finish()
// saves and publishes the step the trainer stopped after.
TEST_F(StepsTest, LeavingTheLoopWithoutACheckpointIsWarnedAndFinishSavesIt) {
  Launch left(args("leave", 0));
  auto st = left.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << left.text();
  EXPECT_TRUE(has(left.text(), "[r0 student] STOPPED step=3 stopped=0 saved=1")) << left.text();
  EXPECT_TRUE(has(left.text(), "the trainer left the loop after step 3 without next() returning nullopt or "
                               "finish(): steps 1..3 are in no checkpoint in " +
                                   dir_ + "/ckpt (none was taken); call finish() after the loop"))
      << left.text();
  EXPECT_EQ(publishedStep(), -1);

  Launch finished(args("leave-finish", 0));
  st = finished.finish();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << finished.text();
  EXPECT_TRUE(has(finished.text(), "[r0 student] CKPT step=3 saved=1")) << finished.text();
  EXPECT_FALSE(has(finished.text(), "left the loop")) << finished.text();
  EXPECT_EQ(publishedStep(), 3);
}

} // namespace

// Issue 39 item 4: a loss term of weight 0 is not computed; StepReport (and so
// the status, the Python report and a trainer's metrics.jsonl) says 0 for it,
// never NaN (NaN is not JSON).
TEST_F(StepsTest, ATermNotComputedIsReportedAsZeroNeverNan) {
  for (const std::string alpha : {"0", "1"}) {
    SCOPED_TRACE("loss.alpha=" + alpha);
    Launch api(args("steps", 2, {"loss.alpha=" + alpha, "checkpoint.dir="}));
    const auto st = api.finish();
    ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << api.text();
    const auto lines = losses(api.text(), 0);
    ASSERT_EQ(lines.size(), 2u) << api.text();
    for (const std::string& l : lines) {
      EXPECT_EQ(l.find("nan"), std::string::npos) << l;
      if (alpha == "0") {
        EXPECT_TRUE(has(l, " kd=0 ")) << l;
      } else {
        EXPECT_EQ(l.substr(l.size() - 5), " ce=0") << l;
      }
    }
  }
}
