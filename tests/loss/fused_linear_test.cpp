// fusedLinearLoss: the output projection chunked with the loss. Its value and
// its gradients w.r.t. hidden, weight and bias equal those of distillLoss on
// hidden @ weight.T + bias (float64, 1e-6 relative) for every kind and teacher
// form, with ignored tokens, all-ignored runs of tokens, chunk sizes that do
// not divide N; on the fused CPU kernel and on the ATen-op path; and its memory
// beyond inputs and gradients is two chunks of logits, not [N, V].

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "counting_allocator.h"
#include "distill/core/errors.h"
#include "distill/loss/losses.h"

namespace distill {
namespace {

// max |a - b| / max |b| (b's scale; 1 where b is all zeros).
double relErr(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-300);
  const double err = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  return b.abs().max().item<double>() == 0 ? err : err / scale;
}

struct Head {
  at::Tensor hidden, weight, bias; // leaves that require grad
};

Head makeHead(int64_t n, int64_t d, int64_t v, bool withBias, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Head h;
  h.hidden = at::randn({n, d}, gen, at::kDouble).requires_grad_(true);
  h.weight = (at::randn({v, d}, gen, at::kDouble) * 0.7).requires_grad_(true);
  if (withBias) h.bias = at::randn({v}, gen, at::kDouble).requires_grad_(true);
  return h;
}

void clearGrads(Head& h) {
  for (at::Tensor* t : {&h.hidden, &h.weight, &h.bias}) {
    if (t->defined()) t->mutable_grad() = at::Tensor();
  }
}

TeacherOutput teacherFor(const std::string& mode, const at::Tensor& t, double temperature) {
  if (mode == "dense") return TeacherOutput{LogitsAnswer{t}};
  const int64_t k = 7;
  auto [vals, idx] = t.topk(k, 1);
  TeacherOutput out{TopkAnswer{vals, idx.to(at::kInt), {}, {}}};
  if (mode == "topk_lse" || mode == "topk_tail") out.makeTopk().logsumexp = at::logsumexp(t / temperature, 1);
  if (mode == "topk_tail") {
    at::Tensor rest = (t / temperature).scatter(1, idx, -std::numeric_limits<double>::infinity());
    out.makeTopk().logTail = at::logsumexp(rest, 1);
  }
  return out;
}

// Labels of N = 29 tokens: a few ignored, and tokens 10..19 all ignored (with
// chunks of 5 those would be two chunks without a valid token).
at::Tensor labelsFor(int64_t n, int64_t v, uint64_t seed, bool allIgnored) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
  if (allIgnored) return labels.fill_(-100);
  labels[2] = -100;
  labels.narrow(0, 10, 10).fill_(-100);
  labels[n - 1] = -100;
  return labels;
}

struct Errors {
  double loss = 0, kd = 0, ce = 0, h = 0, w = 0, b = 0;
  double worst() const { return std::max({loss, kd, ce, h, w, b}); }
};

// The fused linear loss (or its ATen-op path) against distillLoss (or its
// ATen-op path) on the materialised logits; gradients through backward().
Errors compare(Head& head, const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& o,
               double normalizer, int64_t chunk, bool aten) {
  Errors e;
  clearGrads(head);
  at::Tensor logits =
      head.bias.defined() ? at::addmm(head.bias, head.hidden, head.weight.t()) : at::mm(head.hidden, head.weight.t());
  LossResult ref = aten ? detail::distillLossAtenOps(logits, labels, teacher, o, normalizer)
                        : distillLoss(logits, labels, teacher, o, normalizer);
  ref.loss.backward();
  const at::Tensor gh = head.hidden.grad().clone(), gw = head.weight.grad().clone();
  const at::Tensor gb = head.bias.defined() ? head.bias.grad().clone() : at::Tensor();
  clearGrads(head);
  LossResult got = aten
      ? detail::fusedLinearLossAtenOps(head.hidden, head.weight, head.bias, labels, teacher, o, normalizer, chunk)
      : fusedLinearLoss(head.hidden, head.weight, head.bias, labels, teacher, o, normalizer, chunk);
  got.loss.backward();
  EXPECT_EQ(got.tokens, ref.tokens);
  e.loss = relErr(got.loss, ref.loss);
  if (o.alpha > 0) e.kd = relErr(got.kd, ref.kd);
  if (o.alpha < 1) e.ce = relErr(got.ce, ref.ce);
  e.h = relErr(head.hidden.grad(), gh);
  e.w = relErr(head.weight.grad(), gw);
  if (gb.defined()) e.b = relErr(head.bias.grad(), gb);
  return e;
}

