// Sampled targets are unbiased and top-k at the same bytes is not: the forward-
// KL gradient averaged over M independent answers of K draws converges to the
// exact full-vocabulary gradient p_S - q within 4 standard errors of the mean
// (the tolerance, from the estimator's covariance (diag q - q q^T) / (K M)),
// while top-k with its exact tail, at no more bytes per token, is off by more
// than that tolerance (its error is a bias: no draws to average). And
// fusedLinearLoss equals distillLoss on materialised logits for the new
// signals.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "distill/loss/losses.h"

namespace distill {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double l2(const at::Tensor& t) { return t.norm().item<double>(); }

// A Zipf-like teacher (q_j ~ rank^-1.1, ranks shuffled over the ids: entropy
// ~4.3 nats at V = 512) and a student near it with its own tail shape.
struct Dists {
  at::Tensor t, z; // [V] teacher and student logits
};

Dists zipf(int64_t v, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor rank = at::randperm(v, gen, at::kLong).to(at::kDouble).add_(1);
  Dists d;
  d.t = rank.log().mul_(-1.1);
  d.z = d.t + at::randn({v}, gen, at::kDouble) * 0.8;
  return d;
}

at::Tensor meanGradient(const at::Tensor& z, const TeacherOutput& teacher, int64_t rows) {
  LossOptions o;
  o.alpha = 1;
  at::Tensor zz = z.expand({rows, z.size(0)}).contiguous().requires_grad_(true);
  distillLoss(zz, at::zeros({rows}, at::kLong), teacher, o, double(rows)).loss.backward();
  return zz.grad().sum(0); // each row's gradient / rows: the mean
}

TEST(SignalsStats, SampledTargetsAreUnbiasedAndTopkAtTheSameBytesIsNot) {
  const int64_t v = 512, kk = 8, m = 20000;
  Dists d = zipf(v, 1);
  at::Tensor q = at::softmax(d.t, 0), p = at::softmax(d.z, 0);
  at::Tensor exact = p - q;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  at::Tensor draws = at::multinomial(q.expand({m, v}), kk, /*replacement=*/true, gen).to(at::kInt);
  at::Tensor sampled = meanGradient(d.z, TeacherOutput{SampledAnswer{draws, at::ones({m, kk}, at::kShort)}}, m);
  const double rmsErr = std::sqrt((1 - (q * q).sum().item<double>()) / double(kk * m));
  const double tol = 4 * rmsErr / l2(exact);
  const double sampledErr = l2(sampled - exact) / l2(exact);
  // Top-k: 6 bytes per entry (bfloat16 value, int32 index) + 8 (logsumexp, log tail) <= 6 K.
  const int64_t k = (6 * kk - 8) / 6;
  auto [vals, idx] = d.t.unsqueeze(0).topk(k, 1);
  TopkAnswer topk{vals, idx.to(at::kInt), at::logsumexp(d.t, 0).reshape({1}),
                  at::logsumexp(d.t.unsqueeze(0).scatter(1, idx, -kInf), 1)};
  const double topkErr = l2(meanGradient(d.z, TeacherOutput{topk}, 1) - exact) / l2(exact);
  std::printf("V %lld: sampled K=%lld over %lld draws: relative error %.4f (tolerance %.4f); top-%lld: %.4f\n",
              (long long)v, (long long)kk, (long long)m, sampledErr, tol, (long long)k, topkErr);
  EXPECT_LT(sampledErr, tol);
  EXPECT_GT(topkErr, tol) << "top-k's bias is within the tolerance: the test would not tell them apart";
  EXPECT_GT(topkErr, 10 * sampledErr);
}

struct Head {
  at::Tensor h, w, b;
};

TEST(SignalsStats, FusedLinearLossEqualsTheMaterialisedLoss) {
  const int64_t n = 10, dim = 5, v = 11;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor h = at::randn({n, dim}, gen, at::kDouble), w = at::randn({v, dim}, gen, at::kDouble);
  at::Tensor b = at::randn({v}, gen, at::kDouble), t = at::randn({n, v}, gen, at::kDouble) * 2;
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  labels[3] = -100;
  at::Tensor z = at::addmm(b, h, w.t());
  at::Tensor ids = std::get<1>(z.topk(4, 1));
  at::Tensor x = ids.narrow(1, 0, 1);
  at::Tensor draws = at::multinomial(at::softmax(t / 1.5, 1), 8, true, gen).to(at::kInt);
  struct Signal {
    TeacherOutput teacher;
    LossKind kind;
  };
  const Signal signals[] = {
      {TeacherOutput{IdsAnswer{t.gather(1, ids), at::logsumexp(t / 1.5, 1),
                               at::logsumexp((t / 1.5).scatter(1, ids, -kInf), 1), ids, {}}},
       LossKind::kReverseKl},
      {TeacherOutput{IdsAnswer{t.gather(1, x), at::logsumexp(t / 1.5, 1), {}, x, at::randn({n}, gen, at::kDouble)}},
       LossKind::kSampledToken},
      {TeacherOutput{SampledAnswer{draws, at::ones({n, 8}, at::kShort)}}, LossKind::kForwardKl},
  };
  for (const Signal& s : signals) {
    LossOptions o;
    o.kind = s.kind;
    o.temperature = 1.5;
    o.alpha = 0.7;
    Head a{h.clone().requires_grad_(true), w.clone().requires_grad_(true), b.clone().requires_grad_(true)};
    Head f{h.clone().requires_grad_(true), w.clone().requires_grad_(true), b.clone().requires_grad_(true)};
    LossResult ra = distillLoss(at::addmm(a.b, a.h, a.w.t()), labels, s.teacher, o, 9);
    LossResult rf = fusedLinearLoss(f.h, f.w, f.b, labels, s.teacher, o, 9, /*chunkTokens=*/4);
    ra.loss.backward();
    rf.loss.backward();
    EXPECT_NEAR(rf.loss.item<double>(), ra.loss.item<double>(), 1e-12) << int(s.kind);
    for (auto [x1, x2] : {std::pair{a.h, f.h}, {a.w, f.w}, {a.b, f.b}}) {
      EXPECT_LT((x1.grad() - x2.grad()).abs().max().item<double>(), 1e-12) << int(s.kind);
    }
  }
}

} // namespace
} // namespace distill
