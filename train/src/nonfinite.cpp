// Numbers that are not finite, for distill::Steps (nonfinite.h).
#include "nonfinite.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace distill::train_impl {

at::Tensor maskedTokens(const TeacherOutput& teacher, int64_t tokens) {
  at::Tensor marks = maskedMarks(teacher); // the answer kind's mark (answers.h)
  if (!marks.defined()) return {};
  marks = marks.reshape(-1).cpu();
  if (marks.numel() != tokens || !marks.any().item<bool>()) return {};
  return marks;
}

LossResult maskedLoss(const LossFn& loss, const RowsFn& rows, const at::Tensor& labels, const TeacherOutput& teacher,
                      const at::Tensor& masked, const LossOptions& o, double normalizer) {
  const at::Tensor index = masked.nonzero().reshape(-1);
  const at::Tensor onLabels = index.to(labels.device());
  const at::Tensor kdLabels = labels.reshape(-1).clone().index_fill_(0, onLabels, o.ignore_index);
  LossResult r = loss(kdLabels.view(labels.sizes()), teacher);
  if (o.alpha >= 1) return r;
  const at::Tensor z = rows(index);
  const at::Tensor target = labels.reshape(-1).index_select(0, onLabels).to(z.device());
  const at::Tensor ce =
      at::cross_entropy_loss(z.to(at::kFloat), target, {}, at::Reduction::Sum, o.ignore_index)
          .div(normalizer > 0 ? normalizer : 1.0);
  r.loss = r.loss + ce.mul(1 - o.alpha).to(r.loss.scalar_type());
  r.ce = r.ce + ce.detach().to(r.ce.device(), r.ce.scalar_type());
  return r;
}

bool gradientsFinite(const std::vector<at::Tensor>& params) {
  at::Tensor sum; // on the first gradient's device: one synchronisation
  for (const at::Tensor& p : params) {
    if (!p.grad().defined()) continue;
    const at::Tensor s = p.grad().sum(at::kDouble);
    sum = sum.defined() ? sum + s.to(sum.device()) : s;
  }
  return !sum.defined() || std::isfinite(sum.item<double>());
}

void dropGradients(const std::vector<at::Tensor>& params, bool scaled) {
  for (const at::Tensor& p : params) {
    if (!p.grad().defined()) continue;
    if (scaled) {
      p.mutable_grad().fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      p.mutable_grad() = at::Tensor();
    }
  }
}

} // namespace distill::train_impl
