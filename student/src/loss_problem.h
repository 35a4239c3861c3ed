#pragma once

// What the loss's files share (internal to student/src):
//   loss_inputs.cpp  the inputs of one call checked and flattened into a Problem
//   losses.cpp       the chunks (fused CPU kernel or ATen ops), autograd, the public calls

#include <ATen/ATen.h>

#include <limits>
#include <sstream>
#include <string>

#include "distill/student/losses.h"
#include "loss_kernel.h"

namespace distill::loss_impl {

using Kind = lossk::Kind;

constexpr double kInf = std::numeric_limits<double>::infinity();

inline std::string shapeOf(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// LossOptions built in code (not parsed) may hold any value: one outside the enum is a ConfigError.
Kind kindOf(LossKind k);

// Everything one call needs, flattened to tokens.
struct Problem {
  Kind kind = Kind::kForward;
  double temperature = 1, alpha = 0.5, beta = 0.5, normalizer = 1;
  bool needKd = true, needCe = true; // terms of nonzero weight: the others are not computed
  int64_t chunk = 1, n = 0, v = 0;
  at::ScalarType compute = at::kFloat; // arithmetic dtype of the chunks
  at::Tensor labels; // [N] int64
  at::Tensor valid; // [Nv] int64: rows whose label is not ignored
  bool allValid = false; // valid == 0..N-1: chunks are plain row ranges (views, no gathers)
  at::Tensor tLogits; // [N, V] or undefined
  at::Tensor tValues, tIndices; // [N, k], [N, k] int64
  at::Tensor tLse, tLogTail; // [N] or undefined each
  // Top-k, computed once for all rows (O(N k)) and shared by the logsumexp
  // check and the chunks: the log of what the top-k probabilities sum to,
  // logsumexp(values / T), with logTail logaddexp(that, logTail) [N].
  at::Tensor tLogSum;
  double eps = 0; // epsilon of the coarsest dtype of the top-k teacher data
  // The fused CPU kernel (loss_kernel.h) computes the chunks: CPU, float32 or
  // float64 student logits with contiguous rows. Otherwise (CUDA, half,
  // bfloat16) the ATen-op path below, which is also its reference in tests.
  bool fused = false;
  at::Tensor zc; // [N, V] contiguous student logits (fused)
  at::Tensor kValues, kLse, kLogTail; // top-k teacher data in the arithmetic dtype, contiguous (fused)
};

// Checks the inputs of one distillLoss call (shapes, dtypes, devices, label
// and index ranges, the teacher's logsumexp; one device sync for the data
// checks) and flattens them to tokens. `allowFused`: the fused CPU kernel may
// compute the chunks (tests turn it off to compare with the ATen-op path).
Problem prepare(const at::Tensor& z, const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& o,
                double normalizer, bool allowFused);

} // namespace distill::loss_impl
