// loss.vocab: a teacher whose vocabulary differs from the student's (losses.h,
// "Vocabularies that differ"; docs/vocab.md).
//
// The maths of truncate. Let q_j = softmax(z_T / T)_j over the teacher's V_t
// ids, K = [0, V_s) the ids the student has and m = sum_{j not in K} q_j the
// mass the others hold. The target is q restricted to K and renormalised,
// q'_j = q_j / (1 - m), i.e. the log-softmax of z_T / T over K alone:
// log q'_j = z_j / T - L' with L' = logsumexp_{j in K}(z_j / T) = L + log(1 - m),
// L the teacher's full logsumexp.
//   Dense: the columns K of the teacher's logits; the loss's log-softmax over
//     them is already log q'. m = exp(logsumexp_{j >= V_s}(z_j / T) - L),
//     summed over the dropped ids themselves (never 1 - a sum).
//   Top-k (values v_i at ids j_i, L = the teacher's logsumexp, or
//     logaddexp(logsumexp(v / T), logTail) with only the log tail, or
//     logsumexp(v / T) with neither): the entries D with j_i >= V_s leave; the
//     measured m = exp(logsumexp_{i in D}(v_i / T) - L). The kept buckets
//     v_i / T - L' with
//       logTail:       L' = logaddexp(logsumexp_{i not in D}(v_i / T), logTail)
//                     (the loss computes it from the remaining values: exact);
//       logsumexp:     L' = L + log1mexp(logsumexp_{i in D}(v_i / T) - L), and
//                     the tail 1 - sum q'_i as before;
//       neither:       the softmax over the remaining values.
//     The teacher's tail stays whole: how much of it lies at ids >= V_s the
//     teacher does not say, so m counts only the top-k's part (exact for
//     padding rows, whose logits never reach the top-k).
#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "distill/core/errors.h"
#include "loss_problem.h"

