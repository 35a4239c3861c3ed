// The losses on a GPU (skipped with the reason where no CUDA device is visible):
// the CUDA row kernel (loss/src/cuda/loss_rows.cu) under fusedLinearLoss and
// distillLoss, and the ATen-op path on CUDA, against the float64 CPU path on the
// same (rounded) values, for every kind, teacher form (dense; top-k alone, with
// logsumexp, with log tail), alpha, temperature, logits dtype, ignored labels
// and loss.vocab truncate. Targets (issue 41): the loss within 1e-3 relative,
// the gradients within the dtype's rounding (max error over max value).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <limits>
#include <string>

#include "distill/core/options.h"
#include "distill/loss/losses.h"

namespace distill {
namespace {

double relErr(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  const double err = (a.cpu().to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  return scale == 0 ? err : err / scale;
}

// The gradient tolerance of a logits dtype: a few units of its rounding.
double gradTol(at::ScalarType dt) {
  if (dt == at::kBFloat16) return 3e-2;
  if (dt == at::kHalf) return 5e-3;
  return 2e-4;
}

// Teacher output from float64 logits t [N, Vt] in the form `mode`, on `device`, values of dtype `dt`.
TeacherOutput teacherFor(const std::string& mode, const at::Tensor& t, double temperature, at::ScalarType dt,
                         const at::Device& device) {
  if (mode == "dense") return TeacherOutput{LogitsAnswer{t.to(dt).to(device)}, t.size(1)};
  const int64_t k = 16;
  auto [vals, idx] = t.topk(k, 1);
  TeacherOutput out{TopkAnswer{vals.to(at::kFloat).to(device), idx.to(device), {}, {}}, t.size(1)};
  if (mode == "topk_lse" || mode == "topk_tail") out.makeTopk().logsumexp = at::logsumexp(t / temperature, 1).to(at::kFloat);
  if (mode == "topk_tail") {
    at::Tensor rest = (t / temperature).scatter(1, idx, -std::numeric_limits<double>::infinity());
    out.makeTopk().logTail = at::logsumexp(rest, 1).to(at::kFloat);
  }
  for (at::Tensor* x : out.tensors()) {
    if (x->defined()) *x = x->to(device);
  }
  return out;
}

// The float64 reference of a teacher sent in a coarser dtype: the same rounded values.
TeacherOutput asDouble(const TeacherOutput& t) {
  TeacherOutput out = t;
  for (at::Tensor* x : out.tensors()) {
    if (x->defined()) *x = x->cpu().to(at::kDouble);
  }
  if (TopkAnswer* k = out.topk(); k && k->indices.defined()) k->indices = t.topk()->indices.cpu(); // ids stay ids
  return out;
}

struct Case {
  std::string kind, mode;
  double alpha, temperature;
  at::ScalarType dt;
  bool truncate; // the teacher has 24 more ids than the student (padding, low logits)
};

std::string name(const Case& c) {
  return c.kind + " " + c.mode + " alpha " + std::to_string(c.alpha) + " T " + std::to_string(c.temperature) + " " +
      std::string(c10::toString(c.dt)) + (c.truncate ? " truncate" : "");
}

// fusedLinearLoss (aten: its ATen-op path) on CUDA against float64 on the CPU.
void checkFusedLinear(const Case& c, bool aten, double& worstLoss, double& worstGrad) {
  const int64_t n = 333, d = 64, v = 1000, vt = c.truncate ? v + 24 : v;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  at::Tensor h64 = at::randn({n, d}, gen, at::kDouble).to(c.dt).to(at::kDouble);
  at::Tensor w64 = (at::randn({v, d}, gen, at::kDouble) * 0.3).to(c.dt).to(at::kDouble);
  at::Tensor t = at::randn({n, vt}, gen, at::kDouble) * 2;
  if (c.truncate) t.narrow(1, v, vt - v).fill_(-30); // padding ids: negligible mass
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  labels.narrow(0, 40, 70).fill_(-100);
  labels[5] = -100;
  LossOptions o;
  o.kind = parseEnum<LossKind>(c.kind).value();
  o.alpha = c.alpha;
  o.temperature = c.temperature;
  if (c.truncate) o.vocab = LossVocab::kTruncate;
  const double tokens = 262;
  TeacherOutput tg = teacherFor(c.mode, t, c.temperature, c.dt, at::kCUDA);
  at::Tensor hr = h64.clone().requires_grad_(true), wr = w64.clone().requires_grad_(true);
  LossResult want = fusedLinearLoss(hr, wr, at::Tensor(), labels, asDouble(tg), o, tokens, 0);
  want.loss.backward();
  at::Tensor hg = h64.to(c.dt).to(at::kCUDA).requires_grad_(true), wg = w64.to(c.dt).to(at::kCUDA).requires_grad_(true);
  at::Tensor lg = labels.to(at::kCUDA);
  LossResult got = aten ? detail::fusedLinearLossAtenOps(hg, wg, at::Tensor(), lg, tg, o, tokens, 64)
                        : fusedLinearLoss(hg, wg, at::Tensor(), lg, tg, o, tokens, 64);
  got.loss.backward();
  const double el = relErr(got.loss, want.loss);
  const double eg = std::max(relErr(hg.grad(), hr.grad()), relErr(wg.grad(), wr.grad()));
  worstLoss = std::max(worstLoss, el);
  worstGrad = std::max(worstGrad, eg);
  EXPECT_LE(el, 1e-3) << name(c) << (aten ? " aten" : " kernel") << ": loss " << got.loss.item<double>() << " vs "
                      << want.loss.item<double>();
  EXPECT_LE(eg, gradTol(c.dt)) << name(c) << (aten ? " aten" : " kernel") << ": gradients";
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(wg.grad().scalar_type(), c.dt);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
    for (const char* mode : {"dense", "topk", "topk_lse", "topk_tail"}) {
      if (std::string(kind) == "reverse_kl" && std::string(mode) == "topk") continue; // a ConfigError
      for (double alpha : {0.5, 1.0, 0.0}) {
        for (double temp : {1.0, 2.0}) {
          out.push_back({kind, mode, alpha, temp, at::kBFloat16, false});
        }
      }
      out.push_back({kind, mode, 0.5, 2.0, at::kHalf, false});
      out.push_back({kind, mode, 0.5, 2.0, at::kFloat, false});
      out.push_back({kind, mode, 0.5, 1.0, at::kBFloat16, true});
    }
  }
  return out;
}

TEST(CudaLoss, FusedLinearMatchesFloat64EveryKind) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  double worstLoss = 0, worstGrad = 0;
  int n = 0;
  for (const Case& c : cases()) {
    for (bool aten : {false, true}) {
      checkFusedLinear(c, aten, worstLoss, worstGrad);
      ++n;
    }
  }
  std::printf("%d cases: worst loss rel %.3g, worst gradient rel %.3g\n", n, worstLoss, worstGrad);
}

// distillLoss on CUDA logits (the row kernel writes a separate gradient there).
TEST(CudaLoss, DistillLossMatchesFloat64EveryKind) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const int64_t n = 77, v = 3000;
  for (const Case& c : cases()) {
    if (c.truncate) continue;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor z64 = (at::randn({n, v}, gen, at::kDouble) * 3).to(c.dt).to(at::kDouble);
    at::Tensor t = at::randn({n, v}, gen, at::kDouble) * 2;
    at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
    labels.narrow(0, 3, 9).fill_(-100);
    LossOptions o;
    o.kind = parseEnum<LossKind>(c.kind).value();
    o.alpha = c.alpha;
    o.temperature = c.temperature;
    TeacherOutput tg = teacherFor(c.mode, t, c.temperature, c.dt, at::kCUDA);
    at::Tensor zr = z64.clone().requires_grad_(true);
    LossResult want = distillLoss(zr, labels, asDouble(tg), o, 68);
    want.loss.backward();
    at::Tensor zg = z64.to(c.dt).to(at::kCUDA).requires_grad_(true);
    LossResult got = distillLoss(zg, labels.to(at::kCUDA), tg, o, 68);
    got.loss.backward();
    EXPECT_LE(relErr(got.loss, want.loss), 1e-3) << name(c);
    if (c.alpha > 0) EXPECT_LE(relErr(got.kd, want.kd), 1e-3) << name(c);
    if (c.alpha < 1) EXPECT_LE(relErr(got.ce, want.ce), 1e-3) << name(c);
    EXPECT_LE(relErr(zg.grad(), zr.grad()), gradTol(c.dt)) << name(c);
  }
}

