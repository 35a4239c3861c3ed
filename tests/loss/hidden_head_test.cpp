// The teacher as hidden states + head (distill/loss/hidden_head.h). In float64,
// fusedLinearLoss from the teacher's hidden states and head equals, to 1e-9,
// the loss and the gradients w.r.t. the student's hidden states, weight and
// bias of the full-logits path given teacher logits = transform(hidden @ W.T +
// b) computed here with plain ATen ops: fusedLinearLoss with those logits and
// distillLoss on the student's materialised logits. Every kind, alpha 0.5 | 1
// | 0, T 1 and 2.5, with and without the head's bias, no transform, soft-capping
// or scaling, the same vocabulary or a padded head truncated (loss.vocab
// truncate, the dropped mass reported as the materialised path reports it),
// ignored tokens, chunk sizes that do not divide N; fused CPU kernel and
// ATen-op path. teacherLogits (the materialised helper) gives those logits. The
// head's errors, the truncation errors as the materialised path says them, no
// gradient into the teacher, and memory: the fused two-head path holds chunks,
// never [N, V].

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <limits>
#include <string>

#include "counting_allocator.h"
#include "distill/core/errors.h"
#include "distill/loss/hidden_head.h"
#include "distill/loss/losses.h"
#include "support/expect_throw.h"

