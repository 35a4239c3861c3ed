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
#include "distill/student/losses.h"

namespace distill {
namespace {

double maxAbs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// ---- the Python reference -------------------------------------------------

struct Case {
  std::string name, kind, mode;
  double temperature = 1, beta = 0.5, alpha = 0.5;
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

std::vector<Case> pythonCases(int seed) {
  char dirTemplate[] = "/tmp/distill_losses_XXXXXX";
  const char* dir = mkdtemp(dirTemplate);
  EXPECT_NE(dir, nullptr);
  std::string cmd = std::string(DISTILL_TEST_PYTHON) + " " + DISTILL_LOSSES_REFERENCE +
                    " --seed " + std::to_string(seed) + " --out " + dir +
                    " --batch 2 --seq 19 --vocab 101 --topk 8";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<Case> cases;
  std::ifstream list(std::string(dir) + "/cases.txt");
  std::string path;
  Case c;
  while (list >> c.name >> c.kind >> c.temperature >> c.beta >> c.alpha >> c.mode >> path) {
    c.t = readRecords(path);
    cases.push_back(c);
    std::remove(path.c_str());
  }
  std::remove((std::string(dir) + "/cases.txt").c_str());
  rmdir(dir);
  return cases;
}

TeacherOutput teacherOf(const Case& c, at::ScalarType dtype) {
  TeacherOutput t;
  auto get = [&](const char* n) {
    auto it = c.t.find(n);
    return it == c.t.end() ? at::Tensor() : it->second;
  };
  if (auto l = get("teacher_logits"); l.defined()) t.logits = l.to(dtype);
  if (auto v = get("teacher_values"); v.defined()) t.topkValues = v.to(dtype);
  t.topkIndices = get("teacher_indices");
  if (auto l = get("teacher_lse"); l.defined()) t.logsumexp = l.to(dtype);
  return t;
}

LossOptions optionsOf(const Case& c, int64_t chunk) {
  LossOptions o;
  o.kind = c.kind;
  o.temperature = c.temperature;
  o.jsd_beta = c.beta;
  o.alpha = c.alpha;
  o.chunk_tokens = chunk;
  return o;
}

TEST(Losses, MatchPythonReference) {
  std::vector<Case> cases = pythonCases(20240611);
  ASSERT_EQ(cases.size(), 16u);
  double worstLoss64 = 0, worstGrad64 = 0, worstLoss32 = 0, worstGrad32 = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const double norm = c.t.at("normalizer").item<double>();
    const at::Tensor& labels = c.t.at("labels");
    ASSERT_GT(labels.numel() - countTokens(labels, -100), 0);  // some tokens are ignored
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
  std::printf("max abs error vs python: float64 loss/kd/ce %.3g grad %.3g; float32 loss %.3g grad %.3g\n",
              worstLoss64, worstGrad64, worstLoss32, worstGrad32);
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
    s.teacher.logits = t;
  } else {
    auto [vals, idx] = t.topk(k, 1);
    s.teacher.topkValues = vals;
    s.teacher.topkIndices = idx.to(at::kInt);
    if (mode == "topk_lse") s.teacher.logsumexp = at::logsumexp(t / temperature, 1);
  }
  return s;
}

TEST(Losses, FiniteDifferences) {
  struct Spec { const char* kind; const char* mode; double t; };
  const Spec specs[] = {{"forward_kl", "dense", 1.0}, {"forward_kl", "dense", 2.5},
                        {"forward_kl", "topk", 1.0},  {"forward_kl", "topk", 2.5},
                        {"forward_kl", "topk_lse", 2.5}, {"reverse_kl", "dense", 2.5},
                        {"reverse_kl", "topk_lse", 1.0}, {"jsd", "dense", 2.5},
                        {"jsd", "topk", 1.0}, {"jsd", "topk_lse", 2.5}};
  double worst = 0;
  for (const Spec& sp : specs) {
    SCOPED_TRACE(std::string(sp.kind) + " " + sp.mode + " T=" + std::to_string(sp.t));
    Small s = smallProblem(sp.mode, sp.t, 7);
    LossOptions o;
    o.kind = sp.kind;
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
        out.logits = t;
      } else {
        auto [v, i] = t.topk(4, 1);
        out.topkValues = v;
        out.topkIndices = i;
        out.logsumexp = at::logsumexp(t / o.temperature, 1);
      }
      return out;
    };
    // Each student: accSteps backward passes into its own copy; then "all-reduce SUM".
    at::Tensor accumulated = at::zeros_like(w0), perMicro = at::zeros_like(w0);
    for (int64_t s = 0; s < students; ++s) {
      at::Tensor w = w0.clone().requires_grad_(true), w2 = w0.clone().requires_grad_(true);
      for (int64_t a = 0; a < accSteps; ++a) {
        const size_t i = s * accSteps + a;
        distillLoss(at::matmul(xs[i], w.t()), labels[i], teacherOf(teachers[i]), o, total)
            .loss.backward();
        // The tempting alternative: mean per micro-batch, then averaged over acc steps and ranks.
        const double own = static_cast<double>(countTokens(labels[i], -100));
        (distillLoss(at::matmul(xs[i], w2.t()), labels[i], teacherOf(teachers[i]), o, own).loss /
         static_cast<double>(students * accSteps)).backward();
      }
      accumulated += w.grad();
      perMicro += w2.grad();
    }
    // The same tokens as one batch.
    at::Tensor w = w0.clone().requires_grad_(true);
    LossResult one = distillLoss(at::matmul(at::cat(xs), w.t()), at::cat(labels),
                                 teacherOf(at::cat(teachers)), o, total);
    one.loss.backward();
    EXPECT_EQ(one.tokens, total);
    const double e = maxAbs(accumulated, w.grad());
    const double wrong = maxAbs(perMicro, w.grad());
    std::printf("%s: accumulated vs one batch %.3g; per-micro-batch normalisation off by %.3g "
                "(max |grad| %.3g)\n", mode, e, wrong, w.grad().abs().max().item<double>());
    EXPECT_LT(e, 1e-12);
    EXPECT_GT(wrong, 1e-2 * w.grad().abs().max().item<double>());  // so this test can fail
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
  LossResult r3 = distillLoss(s.z, s.labels, s.teacher, o, 5.0);  // z does not require grad
  EXPECT_FALSE(r3.loss.requires_grad());
  EXPECT_DOUBLE_EQ(r3.loss.item<double>(), r1.loss.item<double>());
  EXPECT_NEAR(r1.loss.item<double>(),
              o.alpha * r1.kd.item<double>() + (1 - o.alpha) * r1.ce.item<double>(), 1e-15);
  // A second backward through the same loss is refused, not silently wrong.
  at::Tensor z4 = s.z.clone().requires_grad_(true);
  at::Tensor l4 = distillLoss(z4, s.labels, s.teacher, o, 5.0).loss;
  l4.backward({}, /*retain_graph=*/true);
  EXPECT_THROW(l4.backward(), std::exception);
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
              distillLoss(s.z.to(at::kBFloat16).to(at::kDouble), s.labels, s.teacher, o, 5.0)
                  .loss.item<double>(), 1e-5);
  // A teacher that rules tokens out (-inf) leaves forward KL and JSD finite.
  TeacherOutput masked{s.teacher.logits.clone(), {}, {}, {}};
  masked.logits.select(1, 0).fill_(-std::numeric_limits<double>::infinity());
  for (const char* kind : {"forward_kl", "jsd"}) {
    o.kind = kind;
    at::Tensor zm = s.z.clone().requires_grad_(true);
    LossResult rm = distillLoss(zm, s.labels, masked, o, 5.0);
    rm.loss.backward();
    EXPECT_TRUE(std::isfinite(rm.loss.item<double>())) << kind;
    EXPECT_TRUE(zm.grad().isfinite().all().item<bool>()) << kind;
  }
}

