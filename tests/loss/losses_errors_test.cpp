// losses_test: behaviour and errors of distillLoss (loss/src/losses.cpp,
// loss/src/loss_inputs.cpp): the incoming gradient, ignored tokens, low
// precision, the errors it names, and the edge cases of issue 14 that gave inf
// or NaN.

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/loss/losses.h"
#include "support/expect_throw.h"
#include "distill/teacher/server.h"
#include "counting_allocator.h"
#include "losses_test_util.h"

namespace distill {
namespace {

using testing::expectThrow;
using namespace loss_testing;

// ---- behaviour and errors --------------------------------------------------

TEST(Losses, BackwardScalesByIncomingGradientAndNoGradMatches) {
  Small s = smallProblem("dense", 2.0, 11);
  LossOptions o;
  o.chunk_tokens = 4;
  at::Tensor z1 = s.z.clone().requires_grad_(true), z2 = s.z.clone().requires_grad_(true);
  LossResult r1 = distillLoss(z1, s.labels, s.teacher, o, 5.0);
  r1.loss.backward();
  LossResult r2 = distillLoss(z2, s.labels, s.teacher, o, 5.0);
  (r2.loss * 3.0).backward();
  EXPECT_LT(maxAbs(z2.grad(), z1.grad() * 3.0), 1e-15);
  EXPECT_FALSE(r1.kd.requires_grad());
  EXPECT_FALSE(r1.ce.requires_grad());
  EXPECT_TRUE(r1.loss.requires_grad());
  LossResult r3 = distillLoss(s.z, s.labels, s.teacher, o, 5.0); // z does not require grad
  EXPECT_FALSE(r3.loss.requires_grad());
  EXPECT_DOUBLE_EQ(r3.loss.item<double>(), r1.loss.item<double>());
  EXPECT_NEAR(r1.loss.item<double>(), o.alpha * r1.kd.item<double>() + (1 - o.alpha) * r1.ce.item<double>(), 1e-15);
  // A second backward through the same loss is refused, not silently wrong.
  at::Tensor z4 = s.z.clone().requires_grad_(true);
  at::Tensor l4 = distillLoss(z4, s.labels, s.teacher, o, 5.0).loss;
  l4.backward({}, /*retain_graph=*/true);
  EXPECT_THROW(l4.backward(), UsageError);
}

TEST(Losses, AllIgnoredAndLowPrecision) {
  Small s = smallProblem("dense", 1.0, 5);
  LossOptions o;
  at::Tensor z = s.z.clone().requires_grad_(true);
  LossResult r = distillLoss(z, at::full({6}, -100, at::kLong), s.teacher, o, 1.0);
  r.loss.backward();
  EXPECT_EQ(r.tokens, 0);
  EXPECT_EQ(r.loss.item<double>(), 0.0);
  EXPECT_EQ(z.grad().abs().max().item<double>(), 0.0);
  // bfloat16 logits: float32 arithmetic, bfloat16 gradient.
  at::Tensor zb = s.z.to(at::kBFloat16).requires_grad_(true);
  LossResult rb = distillLoss(zb, s.labels, s.teacher, o, 5.0);
  rb.loss.backward();
  EXPECT_EQ(zb.grad().scalar_type(), at::kBFloat16);
  EXPECT_NEAR(rb.loss.item<double>(),
              distillLoss(s.z.to(at::kBFloat16).to(at::kDouble), s.labels, s.teacher, o, 5.0).loss.item<double>(),
              1e-5);
  // A teacher that rules tokens out (-inf) leaves forward KL and JSD finite.
  TeacherOutput masked{LogitsAnswer{s.teacher.logits()->logits.clone()}};
  masked.logits()->logits.select(1, 0).fill_(-std::numeric_limits<double>::infinity());
  for (const char* kind : {"forward_kl", "jsd"}) {
    o.kind = lossKind(kind);
    at::Tensor zm = s.z.clone().requires_grad_(true);
    LossResult rm = distillLoss(zm, s.labels, masked, o, 5.0);
    rm.loss.backward();
    EXPECT_TRUE(std::isfinite(rm.loss.item<double>())) << kind;
    EXPECT_TRUE(zm.grad().isfinite().all().item<bool>()) << kind;
  }
}

TEST(Losses, Errors) {
  Small s = smallProblem("dense", 1.0, 5);
  Small k = smallProblem("topk", 1.0, 5);
  LossOptions o;
  auto run = [&](const at::Tensor& z, const at::Tensor& l, const TeacherOutput& t, const LossOptions& opt,
                 double norm = 5.0) { return [=] { distillLoss(z, l, t, opt, norm); }; };
  std::string m = expectThrow<ProtocolError>(
      run(s.z, s.labels, TeacherOutput{LogitsAnswer{s.teacher.logits()->logits.narrow(1, 0, 8)}}, o));
  EXPECT_NE(m.find("vocabulary has 8 entries, the student's 9"), std::string::npos) << m;
  EXPECT_NE(m.find("loss.vocab"), std::string::npos) << m;
  m = expectThrow<ProtocolError>(run(s.z, s.labels.narrow(0, 0, 5), s.teacher, o));
  EXPECT_NE(m.find("6 elements"), std::string::npos) << m;
  EXPECT_NE(m.find("[5]"), std::string::npos) << m;
  expectThrow<ProtocolError>(run(s.z, s.labels.to(at::kInt), s.teacher, o));
  expectThrow<ProtocolError>(run(s.z, s.labels, TeacherOutput{}, o));
  expectThrow<ProtocolError>(run(s.z.to(at::kLong), s.labels, s.teacher, o));
  at::Tensor badLabels = s.labels.clone();
  badLabels[0] = 9;
  expectThrow<ProtocolError>(run(s.z, badLabels, s.teacher, o));
  TeacherOutput dup = k.teacher;
  dup.makeTopk().indices = k.teacher.topk()->indices.clone();
  dup.topk()->indices.select(1, 1).copy_(dup.topk()->indices.select(1, 0));
  m = expectThrow<ProtocolError>(run(k.z, k.labels, dup, o));
  EXPECT_NE(m.find("repeated"), std::string::npos) << m;
  TeacherOutput oob = k.teacher;
  oob.makeTopk().indices = k.teacher.topk()->indices.clone();
  oob.topk()->indices[0][0] = 9;
  expectThrow<ProtocolError>(run(k.z, k.labels, oob, o));
  TeacherOutput badIdx = k.teacher;
  badIdx.makeTopk().indices = k.teacher.topk()->indices.narrow(1, 0, 2);
  expectThrow<ProtocolError>(run(k.z, k.labels, badIdx, o));
  TeacherOutput badLse = k.teacher;
  badLse.makeTopk().logsumexp = at::zeros({5}, at::kDouble);
  expectThrow<ProtocolError>(run(k.z, k.labels, badLse, o));

  auto with = [&](auto edit) {
    LossOptions b;
    edit(b);
    return b;
  };
  // A kind outside the enum (LossOptions built in code, not parsed).
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.kind = static_cast<LossKind>(7); })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.temperature = 0; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.alpha = 1.5; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.jsd_beta = 1; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.chunk_tokens = 0; })));
  expectThrow<UsageError>(run(s.z, s.labels, s.teacher, o, 0.0)); // the normalizer: an argument, not a key
  m = expectThrow<ConfigError>(run(k.z, k.labels, k.teacher, with([](auto& b) { b.kind = LossKind::kReverseKl; })));
  EXPECT_NE(m.find("logsumexp"), std::string::npos) << m;
}