namespace distill {
namespace {

using testing::expectThrow;

constexpr int64_t kN = 29, kDs = 6, kDt = 9, kVs = 41, kPad = 7, kIgnore = -100;

// max |a - b| / max(max |b|, 1).
double relErr(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1.0);
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / scale;
}

struct Student {
  at::Tensor h, w, b; // leaves that require grad (b: when used)
};

Student makeStudent(bool bias, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Student s;
  s.h = at::randn({kN, kDs}, gen, at::kDouble).requires_grad_(true);
  s.w = (at::randn({kVs, kDs}, gen, at::kDouble) * 0.7).requires_grad_(true);
  if (bias) s.b = at::randn({kVs}, gen, at::kDouble).requires_grad_(true);
  return s;
}

struct Teacher {
  at::Tensor h; // [N, d_t]
  TeacherHead head;
};

// Logits of std ~2.5 (so that a softcap of 3 bends them); `transform`: none | softcap | scale.
Teacher makeTeacher(int64_t vt, bool bias, const std::string& transform, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Teacher t;
  t.h = at::randn({kN, kDt}, gen, at::kDouble);
  t.head.weight = at::randn({vt, kDt}, gen, at::kDouble) * (2.5 / 3.0);
  if (bias) t.head.bias = at::randn({vt}, gen, at::kDouble);
  if (transform == "softcap") t.head.softcap = 3.0;
  if (transform == "scale") t.head.scale = 0.7;
  return t;
}

// The teacher's logits as its own forward makes them, in plain ATen ops.
at::Tensor referenceLogits(const Teacher& t) {
  at::Tensor z = at::mm(t.h, t.head.weight.t());
  if (t.head.bias.defined()) z = z + t.head.bias;
  z = z * t.head.scale;
  if (t.head.softcap > 0) z = t.head.softcap * at::tanh(z / t.head.softcap);
  return z;
}

// A few ignored labels, and tokens 10..19 all ignored (whole chunks of 5 without a valid token).
at::Tensor makeLabels(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor labels = at::randint(0, kVs, {kN}, gen, at::kLong);
  labels[2] = kIgnore;
  labels.narrow(0, 10, 10).fill_(kIgnore);
  labels[kN - 1] = kIgnore;
  return labels;
}

struct Outcome {
  LossResult r;
  at::Tensor gh, gw, gb;
};

template <typename F>
Outcome run(Student& s, F&& loss) {
  for (at::Tensor* t : {&s.h, &s.w, &s.b}) {
    if (t->defined()) t->mutable_grad() = at::Tensor();
  }
  Outcome o;
  o.r = loss();
  o.r.loss.backward();
  o.gh = s.h.grad().clone();
  o.gw = s.w.grad().clone();
  if (s.b.defined()) o.gb = s.b.grad().clone();
  return o;
}

// The largest relative difference between two outcomes (the terms computed, the gradients, the mass).
double worstDiff(const Outcome& a, const Outcome& b, const LossOptions& o) {
  double e = relErr(a.r.loss, b.r.loss);
  if (o.alpha > 0) e = std::max(e, relErr(a.r.kd, b.r.kd));
  if (o.alpha < 1) e = std::max(e, relErr(a.r.ce, b.r.ce));
  e = std::max({e, relErr(a.gh, b.gh), relErr(a.gw, b.gw)});
  if (a.gb.defined()) e = std::max(e, relErr(a.gb, b.gb));
  e = std::max(e, std::abs(a.r.truncatedMassMax - b.r.truncatedMassMax));
  e = std::max(e, std::abs(a.r.truncatedMassSum - b.r.truncatedMassSum));
  if (a.r.tokens != b.r.tokens) e = 1;
  return e;
}

LossOptions optionsFor(const char* kind, double alpha, double temperature, bool padded) {
  LossOptions o;
  o.kind = parseEnum<LossKind>(kind).value();
  o.alpha = alpha;
  o.temperature = temperature;
  o.ignore_index = kIgnore;
  o.chunk_tokens = 3; // distillLoss's own chunks: unrelated to the fused loss's
  if (padded) {
    o.vocab = LossVocab::kTruncate;
    o.max_truncated_mass = 1; // the head's extra rows carry mass here on purpose
  }
  return o;
}

struct Case {
  const char* kind;
  double alpha, temperature;
  bool bias, padded, aten;
  std::string transform;
  int64_t chunk;
  std::string what() const {
    return std::string(kind) + " alpha " + std::to_string(alpha) + " T " + std::to_string(temperature) + " bias " +
        std::to_string(bias) + " padded " + std::to_string(padded) + " " + transform + " chunk " +
        std::to_string(chunk) + (aten ? " aten" : " fused");
  }
};

// One case: the hidden-state loss against the full-logits ones; returns the worst difference.
double checkCase(const Case& c, uint64_t seed) {
  Student s = makeStudent(c.bias, seed);
  const Teacher t = makeTeacher(c.padded ? kVs + kPad : kVs, c.bias, c.transform, seed + 7);
  const at::Tensor labels = makeLabels(seed);
  const LossOptions o = optionsFor(c.kind, c.alpha, c.temperature, c.padded);
  const double norm = 57;
  TeacherOutput full;
  full.makeLogits().logits = referenceLogits(t);
  full.vocab = full.logits()->logits.size(1);
  EXPECT_LE(relErr(teacherLogits(t.h, t.head, c.chunk), full.logits()->logits), 1e-12) << c.what();
  const Outcome got = run(s, [&] {
    return c.aten ? detail::fusedLinearLossAtenOps(s.h, s.w, s.b, labels, t.h, t.head, o, norm, c.chunk)
                  : fusedLinearLoss(s.h, s.w, s.b, labels, t.h, t.head, o, norm, c.chunk);
  });
  const Outcome fused = run(s, [&] {
    return c.aten ? detail::fusedLinearLossAtenOps(s.h, s.w, s.b, labels, full, o, norm, c.chunk)
                  : fusedLinearLoss(s.h, s.w, s.b, labels, full, o, norm, c.chunk);
  });
  const Outcome materialised = run(s, [&] {
    const at::Tensor z = s.b.defined() ? at::addmm(s.b, s.h, s.w.t()) : at::mm(s.h, s.w.t());
    return c.aten ? detail::distillLossAtenOps(z, labels, full, o, norm) : distillLoss(z, labels, full, o, norm);
  });
  const double e1 = worstDiff(got, fused, o), e2 = worstDiff(got, materialised, o);
  EXPECT_LE(e1, 1e-9) << c.what() << ": against fusedLinearLoss with the teacher's logits";
  EXPECT_LE(e2, 1e-9) << c.what() << ": against distillLoss on the materialised logits";
  if (c.padded && c.alpha > 0) EXPECT_GT(got.r.truncatedMassMax, 0.01) << c.what(); // truncation did drop mass
  return std::max(e1, e2);
}

TEST(HiddenHead, EveryKindEqualsTheFullLogitsLoss) {
  double worst = 0;
  int cases = 0;
  for (bool aten : {false, true}) {
    for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
      for (double alpha : {0.5, 1.0, 0.0}) {
        for (double temperature : {1.0, 2.5}) {
          for (bool bias : {true, false}) {
            for (const char* transform : {"none", "softcap", "scale"}) {
              for (bool padded : {false, true}) {
                for (int64_t chunk : {0, 5}) {
                  const Case c{kind, alpha, temperature, bias, padded, aten, transform, chunk};
                  worst = std::max(worst, checkCase(c, static_cast<uint64_t>(100 + cases)));
                  ++cases;
                }
              }
            }
          }
        }
      }
    }
  }
  std::printf("%d cases, worst relative difference %.3g\n", cases, worst);
}