// Every kind x teacher form x bias x chunk size, fused kernel and ATen ops.
TEST(FusedLinearLoss, EqualsTheUnfusedLossOnMaterialisedLogits) {
  const int64_t n = 29, d = 6, v = 41;
  double worst = 0;
  int cases = 0;
  for (bool aten : {false, true}) {
    for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
      for (const char* mode : {"dense", "topk", "topk_lse", "topk_tail"}) {
        if (std::string(kind) == "reverse_kl" && std::string(mode) == "topk") continue; // a ConfigError
        for (bool withBias : {true, false}) {
          for (int64_t chunk : {0, 1, 4, 5, 7, 64}) {
            for (double alpha : {0.5, 1.0, 0.0}) {
              Head head = makeHead(n, d, v, withBias, static_cast<uint64_t>(cases + 1));
              auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(1000 + cases));
              at::Tensor t = at::randn({n, v}, gen, at::kDouble) * 2;
              LossOptions o;
              o.kind = parseEnum<LossKind>(kind).value();
              o.temperature = 1.7;
              o.alpha = alpha;
              o.chunk_tokens = 3; // distillLoss's own chunks: unrelated to fusedLinearLoss's
              at::Tensor labels = labelsFor(n, v, static_cast<uint64_t>(cases), false);
              Errors e = compare(head, labels, teacherFor(mode, t, o.temperature), o, 57.0, chunk, aten);
              worst = std::max(worst, e.worst());
              EXPECT_LE(e.worst(), 1e-6) << kind << " " << mode << (aten ? " aten" : " fused") << " bias " << withBias
                                         << " chunk " << chunk << " alpha " << alpha << ": loss " << e.loss << " kd "
                                         << e.kd << " ce " << e.ce << " d/dhidden " << e.h << " d/dweight " << e.w
                                         << " d/dbias " << e.b;
              ++cases;
            }
          }
        }
      }
    }
  }
  std::printf("%d cases, worst relative error %.3g\n", cases, worst);
}

// Every label ignored: loss 0 (normalizer 0 allowed), zero gradients that flow.
TEST(FusedLinearLoss, AllIgnoredGivesZeroLossAndZeroGradients) {
  for (const char* mode : {"dense", "topk_tail"}) {
    Head head = makeHead(13, 4, 17, true, 5);
    at::Tensor t = at::randn({13, 17}, at::kDouble);
    LossOptions o;
    at::Tensor labels = labelsFor(13, 17, 1, true);
    LossResult r = fusedLinearLoss(head.hidden, head.weight, head.bias, labels, teacherFor(mode, t, 1.0), o, 0.0, 4);
    EXPECT_EQ(r.tokens, 0);
    EXPECT_EQ(r.loss.item<double>(), 0.0);
    r.loss.backward();
    EXPECT_EQ(head.hidden.grad().abs().max().item<double>(), 0.0);
    EXPECT_EQ(head.weight.grad().abs().max().item<double>(), 0.0);
    EXPECT_EQ(head.bias.grad().abs().max().item<double>(), 0.0);
  }
}

