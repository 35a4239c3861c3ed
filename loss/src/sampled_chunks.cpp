// The chunks of the two losses whose teacher is a few ids per token (losses.h):
// sampled targets (forward KL against counts / K) and loss.kind sampled_token
// (the per-token reverse-KL estimate as a policy-gradient advantage), on ATen
// ops: where no row kernel runs (CUDA, half/bfloat16 logits, loss.vocab
// truncate), and as the reference of the CPU kernel's sampledRows
// (cpu/loss_kernel_sampled.h), which computes both where it runs.
#include <ATen/ATen.h>

#include "distill/core/errors.h"
#include "loss_problem.h"

namespace distill::loss_impl {
namespace {

// Sampled targets: kd = -sum_j w_j log p_j over the drawn ids j (the
// cross-entropy against the estimate w = counts / K of the teacher's
// distribution); d kd / d s = p - scatter(w), unbiased for the full forward
// KL's p - q.
at::Tensor sampledTargets(const Problem& pb, at::Tensor& s, const at::Tensor& rows, const at::Tensor& lseS,
                          bool needGrad, at::Tensor& kdSum) {
  at::Tensor idx = pb.tIndices.index_select(0, rows);
  at::Tensor w = pb.tWeights.index_select(0, rows);
  at::Tensor logP = s.gather(1, idx).sub_(lseS.unsqueeze(1));
  kdSum.add_(logP.mul_(w).masked_fill_(w == 0, 0).sum().neg().to(at::kDouble)); // padding: 0, even at p = 0
  if (!needGrad) return {};
  s.sub_(lseS.unsqueeze(1)).exp_(); // p
  s.scatter_add_(1, idx, w.neg());
  return s;
}

// loss.kind sampled_token: with x the sampled id, d = log p_S(x) - log p_T(x)
// (the per-token reverse-KL estimate) and the importance weight r (1, or the
// ratio p_S(x) / p_sample(x) truncated at kSampledTokenMaxRatio; detached),
// kd = r d, and d kd / d s is taken as r d (onehot(x) - p): the score-function
// gradient of the reverse KL, i.e. the policy gradient of the advantage -d.
at::Tensor sampledToken(const Problem& pb, at::Tensor& s, const at::Tensor& rows, const at::Tensor& lseS,
                        bool needGrad, at::Tensor& kdSum) {
  at::Tensor idx = pb.tIndices.index_select(0, rows); // [C, 1]
  at::Tensor logPx = s.gather(1, idx).squeeze(1).sub_(lseS);
  at::Tensor logQx = pb.tValues.index_select(0, rows).squeeze(1).to(pb.compute).div_(pb.temperature);
  logQx.sub_(pb.tLse.index_select(0, rows).to(pb.compute));
  at::Tensor d = logPx - logQx;
  if (pb.tSamplingLogp.defined()) {
    at::Tensor logR = logPx - pb.tSamplingLogp.index_select(0, rows).to(pb.compute);
    d.mul_(logR.exp_().clamp_max_(kSampledTokenMaxRatio));
  }
  kdSum.add_(d.sum().to(at::kDouble));
  if (!needGrad) return {};
  s.sub_(lseS.unsqueeze(1)).exp_().neg_(); // -p
  s.scatter_add_(1, idx, at::ones_like(d).unsqueeze(1));
  return s.mul_(d.unsqueeze(1));
}

} // namespace

void sampledChunk(const Problem& pb, at::Tensor& x, const at::Tensor& rows, const at::Tensor& lse1,
                  const at::Tensor& gce, at::Tensor& grad, at::Tensor& kdSum) {
  const bool needGrad = grad.defined();
  if (!pb.needKd) {
    if (needGrad) grad.index_copy_(0, rows, gce.to(grad.scalar_type()));
    return;
  }
  const double t = pb.temperature;
  if (t != 1) x.div_(t); // s = z / T
  at::Tensor lseS = lse1.defined() && t == 1 ? lse1 : at::logsumexp(x, 1);
  at::Tensor gs = pb.sampledToken ? sampledToken(pb, x, rows, lseS, needGrad, kdSum)
                                  : sampledTargets(pb, x, rows, lseS, needGrad, kdSum);
  if (!needGrad) return;
  at::Tensor g = gs.mul_(pb.alpha * t / pb.normalizer); // d(T^2 kd)/dz = T * d kd / ds
  if (gce.defined()) g.add_(gce);
  grad.index_copy_(0, rows, g.to(grad.scalar_type()));
}

} // namespace distill::loss_impl
