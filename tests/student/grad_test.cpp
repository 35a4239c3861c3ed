// Gradient accumulation + data parallelism give the gradient of one batch:
// 2 student processes x grad_acc_steps 4 micro-batches with uneven
// ignore_index masks (one micro-batch with nothing to learn), each loss
// divided by stepTokenCount and the gradients summed with allReduceGradients,
// against one process on the concatenated batch. Double precision.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "distill/core/config.h"
#include "distill/group/student_context.h"
#include "distill/core/errors.h"
#include "distill/core/topology.h"
#include "distill/student/grad.h"
#include "distill/student/grad_sync.h"
#include "distill/student/losses.h"
#include "job_fixture.h"
#include "support/roles.h"
#include "support/tiny_net.h"

namespace dt = distill::testing;
using namespace std::chrono;

namespace {

constexpr int64_t kVocab = 48, kDim = 16, kSeq = 12, kIgnore = -100, kG = 4;

struct Net : distill::testing::TinyNet {
  Net() : TinyNet(kVocab, kDim) {}
};

std::shared_ptr<Net> makeNet() {
  torch::manual_seed(5);
  auto net = std::make_shared<Net>();
  net->to(torch::kDouble);
  return net;
}

struct Batch {
  at::Tensor ids, labels, teacher;
};

// Rank 0 has 2 rows per micro-batch, rank 1 has 3; the share of ignored
// labels differs per micro-batch, down to all of them.
Batch gradBatch(int rank, int acc) {
  static const double dropped[2][kG] = {{0.0, 0.5, 0.9, 0.2}, {0.95, 1.0, 0.3, 0.7}};
  const int64_t rows = rank == 0 ? 2 : 3;
  auto g = at::make_generator<at::CPUGeneratorImpl>(uint64_t(100 * rank + acc + 1));
  Batch b;
  b.ids = at::randint(0, kVocab, {rows, kSeq}, g, at::kLong);
  b.labels = at::randint(0, kVocab, {rows, kSeq}, g, at::kLong);
  b.labels.masked_fill_(at::rand({rows, kSeq}, g, at::kDouble) < dropped[rank][acc % kG], kIgnore);
  b.teacher = at::randn({rows, kSeq, kVocab}, g, at::kDouble) * 3;
  return b;
}

std::string yaml() {
  return "run:\n  startup_timeout_s: 30\n  collective_timeout_s: 30\nteacher:\n  kind: self\n"
         "student:\n  grad_acc_steps: 4\n  bucket_mb: 0.002\n" // several gradient buckets
         "loss:\n  kind: jsd\n  temperature: 2.0\n  alpha: 0.7\n  chunk_tokens: 5\n  ignore_index: -100\n";
}

} // namespace

// One step of a data-parallel student; writes its all-reduced gradients to args[0].
DISTILL_TEST_ROLE(grad_student) {
  int argc = 1;
  char arg0[] = "grad_student";
  char* argv[] = {arg0, nullptr};
  const distill::Config cfg = distill::jobConfig(argc, argv);
  distill::StudentContext ctx(distill::Topology::fromEnvironment(), cfg);
  const int rank = ctx.rank();
  auto net = makeNet();
  std::vector<at::Tensor> labels;
  for (int a = 0; a < cfg.student.grad_acc_steps; ++a) labels.push_back(gradBatch(rank, a).labels);
  const double normalizer = distill::stepTokenCount(ctx.group(), labels, cfg.loss.ignore_index);
  for (int a = 0; a < cfg.student.grad_acc_steps; ++a) {
    Batch b = gradBatch(rank, a);
    distill::TeacherOutput t;
    t.makeLogits().logits = b.teacher;
    distill::distillLoss(net->forward(b.ids), b.labels, t, cfg.loss, normalizer).loss.backward();
  }
  distill::allReduceGradients(ctx.group(), net->parameters(), cfg.student.bucket_mb);
  std::vector<at::Tensor> grads;
  for (auto& p : net->parameters()) grads.push_back(p.grad());
  torch::save(grads, args.at(0));
  // Evaluation on student rank 0 only, its value broadcast to every student.
  int calls = 0;
  auto eval = distill::evaluateOnRank0(
      ctx.group(),
      [&] {
        ++calls;
        return std::vector<double>{42.5, double(rank)};
      },
      2);
  if (eval != std::vector<double>{42.5, 0.0} || calls != (rank == 0 ? 1 : 0)) {
    std::fprintf(stderr, "evaluateOnRank0: got %f %f, %d call(s)\n", eval[0], eval[1], calls);
    return 1;
  }
  std::fprintf(stderr, "RESULT step tokens=%.0f\n", normalizer);
  return 0;
}