template <typename E, typename F>
std::string expectThrow(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.message();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception";
  return {};
}

TEST(Losses, Errors) {
  Small s = smallProblem("dense", 1.0, 5);
  Small k = smallProblem("topk", 1.0, 5);
  LossOptions o;
  auto run = [&](const at::Tensor& z, const at::Tensor& l, const TeacherOutput& t,
                 const LossOptions& opt, double norm = 5.0) {
    return [=] { distillLoss(z, l, t, opt, norm); };
  };
  std::string m = expectThrow<ProtocolError>(
      run(s.z, s.labels, TeacherOutput{s.teacher.logits.narrow(1, 0, 8), {}, {}, {}}, o));
  EXPECT_NE(m.find("[6, 9]"), std::string::npos) << m;
  EXPECT_NE(m.find("[6, 8]"), std::string::npos) << m;
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
  dup.topkIndices = k.teacher.topkIndices.clone();
  dup.topkIndices.select(1, 1).copy_(dup.topkIndices.select(1, 0));
  m = expectThrow<ProtocolError>(run(k.z, k.labels, dup, o));
  EXPECT_NE(m.find("repeated"), std::string::npos) << m;
  TeacherOutput oob = k.teacher;
  oob.topkIndices = k.teacher.topkIndices.clone();
  oob.topkIndices[0][0] = 9;
  expectThrow<ProtocolError>(run(k.z, k.labels, oob, o));
  TeacherOutput badIdx = k.teacher;
  badIdx.topkIndices = k.teacher.topkIndices.narrow(1, 0, 2);
  expectThrow<ProtocolError>(run(k.z, k.labels, badIdx, o));
  TeacherOutput badLse = k.teacher;
  badLse.logsumexp = at::zeros({5}, at::kDouble);
  expectThrow<ProtocolError>(run(k.z, k.labels, badLse, o));

  auto with = [&](auto edit) {
    LossOptions b;
    edit(b);
    return b;
  };
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.kind = "kl"; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.temperature = 0; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.alpha = 1.5; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.jsd_beta = 1; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, with([](auto& b) { b.chunk_tokens = 0; })));
  expectThrow<ConfigError>(run(s.z, s.labels, s.teacher, o, 0.0));
  m = expectThrow<ConfigError>(
      run(k.z, k.labels, k.teacher, with([](auto& b) { b.kind = "reverse_kl"; })));
  EXPECT_NE(m.find("logsumexp"), std::string::npos) << m;
}