// Backward scales by the incoming gradient; no grad mode gives the same value;
// a frozen projection gets no gradient; leading dims [B, T, d] flatten.
TEST(FusedLinearLoss, BackwardScalesNoGradAndFrozenWeight) {
  Head head = makeHead(12, 5, 19, true, 9);
  at::Tensor t = at::randn({12, 19}, at::kDouble);
  at::Tensor labels = labelsFor(29, 19, 3, false).narrow(0, 0, 12).clone();
  LossOptions o;
  o.kind = LossKind::kJsd;
  TeacherOutput teacher = teacherFor("dense", t, 1.0);
  LossResult r1 = fusedLinearLoss(head.hidden, head.weight, head.bias, labels, teacher, o, 11.0, 5);
  r1.loss.backward();
  const at::Tensor gh = head.hidden.grad().clone(), gw = head.weight.grad().clone();
  clearGrads(head);
  LossResult r3 =
      fusedLinearLoss(head.hidden.view({3, 4, 5}), head.weight, head.bias, labels.view({3, 4}), teacher, o, 11.0, 5);
  (r3.loss * 3.0).backward();
  EXPECT_LE(relErr(head.hidden.grad(), gh * 3.0), 1e-12);
  EXPECT_LE(relErr(head.weight.grad(), gw * 3.0), 1e-12);
  {
    at::NoGradGuard noGrad;
    LossResult r = fusedLinearLoss(head.hidden, head.weight, head.bias, labels, teacher, o, 11.0, 5);
    EXPECT_FALSE(r.loss.requires_grad());
    EXPECT_EQ(r.loss.item<double>(), r1.loss.item<double>());
  }
  clearGrads(head);
  at::Tensor frozen = head.weight.detach();
  LossResult rf = fusedLinearLoss(head.hidden, frozen, at::Tensor(), labels, teacher, o, 11.0, 5);
  rf.loss.backward();
  EXPECT_TRUE(head.hidden.grad().defined());
  EXPECT_FALSE(head.weight.grad().defined());
  EXPECT_THROW(rf.loss.backward(), distill::UsageError); // its gradients were handed on
}

TEST(FusedLinearLoss, BadShapesNameTheTensors) {
  Head head = makeHead(6, 4, 9, true, 2);
  at::Tensor labels = at::zeros({6}, at::kLong);
  TeacherOutput teacher{LogitsAnswer{at::randn({6, 9}, at::kDouble)}};
  LossOptions o;
  auto message = [&](const at::Tensor& h, const at::Tensor& w, const at::Tensor& b, const at::Tensor& l) {
    try {
      fusedLinearLoss(h, w, b, l, teacher, o, 6.0);
    } catch (const ProtocolError& e) {
      return std::string(e.what());
    }
    return std::string("no ProtocolError");
  };
  EXPECT_NE(message(head.hidden, head.weight.t(), head.bias, labels).find("weight [4, 9]"), std::string::npos);
  EXPECT_NE(message(head.hidden, head.weight, head.bias.narrow(0, 0, 8), labels).find("bias [8]"), std::string::npos);
  EXPECT_NE(message(head.hidden.to(at::kFloat), head.weight, head.bias, labels).find("Float"), std::string::npos);
  const std::string m = message(head.hidden, head.weight, head.bias, at::zeros({5}, at::kLong));
  EXPECT_NE(m.find("fusedLinearLoss: labels"), std::string::npos) << m;
}

