// Distillation losses: values and gradients against an independent Python
// reference, finite differences, gradient accumulation with a global token
// normalizer, error reporting, and the memory bound of the chunked loss.

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

namespace distill {
namespace {

using testing::expectThrow;

constexpr double kInf = std::numeric_limits<double>::infinity();

double maxAbs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// ---- the Python reference -------------------------------------------------

// An option spelling ("jsd") as the enum LossOptions holds.
LossKind lossKind(const std::string& s) { return parseEnum<LossKind>(s).value(); }

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

// ---- finite differences ---------------------------------------------------

struct Small {
  at::Tensor z, labels;
  TeacherOutput teacher;
};

Small smallProblem(const std::string& mode, double temperature, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t n = 6, v = 9, k = 3;
  auto opt = at::TensorOptions().dtype(at::kDouble);
  Small s;
  s.z = at::randn({n, v}, gen, opt) * 1.5;
  at::Tensor t = at::randn({n, v}, gen, opt) * 2;
  s.labels = at::randint(0, v, {n}, gen, at::kLong);
  s.labels[2] = -100;
  if (mode == "dense") {
    s.teacher.makeLogits().logits = t;
  } else {
    auto [vals, idx] = t.topk(k, 1);
    s.teacher.makeTopk().values = vals;
    s.teacher.makeTopk().indices = idx.to(at::kInt);
    if (mode != "topk") s.teacher.makeTopk().logsumexp = at::logsumexp(t / temperature, 1);
    if (mode == "topk_tail") s.teacher.makeTopk().logTail = at::logsumexp((t / temperature).scatter(1, idx, -kInf), 1);
  }
  return s;
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

// ---- memory -----------------------------------------------------------------

// ---- the fused CPU kernel against the ATen-op path --------------------------

// On CPU distillLoss runs the fused kernel (loss/src/cpu/loss_kernel_impl.h);
// detail::distillLossAtenOps is the ATen-op path (CUDA, half/bfloat16) it
// replaced there. Every kind, teacher form, temperature and weight, float32
// and float64, ignored tokens, several chunks, vocabularies that are not a
// multiple of any vector width, -inf logits on both sides and logits large
// enough to underflow: values and gradients agree to rounding (loss, kd and ce
// within 1e-6 relative beyond 1, gradients within 1e-6; 1e-12 in float64).
TEST(Losses, FusedCpuKernelMatchesAtenOps) {
  double worst[2] = {0, 0}; // float32, float64
  int beyond = 0; // float32 cases beyond 1e-6, checked against float64 instead
  for (at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const bool f32 = dtype == at::kFloat;
    for (int64_t v : {37, 300}) {
      for (double scale : {1.0, 12.0}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(v * 10 + scale));
        const int64_t n = 23, k = 8;
        at::Tensor z0 = (at::randn({n, v}, gen, at::kDouble) * (1.5 * scale)).to(dtype);
        at::Tensor t = (at::randn({n, v}, gen, at::kDouble) * (2 * scale)).to(dtype);
        z0[3].narrow(0, 0, 5).fill_(-kInf); // masked student tokens
        t[4].narrow(0, 2, 6).fill_(-kInf); // masked teacher tokens
        at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
        labels[1] = -100;
        labels[9] = -100;
        for (const char* mode : {"dense", "dense_bf16", "topk", "topk_lse", "topk_tail", "tail_only"}) {
          for (double temp : {1.0, 2.5}) {
            TeacherOutput teacher;
            if (std::string(mode) == "dense") {
              teacher.makeLogits().logits = t;
            } else if (std::string(mode) == "dense_bf16") {
              teacher.makeLogits().logits = t.to(at::kBFloat16); // converted chunk by chunk
            } else {
              auto [vals, idx] = t.topk(k, 1);
              teacher.makeTopk().values = vals;
              teacher.makeTopk().indices = std::string(mode) == "topk" ? idx.to(at::kInt) : idx;
              at::Tensor st = t.to(at::kDouble) / temp;
              if (std::string(mode) == "topk_lse" || std::string(mode) == "topk_tail") {
                teacher.makeTopk().logsumexp = at::logsumexp(st, 1).to(dtype);
              }
              if (std::string(mode) == "topk_tail" || std::string(mode) == "tail_only") {
                teacher.makeTopk().logTail = at::logsumexp(st.scatter(1, idx, -kInf), 1).to(dtype);
              }
            }
            for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
              if (std::string(kind) == "reverse_kl" && std::string(mode) == "topk") continue; // refused
              for (double alpha : {0.0, 0.6, 1.0}) {
                SCOPED_TRACE(std::string(f32 ? "float32 " : "float64 ") + mode + " " + kind +
                             " V=" + std::to_string(v) + " scale=" + std::to_string(scale) +
                             " T=" + std::to_string(temp) + " alpha=" + std::to_string(alpha));
                LossOptions o;
                o.kind = lossKind(kind);
                o.temperature = temp;
                o.alpha = alpha;
                o.jsd_beta = 0.3;
                o.chunk_tokens = 5;
                at::Tensor za = z0.clone().requires_grad_(true), zb = z0.clone().requires_grad_(true);
                LossResult a = distillLoss(za, labels, teacher, o, 21.0);
                LossResult b = detail::distillLossAtenOps(zb, labels, teacher, o, 21.0);
                a.loss.backward();
                b.loss.backward();
                double d = 0;
                for (auto [x, y] : {std::pair{a.loss, b.loss}, {a.kd, b.kd}, {a.ce, b.ce}}) {
                  const double xv = x.item<double>(), yv = y.item<double>();
                  ASSERT_EQ(std::isnan(xv), std::isnan(yv)) << xv << " vs " << yv;
                  ASSERT_EQ(std::isinf(xv), std::isinf(yv)) << xv << " vs " << yv;
                  // Relative to the value beyond 1: a float32 loss of 100 is only known to 7.6e-6.
                  if (std::isfinite(xv)) d = std::max(d, std::abs(xv - yv) / std::max(1.0, std::abs(yv)));
                }
                at::Tensor ga = za.grad(), gb = zb.grad();
                ASSERT_TRUE(at::equal(at::isnan(ga), at::isnan(gb)));
                at::Tensor fin = at::isfinite(gb);
                d = std::max(d, maxAbs(ga.masked_select(fin), gb.masked_select(fin)));
                // Ignored tokens get no gradient at all.
                EXPECT_EQ(ga[1].abs().max().item<double>(), 0.0);
                if (f32 && d > 1e-6) {
                  // Beyond 1e-6 in float32 (logits of +-50: a log-probability is only
                  // known to ~4e-6), the fused result must be as close to the float64
                  // computation on the same inputs as the ATen-op path is. The teacher
                  // keeps its float32 tensors: the same rounding floor r (losses.h).
                  at::Tensor zc = z0.to(at::kDouble).requires_grad_(true);
                  LossResult c = detail::distillLossAtenOps(zc, labels, teacher, o, 21.0);
                  c.loss.backward();
                  const double fa = std::abs(a.loss.item<double>() - c.loss.item<double>()) /
                      std::max(1.0, std::abs(c.loss.item<double>()));
                  const double fb = std::abs(b.loss.item<double>() - c.loss.item<double>()) /
                      std::max(1.0, std::abs(c.loss.item<double>()));
                  EXPECT_LE(fa, 1.5 * fb + 1e-6);
                  EXPECT_LE(maxAbs(ga, zc.grad()), 1.5 * maxAbs(gb, zc.grad()) + 1e-6);
                  ++beyond;
                } else {
                  EXPECT_LE(d, f32 ? 1e-6 : 1e-12);
                }
                worst[f32 ? 0 : 1] = std::max(worst[f32 ? 0 : 1], d);
              }
            }
          }
        }
      }
    }
  }
  std::printf(
      "fused CPU kernel vs ATen ops, max difference of loss, kd, ce (relative beyond 1) and gradient: "
      "float32 %.3g, float64 %.3g; %d float32 cases beyond 1e-6 (as close to float64 as ATen's)\n",
      worst[0], worst[1], beyond);
}

TEST(Losses, MemoryIsBoundedByChunks) {
  const int64_t n = 512, v = 128000, chunk = 64;
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counting(), /*priority=*/100);
  const double mib = 1024.0 * 1024.0;
  const int64_t gradBytes = n * v * 4, chunkBytes = chunk * v * 4;
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    at::Tensor z = at::randn({n, v}, gen, at::kFloat).requires_grad_(true);
    at::Tensor t = at::randn({n, v}, gen, at::kFloat) * 2;
    at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
    labels.narrow(0, 0, 100).fill_(-100);
    auto [vals, idx] = t.topk(64, 1);
    at::Tensor lse = at::logsumexp(t / 2.0, 1);
    // The fused CPU kernel (distillLoss here): one row of scratch per thread;
    // the ATen-op path (CUDA, half/bfloat16): at most ~10 chunk buffers.
    for (bool aten : {false, true}) {
      for (const char* mode : {"dense", "topk_lse"}) {
        for (const char* kind : {"forward_kl", "jsd"}) {
          LossOptions o;
          o.kind = lossKind(kind);
          o.temperature = 2.0;
          o.chunk_tokens = chunk;
          TeacherOutput teacher = std::string(mode) == "dense" ? TeacherOutput{LogitsAnswer{t}}
                                                               : TeacherOutput{TopkAnswer{vals, idx.to(at::kInt), lse, {}}};
          z.mutable_grad() = at::Tensor();
          const int64_t base = counting().live();
          counting().resetPeak();
          LossResult r = aten ? detail::distillLossAtenOps(z, labels, teacher, o, 412.0)
                              : distillLoss(z, labels, teacher, o, 412.0);
          const int64_t afterForward = counting().live() - base;
          r.loss.backward();
          const int64_t extra = counting().peak() - base;
          ASSERT_TRUE(std::isfinite(r.loss.item<double>()));
          ASSERT_EQ(z.grad().sizes(), z.sizes());
          std::printf(
              "%s %s %s N=%ld V=%ld chunk=%ld: peak beyond inputs %.1f MiB = gradient %.1f "
              "MiB + %.1f MiB (%.1f chunk buffers of %.1f MiB); held after forward %.1f MiB\n",
              aten ? "aten-ops" : "fused", mode, kind, n, v, chunk, extra / mib, gradBytes / mib,
              (extra - gradBytes) / mib, double(extra - gradBytes) / chunkBytes, chunkBytes / mib, afterForward / mib);
          EXPECT_LE(extra - gradBytes, (aten ? 10 : 1) * chunkBytes);
        }
      }
    }
    // For scale: the same forward KL with plain autograd over the whole batch.
    z.mutable_grad() = at::Tensor();
    const int64_t base = counting().live();
    counting().resetPeak();
    {
      at::Tensor logp = at::log_softmax(z / 2.0, 1), logq = at::log_softmax(t / 2.0, 1);
      at::Tensor kd = (logq.exp() * (logq - logp)).sum(1).masked_select(labels != -100).sum();
      (kd * 4.0 / 412.0).backward();
    }
    const int64_t naive = counting().peak() - base;
    std::printf("plain autograd, unchunked: peak beyond inputs %.1f MiB\n", naive / mib);
    EXPECT_GT(naive, gradBytes + 10 * chunkBytes); // the measurement can tell them apart
  }
  c10::SetCPUAllocator(before, /*priority=*/100);
}

