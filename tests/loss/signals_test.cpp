// The losses of issue 44's signals (losses.h: "Ids answers", loss.kind
// sampled_token, "Sampled targets"), in float64 against their closed forms
// written out here: value and gradient to 1e-12; the sampled-token gradient's
// expectation under the student equals the exact reverse-KL gradient; the
// sampled targets' gradient averaged over many draws converges to the exact
// forward-KL gradient within a stated tolerance, which top-k at the same bytes
// misses; the refusals; fusedLinearLoss equal to distillLoss for each.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "distill/core/errors.h"
#include "distill/loss/losses.h"
#include "losses_test_util.h"
#include "support/expect_throw.h"

namespace distill {
namespace {

using namespace loss_testing;
using testing::expectThrow;

constexpr int64_t kN = 6, kV = 9;

struct Case {
  at::Tensor z, t, labels; // [N, V] student and teacher logits, labels (one ignored)
};

Case makeCase(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Case c;
  c.z = at::randn({kN, kV}, gen, at::kDouble) * 1.5;
  c.t = at::randn({kN, kV}, gen, at::kDouble) * 2;
  c.labels = at::randint(0, kV, {kN}, gen, at::kLong);
  c.labels[2] = -100;
  return c;
}

LossOptions opts(LossKind kind, double t, double alpha) {
  LossOptions o;
  o.kind = kind;
  o.temperature = t;
  o.alpha = alpha;
  o.chunk_tokens = 4; // two chunks
  return o;
}

struct Got {
  double loss, kd;
  at::Tensor grad;
};

Got run(const at::Tensor& z0, const at::Tensor& labels, const TeacherOutput& t, const LossOptions& o, double norm) {
  at::Tensor z = z0.clone().requires_grad_(true);
  LossResult r = distillLoss(z, labels, t, o, norm);
  r.loss.backward();
  return {r.loss.item<double>(), r.kd.item<double>(), z.grad()};
}

// The hard-label part of the closed forms: (1 - alpha) (softmax(z) - onehot) / norm on valid rows.
at::Tensor ceGrad(const Case& c, const at::Tensor& valid, double alpha, double norm) {
  at::Tensor g = at::softmax(c.z, 1);
  for (int64_t r = 0; r < kN; ++r) {
    if (valid[r].item<bool>()) g[r][c.labels[r].item<int64_t>()] -= 1;
  }
  return g.mul_(valid.unsqueeze(1)).mul_((1 - alpha) / norm);
}

double ceSum(const Case& c, const at::Tensor& valid) {
  at::Tensor logp = at::log_softmax(c.z, 1);
  double s = 0;
  for (int64_t r = 0; r < kN; ++r) {
    if (valid[r].item<bool>()) s -= logp[r][c.labels[r].item<int64_t>()].item<double>();
  }
  return s;
}

// Reverse KL over the student's top-k + tail bucket, and its gradient, by hand.
TEST(Signals, IdsReverseKlOnTheStudentsTopkIsTheBucketClosedForm) {
  for (double temp : {1.0, 2.0}) {
    Case c = makeCase(3);
    const int64_t k = 3;
    at::Tensor ids = std::get<1>(c.z.topk(k, 1));
    at::Tensor s = c.z / temp, tt = c.t / temp;
    IdsAnswer a{c.t.gather(1, ids), at::logsumexp(tt, 1), at::logsumexp(tt.scatter(1, ids, -kInf), 1),
                ids.to(at::kInt), {}};
    const double alpha = 0.6, norm = 7;
    Got got = run(c.z, c.labels, TeacherOutput{a}, opts(LossKind::kReverseKl, temp, alpha), norm);

    at::Tensor p = at::softmax(s, 1), q = at::softmax(tt, 1);
    at::Tensor pb = at::cat({p.gather(1, ids), (1 - p.gather(1, ids).sum(1, true))}, 1);
    at::Tensor qb = at::cat({q.gather(1, ids), (1 - q.gather(1, ids).sum(1, true))}, 1);
    at::Tensor kl = (pb * (pb / qb).log()).sum(1); // [N]
    at::Tensor valid = c.labels != -100;
    const double kdSum = (kl * valid).sum().item<double>();
    const double want = (alpha * temp * temp * kdSum + (1 - alpha) * ceSum(c, valid)) / norm;
    EXPECT_NEAR(got.loss, want, 1e-12 * std::abs(want)) << "T " << temp;
    // d KL / d s_j = p_j (log(P_b / Q_b) - KL), b the bucket of token j.
    at::Tensor bucketOf = at::full({kN, kV}, k, at::kLong).scatter(1, ids, at::arange(k).expand({kN, k}).contiguous());
    at::Tensor logRatio = (pb / qb).log().gather(1, bucketOf);
    at::Tensor g = (p * (logRatio - kl.unsqueeze(1))).mul_(valid.unsqueeze(1)).mul_(alpha * temp / norm);
    g.add_(ceGrad(c, valid, alpha, norm));
    EXPECT_LT(maxAbs(got.grad, g), 1e-13) << "T " << temp;
    // Never above the full reverse KL: the bucketing drops P_tail KL(p|tail || q|tail) >= 0.
    at::Tensor full = (p * (p / q).log()).sum(1);
    EXPECT_TRUE((kl <= full + 1e-15).all().item<bool>());
    EXPECT_GT((full - kl).max().item<double>(), 1e-3) << "the student's tail holds mass here";
  }
}

// Where the student's mass is all on its top-k, the bucket reverse KL is the full one.
TEST(Signals, IdsReverseKlIsExactWhereTheStudentsMassIs) {
  Case c = makeCase(4);
  const int64_t k = 4;
  at::Tensor ids = std::get<1>(c.z.topk(k, 1));
  at::Tensor z = at::full_like(c.z, -kInf).scatter(1, ids, c.z.gather(1, ids)); // no mass outside
  IdsAnswer a{c.t.gather(1, ids), at::logsumexp(c.t, 1), at::logsumexp(c.t.scatter(1, ids, -kInf), 1),
              ids.to(at::kInt), {}};
  at::Tensor labels = at::full({kN}, 0, at::kLong).copy_(ids.select(1, 0)); // no -inf label
  Got got = run(z, labels, TeacherOutput{a}, opts(LossKind::kReverseKl, 1.0, 1.0), kN);
  at::Tensor p = at::softmax(z, 1), logq = at::log_softmax(c.t, 1);
  at::Tensor full = (p * (at::log_softmax(z, 1) - logq)).masked_fill_(p == 0, 0).sum();
  EXPECT_NEAR(got.kd, full.item<double>() / kN, 1e-13);
  EXPECT_TRUE(at::isfinite(got.grad).all().item<bool>());
}

TEST(Signals, SampledTokenIsThePolicyGradientOfTheReverseKlEstimate) {
  for (bool weighted : {false, true}) {
    for (double temp : {1.0, 1.5}) {
      Case c = makeCase(5);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
      at::Tensor x = at::randint(0, kV, {kN, 1}, gen, at::kLong);
      at::Tensor s = c.z / temp, tt = c.t / temp;
      at::Tensor logp = at::log_softmax(s, 1).gather(1, x).squeeze(1);
      // Sampling log-probs that put the ratio on both sides of the truncation at 2.
      at::Tensor logSample = logp + at::tensor({0.5, -1.0, 0.2, -0.3, 1.0, -2.0}, at::kDouble);
      IdsAnswer a{c.t.gather(1, x), at::logsumexp(tt, 1), {}, x.to(at::kInt), weighted ? logSample : at::Tensor()};
      const double alpha = 0.7, norm = 9;
      Got got = run(c.z, c.labels, TeacherOutput{a}, opts(LossKind::kSampledToken, temp, alpha), norm);

      at::Tensor d = logp - at::log_softmax(tt, 1).gather(1, x).squeeze(1);
      at::Tensor r = weighted ? (logp - logSample).exp().clamp_max(kSampledTokenMaxRatio) : at::ones_like(d);
      if (weighted) EXPECT_EQ(r.eq(kSampledTokenMaxRatio).sum().item<int64_t>(), 2) << "two ratios truncated";
      at::Tensor valid = c.labels != -100;
      const double kdSum = (r * d * valid).sum().item<double>();
      EXPECT_NEAR(got.kd, temp * temp * kdSum / norm, 1e-13);
      const double want = (alpha * temp * temp * kdSum + (1 - alpha) * ceSum(c, valid)) / norm;
      EXPECT_NEAR(got.loss, want, 1e-13);
      at::Tensor onehot = at::zeros_like(c.z).scatter_(1, x, 1.0);
      at::Tensor g = (onehot - at::softmax(s, 1)).mul_((r * d * valid).unsqueeze(1)).mul_(alpha * temp / norm);
      g.add_(ceGrad(c, valid, alpha, norm));
      EXPECT_LT(maxAbs(got.grad, g), 1e-13) << "weighted " << weighted << " T " << temp;
    }
  }
}

// Sum over x of p_S(x) times the gradient with x sampled = the exact reverse-KL gradient.
TEST(Signals, SampledTokenGradientsExpectationIsTheReverseKlGradient) {
  Case c = makeCase(6);
  const double temp = 1.3;
  at::Tensor z = c.z[0].expand({kV, kV}).contiguous(), t = c.t[0].expand({kV, kV}).contiguous();
  at::Tensor x = at::arange(kV).unsqueeze(1); // row j samples token j
  IdsAnswer a{t.gather(1, x), at::logsumexp(t / temp, 1), {}, x, {}};
  Got got = run(z, x.squeeze(1), TeacherOutput{a}, opts(LossKind::kSampledToken, temp, 1.0), 1.0);
  at::Tensor p = at::softmax(c.z[0] / temp, 0), logq = at::log_softmax(c.t[0] / temp, 0);
  at::Tensor expected = (got.grad * p.unsqueeze(1)).sum(0); // E_x~p [grad(x)]
  at::Tensor kl = (p * (p.log() - logq)).sum();
  at::Tensor exact = p * (p.log() - logq - kl) * temp; // d (T^2 KL) / dz
  EXPECT_LT(maxAbs(expected, exact), 1e-14);
}

TEST(Signals, SampledTargetsGradientIsSoftmaxMinusCountsOverK) {
  Case c = makeCase(7);
  const double temp = 2.0, alpha = 0.8, norm = 5;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const int64_t kk = 8;
  at::Tensor draws = at::multinomial(at::softmax(c.t / temp, 1), kk, /*replacement=*/true, gen);
  at::Tensor counts = at::zeros({kN, kV}, at::kDouble).scatter_add_(1, draws, at::ones({kN, kk}, at::kDouble));
  // Sent as every id with its count (zeros are padding): [N, V] ids, int16 counts.
  at::Tensor ids = at::arange(kV, at::kInt).expand({kN, kV}).contiguous();
  SampledAnswer a{ids, counts.to(at::kShort)};
  Got got = run(c.z, c.labels, TeacherOutput{a}, opts(LossKind::kForwardKl, temp, alpha), norm);
  at::Tensor valid = c.labels != -100, w = counts / kk;
  at::Tensor logp = at::log_softmax(c.z / temp, 1);
  const double kdSum = -(w * logp).sum(1).mul(valid).sum().item<double>();
  EXPECT_NEAR(got.kd, temp * temp * kdSum / norm, 1e-13);
  EXPECT_NEAR(got.loss, (alpha * temp * temp * kdSum + (1 - alpha) * ceSum(c, valid)) / norm, 1e-13);
  at::Tensor g = (logp.exp() - w).mul_(valid.unsqueeze(1)).mul_(alpha * temp / norm).add_(ceGrad(c, valid, alpha, norm));
  EXPECT_LT(maxAbs(got.grad, g), 1e-14);
}

TEST(Signals, ReverseKlJsdAndSampledTokenRefuseSampledTargets) {
  Case c = makeCase(8);
  SampledAnswer a{at::zeros({kN, 2}, at::kInt), at::full({kN, 2}, 4, at::kShort)};
  for (LossKind k : {LossKind::kReverseKl, LossKind::kJsd}) {
    std::string m = expectThrow<ConfigError>([&] { run(c.z, c.labels, TeacherOutput{a}, opts(k, 1.0, 0.5), kN); });
    EXPECT_NE(m.find("no unbiased estimate"), std::string::npos) << m;
    EXPECT_NE(m.find("use loss.kind forward_kl"), std::string::npos) << m;
  }
  std::string m0 = expectThrow<ConfigError>(
      [&] { run(c.z, c.labels, TeacherOutput{a}, opts(LossKind::kSampledToken, 1.0, 0.5), kN); });
  EXPECT_NE(m0.find("sampled_token needs ids answers"), std::string::npos) << m0;
  at::Tensor vals, idx;
  std::tie(vals, idx) = c.t.topk(3, 1);
  std::string m = expectThrow<ConfigError>([&] { run(c.z, c.labels, TeacherOutput{TopkAnswer{vals, idx, {}, {}}},
                                               opts(LossKind::kSampledToken, 1.0, 0.5), kN); });
  EXPECT_NE(m.find("sampled_token needs ids answers"), std::string::npos) << m;
  IdsAnswer noIds{vals, at::logsumexp(c.t, 1), {}, {}, {}};
  m = expectThrow<ProtocolError>([&] { run(c.z, c.labels, TeacherOutput{noIds}, opts(LossKind::kReverseKl, 1.0, 0.5), kN); });
  EXPECT_NE(m.find("IdsAnswer::ids"), std::string::npos) << m;
  IdsAnswer three{vals, at::logsumexp(c.t, 1), {}, idx, {}};
  m = expectThrow<ProtocolError>([&] { run(c.z, c.labels, TeacherOutput{three}, opts(LossKind::kSampledToken, 1.0, 0.5), kN); });
  EXPECT_NE(m.find("one id per token"), std::string::npos) << m;
  SampledAnswer bad{at::full({kN, 2}, kV, at::kInt), at::full({kN, 2}, 4, at::kShort)};
  m = expectThrow<ProtocolError>([&] { run(c.z, c.labels, TeacherOutput{bad}, opts(LossKind::kForwardKl, 1.0, 0.5), kN); });
  EXPECT_NE(m.find("every id must be in [0, 9)"), std::string::npos) << m;
}

} // namespace
} // namespace distill