namespace distill::loss_impl {

namespace {

// A dropped mass this near 1 is all of it: float32 rounding of the top-k's
// buckets (a few eps32 per term) stays far below it.
constexpr double kAllMassTolerance = 1e-5;

// log(1 - exp(a)) for a <= 0 (Maechler's log1mexp).
at::Tensor log1mexp(const at::Tensor& a) {
  return at::where(a > -std::log(2.0), at::log(-at::expm1(a)), at::log1p(-at::exp(a)));
}

// The dropped mass of every valid row of a dense teacher, chunk by chunk: one
// [chunk, V_t] buffer at a time.
at::Tensor denseMass(const Problem& pb) {
  const int64_t nv = pb.valid.size(0);
  at::Tensor mass = at::empty({nv}, pb.tFull.options().dtype(pb.compute));
  for (int64_t c0 = 0; c0 < nv; c0 += pb.chunk) {
    const int64_t c = std::min(pb.chunk, nv - c0);
    at::Tensor s = pb.tFull.index_select(0, pb.valid.narrow(0, c0, c)).to(pb.compute).div_(pb.temperature);
    at::Tensor all = at::logsumexp(s, 1);
    at::Tensor dropped = at::logsumexp(s.narrow(1, pb.v, pb.vt - pb.v), 1);
    mass.narrow(0, c0, c).copy_(dropped.sub_(all).exp_());
  }
  return mass;
}

// Top-k: the dropped mass of every row, and the renormalised teacher (see the
// top of this file).
at::Tensor topkTruncate(Problem& pb) {
  const double inf = std::numeric_limits<double>::infinity();
  at::Tensor drop = pb.tIndices >= pb.v; // [N, k]
  at::Tensor s = pb.tValues.to(pb.compute).div(pb.temperature);
  at::Tensor full; // L
  if (pb.tLse.defined()) {
    full = pb.tLse.to(pb.compute);
  } else if (pb.tLogTail.defined()) {
    full = at::logaddexp(at::logsumexp(s, 1), pb.tLogTail.to(pb.compute));
  } else {
    full = at::logsumexp(s, 1);
  }
  at::Tensor lseDropped = at::logsumexp(s.masked_fill(~drop, -inf), 1); // -inf: nothing dropped
  at::Tensor mass = (lseDropped - full).exp();
  if (!anyTopkDropped(pb)) return mass; // all zeros
  pb.tNull = drop;
  pb.tValues = pb.tValues.masked_fill(drop, -inf);
  pb.tIndices = pb.tIndices.masked_fill(drop, 0);
  if (pb.tLse.defined()) pb.tLse = full + log1mexp((lseDropped - full).clamp_max(0));
  if (pb.tLse.defined() || pb.tLogTail.defined()) {
    pb.tLogSum = at::logsumexp(pb.tValues.to(pb.compute).div(pb.temperature), 1);
    if (pb.tLogTail.defined()) pb.tLogSum = at::logaddexp(pb.tLogSum, pb.tLogTail.to(pb.compute));
  }
  return mass;
}

} // namespace

int64_t teacherVocab(const Problem& pb, int64_t stated, int64_t width, const LossOptions& o) {
  int64_t vt = stated;
  if (width >= 0) {
    DISTILL_CHECK_T(ProtocolError, vt <= 0 || vt == width, pb.fn, ": the teacher stated a vocabulary of ", vt,
                    " entries but sent logits ", width, " wide");
    vt = width;
  }
  if (vt <= 0 || vt == pb.v) return pb.v;
  DISTILL_CHECK_T(ProtocolError, vt > pb.v, pb.fn, ": the teacher's vocabulary has ", vt, " entries, the student's ",
                  pb.v, ": the student's ids >= ", vt,
                  " have no teacher probability, and loss.vocab (error | truncate) only bridges a teacher vocabulary "
                  "LARGER than the student's (docs/vocab.md)");
  DISTILL_CHECK_T(ProtocolError, o.vocab == LossVocab::kTruncate, pb.fn, ": the teacher's vocabulary has ", vt,
                  " entries, the student's ", pb.v,
                  " (loss.vocab: error); set loss.vocab: truncate to drop the teacher's ids >= ", pb.v,
                  " and renormalise the rest, when they are padding (docs/vocab.md)");
  return vt;
}

bool anyTopkDropped(const Problem& pb) { return (pb.tIndices >= pb.v).any().item<bool>(); }

void truncateTeacher(Problem& pb, const LossOptions& o) {
  at::Tensor mass = pb.tFull.defined() ? denseMass(pb) : topkTruncate(pb);
  if (!pb.tFull.defined() && !pb.allValid) mass = mass.index_select(0, pb.valid);
  std::function<at::Tensor(int64_t)> denseRow;
  if (pb.tFull.defined()) denseRow = [&pb](int64_t row) { return pb.tFull[row]; };
  checkTruncatedMass(pb, o.max_truncated_mass, mass, denseRow);
}

void checkTruncatedMass(Problem& pb, double maxMass, const at::Tensor& mass,
                        const std::function<at::Tensor(int64_t)>& denseRow) {
  pb.massMax = 0, pb.massSum = 0;
  if (mass.numel() == 0) return;
  at::Tensor worst = mass.argmax();
  // NaN compares false: a row whose mass is NaN fails too.
  const double mx = mass.max().item<double>();
  pb.massSum = mass.sum(at::kDouble).item<double>();
  pb.massMax = mx;
  // One rule for dense and top-k: a mass within rounding of 1 is all of it
  // (top-k's rounds to 0.9999999 where dense's is exactly 1), whatever the bound.
  const bool all = mx >= 1 - kAllMassTolerance;
  if (mx <= maxMass && !all) return;
  const int64_t row = pb.valid[worst.item<int64_t>()].item<int64_t>();
  const std::string head = std::string(pb.fn) + ": loss.vocab truncate: for token " + std::to_string(row) + ", the teacher's ids >= " +
      std::to_string(pb.v) + " (of its " + std::to_string(pb.vt) + ")";
  DISTILL_CHECK_T(ProtocolError, std::isfinite(mx), head,
                  " hold a probability that is not finite: the teacher's output for it is not finite (NaN or +inf), "
                  "so there is nothing to measure or renormalise; a distill teacher refuses such answers "
                  "(teacher.on_nonfinite), so this output came from another producer");
  DISTILL_CHECK_T(ProtocolError, !all, head, " hold all of the teacher's probability (at T = ", pb.temperature,
                  "): nothing is left on the student's ids to renormalise, whatever loss.max_truncated_mass; "
                  "those ids are the teacher's real vocabulary, not padding (docs/vocab.md)");
  std::string where;
  if (denseRow) { // the dropped id holding the most of it
    const at::Tensor full = denseRow(row).to(at::kDouble).div(pb.temperature);
    const at::Tensor s = full.narrow(0, pb.v, pb.vt - pb.v);
    const at::Tensor lse = at::logsumexp(full, 0);
    const int64_t top = s.argmax().item<int64_t>();
    where = ", the most at id " + std::to_string(pb.v + top) + " (" +
        std::to_string((s[top] - lse).exp().item<double>()) + ")";
  } else if (pb.tNull.defined()) {
    where = ", in " + std::to_string(pb.tNull[row].sum().item<int64_t>()) + " of its top-" +
        std::to_string(pb.tNull.size(1)) + " entries";
  }
  DISTILL_THROW(ProtocolError, head, " hold probability ", mx, " (at T = ", pb.temperature, ")", where,
                ", above loss.max_truncated_mass = ", maxMass,
                ". If those ids are padding rows (an undertrained head can leave them 1e-3 of the mass), raise "
                "loss.max_truncated_mass above ", mx,
                " (docs/vocab.md says how to pick it); if they are real tokens, truncating them changes what the "
                "student learns: give the student the teacher's vocabulary");
}

LossResult withMass(const Problem& pb, LossResult r) {
  r.truncatedMassMax = pb.massMax;
  r.truncatedMassSum = pb.massSum;
  return r;
}

} // namespace distill::loss_impl
