// Distillation losses: values and gradients against an independent Python
// reference, finite differences, gradient accumulation with a global token
// normalizer. One test, losses_test, with error reporting in
// losses_errors_test.cpp and the fused kernel and the memory bound of the
// chunked loss in losses_kernel_test.cpp.

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

// ---- the Python reference -------------------------------------------------

struct Case {
  std::string name, kind, mode;
  double temperature = 1, beta = 0.5, alpha = 0.5;
  std::string dtype = "f64", check = "exact"; // edge cases: precision to run in, exact | bound
  std::map<std::string, at::Tensor> t;
};

// Reads the records written by reference.py: "name dtype ndim dims...\n" + raw bytes.
std::map<std::string, at::Tensor> readRecords(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::map<std::string, at::Tensor> out;
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream is(line);
    std::string name, code;
    int ndim = 0;
    is >> name >> code >> ndim;
    std::vector<int64_t> shape(ndim);
    for (auto& d : shape) is >> d;
    auto dtype = code == "f64" ? at::kDouble : code == "i64" ? at::kLong : at::kInt;
    at::Tensor t = at::empty(shape, dtype);
    f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    out[name] = t;
  }
  return out;
}

// Runs reference.py with `args` and reads the cases it lists: the random ones
// (cases.txt), or with --edge the exact edge cases (edge_cases.txt, with two
// more columns: dtype and check).
std::vector<Case> pythonCases(const std::string& args, bool edge = false) {
  char dirTemplate[] = "/tmp/distill_losses_XXXXXX";
  const char* dir = mkdtemp(dirTemplate);
  EXPECT_NE(dir, nullptr);
  std::string cmd = std::string(DISTILL_TEST_PYTHON) + " " + DISTILL_LOSSES_REFERENCE + " " + args + " --out " + dir;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<Case> cases;
  const std::string listPath = std::string(dir) + (edge ? "/edge_cases.txt" : "/cases.txt");
  std::ifstream list(listPath);
  std::string path;
  Case c;
  while (list >> c.name >> c.kind >> c.temperature >> c.beta >> c.alpha >> c.mode) {
    if (edge) list >> c.dtype >> c.check;
    list >> path;
    c.t = readRecords(path);
    cases.push_back(c);
    std::remove(path.c_str());
  }
  std::remove(listPath.c_str());
  rmdir(dir);
  return cases;
}

std::vector<Case> pythonCases(int seed) {
  return pythonCases("--seed " + std::to_string(seed) + " --batch 2 --seq 19 --vocab 101 --topk 8");
}

TeacherOutput teacherOf(const Case& c, at::ScalarType dtype) {
  TeacherOutput t;
  auto get = [&](const char* n) {
    auto it = c.t.find(n);
    return it == c.t.end() ? at::Tensor() : it->second;
  };
  if (auto l = get("teacher_logits"); l.defined()) t.makeLogits().logits = l.to(dtype);
  if (auto v = get("teacher_values"); v.defined()) t.makeTopk().values = v.to(dtype);
  if (auto i = get("teacher_indices"); i.defined()) t.makeTopk().indices = i;
  if (auto l = get("teacher_lse"); l.defined()) t.makeTopk().logsumexp = l.to(dtype);
  if (auto l = get("teacher_log_tail"); l.defined()) t.makeTopk().logTail = l.to(dtype);
  return t;
}

LossOptions optionsOf(const Case& c, int64_t chunk) {
  LossOptions o;
  o.kind = lossKind(c.kind);
  o.temperature = c.temperature;
  o.jsd_beta = c.beta;
  o.alpha = c.alpha;
  o.chunk_tokens = chunk;
  return o;
}

