#include "distill/loss/losses.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "distill/core/errors.h"
#include "loss_problem.h"

namespace distill {

using namespace loss_impl;

namespace {

// w * d with 0 where w == 0 (the 0 log 0 = 0 convention: d may be +-inf there).
at::Tensor& weighted(at::Tensor& d, const at::Tensor& w) { return d.mul_(w).masked_fill_(w == 0, 0); }

// log(1 - exp(a)) for a <= 0, accurate at both ends (Maechler's log1mexp).
at::Tensor log1mexp(const at::Tensor& a) {
  return at::where(a > -std::log(2.0), at::log(-at::expm1(a)), at::log1p(-at::exp(a)));
}

// Per-row divergence between teacher (log q) and student (log p) distributions
// over the columns (tokens, or buckets), unscaled by T^2. `grad` is its gradient
// w.r.t. a logit shift of each column's student mass: for tokens that is the
// gradient w.r.t. the scaled logits s = z / T; for a bucket b holding tokens j
// it is sum_j d/ds_j, and token j's share is p_j / P_b of it. Consumes logq and
// logp (they are overwritten).
struct Divergence {
  at::Tensor kd; // [C]
  at::Tensor grad; // d kd / d s for every column of logp, or undefined
};

Divergence divergence(Kind kind, double beta, at::Tensor& logq, at::Tensor& logp, bool needGrad) {
  Divergence out;
  if (kind == Kind::kForward) {
    at::Tensor q = logq.exp();
    at::Tensor d = logq - logp;
    out.kd = weighted(d, q).sum(1);
    d.reset();
    if (needGrad) out.grad = logp.exp_().sub_(q); // p - q
  } else if (kind == Kind::kReverse) {
    at::Tensor p = logp.exp();
    at::Tensor d = logp.sub_(logq); // log p - log q, in place
    {
      at::Tensor e = d * p;
      out.kd = e.masked_fill_(p == 0, 0).sum(1); // 0 log 0 = 0 where p == 0
    }
    if (needGrad) out.grad = weighted(d.sub_(out.kd.unsqueeze(1)), p); // p (log p/q - KL)
  } else {
    // log M = logaddexp(log beta + log q, log(1-beta) + log p), from the
    // log-probabilities: log(beta q + (1-beta) p) is -inf where both underflow
    // (|log q|, |log p| > ~745 in float64, ~104 in float32) while p or q is
    // still a denormal > 0, and p (log p - log M) is then inf.
    // -inf log-probabilities are raised to kLogFloor first: exp() of both is
    // exactly 0 in float32 and float64, so no value changes, but log M and
    // every log ratio are then finite and 0 * (log ratio) is 0 without the
    // masking passes of weighted() (which pays for logaddexp's extra cost).
    constexpr double kLogFloor = -1e4;
    logq.clamp_min_(kLogFloor);
    logp.clamp_min_(kLogFloor);
    at::Tensor logm = logq + std::log(beta);
    at::logaddexp_out(logm, logm, logp + std::log1p(-beta));
    at::Tensor q = logq.exp(), p = logp.exp();
    at::Tensor kq = logq.sub_(logm).mul_(q).sum(1); // KL(q || M)
    at::Tensor d = logp.sub_(logm); // log p - log M
    logm.reset();
    at::Tensor kp = (d * p).sum(1); // KL(p || M)
    out.kd = kq.mul_(beta).add_(kp, 1 - beta);
    // d/ds of beta KL(q||M) + (1-beta) KL(p||M) is (1-beta) p (log p/M - KL(p||M)).
    if (needGrad) out.grad = d.sub_(kp.unsqueeze(1)).mul_(p).mul_(1 - beta);
  }
  return out;
}

// The valid rows of one chunk: `rows` (indices into the N tokens), or when
// every token is valid the range [first, first + count) taken as views.
struct Rows {
  at::Tensor index;
  int64_t first = 0, count = 0;
  bool range = false;
  at::Tensor of(const at::Tensor& t) const { return range ? t.narrow(0, first, count) : t.index_select(0, index); }
  void write(at::Tensor& grad, const at::Tensor& g) const {
    if (range) {
      grad.narrow(0, first, count).copy_(g);
    } else {
      grad.index_copy_(0, index, g.to(grad.scalar_type()));
    }
  }
};

// Dense teacher logits: the log-softmaxes come from ATen's fused kernels (one
// pass each, no logsumexp temporaries), and nothing is gathered when the rows
// are a plain range. The divergence and the gradient assembly are those of
// the top-k path (lossChunk); tests/loss checks both against a reference.
void denseChunk(const Problem& pb, const at::Tensor& z, const Rows& rows, at::Tensor& grad, at::Tensor& kdSum,
                at::Tensor& ceSum) {
  const bool needGrad = grad.defined();
  const double t = pb.temperature;
  at::Tensor zc = rows.of(z);
  at::Tensor logp1; // temperature 1: the hard-label CE, and the KD's log p when T == 1
  if (pb.needCe || t == 1) logp1 = at::log_softmax(zc, 1, pb.compute);
  at::Tensor gce;
  if (pb.needCe) {
    at::Tensor lab = rows.of(pb.labels).unsqueeze(1); // [C, 1]
    ceSum.add_(logp1.gather(1, lab).sum().neg().to(at::kDouble));
    if (needGrad) {
      gce = logp1.exp();
      gce.scatter_add_(1, lab, at::full({lab.size(0), 1}, -1.0, gce.options()));
      gce.mul_((1 - pb.alpha) / pb.normalizer);
    }
  }
  at::Tensor g = std::move(gce);
  if (pb.needKd) {
    at::Tensor logp = t == 1 ? std::move(logp1) : at::log_softmax(zc.to(pb.compute).div(t), 1);
    at::Tensor tc = rows.of(pb.tLogits);
    at::Tensor logq = t == 1 ? at::log_softmax(tc, 1, pb.compute) : at::log_softmax(tc.to(pb.compute).div(t), 1);
    Divergence dv = divergence(pb.kind, pb.beta, logq, logp, needGrad);
    kdSum.add_(dv.kd.sum().to(at::kDouble));
    if (needGrad) {
      at::Tensor gkd = dv.grad.mul_(pb.alpha * t / pb.normalizer); // d(T^2 kd)/dz = T * d kd / ds
      if (g.defined()) gkd.add_(g);
      g = std::move(gkd);
    }
  }
  if (needGrad) rows.write(grad, g);
}

// The teacher's log-probabilities of the k+1 buckets of some rows (the k top
// tokens, then the tail), from what it sent; see losses.h ("Top-k").
// `studentLogTail` [C]: the student's logsumexp over the non-top-k tokens
// (-inf: its tail is empty).
at::Tensor teacherBuckets(const Problem& pb, const at::Tensor& rows, const at::Tensor& studentLogTail) {
  at::Tensor vals = pb.tValues.index_select(0, rows).to(pb.compute).div_(pb.temperature); // our own copy
  if (!pb.tLse.defined() && !pb.tLogTail.defined()) { // the truncated target: no mass outside the top-k
    return at::cat({at::log_softmax(vals, 1), at::full({vals.size(0), 1}, -kInf, vals.options())}, 1);
  }
  at::Tensor logSum = pb.tLogSum.index_select(0, rows);
  if (pb.tLogTail.defined()) {
    // The exact tail: log-softmax over [values / T, logTail], whose normaliser
    // logSum is already known.
    at::Tensor tail = pb.tLogTail.index_select(0, rows).to(pb.compute).unsqueeze(1);
    return at::cat({vals, tail}, 1).sub_(logSum.unsqueeze(1));
  }
  // logsumexp only: the tail is 1 - sum q_i, in log space; lseK = log sum q_i.
  at::Tensor lse = pb.tLse.index_select(0, rows).to(pb.compute);
  at::Tensor lseK = logSum.sub_(lse);
  at::Tensor logqTail;
  if (vals.size(1) == pb.v && !pb.tNull.defined()) {
    logqTail = at::full_like(lseK, -kInf); // k = V: no tail at all, whatever the rounding says
  } else {
    logqTail = log1mexp(lseK.clamp_max(0));
    // Rounding decides 1 - sum q_i only down to r = 4 eps max(1, |lse|): a
    // tail below r may be 0 or anything up to r. Taken as 0 where the
    // student's tail is empty too (so forward KL stays finite), as r elsewhere
    // (so reverse KL does; a lower bound of the exact value then).
    at::Tensor logR = lse.abs().clamp_min_(1).mul_(4 * pb.eps).log_();
    at::Tensor floor = at::where(studentLogTail == -kInf, at::full_like(logR, -kInf), logR);
    logqTail = at::where(logqTail < logR, floor, logqTail);
  }
  // Renormalised (log of sum q_i + q_tail; 0 up to rounding unless sum q_i > 1,
  // within the tolerance of the logsumexp check, or the tail was raised to r).
  at::Tensor norm = at::logaddexp(lseK, logqTail);
  vals.sub_((lse + norm).unsqueeze(1)); // log q_i = values / T - lse - norm
  return at::cat({vals, logqTail.sub_(norm).unsqueeze(1)}, 1);
}

} // namespace

namespace loss_impl {

HardLabel hardLabelTerm(const Problem& pb, const at::Tensor& x, const at::Tensor& rows, bool needGrad,
                        at::Tensor& ceSum) {
  HardLabel h;
  if (!pb.needCe) return h;
  at::Tensor lab = pb.labels.index_select(0, rows).unsqueeze(1); // [C, 1]
  h.lse1 = at::logsumexp(x, 1);
  ceSum.add_((h.lse1 - x.gather(1, lab).squeeze(1)).sum().to(at::kDouble));
  if (needGrad) {
    h.gce = (x - h.lse1.unsqueeze(1)).exp_();
    h.gce.scatter_add_(1, lab, at::full({lab.size(0), 1}, -1.0, h.gce.options()));
    h.gce.mul_((1 - pb.alpha) / pb.normalizer);
  }
  return h;
}

} // namespace loss_impl

namespace {

// One chunk of valid rows: adds the kd and ce sums to the accumulators and, when
// `grad` is defined, writes the gradient of loss w.r.t. those rows into it.
// `grad` may be z itself: every read of z comes before the gradient is written.
void lossChunk(const Problem& pb, const at::Tensor& z, const Rows& chunk, at::Tensor& grad, Sums& sums) {
  const at::Tensor rows = chunk.range ? pb.valid.narrow(0, chunk.first, chunk.count) : chunk.index;
  if (pb.kernel) return pb.kernel->run(pb, rows, grad, sums);
  at::Tensor &kdSum = sums.kd, &ceSum = sums.ce;
  if (pb.tLogits.defined()) return denseChunk(pb, z, chunk, grad, kdSum, ceSum);
  const bool needGrad = grad.defined();
  const double t = pb.temperature;

  // Hard-label CE at temperature 1; its gradient first, while x still holds z.
  at::Tensor x = z.index_select(0, rows).to(pb.compute); // our own [C, V] copy
  auto [lse1, gce] = hardLabelTerm(pb, x, rows, needGrad, ceSum);
  if (pb.tWeights.defined() || pb.sampledToken) return sampledChunk(pb, x, rows, lse1, gce, grad, kdSum);
  if (!pb.needKd) {
    if (needGrad) grad.index_copy_(0, rows, gce.to(grad.scalar_type()));
    return;
  }

  if (t != 1) x.div_(t); // x = s = z / T from here on
  at::Tensor lseS = lse1.defined() && t == 1 ? lse1 : at::logsumexp(x, 1);
  lse1.reset();
  at::Tensor gs; // d kd / d s, unscaled

  {
    // k + 1 buckets: the teacher's top-k tokens and the tail (see losses.h).
    at::Tensor idx = pb.tIndices.index_select(0, rows);
    at::Tensor logPK = x.gather(1, idx).sub_(lseS.unsqueeze(1));
    // Null buckets (loss.vocab truncate, loss_vocab.cpp): p = 0 there, and
    // their index (0) is neither masked out of the tail nor written below.
    at::Tensor null = pb.tNull.defined() ? pb.tNull.index_select(0, rows) : at::Tensor();
    // Tail mass from the logits outside the top-k, never as 1 - sum P_i.
    if (null.defined()) {
      logPK.masked_fill_(null, -kInf);
      // min(x, -inf) at the kept ids, min(x, +inf) = x at the null ones: the
      // same result in any order, so repeated indices do not race.
      x.scatter_reduce_(1, idx, at::full_like(logPK, -kInf).masked_fill_(null, kInf), "amin");
    } else {
      x.scatter_(1, idx, -kInf);
    }
    at::Tensor lseTail = at::logsumexp(x, 1);
    at::Tensor logP = at::cat({logPK, (lseTail - lseS).unsqueeze(1)}, 1);
    at::Tensor logq = teacherBuckets(pb, rows, lseTail);
    Divergence dv = divergence(pb.kind, pb.beta, logq, logP, needGrad);
    kdSum.add_(dv.kd.sum().to(at::kDouble));
    if (needGrad) {
      // dv.grad[b] is the gradient w.r.t. bucket b's summed logit mass: token j
      // of bucket b gets (p_j / P_b) * dv.grad[b]. For the top-k that ratio is 1;
      // in the tail it is the softmax of the tail logits (stable when P_tail ~ 0).
      const int64_t k = idx.size(1);
      at::Tensor safe = at::where(at::isinf(lseTail), at::zeros_like(lseTail), lseTail);
      x.sub_(safe.unsqueeze(1)).exp_().mul_(dv.grad.select(1, k).unsqueeze(1));
      if (null.defined()) {
        // The kept ids hold exp(-inf) * g = 0 here: adding their gradient sets
        // it, and a null bucket adds exactly 0 wherever its index points.
        x.scatter_add_(1, idx, dv.grad.narrow(1, 0, k).masked_fill(null, 0));
      } else {
        x.scatter_(1, idx, dv.grad.narrow(1, 0, k));
      }
      gs = std::move(x);
    }
  }

  if (!needGrad) return;
  // d(T^2 kd)/dz = T * d kd / ds.
  at::Tensor g = gs.mul_(pb.alpha * t / pb.normalizer);
  if (gce.defined()) g.add_(gce);
  grad.index_copy_(0, rows, g.to(grad.scalar_type()));
}

} // namespace

namespace loss_impl {

Sums runChunks(const Problem& pb, const at::Tensor& z2, at::Tensor grad2) {
  auto dopt = at::TensorOptions().dtype(at::kDouble).device(z2.device());
  Sums s{at::zeros({}, dopt), at::zeros({}, dopt)};
  const int64_t nv = pb.valid.size(0);
  for (int64_t c0 = 0; c0 < nv; c0 += pb.chunk) {
    Rows rows;
    rows.first = c0;
    rows.count = std::min(pb.chunk, nv - c0);
    rows.range = pb.allValid;
    if (!rows.range) rows.index = pb.valid.narrow(0, c0, rows.count);
    lossChunk(pb, z2, rows, grad2, s);
  }
  return s;
}

LossResult finish(const Problem& pb, const Sums& s) {
  const double t2 = pb.temperature * pb.temperature;
  // No valid token: every sum is 0 and the normalizer may be 0 too.
  const double scale = pb.valid.size(0) == 0 ? 0.0 : 1.0 / pb.normalizer;
  const at::Tensor notComputed = at::full({}, std::numeric_limits<double>::quiet_NaN(), s.kd.options());
  LossResult r;
  r.kd = (pb.needKd ? s.kd * (t2 * scale) : notComputed).to(pb.compute);
  r.ce = (pb.needCe ? s.ce * scale : notComputed).to(pb.compute);
  // Only the terms of nonzero weight: 0 * inf would be NaN.
  at::Tensor loss = at::zeros({}, s.kd.options());
  if (pb.needKd) loss.add_(s.kd, pb.alpha * t2 * scale);
  if (pb.needCe) loss.add_(s.ce, (1 - pb.alpha) * scale);
  r.loss = loss.to(pb.compute);
  r.tokens = pb.valid.size(0);
  return withMass(pb, r);
}

} // namespace loss_impl

namespace {

// The gradient is computed chunk by chunk in forward and kept (one [N, V]
// tensor, the size of the gradient autograd would produce anyway); backward
// only scales it, so no chunk's softmax outlives its chunk.
class DistillFunction : public torch::autograd::Function<DistillFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& z,
                                                const Problem* pb) {
    // Every valid row's gradient is written by its chunk; ignored rows stay 0.
    at::Tensor grad = pb->allValid ? at::empty_like(z, at::MemoryFormat::Contiguous)
                                   : at::zeros_like(z, at::MemoryFormat::Contiguous);
    Sums s = runChunks(*pb, z.reshape({-1, pb->v}), grad.view({-1, pb->v}));
    LossResult r = finish(*pb, s);
    ctx->saved_data["grad"] = grad;
    ctx->mark_non_differentiable({r.kd, r.ce});
    return {r.loss, r.kd, r.ce};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list gradOut) {
    auto it = ctx->saved_data.find("grad");
    DISTILL_CHECK_T(UsageError, it != ctx->saved_data.end(),
                    "distillLoss: backward ran twice through the same loss; its gradient is "
                    "handed on by the first backward (retain_graph is not supported)");
    at::Tensor g = it->second.toTensor();
    ctx->saved_data.erase(it); // drop our reference so autograd may reuse the buffer
    if (!gradOut[0].defined()) return {at::Tensor(), at::Tensor()};
    // loss.backward() passes 1: then the gradient is handed on as it is (one
    // pass over [N, V] less; a CPU scalar costs nothing to look at).
    if (!(gradOut[0].is_cpu() && gradOut[0].numel() == 1 && gradOut[0].item<double>() == 1.0)) g.mul_(gradOut[0]);
    return {g, at::Tensor()};
  }
};

} // namespace