// Two steps of a data-parallel student: in the first, every label of every
// micro-batch of every student is ignored (all completions truncated), so the
// step's token count is 0; the second is ordinary. Prints what it saw.
DISTILL_TEST_ROLE(empty_step_student) {
  int argc = 1;
  char arg0[] = "empty_step_student";
  char* argv[] = {arg0, nullptr};
  const distill::Config cfg = distill::jobConfig(argc, argv);
  distill::StudentContext ctx(distill::Topology::fromEnvironment(), cfg);
  const int rank = ctx.rank();
  auto net = makeNet();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 2; ++step) {
    std::vector<Batch> batches;
    std::vector<at::Tensor> labels;
    for (int a = 0; a < cfg.student.grad_acc_steps; ++a) {
      batches.push_back(gradBatch(rank, a));
      if (step == 0) batches.back().labels.fill_(kIgnore);
      labels.push_back(batches.back().labels);
    }
    const double tokens = distill::stepTokenCount(ctx.group(), labels, cfg.loss.ignore_index);
    double loss = 0;
    for (auto& b : batches) {
      distill::TeacherOutput t;
      t.makeLogits().logits = b.teacher;
      distill::LossResult r = distill::distillLoss(net->forward(b.ids), b.labels, t, cfg.loss, tokens);
      r.loss.backward();
      loss += r.loss.item<double>();
    }
    distill::allReduceGradients(ctx.group(), net->parameters(), cfg.student.bucket_mb);
    double maxGrad = 0;
    for (auto& p : net->parameters()) maxGrad = std::max(maxGrad, p.grad().abs().max().item<double>());
    opt.step();
    opt.zero_grad();
    std::fprintf(stderr, "RESULT step %d tokens=%.0f loss=%.17g max_grad=%.17g\n", step, tokens, loss, maxGrad);
  }
  return 0;
}