// Every label ignored: loss 0 (normalizer 0 allowed), zero gradients that flow, nothing truncated.
TEST(HiddenHead, AllIgnoredGivesZeroLossAndZeroGradients) {
  Student s = makeStudent(true, 1);
  const Teacher t = makeTeacher(kVs + kPad, true, "softcap", 2);
  const at::Tensor labels = at::full({kN}, kIgnore, at::kLong);
  const LossOptions o = optionsFor("jsd", 0.5, 2.0, true);
  const Outcome r = run(s, [&] { return fusedLinearLoss(s.h, s.w, s.b, labels, t.h, t.head, o, 0.0, 4); });
  EXPECT_EQ(r.r.tokens, 0);
  EXPECT_EQ(r.r.loss.item<double>(), 0.0);
  EXPECT_EQ(r.gh.abs().max().item<double>(), 0.0);
  EXPECT_EQ(r.gw.abs().max().item<double>(), 0.0);
  EXPECT_EQ(r.r.truncatedMassMax, 0.0);
}

// The teacher's tensors get no gradient even when they require it; no grad mode gives the same
// value; leading dims [B, T, d] flatten on both sides.
TEST(HiddenHead, NoGradientIntoTheTeacherAndLeadingDims) {
  Student s = makeStudent(true, 3);
  Teacher t = makeTeacher(kVs, true, "none", 4);
  t.h.requires_grad_(true);
  t.head.weight.requires_grad_(true);
  const at::Tensor labels = makeLabels(5);
  const LossOptions o = optionsFor("forward_kl", 0.5, 2.0, false);
  const Outcome flat = run(s, [&] { return fusedLinearLoss(s.h, s.w, s.b, labels, t.h, t.head, o, 19.0, 7); });
  EXPECT_FALSE(t.h.grad().defined());
  EXPECT_FALSE(t.head.weight.grad().defined());
  const at::Tensor h3 = s.h.view({1, kN, kDs}), th3 = t.h.view({kN, 1, kDt});
  const Outcome shaped =
      run(s, [&] { return fusedLinearLoss(h3, s.w, s.b, labels.view({1, kN}), th3, t.head, o, 19.0, 7); });
  EXPECT_LE(worstDiff(shaped, flat, o), 1e-12);
  EXPECT_EQ(teacherLogits(th3, t.head).sizes(), (at::IntArrayRef{kN, 1, kVs}));
  at::NoGradGuard noGrad;
  const LossResult r = fusedLinearLoss(s.h, s.w, s.b, labels, t.h, t.head, o, 19.0, 7);
  EXPECT_FALSE(r.loss.requires_grad());
  EXPECT_EQ(r.loss.item<double>(), flat.r.loss.item<double>());
}

// The answer kind (HiddenAnswer in TeacherOutput, as a Client hands it): fusedLinearLoss takes the
// chunked path, distillLoss the materialised one (a padded head truncated too); both equal the
// full-logits loss. Without its head the answer is refused.
TEST(HiddenHead, AHiddenAnswerIsReadWithItsHead) {
  Student s = makeStudent(true, 31);
  Teacher t = makeTeacher(kVs + kPad, true, "softcap", 32);
  const at::Tensor labels = makeLabels(33);
  const LossOptions o = optionsFor("jsd", 0.5, 2.0, /*padded=*/true);
  const TeacherOutput dense{LogitsAnswer{referenceLogits(t)}, kVs + kPad};
  const TeacherOutput hidden{HiddenAnswer{t.h, std::make_shared<const TeacherHead>(t.head)}, kVs + kPad};
  EXPECT_EQ(hidden.kind(), AnswerKind::kHidden);
  const Outcome want = run(s, [&] { return fusedLinearLoss(s.h, s.w, s.b, labels, dense, o, 19.0, 5); });
  const Outcome fused = run(s, [&] { return fusedLinearLoss(s.h, s.w, s.b, labels, hidden, o, 19.0, 5); });
  EXPECT_LE(worstDiff(fused, want, o), 1e-9);
  const at::Tensor z = at::addmm(s.b, s.h, s.w.t());
  const LossResult a = distillLoss(z, labels, dense, o, 19.0), b = distillLoss(z, labels, hidden, o, 19.0);
  EXPECT_LE(relErr(b.loss, a.loss), 1e-12);
  EXPECT_LE(relErr(b.loss, want.r.loss), 1e-9);
  TeacherOutput headless = hidden;
  headless.hidden()->head = nullptr;
  EXPECT_NE(expectThrow<UsageError>([&] { distillLoss(z, labels, headless, o, 19.0); }).find("no head came with them"),
            std::string::npos);
  EXPECT_NE(expectThrow<UsageError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, headless, o, 19.0); })
                .find("no head came with them"),
            std::string::npos);
}