int64_t countTokens(const at::Tensor& labels, int64_t ignoreIndex) {
  DISTILL_CHECK_T(ProtocolError, labels.defined() && !at::isFloatingType(labels.scalar_type()),
                  "countTokens: labels: expected an integer tensor");
  return (labels != ignoreIndex).sum().item<int64_t>();
}

void validateLossOptions(const LossOptions& o) {
  kindOf(o.kind);
  DISTILL_CHECK_T(ConfigError, std::isfinite(o.temperature) && o.temperature > 0,
                  "loss.temperature must be > 0, found ", o.temperature);
  DISTILL_CHECK_T(ConfigError, o.alpha >= 0 && o.alpha <= 1, "loss.alpha must be in [0, 1], found ", o.alpha);
  DISTILL_CHECK_T(ConfigError, o.jsd_beta > 0 && o.jsd_beta < 1, "loss.jsd_beta must be in (0, 1), found ", o.jsd_beta);
  DISTILL_CHECK_T(ConfigError, o.chunk_tokens >= 1, "loss.chunk_tokens must be >= 1, found ", o.chunk_tokens);
}

namespace {

LossResult run(const at::Tensor& studentLogits, const at::Tensor& labels, const TeacherOutput& teacher,
               const LossOptions& options, double normalizer, bool allowFused) {
  Problem pb = prepare(studentShape(studentLogits, allowFused), labels, teacher, options, normalizer);
  if (pb.kernel) pb.zc = studentLogits.reshape({pb.n, pb.v});
  if (!(at::GradMode::is_enabled() && studentLogits.requires_grad())) {
    at::NoGradGuard noGrad;
    LossResult r = finish(pb, runChunks(pb, studentLogits.reshape({-1, pb.v}), at::Tensor()));
    return r;
  }
  torch::autograd::variable_list out = DistillFunction::apply(studentLogits, &pb);
  return withMass(pb, LossResult{out[0], out[1], out[2], pb.valid.size(0)});
}

} // namespace

LossResult distillLoss(const at::Tensor& studentLogits, const at::Tensor& labels, const TeacherOutput& teacher,
                       const LossOptions& options, double normalizer) {
  return run(studentLogits, labels, teacher, options, normalizer, /*allowFused=*/true);
}

namespace detail {

LossResult distillLossAtenOps(const at::Tensor& studentLogits, const at::Tensor& labels, const TeacherOutput& teacher,
                              const LossOptions& options, double normalizer) {
  return run(studentLogits, labels, teacher, options, normalizer, /*allowFused=*/false);
}

} // namespace detail

} // namespace distill