// Issue 17: the same start on every student. Prints RESULT lines the test checks.
DISTILL_TEST_ROLE(broadcast_student) {
  int argc = 1;
  char arg0[] = "broadcast_student";
  char* argv[] = {arg0, nullptr};
  const distill::Config cfg = distill::jobConfig(argc, argv);
  distill::StudentContext ctx(distill::Topology::fromEnvironment(), cfg); // seeds torch with run.seed
  auto& group = ctx.group();
  // 1 when `t` equals student rank 0's `t`.
  auto sameAsRank0 = [&](const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> flat;
    for (auto& t : ts) flat.push_back(t.detach().reshape(-1).to(at::kDouble));
    at::Tensor mine = at::cat(flat), theirs = mine.clone();
    group.broadcast(theirs, 0, "test: rank 0's values");
    at::Tensor same = at::full({1}, at::equal(mine, theirs) ? 1.0 : 0.0, at::kDouble);
    group.allReduce(same, distill::ReduceOp::kMin, "test: all the same");
    return static_cast<int>(same.item<double>());
  };
  std::fprintf(stderr, "RESULT seeded_same=%d\n", sameAsRank0({at::rand({8}, at::kDouble)}));
  torch::manual_seed(uint64_t(100 + ctx.rank())); // a trainer that seeds per rank
  auto net = std::make_shared<Net>();
  net->to(torch::kDouble);
  std::fprintf(stderr, "RESULT before_same=%d\n", sameAsRank0(net->parameters()));
  distill::broadcastParameters(group, net->parameters(), net->buffers(), /*bucketMb=*/0.002);
  std::fprintf(stderr, "RESULT after_broadcast_same=%d\n", sameAsRank0(net->parameters()));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Batch b = gradBatch(ctx.rank(), 0);
  distill::TeacherOutput t;
  t.makeLogits().logits = b.teacher;
  const double tokens = distill::stepTokenCount(group, {b.labels}, cfg.loss.ignore_index);
  distill::distillLoss(net->forward(b.ids), b.labels, t, cfg.loss, tokens).loss.backward();
  distill::allReduceGradients(group, net->parameters(), cfg.student.bucket_mb);
  opt.step();
  std::fprintf(stderr, "RESULT after_step_same=%d\n", sameAsRank0(net->parameters()));
  // A student with another model: a clear error on every student, not a hang.
  std::vector<at::Tensor> params = net->parameters();
  if (ctx.rank() == 1) params.push_back(at::zeros({3}, at::kDouble));
  try {
    distill::broadcastParameters(group, params);
    std::fprintf(stderr, "RESULT mismatch_error=none\n");
  } catch (const ::distill::ConfigError& e) {
    std::fprintf(stderr, "RESULT mismatch_error=%s\n", e.what());
  }
  return 0;
}