// ---- issue 14: edge cases that gave inf or NaN ------------------------------

// Rows with an infinite gradient entry or a NaN one.
int64_t badRows(const at::Tensor& grad) { return (~grad.isfinite()).any(1).sum().item<int64_t>(); }

// Item 1 at scale: float32, V = 32000, T = 0.25, LLM-like logits (a peaked
// teacher, a student near it): most tokens have p and q below float32's
// smallest denormal, and log(beta q + (1-beta) p) was -inf for them.
TEST(Losses, JsdStaysFiniteWhereBothDistributionsUnderflow) {
  const int64_t n = 256, v = 32000;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(14);
  at::Tensor t = at::randn({n, v}, gen, at::kFloat) * 3;
  t.select(1, 0).add_(12);
  at::Tensor z = (t + at::randn({n, v}, gen, at::kFloat) * 0.5).requires_grad_(true);
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  LossOptions o;
  o.kind = LossKind::kJsd;
  o.temperature = 0.25;
  o.chunk_tokens = 64;
  TeacherOutput teacher;
  teacher.makeLogits().logits = t;
  LossResult r = distillLoss(z, labels, teacher, o, double(n));
  r.loss.backward();
  EXPECT_TRUE(std::isfinite(r.loss.item<double>())) << r.loss.item<double>();
  EXPECT_EQ(badRows(z.grad()), 0);
  // The same in float64 (where nothing underflows here): the float32 loss is right, not just finite.
  at::Tensor z64 = z.detach().to(at::kDouble).requires_grad_(true);
  teacher.makeLogits().logits = t.to(at::kDouble);
  LossResult r64 = distillLoss(z64, labels, teacher, o, double(n));
  r64.loss.backward();
  EXPECT_NEAR(r.loss.item<double>(), r64.loss.item<double>(), 1e-5 * r64.loss.item<double>());
  EXPECT_LT(maxAbs(z.grad(), z64.grad()), 1e-6);
}