TEST(Losses, MatchPythonReference) {
  std::vector<Case> cases = pythonCases(20240611);
  ASSERT_EQ(cases.size(), 22u);
  double worstLoss64 = 0, worstGrad64 = 0, worstLoss32 = 0, worstGrad32 = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const double norm = c.t.at("normalizer").item<double>();
    const at::Tensor& labels = c.t.at("labels");
    ASSERT_GT(labels.numel() - countTokens(labels, -100), 0); // some tokens are ignored
    // Chunks smaller than N (38 tokens, ~27 valid) and not dividing it, 1, and all at once.
    for (int64_t chunk : {7, 1, 1000}) {
      at::Tensor z = c.t.at("student").clone().requires_grad_(true);
      LossResult r = distillLoss(z, labels, teacherOf(c, at::kDouble), optionsOf(c, chunk), norm);
      r.loss.backward();
      const double el = std::abs(r.loss.item<double>() - c.t.at("ref_loss").item<double>());
      const double ek = std::abs(r.kd.item<double>() - c.t.at("ref_kd").item<double>());
      const double ec = std::abs(r.ce.item<double>() - c.t.at("ref_ce").item<double>());
      const double eg = maxAbs(z.grad(), c.t.at("ref_grad"));
      EXPECT_LT(el, 1e-12);
      EXPECT_LT(ek, 1e-12);
      EXPECT_LT(ec, 1e-12);
      EXPECT_LT(eg, 1e-8);
      EXPECT_EQ(r.tokens, countTokens(labels, -100));
      worstLoss64 = std::max({worstLoss64, el, ek, ec});
      worstGrad64 = std::max(worstGrad64, eg);
    }
    // float32 inputs (the reference's inputs are float32 values), chunked.
    at::Tensor z = c.t.at("student").to(at::kFloat).requires_grad_(true);
    LossResult r = distillLoss(z, labels, teacherOf(c, at::kFloat), optionsOf(c, 7), norm);
    r.loss.backward();
    EXPECT_EQ(r.loss.scalar_type(), at::kFloat);
    const double el = std::abs(r.loss.item<double>() - c.t.at("ref_loss").item<double>());
    const double eg = maxAbs(z.grad(), c.t.at("ref_grad"));
    EXPECT_LT(el, 1e-5);
    EXPECT_LT(eg, 1e-6);
    worstLoss32 = std::max(worstLoss32, el);
    worstGrad32 = std::max(worstGrad32, eg);
  }
  std::printf("max abs error vs python: float64 loss/kd/ce %.3g grad %.3g; float32 loss %.3g grad %.3g\n", worstLoss64,
              worstGrad64, worstLoss32, worstGrad32);
}

// Issue 14, items 1-3: inputs where the old formulas gave inf or NaN (JSD with
// both distributions underflowing; a teacher tail that cancels in 1 - sum q;
// k = V), against exact values (mpmath, from the teacher's full logits) and
// exact central differences, in the precision each case names.
TEST(Losses, EdgeCasesMatchExactReference) {
  std::vector<Case> cases = pythonCases("--edge", /*edge=*/true);
  ASSERT_EQ(cases.size(), 13u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const at::ScalarType dtype = c.dtype == "f32" ? at::kFloat : at::kDouble;
    const double ref = c.t.at("ref_loss").item<double>(), norm = c.t.at("normalizer").item<double>();
    for (int64_t chunk : {1, 1000}) {
      at::Tensor z = c.t.at("student").to(dtype).clone().requires_grad_(true);
      LossResult r = distillLoss(z, c.t.at("labels"), teacherOf(c, dtype), optionsOf(c, chunk), norm);
      r.loss.backward();
      const double loss = r.loss.item<double>(), eg = maxAbs(z.grad(), c.t.at("ref_grad"));
      EXPECT_TRUE(std::isnan(r.ce.item<double>())); // alpha = 1: ce is not computed
      EXPECT_EQ(r.kd.item<double>(), loss);
      EXPECT_TRUE(std::isfinite(loss)) << loss;
      EXPECT_TRUE(z.grad().isfinite().all().item<bool>()) << z.grad();
      if (c.check == "bound") {
        // logsumexp only: the tail below rounding is floored, so a lower bound.
        EXPECT_GT(loss, 0.0);
        EXPECT_LE(loss, ref * (1 + 1e-6)) << "exact " << ref;
        std::printf("%s: %.6g (exact %.6g, without the log tail)\n", c.name.c_str(), loss, ref);
        continue;
      }
      const double tol = dtype == at::kDouble ? 1e-12 : 2e-6;
      EXPECT_LE(std::abs(loss - ref), tol * std::max(1.0, std::abs(ref))) << loss << " vs exact " << ref;
      EXPECT_LE(eg, dtype == at::kDouble ? 1e-12 : 2e-6) << z.grad() << c.t.at("ref_grad");
    }
  }
}


TEST(Losses, FiniteDifferences) {
  struct Spec {
    const char* kind;
    const char* mode;
    double t;
  };
  const Spec specs[] = {{"forward_kl", "dense", 1.0},
                        {"forward_kl", "dense", 2.5},
                        {"forward_kl", "topk", 1.0},
                        {"forward_kl", "topk", 2.5},
                        {"forward_kl", "topk_lse", 2.5},
                        {"reverse_kl", "dense", 2.5},
                        {"reverse_kl", "topk_lse", 1.0},
                        {"jsd", "dense", 2.5},
                        {"jsd", "topk", 1.0},
                        {"jsd", "topk_lse", 2.5},
                        {"forward_kl", "topk_tail", 2.5},
                        {"reverse_kl", "topk_tail", 1.0},
                        {"jsd", "topk_tail", 2.5}};
  double worst = 0;
  for (const Spec& sp : specs) {
    SCOPED_TRACE(std::string(sp.kind) + " " + sp.mode + " T=" + std::to_string(sp.t));
    Small s = smallProblem(sp.mode, sp.t, 7);
    LossOptions o;
    o.kind = lossKind(sp.kind);
    o.temperature = sp.t;
    o.alpha = 0.6;
    o.jsd_beta = 0.3;
    o.chunk_tokens = 4;
    at::Tensor z = s.z.clone().requires_grad_(true);
    distillLoss(z, s.labels, s.teacher, o, 5.0).loss.backward();
    // Central differences through the value-only path (no grad mode).
    at::NoGradGuard noGrad;
    at::Tensor fd = at::zeros_like(s.z);
    const double eps = 1e-6;
    for (int64_t i = 0; i < s.z.numel(); ++i) {
      at::Tensor zp = s.z.clone(), zm = s.z.clone();
      zp.view(-1)[i] += eps;
      zm.view(-1)[i] -= eps;
      const double lp = distillLoss(zp, s.labels, s.teacher, o, 5.0).loss.item<double>();
      const double lm = distillLoss(zm, s.labels, s.teacher, o, 5.0).loss.item<double>();
      fd.view(-1)[i] = (lp - lm) / (2 * eps);
    }
    const double e = maxAbs(z.grad(), fd);
    EXPECT_LT(e, 1e-8);
    worst = std::max(worst, e);
    // The ignored token gets no gradient at all.
    EXPECT_EQ(z.grad()[2].abs().max().item<double>(), 0.0);
  }
  std::printf("max abs error, analytic vs central differences: %.3g\n", worst);
}