// Issue 17: GradientSync (all-reduce overlapped with backward, buckets started
// from post-accumulate-grad hooks, no collective on accumulation micro-batches)
// against allReduceGradients after backward, on two identical nets, for two
// steps with an optimizer step between. Writes the synced gradients of step 1
// to args[0] and prints RESULT lines.
DISTILL_TEST_ROLE(grad_sync_student) {
  int argc = 1;
  char arg0[] = "grad_sync_student";
  char* argv[] = {arg0, nullptr};
  const distill::Config cfg = distill::jobConfig(argc, argv);
  distill::StudentContext ctx(distill::Topology::fromEnvironment(), cfg);
  auto& group = ctx.group();
  const int rank = ctx.rank(), G = cfg.student.grad_acc_steps;
  auto overlapped = makeNet(), after = makeNet();
  distill::GradientSync sync(group, overlapped->parameters(), cfg.student.bucket_mb);
  // A second GradientSync on the same parameters is API misuse: a UsageError, before any collective.
  try {
    distill::GradientSync twice(group, overlapped->parameters(), cfg.student.bucket_mb);
    std::fprintf(stderr, "MISUSE none\n");
  } catch (const distill::UsageError& e) {
    std::fprintf(stderr, "MISUSE UsageError: %s\n", e.message().c_str());
  }
  torch::optim::SGD optA(overlapped->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD optB(after->parameters(), torch::optim::SGDOptions(0.1));
  double maxDiff = 0;
  int64_t collectivesWhileAccumulating = 0;
  for (int step = 0; step < 2; ++step) {
    std::vector<at::Tensor> labels;
    for (int a = 0; a < G; ++a) labels.push_back(gradBatch(rank, a + 10 * step).labels);
    const double tokens = distill::stepTokenCount(group, labels, cfg.loss.ignore_index);
    for (int a = 0; a < G; ++a) {
      Batch b = gradBatch(rank, a + 10 * step);
      distill::TeacherOutput t;
      t.makeLogits().logits = b.teacher;
      sync.setSyncing(a + 1 == G);
      const int64_t before = group.sequence();
      distill::distillLoss(overlapped->forward(b.ids), b.labels, t, cfg.loss, tokens).loss.backward();
      if (a + 1 < G) collectivesWhileAccumulating += group.sequence() - before;
      distill::distillLoss(after->forward(b.ids), b.labels, t, cfg.loss, tokens).loss.backward();
    }
    sync.wait();
    distill::allReduceGradients(group, after->parameters(), cfg.student.bucket_mb);
    auto pa = overlapped->parameters(), pb = after->parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      maxDiff = std::max(maxDiff, (pa[i].grad() - pb[i].grad()).abs().max().item<double>());
    if (step == 0) {
      std::vector<at::Tensor> grads;
      for (auto& p : pa) grads.push_back(p.grad());
      torch::save(grads, args.at(0));
    }
    optA.step(), optB.step();
    optA.zero_grad(), optB.zero_grad();
  }
  std::fprintf(stderr, "RESULT buckets=%d started_during_backward=%d accumulating_collectives=%lld max_diff=%.3e\n",
               sync.buckets(), sync.startedDuringBackward(), static_cast<long long>(collectivesWhileAccumulating),
               maxDiff);
  return 0;
}

TEST(StudentGrad, OverlappedSyncEqualsAllReduceAfterBackward) {
  dt::Job job(2, yaml(), /*withSegment=*/false);
  std::vector<std::string> out;
  std::vector<dt::Child> kids;
  for (int r = 0; r < 2; ++r) {
    out.push_back(::testing::TempDir() + dt::uniqueName("gradsync") + ".pt");
    kids.push_back(job.spawnRole("grad_sync_student", r, {out.back()}));
  }
  auto st = dt::joinAll(kids, seconds(60));
  std::vector<std::vector<at::Tensor>> grads(2);
  for (int r = 0; r < 2; ++r) {
    const std::string log = job.log(r);
    ASSERT_TRUE(st[size_t(r)].exited && st[size_t(r)].code == 0) << st[size_t(r)].describe() << "\n" << log;
    const double buckets = dt::numberAfter(log, "RESULT buckets=");
    EXPECT_GE(buckets, 2) << log; // bucket_mb 0.002: fc (bias, weight), then the embedding
    // Buckets left backward before it ended: the overlap is real.
    EXPECT_GE(dt::numberAfter(log, "started_during_backward="), 1) << log;
    EXPECT_EQ(dt::numberAfter(log, "accumulating_collectives="), 0) << log; // no_sync
    const double diff = dt::numberAfter(log, "max_diff=");
    EXPECT_LE(diff, 1e-6) << log;
    EXPECT_NE(log.find("MISUSE UsageError: GradientSync: parameter 0 already has"), std::string::npos) << log;
    std::printf("rank %d: overlapped vs after-backward max |diff| = %.3e\n", r, diff);
    torch::load(grads[size_t(r)], out[size_t(r)]);
    std::remove(out[size_t(r)].c_str());
  }
  // Both students hold the same (summed) gradient.
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << "parameter " << i;
}

TEST(StudentGrad, AccumulatedDataParallelGradientEqualsOneBatch) {
  dt::Job job(2, yaml(), /*withSegment=*/false);
  std::vector<std::string> out;
  std::vector<dt::Child> kids;
  for (int r = 0; r < 2; ++r) {
    out.push_back(::testing::TempDir() + dt::uniqueName("grad") + ".pt");
    kids.push_back(job.spawnRole("grad_student", r, {out.back()}));
  }
  // Meanwhile: one process, one batch of the same tokens, one normaliser.
  std::vector<at::Tensor> ids, labels, teacher;
  for (int r = 0; r < 2; ++r) {
    for (int a = 0; a < kG; ++a) {
      Batch b = gradBatch(r, a);
      ids.push_back(b.ids);
      labels.push_back(b.labels);
      teacher.push_back(b.teacher);
    }
  }
  auto net = makeNet();
  distill::TeacherOutput t;
  t.makeLogits().logits = at::cat(teacher);
  at::Tensor all = at::cat(labels);
  const int64_t tokens = distill::countTokens(all, kIgnore);
  distill::distillLoss(net->forward(at::cat(ids)), all, t, job.config().loss, double(tokens)).loss.backward();

  auto st = dt::joinAll(kids, seconds(60));
  for (int r = 0; r < 2; ++r) {
    const std::string log = job.log(r);
    ASSERT_TRUE(st[size_t(r)].exited && st[size_t(r)].code == 0) << st[size_t(r)].describe() << "\n" << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT step tokens="), double(tokens)) << log;
    std::vector<at::Tensor> grads;
    torch::load(grads, out[size_t(r)]);
    auto params = net->parameters();
    ASSERT_EQ(grads.size(), params.size());
    double maxDiff = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_EQ(grads[i].scalar_type(), at::kDouble);
      maxDiff = std::max(maxDiff, (grads[i] - params[i].grad()).abs().max().item<double>());
      EXPECT_GT(params[i].grad().abs().max().item<double>(), 1e-3) << "parameter " << i << " got no gradient";
    }
    EXPECT_LE(maxDiff, 1e-6) << "rank " << r;
    std::printf("rank %d: max |grad - one-batch grad| = %.3e over %lld tokens\n", r, maxDiff,
                static_cast<long long>(tokens));
    std::remove(out[size_t(r)].c_str());
  }
}