// Issue 28 item 2: teacher values and logits arrive in bfloat16 or float16
// (teacher.payload_dtype); the loss computes in float32 whatever arrives: the
// same loss and gradient as with the same values upcast to float32 by the caller.
TEST(Losses, HalfTeacherPayloadsComputeInFloat32) {
  const int64_t n = 64, v = 1000, k = 32;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(28);
  at::Tensor t = at::randn({n, v}, gen, at::kFloat) * 3;
  at::Tensor z0 = at::randn({n, v}, gen, at::kFloat);
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  LossOptions o;
  o.temperature = 2.0;
  auto run = [&](const TeacherOutput& sent) {
    at::Tensor z = z0.clone().requires_grad_();
    LossResult r = distillLoss(z, labels, sent, o, double(n));
    r.loss.backward();
    EXPECT_EQ(r.loss.scalar_type(), at::kFloat);
    return std::make_pair(r.loss.item<double>(), z.grad());
  };
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto out = topkOutput(t, k, o.temperature, dtype);
    TeacherOutput half, up;
    half.makeTopk().values = out.at(protocol::kTopkValues);
    ASSERT_EQ(half.topk()->values.scalar_type(), dtype);
    half.makeTopk().indices = up.makeTopk().indices = out.at(protocol::kTopkIndices);
    half.makeTopk().logsumexp = up.makeTopk().logsumexp = out.at(protocol::kLogsumexp);
    half.makeTopk().logTail = up.makeTopk().logTail = out.at(protocol::kLogTail);
    up.makeTopk().values = half.topk()->values.to(at::kFloat);
    auto [a, ga] = run(half);
    auto [b, gb] = run(up);
    EXPECT_EQ(a, b);
    EXPECT_TRUE(at::equal(ga, gb));
    // And near the float32 answer: values rounded, the k + 1 buckets still sum to 1.
    auto f = topkOutput(t, k, o.temperature);
    TeacherOutput full;
    full.makeTopk().values = f.at(protocol::kTopkValues), full.makeTopk().indices = f.at(protocol::kTopkIndices);
    full.makeTopk().logsumexp = f.at(protocol::kLogsumexp), full.makeTopk().logTail = f.at(protocol::kLogTail);
    EXPECT_NEAR(a, run(full).first, 1e-2 * std::abs(a));
    // Dense logits in the same dtype.
    TeacherOutput dense, denseUp;
    dense.makeLogits().logits = t.to(dtype);
    denseUp.makeLogits().logits = dense.logits()->logits.to(at::kFloat);
    auto [c, gc] = run(dense);
    auto [d, gd] = run(denseUp);
    EXPECT_EQ(c, d);
    EXPECT_TRUE(at::equal(gc, gd));
  }
  // float16 cannot hold a logit of 1e5: an error naming the key, not an inf sent.
  at::Tensor huge = t.clone();
  huge[0][0] = 1e5;
  try {
    topkOutput(huge, k, 1.0, at::kHalf);
    ADD_FAILURE() << "a logit of 1e5 was sent as float16";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("overflows Half (teacher.payload_dtype)"), std::string::npos) << e.what();
  }
}

} // namespace
} // namespace distill