// Item 2 at scale, through the server's own top-k shaping (float32, top-64,
// V = 32000): rows where the teacher is confident enough that 1 - sum q_i
// cancels in float32. Reverse KL (and JSD, forward KL) stay finite and agree
// with the same computed in float64 from the same float32 output.
TEST(Losses, ServerTopkOutputKeepsTheTeacherTail) {
  const int64_t n = 256, v = 32000, k = 64;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(15);
  at::Tensor t = at::randn({n, v}, gen, at::kFloat) * 2;
  // A confident next token on every row, 18..34 above the bulk.
  t.select(1, 7).add_(at::rand({n}, gen, at::kFloat) * 16 + 18);
  at::Tensor z0 = at::randn({n, v}, gen, at::kFloat);
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  auto out = topkOutput(t, k, 1.0);
  TeacherOutput sent;
  sent.makeTopk().values = out.at(protocol::kTopkValues);
  sent.makeTopk().indices = out.at(protocol::kTopkIndices);
  sent.makeTopk().logsumexp = out.at(protocol::kLogsumexp);
  sent.makeTopk().logTail = out.at(protocol::kLogTail);
  ASSERT_EQ(sent.topk()->logTail.scalar_type(), at::kFloat);
  // The cancellation is there: in float32, the top-k mass rounds to 1 on some rows.
  at::Tensor topMass = (sent.topk()->values - sent.topk()->logsumexp.unsqueeze(1)).exp().sum(1);
  const int64_t cancelled = (topMass >= 1).sum().item<int64_t>();
  EXPECT_GT(cancelled, 10);
  for (const char* kind : {"reverse_kl", "forward_kl", "jsd"}) {
    SCOPED_TRACE(kind);
    LossOptions o;
    o.kind = lossKind(kind);
    o.chunk_tokens = 64;
    at::Tensor z = z0.clone().requires_grad_(true);
    LossResult r = distillLoss(z, labels, sent, o, double(n));
    r.loss.backward();
    EXPECT_TRUE(std::isfinite(r.loss.item<double>()));
    EXPECT_EQ(badRows(z.grad()), 0);
    TeacherOutput sent64{TopkAnswer{sent.topk()->values.to(at::kDouble), sent.topk()->indices, sent.topk()->logsumexp.to(at::kDouble), sent.topk()->logTail.to(at::kDouble)}};
    at::Tensor z64 = z0.to(at::kDouble).requires_grad_(true);
    LossResult r64 = distillLoss(z64, labels, sent64, o, double(n));
    r64.loss.backward();
    EXPECT_NEAR(r.loss.item<double>(), r64.loss.item<double>(), 1e-5 * std::abs(r64.loss.item<double>()));
    EXPECT_LT(maxAbs(z.grad(), z64.grad()), 1e-6);
    if (std::string(kind) == "reverse_kl") {
      // Without the log tail (an older teacher): still finite, never NaN.
      TeacherOutput old = sent;
      old.makeTopk().logTail = at::Tensor();
      at::Tensor zo = z0.clone().requires_grad_(true);
      LossResult ro = distillLoss(zo, labels, old, o, double(n));
      ro.loss.backward();
      EXPECT_TRUE(std::isfinite(ro.loss.item<double>()));
      EXPECT_EQ(badRows(zo.grad()), 0);
      std::printf(
          "reverse_kl, %ld of %ld rows with top-k mass rounding to 1: %.6f with the log tail, "
          "%.6f without (a lower bound)\n",
          cancelled, n, r.loss.item<double>(), ro.loss.item<double>());
    }
  }
}