// teacher.on_nonfinite mask marks a token's hidden row all NaN; Steps then ignores its label for the
// kd term: such rows never reach the loss, on either path.
TEST(HiddenHead, AMaskedHiddenRowOfAnIgnoredTokenIsNeverRead) {
  Student s = makeStudent(false, 41);
  Teacher t = makeTeacher(kVs, false, "none", 42);
  at::Tensor labels = makeLabels(43);
  labels[4] = kIgnore;
  const LossOptions o = optionsFor("forward_kl", 0.5, 1.0, false);
  const auto head = std::make_shared<const TeacherHead>(t.head);
  const TeacherOutput clean{HiddenAnswer{t.h, head}, kVs};
  at::Tensor marked = t.h.clone();
  marked[4].fill_(std::numeric_limits<double>::quiet_NaN());
  const TeacherOutput masked{HiddenAnswer{marked, head}, kVs};
  const Outcome a = run(s, [&] { return fusedLinearLoss(s.h, s.w, s.b, labels, clean, o, 19.0, 5); });
  const Outcome b = run(s, [&] { return fusedLinearLoss(s.h, s.w, s.b, labels, masked, o, 19.0, 5); });
  EXPECT_LE(worstDiff(b, a, o), 1e-12);
  const at::Tensor z = at::mm(s.h, s.w.t());
  EXPECT_LE(relErr(distillLoss(z, labels, masked, o, 19.0).loss, distillLoss(z, labels, clean, o, 19.0).loss), 1e-12);
}

// A padded head whose extra rows carry mass above loss.max_truncated_mass, or whose logits are not
// finite: the materialised path's errors, word for word.
TEST(HiddenHead, TruncationErrorsAreTheMaterialisedPaths) {
  Student s = makeStudent(false, 6);
  const at::Tensor labels = makeLabels(7);
  LossOptions o = optionsFor("forward_kl", 0.5, 1.0, true);
  o.max_truncated_mass = 1e-4;
  for (bool nan : {false, true}) {
    Teacher t = makeTeacher(kVs + kPad, true, "softcap", 8);
    if (nan) t.h[4].fill_(std::numeric_limits<double>::quiet_NaN());
    TeacherOutput full;
    full.makeLogits().logits = referenceLogits(t);
    const std::string want =
        expectThrow<ProtocolError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, full, o, 20.0, 5); });
    const std::string got =
        expectThrow<ProtocolError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, t.h, t.head, o, 20.0, 5); });
    EXPECT_EQ(got, want);
    EXPECT_NE(got.find(nan ? "not finite" : "the most at id "), std::string::npos) << got;
  }
}