// Issue 14 item 5: a step without a single non-ignored label on any student
// (stepTokenCount 0) trains on: zero loss, zero gradient, and the next step is
// ordinary. It used to end the run with a ConfigError from distillLoss.
TEST(StudentGrad, StepWithoutTokensTrainsOn) {
  dt::Job job(2, yaml(), /*withSegment=*/false);
  std::vector<dt::Child> kids;
  for (int r = 0; r < 2; ++r) kids.push_back(job.spawnRole("empty_step_student", r));
  auto st = dt::joinAll(kids, seconds(60));
  for (int r = 0; r < 2; ++r) {
    const std::string log = job.log(r);
    ASSERT_TRUE(st[size_t(r)].exited && st[size_t(r)].code == 0) << st[size_t(r)].describe() << "\n" << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT step 0 tokens="), 0.0) << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT step 0 tokens=0 loss="), 0.0) << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT step 0 tokens=0 loss=0 max_grad="), 0.0) << log;
    EXPECT_GT(dt::numberAfter(log, "RESULT step 1 tokens="), 0.0) << log;
    const size_t at = log.find("RESULT step 1");
    ASSERT_NE(at, std::string::npos) << log;
    EXPECT_GT(dt::numberAfter(log.substr(at), "max_grad="), 1e-3) << log;
  }
}

// Issue 17: run.seed seeds every student alike, and broadcastParameters gives
// every student rank 0's weights whatever its RNG did (as DDP does at start);
// they stay the same after a step; different models are a ConfigError.
TEST(StudentGrad, StudentsStartFromRank0sParameters) {
  dt::Job job(2, yaml(), /*withSegment=*/false);
  std::vector<dt::Child> kids;
  for (int r = 0; r < 2; ++r) kids.push_back(job.spawnRole("broadcast_student", r));
  auto st = dt::joinAll(kids, seconds(60));
  for (int r = 0; r < 2; ++r) {
    const std::string log = job.log(r);
    ASSERT_TRUE(st[size_t(r)].exited && st[size_t(r)].code == 0) << st[size_t(r)].describe() << "\n" << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT seeded_same="), 1.0) << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT before_same="), 0.0) << log; // the test's own premise
    EXPECT_EQ(dt::numberAfter(log, "RESULT after_broadcast_same="), 1.0) << log;
    EXPECT_EQ(dt::numberAfter(log, "RESULT after_step_same="), 1.0) << log;
    EXPECT_NE(
        log.find(" student] broadcastParameters: student rank " + std::to_string(r) + " passes " + (r ? "4" : "3")),
        std::string::npos)
        << log;
    EXPECT_NE(log.find("every student must build the same model"), std::string::npos) << log;
  }
}