// The server's top-k output: the log tail is summed, not subtracted, and -inf when k = V.
TEST(Losses, ServerTopkOutputLogTail) {
  at::Tensor t = at::tensor({40.0, 0.0, 0.0, 1.0, 2.0, 3.0}, at::kFloat).view({2, 3});
  auto out = topkOutput(t, 1, 1.0);
  EXPECT_EQ(out.size(), 4u);
  EXPECT_FLOAT_EQ(out.at(protocol::kLogTail)[0].item<float>(), std::log(2.0f));
  EXPECT_FLOAT_EQ(out.at(protocol::kLogTail)[1].item<float>(), std::log(std::exp(1.0f) + std::exp(2.0f)));
  EXPECT_EQ(out.at(protocol::kLogsumexp)[0].item<float>(), 40.0f); // the tail is below its rounding
  EXPECT_EQ(out.at(protocol::kTopkIndices).scalar_type(), at::kInt);
  auto all = topkOutput(t, 3, 2.0);
  EXPECT_TRUE((all.at(protocol::kLogTail) == -kInf).all().item<bool>());
  EXPECT_THROW(topkOutput(t, 4, 1.0), ConfigError);
}

// Item 4: a term of weight 0 is not computed, so it cannot poison the loss.
TEST(Losses, ZeroWeightTermIsNotComputed) {
  Small s = smallProblem("dense", 1.0, 21);
  LossOptions o;
  o.chunk_tokens = 4;
  // Forward KL is infinite: the student rules out (-inf) a token the teacher likes.
  at::Tensor zInf = s.z.clone();
  zInf.select(1, 8).fill_(-kInf);
  at::Tensor labels = s.labels.clone();
  labels.masked_fill_(labels == 8, 0); // keep CE finite
  o.alpha = 0.3;
  EXPECT_FALSE(std::isfinite(distillLoss(zInf, labels, s.teacher, o, 5.0).kd.item<double>()));
  o.alpha = 0;
  for (const char* mode : {"dense", "topk_tail"}) {
    SCOPED_TRACE(mode);
    TeacherOutput teacher = smallProblem(mode, 1.0, 21).teacher;
    at::Tensor z = zInf.clone().requires_grad_(true);
    LossResult r = distillLoss(z, labels, teacher, o, 5.0);
    r.loss.backward();
    EXPECT_TRUE(std::isnan(r.kd.item<double>())); // "not computed"
    // Exactly the hard-label CE: value and gradient.
    at::Tensor zc = zInf.clone().requires_grad_(true);
    at::Tensor ce = at::cross_entropy_loss(zc, labels, {}, at::Reduction::Sum, -100) / 5.0;
    ce.backward();
    EXPECT_NEAR(r.loss.item<double>(), ce.item<double>(), 1e-14);
    EXPECT_NEAR(r.ce.item<double>(), ce.item<double>(), 1e-14);
    EXPECT_LT(maxAbs(z.grad(), zc.grad()), 1e-15);
  }
  // alpha = 1 with an infinite CE (the label's logit is -inf, and the teacher rules it out too).
  at::Tensor zl = s.z.clone();
  TeacherOutput teacher{LogitsAnswer{s.teacher.logits()->logits.clone()}};
  for (int64_t i = 0; i < s.labels.size(0); ++i) {
    const int64_t l = s.labels[i].item<int64_t>();
    if (l < 0) continue;
    zl[i][l] = -kInf;
    teacher.logits()->logits[i][l] = -kInf;
  }
  o.alpha = 0.5;
  EXPECT_FALSE(std::isfinite(distillLoss(zl, s.labels, teacher, o, 5.0).ce.item<double>()));
  o.alpha = 1;
  at::Tensor z = zl.clone().requires_grad_(true);
  LossResult r = distillLoss(z, s.labels, teacher, o, 5.0);
  r.loss.backward();
  EXPECT_TRUE(std::isnan(r.ce.item<double>()));
  EXPECT_TRUE(std::isfinite(r.loss.item<double>()));
  EXPECT_EQ(r.loss.item<double>(), r.kd.item<double>());
  EXPECT_TRUE(z.grad().isfinite().all().item<bool>());
}

