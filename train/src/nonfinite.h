#pragma once

// Numbers that are not finite, for distill::Steps (steps.cpp; docs/configuration.md,
// "Numbers that are not finite"): the tokens a teacher masked (teacher.on_nonfinite
// mask) and their loss, and the gradient checks of loss.on_nonfinite. Functions
// only, no state: call them from the student's training thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "distill/core/options.h"
#include "distill/loss/losses.h"

namespace distill::train_impl {

// The loss of a micro-batch for labels and a teacher output (distillLoss or fusedLinearLoss).
using LossFn = std::function<LossResult(const at::Tensor& labels, const TeacherOutput& teacher)>;
// The student's logits [n, V] of the flat token indices `index` (int64 [n], CPU).
using RowsFn = std::function<at::Tensor(const at::Tensor& index)>;

// The tokens the teacher marked as masked (core/answer_kinds.h, "Masked tokens"):
// flat bool [tokens] on the CPU; undefined when there are none. One
// synchronisation with the teacher output's device.
at::Tensor maskedTokens(const TeacherOutput& teacher, int64_t tokens);

// The loss with the `masked` tokens out of the kd term (ignored there) and
// learning from their labels only: (1 - alpha) x their cross-entropy summed,
// over `normalizer`, added to the loss (and to ce). With alpha = 1 they add nothing.
LossResult maskedLoss(const LossFn& loss, const RowsFn& rows, const at::Tensor& labels, const TeacherOutput& teacher,
                      const at::Tensor& masked, const LossOptions& o, double normalizer);

// Whether every gradient of `params` is finite (one sum in float64, one synchronisation).
bool gradientsFinite(const std::vector<at::Tensor>& params);

// loss.on_nonfinite skip_step: leaves every parameter without a gradient (the
// optimizers of torch step only parameters with one); `scaled` (a loss scale
// is set): fills them with NaN instead, so that the scaler skips the step.
void dropGradients(const std::vector<at::Tensor>& params, bool scaled);

} // namespace distill::train_impl