// ---- gradient accumulation with a global normalizer ------------------------

TEST(Losses, GradientAccumulationMatchesOneBatch) {
  const int64_t students = 2, accSteps = 4, tokens = 16, hidden = 6, vocab = 11;
  // Valid tokens per (student, micro-batch): uneven, some nearly empty.
  const int64_t validCount[2][4] = {{1, 16, 3, 12}, {14, 2, 16, 7}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto opt = at::TensorOptions().dtype(at::kDouble);
  at::Tensor w0 = at::randn({vocab, hidden}, gen, opt) * 0.5;
  std::vector<at::Tensor> xs, labels, teachers;
  int64_t total = 0;
  for (int64_t s = 0; s < students; ++s) {
    for (int64_t a = 0; a < accSteps; ++a) {
      xs.push_back(at::randn({tokens, hidden}, gen, opt));
      teachers.push_back(at::randn({tokens, vocab}, gen, opt) * 2);
      at::Tensor l = at::randint(0, vocab, {tokens}, gen, at::kLong);
      at::Tensor order = at::randperm(tokens, gen, at::kLong);
      l.index_fill_(0, order.narrow(0, validCount[s][a], tokens - validCount[s][a]), -100);
      labels.push_back(l);
      total += countTokens(l, -100);
    }
  }
  ASSERT_EQ(total, 71);
  for (const char* mode : {"dense", "topk_lse"}) {
    SCOPED_TRACE(mode);
    LossOptions o;
    o.temperature = 2.0;
    o.alpha = 0.7;
    o.chunk_tokens = 5;
    auto teacherOf = [&](const at::Tensor& t) {
      TeacherOutput out;
      if (std::string(mode) == "dense") {
        out.makeLogits().logits = t;
      } else {
        auto [v, i] = t.topk(4, 1);
        out.makeTopk().values = v;
        out.makeTopk().indices = i;
        out.makeTopk().logsumexp = at::logsumexp(t / o.temperature, 1);
      }
      return out;
    };
    // Each student: accSteps backward passes into its own copy; then "all-reduce SUM".
    at::Tensor accumulated = at::zeros_like(w0), perMicro = at::zeros_like(w0);
    for (int64_t s = 0; s < students; ++s) {
      at::Tensor w = w0.clone().requires_grad_(true), w2 = w0.clone().requires_grad_(true);
      for (int64_t a = 0; a < accSteps; ++a) {
        const size_t i = s * accSteps + a;
        distillLoss(at::matmul(xs[i], w.t()), labels[i], teacherOf(teachers[i]), o, total).loss.backward();
        // The tempting alternative: mean per micro-batch, then averaged over acc steps and ranks.
        const double own = static_cast<double>(countTokens(labels[i], -100));
        (distillLoss(at::matmul(xs[i], w2.t()), labels[i], teacherOf(teachers[i]), o, own).loss /
         static_cast<double>(students * accSteps))
            .backward();
      }
      accumulated += w.grad();
      perMicro += w2.grad();
    }
    // The same tokens as one batch.
    at::Tensor w = w0.clone().requires_grad_(true);
    LossResult one =
        distillLoss(at::matmul(at::cat(xs), w.t()), at::cat(labels), teacherOf(at::cat(teachers)), o, total);
    one.loss.backward();
    EXPECT_EQ(one.tokens, total);
    const double e = maxAbs(accumulated, w.grad());
    const double wrong = maxAbs(perMicro, w.grad());
    std::printf(
        "%s: accumulated vs one batch %.3g; per-micro-batch normalisation off by %.3g "
        "(max |grad| %.3g)\n",
        mode, e, wrong, w.grad().abs().max().item<double>());
    EXPECT_LT(e, 1e-12);
    EXPECT_GT(wrong, 1e-2 * w.grad().abs().max().item<double>()); // so this test can fail
  }
}

} // namespace
} // namespace distill