// A top-k teacher whose entries reach ids the student lacks (loss.vocab truncate's null buckets).
TEST(CudaLoss, TruncatedTopkWithDroppedEntries) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const int64_t n = 50, v = 500, vt = 512;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor z64 = (at::randn({n, v}, gen, at::kDouble) * 2).to(at::kBFloat16).to(at::kDouble);
  at::Tensor t = at::randn({n, vt}, gen, at::kDouble) * 2;
  t.narrow(1, v, vt - v).fill_(-3); // dropped ids inside some top-16 rows' tails, mass small
  t.select(0, 0)[v + 3] = 4.0; // row 0: a dropped id in its top-k
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  LossOptions o;
  o.vocab = LossVocab::kTruncate;
  o.max_truncated_mass = 0.9;
  for (const char* mode : {"topk", "topk_lse", "topk_tail"}) {
    TeacherOutput tg = teacherFor(mode, t, 1.0, at::kBFloat16, at::kCUDA);
    at::Tensor zr = z64.clone().requires_grad_(true);
    LossResult want = distillLoss(zr, labels, asDouble(tg), o, n);
    want.loss.backward();
    at::Tensor zg = z64.to(at::kBFloat16).to(at::kCUDA).requires_grad_(true);
    LossResult got = distillLoss(zg, labels.to(at::kCUDA), tg, o, n);
    got.loss.backward();
    EXPECT_LE(relErr(got.loss, want.loss), 1e-3) << mode;
    EXPECT_LE(relErr(zg.grad(), zr.grad()), gradTol(at::kBFloat16)) << mode;
  }
}

} // namespace
} // namespace distill