// Item 5: a step whose labels are all ignored has a step token count of 0;
// each of its micro-batches gives a zero loss with a zero gradient.
TEST(Losses, StepWithoutTokensGivesZeroLoss) {
  for (const char* mode : {"dense", "topk", "topk_tail"}) {
    for (double alpha : {0.0, 0.5, 1.0}) {
      SCOPED_TRACE(std::string(mode) + " alpha " + std::to_string(alpha));
      Small s = smallProblem(mode, 2.0, 3);
      LossOptions o;
      o.alpha = alpha;
      o.temperature = 2.0;
      at::Tensor none = at::full_like(s.labels, -100);
      at::Tensor z = s.z.clone().requires_grad_(true);
      LossResult r = distillLoss(z, none, s.teacher, o, 0.0);
      EXPECT_EQ(r.tokens, 0);
      EXPECT_EQ(r.loss.item<double>(), 0.0);
      EXPECT_TRUE(r.loss.requires_grad());
      r.loss.backward();
      ASSERT_TRUE(z.grad().defined());
      EXPECT_EQ(z.grad().abs().max().item<double>(), 0.0);
      // kd and ce are 0, or NaN where their weight is 0 (not computed).
      EXPECT_EQ(std::isnan(r.kd.item<double>()), alpha == 0.0);
      EXPECT_EQ(std::isnan(r.ce.item<double>()), alpha == 1.0);
      if (alpha == 0.5) {
        EXPECT_EQ(r.kd.item<double>(), 0.0);
        EXPECT_EQ(r.ce.item<double>(), 0.0);
      }
      EXPECT_EQ(distillLoss(s.z, none, s.teacher, o, 0.0).loss.item<double>(), 0.0); // no grad
    }
  }
  // A normalizer of 0 with valid tokens is still an error, naming the count.
  Small s = smallProblem("dense", 1.0, 3);
  LossOptions o;
  try {
    distillLoss(s.z, s.labels, s.teacher, o, 0.0);
    ADD_FAILURE() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_NE(e.message().find("5 non-ignored token(s)"), std::string::npos) << e.message();
  }
  EXPECT_THROW(distillLoss(s.z, s.labels, s.teacher, o, -1.0), UsageError);
  EXPECT_THROW(distillLoss(s.z, s.labels, s.teacher, o, std::nan("")), UsageError);
}

