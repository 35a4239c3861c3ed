#pragma once

// What losses_test's sources share: a distance between tensors, a loss kind by its
// spelling, and a small problem (6 tokens, 9 entries) in float64 for finite differences.

#include <torch/torch.h>

#include <limits>
#include <string>

#include "distill/core/options.h"
#include "distill/loss/losses.h"

namespace distill::loss_testing {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

inline double maxAbs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// An option spelling ("jsd") as the enum LossOptions holds.
inline LossKind lossKind(const std::string& s) { return parseEnum<LossKind>(s).value(); }

struct Small {
  at::Tensor z, labels;
  TeacherOutput teacher;
};

inline Small smallProblem(const std::string& mode, double temperature, uint64_t seed) {
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

} // namespace distill::loss_testing