// Memory beyond the inputs: the three gradients and two [chunk, V] buffers; the
// unfused loss holds [N, V] logits and their gradient.
TEST(FusedLinearLoss, MemoryIsTwoChunksOfLogits) {
  const int64_t n = 1024, d = 64, v = 32000, chunk = 128;
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counting(), /*priority=*/100);
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
    at::Tensor h = at::randn({n, d}, gen, at::kFloat).requires_grad_(true);
    at::Tensor w = (at::randn({v, d}, gen, at::kFloat) * 0.1).requires_grad_(true);
    at::Tensor t = at::randn({n, v}, gen, at::kFloat);
    auto [vals, idx] = t.topk(64, 1);
    TeacherOutput teacher{TopkAnswer{vals, idx, at::logsumexp(t, 1), {}}};
    t.reset();
    at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
    LossOptions o;
    const int64_t inputs = counting().live();
    counting().resetPeak();
    fusedLinearLoss(h, w, at::Tensor(), labels, teacher, o, n, chunk).loss.backward();
    const int64_t fused = counting().peak() - inputs;
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    counting().resetPeak();
    distillLoss(at::mm(h, w.t()), labels, teacher, o, n).loss.backward();
    const int64_t unfused = counting().peak() - inputs;
    const int64_t grads = (n * d + v * d) * 4, chunkLogits = chunk * v * 4;
    std::printf("peak beyond inputs: fused %.1f MiB (gradients %.1f + %.1f chunk buffers of %.1f), unfused %.1f MiB\n",
                fused / 1048576.0, grads / 1048576.0, double(fused - grads) / chunkLogits, chunkLogits / 1048576.0,
                unfused / 1048576.0);
    EXPECT_LE(fused, grads + 3 * chunkLogits);
    EXPECT_GE(unfused, 2 * n * v * 4);
  }
  c10::SetCPUAllocator(before, /*priority=*/100);
}

} // namespace
} // namespace distill

namespace distill {
namespace {

// On a GPU, bf16 and fp16 hidden states and weight (the weight gradient's half-precision GEMM with
// float32 accumulation, whichever overload this torch has): the loss and the three gradients
// against the float64 CPU reference of the same values, within half-precision rounding.
TEST(FusedLinearLoss, HalfPrecisionOnCudaMatchesTheFloat64Reference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  const int64_t n = 300, d = 64, v = 1000;
  for (at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
    for (const char* mode : {"dense", "topk_lse"}) {
      Head ref = makeHead(n, d, v, true, 7);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
      at::Tensor t = at::randn({n, v}, gen, at::kDouble) * 2;
      at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
      labels.narrow(0, 0, 20).fill_(-100);
      LossOptions o;
      o.alpha = 0.5;
      const double tokens = 280;
      // The reference: the same (rounded) values in float64 on the CPU.
      Head h;
      h.hidden = ref.hidden.detach().to(dt).to(at::kCUDA).requires_grad_(true);
      h.weight = ref.weight.detach().to(dt).to(at::kCUDA).requires_grad_(true);
      h.bias = ref.bias.detach().to(dt).to(at::kCUDA).requires_grad_(true);
      for (at::Tensor* x : {&ref.hidden, &ref.weight, &ref.bias}) {
        *x = x->detach().to(dt).to(at::kDouble).requires_grad_(true);
      }
      LossResult want = distillLoss(at::addmm(ref.bias, ref.hidden, ref.weight.t()), labels,
                                    teacherFor(mode, t, o.temperature), o, tokens);
      want.loss.backward();
      TeacherOutput tc = teacherFor(mode, t.to(at::kFloat), o.temperature);
      for (at::Tensor* x : tc.tensors()) {
        if (x->defined()) *x = x->to(at::kCUDA);
      }
      LossResult got = fusedLinearLoss(h.hidden, h.weight, h.bias, labels.to(at::kCUDA), tc, o, tokens, 64);
      got.loss.backward();
      const double tol = dt == at::kHalf ? 1e-2 : 6e-2; // max error over max value; bf16 keeps 8 bits
      EXPECT_LE(relErr(got.loss.cpu(), want.loss), tol) << c10::toString(dt) << " " << mode;
      EXPECT_LE(relErr(h.hidden.grad().cpu(), ref.hidden.grad()), tol) << c10::toString(dt) << " " << mode;
      EXPECT_LE(relErr(h.weight.grad().cpu(), ref.weight.grad()), tol) << c10::toString(dt) << " " << mode;
      EXPECT_LE(relErr(h.bias.grad().cpu(), ref.bias.grad()), tol) << c10::toString(dt) << " " << mode;
      EXPECT_EQ(h.weight.grad().scalar_type(), dt);
    }
  }
}

} // namespace
} // namespace distill