// Item 6: a logsumexp that its own top-k contradicts is refused, naming the
// row and both values; rounding within the tolerance is not.
TEST(Losses, LogsumexpContradictingTheTopkIsRefused) {
  Small s = smallProblem("topk_tail", 1.0, 9);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor t = at::randn({6, 9}, gen, at::kDouble) * 2;
  auto [vals, idx] = t.topk(3, 1);
  LossOptions o;
  o.temperature = 1.0;
  for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
    for (bool withTail : {false, true}) {
      SCOPED_TRACE(std::string(kind) + (withTail ? " with log tail" : ""));
      o.kind = lossKind(kind);
      TeacherOutput good{TopkAnswer{vals, idx, at::logsumexp(t, 1), {}}};
      if (withTail) good.makeTopk().logTail = at::logsumexp(t.scatter(1, idx, -kInf), 1);
      EXPECT_NO_THROW(distillLoss(s.z, s.labels, good, o, 5.0));
      // What the top-k (and tail) say the logsumexp is.
      at::Tensor said = at::logsumexp(vals, 1);
      if (withTail) said = at::logaddexp(said, good.topk()->logTail);
      // Rounding within the tolerance (1e-4 in log space): accepted, renormalised.
      TeacherOutput close = good;
      close.makeTopk().logsumexp = said - 0.5e-4;
      EXPECT_NO_THROW(distillLoss(s.z, s.labels, close, o, 5.0));
      // Sent at T = 2 while the loss uses T = 1: the top-k "probabilities" sum above 1.
      TeacherOutput wrongT = good;
      wrongT.makeTopk().logsumexp = at::logsumexp(t / 2.0, 1);
      const int64_t first = (said - wrongT.topk()->logsumexp > 1e-3).nonzero()[0][0].item<int64_t>();
      std::string m = expectThrow<ProtocolError>([&] { distillLoss(s.z, s.labels, wrongT, o, 5.0); });
      EXPECT_NE(m.find("token row " + std::to_string(first) + " of 6"), std::string::npos) << m;
      std::ostringstream sent;
      sent << "the sent logsumexp " << wrongT.topk()->logsumexp[first].item<double>() << " contradicts";
      EXPECT_NE(m.find(sent.str()), std::string::npos) << m;
      EXPECT_NE(m.find("another temperature"), std::string::npos) << m;
      // Only just beyond the tolerance, on one valid row.
      TeacherOutput off = good;
      off.makeTopk().logsumexp = good.topk()->logsumexp.clone();
      off.topk()->logsumexp[4] = said[4] - 2e-4;
      m = expectThrow<ProtocolError>([&] { distillLoss(s.z, s.labels, off, o, 5.0); });
      EXPECT_NE(m.find("token row 4 of 6"), std::string::npos) << m;
      // ... but not on an ignored row (s.labels[2] is ignored), nor a NaN there.
      TeacherOutput ignored = good;
      ignored.makeTopk().logsumexp = good.topk()->logsumexp.clone();
      ignored.topk()->logsumexp[2] = std::nan("");
      EXPECT_NO_THROW(distillLoss(s.z, s.labels, ignored, o, 5.0));
      TeacherOutput nan = good;
      nan.makeTopk().logsumexp = good.topk()->logsumexp.clone();
      nan.topk()->logsumexp[1] = std::nan("");
      expectThrow<ProtocolError>([&] { distillLoss(s.z, s.labels, nan, o, 5.0); });
      if (withTail) {
        // With the tail the two must agree both ways: a logsumexp too large is refused too.
        TeacherOutput big = good;
        big.makeTopk().logsumexp = good.topk()->logsumexp + 1e-3;
        expectThrow<ProtocolError>([&] { distillLoss(s.z, s.labels, big, o, 5.0); });
      }
    }
  }
}

} // namespace
} // namespace distill