TEST(HiddenHead, BadHeadsAndHiddenStatesAreRefused) {
  Student s = makeStudent(true, 9);
  const Teacher t = makeTeacher(kVs, true, "none", 10);
  const at::Tensor labels = makeLabels(11);
  const LossOptions o = optionsFor("forward_kl", 0.5, 1.0, false);
  auto usage = [&](TeacherHead head, const std::string& part) {
    const std::string m = expectThrow<UsageError>([&] { validateTeacherHead(head); });
    EXPECT_NE(m.find(part), std::string::npos) << m;
    const std::string m2 =
        expectThrow<UsageError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, t.h, head, o, 20.0); });
    EXPECT_EQ(m2, m);
  };
  TeacherHead h = t.head;
  h.weight = t.head.weight.select(1, 0);
  usage(h, "TeacherHead: weight: expected a floating [V_t, d_t]");
  h.weight = t.head.weight.to(at::kLong);
  usage(h, "Long");
  h = t.head;
  h.bias = t.head.bias.narrow(0, 0, kVs - 1);
  usage(h, "TeacherHead: bias: expected [41] Double");
  h.bias = t.head.bias.to(at::kFloat);
  usage(h, "found [41] Float");
  h = t.head;
  h.softcap = -1;
  usage(h, "softcap must be finite and >= 0");
  h.softcap = std::numeric_limits<double>::infinity();
  usage(h, "softcap");
  h = t.head;
  h.scale = 0;
  usage(h, "scale must be finite and > 0");
  // What the teacher sent: hidden states of another width or token count, a head narrower than
  // the student's vocabulary.
  std::string m =
      expectThrow<ProtocolError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, t.h.narrow(1, 0, 5), t.head, o, 20.0); });
  EXPECT_NE(m.find("teacher hidden states: expected floating [..., 9]"), std::string::npos) << m;
  m = expectThrow<ProtocolError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, t.h.narrow(0, 0, 5), t.head, o, 20.0); });
  EXPECT_NE(m.find("teacher hidden states hold 5 tokens"), std::string::npos) << m;
  m = expectThrow<ProtocolError>([&] { teacherLogits(t.h.to(at::kLong), t.head); });
  EXPECT_NE(m.find("teacherLogits: teacher hidden states"), std::string::npos) << m;
  h = t.head;
  h.weight = t.head.weight.narrow(0, 0, kVs - 3);
  h.bias = t.head.bias.narrow(0, 0, kVs - 3);
  m = expectThrow<ProtocolError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, t.h, h, o, 20.0); });
  EXPECT_NE(m.find("the teacher's vocabulary has 38 entries, the student's 41"), std::string::npos) << m;
  // A padded head with loss.vocab error.
  const Teacher padded = makeTeacher(kVs + kPad, false, "none", 12);
  m = expectThrow<ProtocolError>([&] { fusedLinearLoss(s.h, s.w, s.b, labels, padded.h, padded.head, o, 20.0); });
  EXPECT_NE(m.find("(loss.vocab: error)"), std::string::npos) << m;
}

// Memory beyond the inputs (student hidden and weight, teacher hidden and head): the student's
// gradients and a few [chunk, V] buffers (logits, their gradient, the teacher's logits), never
// [N, V]; the materialised path holds the teacher's and the student's [N, V] logits and gradient.
TEST(HiddenHead, MemoryStaysFarBelowTheMaterialisedPath) {
  const int64_t n = 1024, d = 64, v = 32000, chunk = 128;
  c10::Allocator* before = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&counting(), /*priority=*/100);
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
    at::Tensor h = at::randn({n, d}, gen, at::kFloat).requires_grad_(true);
    at::Tensor w = (at::randn({v, d}, gen, at::kFloat) * 0.1).requires_grad_(true);
    at::Tensor th = at::randn({n, d}, gen, at::kFloat);
    TeacherHead head;
    head.weight = at::randn({v, d}, gen, at::kFloat) * 0.2;
    head.softcap = 30;
    at::Tensor labels = at::randint(0, v, {n}, gen, at::kLong);
    LossOptions o;
    const int64_t inputs = counting().live();
    counting().resetPeak();
    fusedLinearLoss(h, w, at::Tensor(), labels, th, head, o, n, chunk).loss.backward();
    const int64_t fused = counting().peak() - inputs;
    h.mutable_grad() = at::Tensor();
    w.mutable_grad() = at::Tensor();
    counting().resetPeak();
    TeacherOutput full;
    full.makeLogits().logits = teacherLogits(th, head);
    distillLoss(at::mm(h, w.t()), labels, full, o, n).loss.backward();
    full.logits()->logits.reset();
    const int64_t materialised = counting().peak() - inputs;
    const int64_t grads = (n * d + v * d) * 4, chunkLogits = chunk * v * 4;
    std::printf("peak beyond inputs: fused two-head %.1f MiB (gradients %.1f + %.1f chunk buffers of %.1f), "
                "materialised %.1f MiB (ratio %.3f)\n",
                fused / 1048576.0, grads / 1048576.0, double(fused - grads) / chunkLogits, chunkLogits / 1048576.0,
                materialised / 1048576.0, double(fused) / materialised);
    EXPECT_LE(fused, grads + 4 * chunkLogits);
    EXPECT_GE(materialised, 3 * n * v * 4);
    EXPECT_LE(fused, 0.3 * materialised);
  }
  c10::SetCPUAllocator(before, /*priority=*/100);
}

} // namespace
} // namespace distill