// ---- memory -----------------------------------------------------------------

// Wraps the CPU allocator to count live bytes and their peak. Every CPU tensor
// storage goes through it; scratch memory that ATen kernels take with malloc
// directly (small, per thread) is not seen.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    c10::Device device = inner.device();
    auto* ctx = new Ctx{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = live_.fetch_add(ctx->n) + ctx->n;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, ctx, &release, device};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void resetPeak() { peak_.store(live_.load()); }

 private:
  struct Ctx {
    c10::DataPtr inner;
    int64_t n;
    CountingAllocator* owner;
  };
  static void release(void* p) {
    auto* ctx = static_cast<Ctx*>(p);
    ctx->owner->live_.fetch_sub(ctx->n);
    delete ctx;
  }
  c10::Allocator* base_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

// Installs the counting allocator for the test's scope (it must outlive every
// tensor it made, hence static).
CountingAllocator& counting() {
  static CountingAllocator* a = new CountingAllocator(c10::GetCPUAllocator());
  return *a;
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
    for (const char* mode : {"dense", "topk_lse"}) {
      for (const char* kind : {"forward_kl", "jsd"}) {
        LossOptions o;
        o.kind = kind;
        o.temperature = 2.0;
        o.chunk_tokens = chunk;
        TeacherOutput teacher = std::string(mode) == "dense"
                                    ? TeacherOutput{t, {}, {}, {}}
                                    : TeacherOutput{{}, vals, idx.to(at::kInt), lse};
        z.mutable_grad() = at::Tensor();
        const int64_t base = counting().live();
        counting().resetPeak();
        LossResult r = distillLoss(z, labels, teacher, o, 412.0);
        const int64_t afterForward = counting().live() - base;
        r.loss.backward();
        const int64_t extra = counting().peak() - base;
        ASSERT_TRUE(std::isfinite(r.loss.item<double>()));
        ASSERT_EQ(z.grad().sizes(), z.sizes());
        std::printf("%s %s N=%ld V=%ld chunk=%ld: peak beyond inputs %.1f MiB = gradient %.1f "
                    "MiB + %.1f MiB (%.1f chunk buffers of %.1f MiB); held after forward %.1f MiB\n",
                    mode, kind, n, v, chunk, extra / mib, gradBytes / mib, (extra - gradBytes) / mib,
                    double(extra - gradBytes) / chunkBytes, chunkBytes / mib, afterForward / mib);
        EXPECT_LE(extra - gradBytes, 10 * chunkBytes);
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
    EXPECT_GT(naive, gradBytes + 10 * chunkBytes);  // the measurement can tell them apart
  }
  c10::SetCPUAllocator(before, /*priority=*/100);
}

}  // namespace
}  // namespace distill
