// loss.vocab (losses.h, "Vocabularies that differ"; docs/vocab.md): a teacher
// vocabulary V_t larger than the student's V_s. truncate gives, in float64 to
// 1e-9, the loss and gradient against a teacher that had only the V_s ids
// (renormalised), for dense and top-k teachers (values only, with logsumexp,
// with log tail), every kind, on the fused CPU kernel, the ATen-op path and
// fusedLinearLoss; the dropped mass it reports equals its closed form; error
// mode, a smaller teacher and a teacher whose extra ids carry mass are errors
// naming what they must.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#include "distill/core/errors.h"
#include "distill/loss/losses.h"
#include "support/expect_throw.h"

namespace distill {
namespace {

using testing::expectThrow;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kN = 12, kVs = 40, kVt = kVs + 8, kK = 6, kIgnore = -100;

double maxDiff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

struct Data {
  at::Tensor zs; // student logits [N, Vs]
  at::Tensor zt; // teacher logits [N, Vt]
  at::Tensor labels; // [N], rows 3 and 7 ignored
};

// Row r gives r % 4 of the extra ids logits far above the rest (they are in its
// top-k) and the others -inf (no mass outside the top-k), so the top-k teacher
// restricted to the V_s ids is known exactly. `denseExtra`: every extra id a
// finite logit instead (dense teachers).
Data makeData(uint64_t seed, bool denseExtra) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Data d;
  d.zs = at::randn({kN, kVs}, gen, at::kDouble) * 2;
  d.zt = at::randn({kN, kVt}, gen, at::kDouble) * 2;
  if (!denseExtra) {
    at::Tensor extra = d.zt.narrow(1, kVs, kVt - kVs);
    extra.fill_(-kInf);
    for (int64_t r = 0; r < kN; ++r) {
      for (int64_t j = 0; j < r % 4; ++j) extra[r][j * 2] = 10 + at::rand({}, gen, at::kDouble).item<double>();
    }
  }
  d.labels = at::randint(0, kVs, {kN}, gen, at::kLong);
  d.labels[3] = kIgnore;
  d.labels[7] = kIgnore;
  return d;
}

// The top-k teacher of logits t [n, V] at temperature T: values only ("topk"),
// with logsumexp ("topk_lse"), or with logsumexp and log tail ("topk_tail").
TeacherOutput topkOf(const at::Tensor& t, int64_t k, const std::string& mode, double temperature) {
  auto [vals, idx] = t.topk(k, 1);
  TeacherOutput o{TopkAnswer{vals, idx.to(at::kInt), {}, {}}};
  if (mode != "topk") o.makeTopk().logsumexp = at::logsumexp(t / temperature, 1);
  if (mode == "topk_tail") o.makeTopk().logTail = at::logsumexp((t / temperature).scatter(1, idx, -kInf), 1);
  return o;
}

LossOptions options(LossKind kind, double temperature) {
  LossOptions o;
  o.kind = kind;
  o.temperature = temperature;
  o.alpha = 0.6;
  o.ignore_index = kIgnore;
  o.chunk_tokens = 5; // chunks that do not divide the 10 valid rows
  o.vocab = LossVocab::kTruncate;
  o.max_truncated_mass = 1; // the extra ids carry mass here on purpose
  return o;
}

struct Outcome {
  double loss = 0, massMax = -1, massSum = -1;
  at::Tensor grad;
};

template <typename F>
Outcome runLoss(const at::Tensor& zs, F&& fn) {
  at::Tensor z = zs.clone().requires_grad_(true);
  LossResult r = fn(z);
  r.loss.backward();
  return {r.loss.item<double>(), r.truncatedMassMax, r.truncatedMassSum, z.grad()};
}

// The reference: the teacher with only the V_s ids. Dense: its first V_s
// columns. Top-k: per row, the top-(k - d_r) of its first V_s logits (d_r of
// its top-k were extra ids) with the logsumexp and tail of those V_s logits;
// one distillLoss call per valid row (k differs between rows), summed.
Outcome reference(const Data& d, const std::string& mode, const LossOptions& o, double norm) {
  LossOptions plain = o;
  plain.vocab = LossVocab::kError;
  const at::Tensor small = d.zt.narrow(1, 0, kVs).contiguous();
  if (mode == "dense") {
    return runLoss(d.zs, [&](const at::Tensor& z) {
      return distillLoss(z, d.labels, TeacherOutput{LogitsAnswer{small}}, plain, norm);
    });
  }
  Outcome out;
  out.grad = at::zeros_like(d.zs);
  const at::Tensor dropped = (std::get<1>(d.zt.topk(kK, 1)) >= kVs).sum(1);
  for (int64_t r = 0; r < kN; ++r) {
    if (d.labels[r].item<int64_t>() == kIgnore) continue;
    const int64_t kr = kK - dropped[r].item<int64_t>();
    TeacherOutput t = topkOf(small.narrow(0, r, 1), kr, mode, o.temperature);
    Outcome one = runLoss(d.zs.narrow(0, r, 1), [&](const at::Tensor& z) {
      return distillLoss(z, d.labels.narrow(0, r, 1), t, plain, norm);
    });
    out.loss += one.loss;
    out.grad[r].copy_(one.grad[0]);
  }
  return out;
}

// The closed form of the dropped mass of each valid row: the teacher's
// probability (at T) of the ids >= V_s, over the full vocabulary (dense, and
// top-k with logsumexp or tail), or over the k values (top-k values only),
// counting the top-k's dropped entries.
at::Tensor closedFormMass(const Data& d, const std::string& mode, double temperature) {
  at::Tensor p;
  if (mode == "dense") {
    p = at::softmax(d.zt / temperature, 1).narrow(1, kVs, kVt - kVs).sum(1);
  } else {
    auto [vals, idx] = d.zt.topk(kK, 1);
    at::Tensor q =
        mode == "topk" ? at::softmax(vals / temperature, 1) : at::softmax(d.zt / temperature, 1).gather(1, idx);
    p = q.masked_fill(idx < kVs, 0).sum(1);
  }
  return p.index_select(0, (d.labels != kIgnore).nonzero().squeeze(1));
}

TeacherOutput bigTeacher(const Data& d, const std::string& mode, double temperature) {
  TeacherOutput t = mode == "dense" ? TeacherOutput{LogitsAnswer{d.zt}} : topkOf(d.zt, kK, mode, temperature);
  t.vocab = kVt;
  return t;
}

TEST(Vocab, TruncateEqualsTheTeacherOfTheStudentsVocabulary) {
  const double norm = 10; // the valid rows
  int checked = 0;
  for (const std::string mode : {"dense", "topk", "topk_lse", "topk_tail"}) {
    const Data d = makeData(11, mode == "dense");
    for (LossKind kind : {LossKind::kForwardKl, LossKind::kReverseKl, LossKind::kJsd}) {
      if (kind == LossKind::kReverseKl && mode == "topk") continue; // needs the teacher's tail
      for (double temperature : {1.0, 2.0}) {
        const LossOptions o = options(kind, temperature);
        const std::string what = mode + " kind " + std::to_string(int(kind)) + " T " + std::to_string(temperature);
        const Outcome ref = reference(d, mode, o, norm);
        const TeacherOutput t = bigTeacher(d, mode, temperature);
        const at::Tensor mass = closedFormMass(d, mode, temperature);
        auto fused = runLoss(d.zs, [&](const at::Tensor& z) { return distillLoss(z, d.labels, t, o, norm); });
        auto aten =
            runLoss(d.zs, [&](const at::Tensor& z) { return detail::distillLossAtenOps(z, d.labels, t, o, norm); });
        for (const Outcome* r : {&fused, &aten}) {
          EXPECT_NEAR(r->loss, ref.loss, 1e-9) << what;
          EXPECT_LT(maxDiff(r->grad, ref.grad), 1e-9) << what;
          EXPECT_NEAR(r->massMax, mass.max().item<double>(), 1e-12) << what;
          EXPECT_NEAR(r->massSum, mass.sum().item<double>(), 1e-12) << what;
        }
        EXPECT_GT(mass.max().item<double>(), 0.1) << what; // the extra ids did carry mass
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 22);
}

// fusedLinearLoss truncates as distillLoss does on hidden @ weight.T + bias.
TEST(Vocab, FusedLinearLossTruncates) {
  const double norm = 10;
  for (const std::string mode : {"dense", "topk", "topk_lse", "topk_tail"}) {
    const Data d = makeData(12, mode == "dense");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const at::Tensor h0 = at::randn({kN, 16}, gen, at::kDouble);
    const at::Tensor w = at::randn({kVs, 16}, gen, at::kDouble) * 0.5;
    const at::Tensor b = at::randn({kVs}, gen, at::kDouble);
    for (LossKind kind : {LossKind::kForwardKl, LossKind::kReverseKl, LossKind::kJsd}) {
      if (kind == LossKind::kReverseKl && mode == "topk") continue;
      const LossOptions o = options(kind, 2.0);
      const TeacherOutput t = bigTeacher(d, mode, 2.0);
      const at::Tensor logits = at::addmm(b, h0, w.t());
      Outcome ref = runLoss(logits, [&](const at::Tensor& z) { return distillLoss(z, d.labels, t, o, norm); });
      at::Tensor gradH = ref.grad.mm(w); // d loss / d hidden through the projection
      for (bool aten : {false, true}) {
        at::Tensor h = h0.clone().requires_grad_(true);
        LossResult r = aten ? detail::fusedLinearLossAtenOps(h, w, b, d.labels, t, o, norm, 4)
                            : fusedLinearLoss(h, w, b, d.labels, t, o, norm, 4);
        r.loss.backward();
        EXPECT_NEAR(r.loss.item<double>(), ref.loss, 1e-9) << mode << " " << int(kind) << " " << aten;
        EXPECT_LT(maxDiff(h.grad(), gradH), 1e-9) << mode << " " << int(kind) << " " << aten;
        EXPECT_NEAR(r.truncatedMassMax, ref.massMax, 1e-12) << mode;
        EXPECT_NEAR(r.truncatedMassSum, ref.massSum, 1e-12) << mode;
      }
    }
  }
}

// Padding rows (logits -1e4): nothing measurable is dropped, the loss is that
// of the student-sized teacher, and loss.max_truncated_mass's default passes.
TEST(Vocab, PaddingRowsAreDroppedSilently) {
  Data d = makeData(13, /*denseExtra=*/true);
  d.zt.narrow(1, kVs, kVt - kVs).fill_(-1e4);
  for (const std::string mode : {"dense", "topk_tail"}) {
    LossOptions o = options(LossKind::kForwardKl, 1.0);
    o.max_truncated_mass = 1e-4;
    const Outcome ref = reference(d, mode, o, 10);
    const TeacherOutput t = bigTeacher(d, mode, 1.0);
    Outcome r = runLoss(d.zs, [&](const at::Tensor& z) { return distillLoss(z, d.labels, t, o, 10); });
    EXPECT_NEAR(r.loss, ref.loss, 1e-9) << mode;
    EXPECT_EQ(r.massMax, 0.0) << mode;
    EXPECT_EQ(r.massSum, 0.0) << mode;
    // Same vocabularies: nothing truncated, nothing reported.
    TeacherOutput same = mode == "dense" ? TeacherOutput{LogitsAnswer{d.zt.narrow(1, 0, kVs)}}
                                         : topkOf(d.zt.narrow(1, 0, kVs), kK, mode, 1.0);
    LossResult plain = distillLoss(d.zs, d.labels, same, o, 10);
    EXPECT_EQ(plain.truncatedMassMax, -1.0);
  }
}

TEST(Vocab, Errors) {
  const Data d = makeData(14, /*denseExtra=*/true);
  LossOptions errorMode = options(LossKind::kForwardKl, 1.0);
  errorMode.vocab = LossVocab::kError;
  for (const std::string mode : {"dense", "topk_lse"}) {
    const Data dm = makeData(14, mode == "dense");
    const TeacherOutput t = bigTeacher(dm, mode, 1.0);
    std::string m = expectThrow<ProtocolError>([&] { distillLoss(dm.zs, dm.labels, t, errorMode, 10); });
    EXPECT_NE(m.find("48 entries"), std::string::npos) << m;
    EXPECT_NE(m.find("student's 40"), std::string::npos) << m;
    EXPECT_NE(m.find("loss.vocab"), std::string::npos) << m;
    // The extra ids carry mass: truncate refuses at the default bound, naming the mass.
    LossOptions strict = options(LossKind::kForwardKl, 1.0);
    strict.max_truncated_mass = 1e-4;
    m = expectThrow<ProtocolError>([&] { distillLoss(dm.zs, dm.labels, t, strict, 10); });
    EXPECT_NE(m.find("If those ids are padding rows"), std::string::npos) << m;
    EXPECT_NE(m.find("raise loss.max_truncated_mass above 0."), std::string::npos) << m;
    EXPECT_NE(m.find("loss.max_truncated_mass = 0.0001"), std::string::npos) << m;
    EXPECT_NE(m.find("probability 0."), std::string::npos) << m;
    EXPECT_NE(m.find(mode == "dense" ? "the most at id " : "of its top-"), std::string::npos) << m;
  }
  // A teacher vocabulary smaller than the student's: an error in both modes.
  const TeacherOutput narrow{LogitsAnswer{d.zt.narrow(1, 0, kVs - 4)}};
  for (LossVocab v : {LossVocab::kError, LossVocab::kTruncate}) {
    LossOptions o = options(LossKind::kForwardKl, 1.0);
    o.vocab = v;
    std::string m = expectThrow<ProtocolError>([&] { distillLoss(d.zs, d.labels, narrow, o, 10); });
    EXPECT_NE(m.find("36 entries"), std::string::npos) << m;
    EXPECT_NE(m.find("student's 40"), std::string::npos) << m;
  }
  // A stated vocabulary the logits contradict.
  TeacherOutput lying{LogitsAnswer{d.zt}};
  lying.vocab = kVt + 1;
  std::string m = expectThrow<ProtocolError>([&] { distillLoss(d.zs, d.labels, lying, errorMode, 10); });
  EXPECT_NE(m.find("49"), std::string::npos) << m;
}

// Issue 39 item 3: all of the mass on the dropped ids, or a teacher that is not
// finite, is said as measured, and dense and top-k follow one rule: an error
// whatever loss.max_truncated_mass (1 included), never a kd of 0.
TEST(Vocab, AllTheMassOrNotFiniteIsAnErrorForDenseAndTopk) {
  LossOptions loose = options(LossKind::kForwardKl, 1.0);
  loose.max_truncated_mass = 1;
  for (const std::string mode : {"dense", "topk_lse", "topk_tail"}) {
    Data d = makeData(15, mode == "dense");
    // No teacher mass on any id the student has: all of it on k of the extra ids (so that
    // the top-k holds it all too; top-k's measured mass then rounds to just below 1).
    d.zt.fill_(-kInf);
    d.zt.narrow(1, kVs, kK).fill_(1.0);
    std::string m =
        expectThrow<ProtocolError>([&] { distillLoss(d.zs, d.labels, bigTeacher(d, mode, 1.0), loose, 10); });
    EXPECT_NE(m.find("hold all of the teacher's probability"), std::string::npos) << mode << ": " << m;
    EXPECT_NE(m.find("nothing is left on the student's ids to renormalise"), std::string::npos) << m;
    EXPECT_EQ(m.find("probability 1 "), std::string::npos) << m;
    Data n = makeData(16, mode == "dense");
    n.zt[2].fill_(std::numeric_limits<double>::quiet_NaN());
    m = expectThrow<ProtocolError>([&] { distillLoss(n.zs, n.labels, bigTeacher(n, mode, 1.0), loose, 10); });
    EXPECT_NE(m.find(mode == "dense" ? "for token 2" : "token row 2 of"), std::string::npos) << mode << ": " << m;
    EXPECT_NE(m.find("not finite"), std::string::npos) << m;
    EXPECT_EQ(m.find("nan"), std::string::npos) << m;
  }
}

} // namespace
} // namespace distill
