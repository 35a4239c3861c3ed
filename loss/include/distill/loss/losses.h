#pragma once

// Distillation losses on the student side: forward KL, reverse KL and JSD at a
// temperature, mixed with hard-label cross-entropy; dense or sparse (top-k)
// teacher output; ignore-index masking; chunked over tokens so that memory is
// bounded in forward AND backward.
//
// Shapes. Student logits [..., V] (leading dims are flattened to N tokens),
// labels [...] with N elements (int64). Teacher (TeacherOutput, answers.h: one
// struct per answer kind): full logits (LogitsAnswer) with the student's
// shape, or top-k (TopkAnswer): values [N, k] (the teacher's LOGITS of its top-k tokens,
// not probabilities) and indices [N, k] (int32 or int64, unique per row), with
// an optional per-token log-sum-exp [N] and log tail mass [N]. Any leading dims
// may be used as long as they flatten to N. Every tensor must be on the student logits' device.
//
// Normalisation. kd and ce are SUMS over the non-ignored tokens of this call
// divided by `normalizer`, which the caller passes: the number of non-ignored
// tokens of the WHOLE optimizer step, over all micro-batches and all students
// (countTokens() per micro-batch, summed and all-reduced before the step).
// Then summing the gradients of the grad_acc_steps micro-batches and
// all-reducing them with SUM gives exactly the gradient of the same tokens as
// one batch, also when micro-batches hold different numbers of valid tokens
// (dividing each micro-batch by its own count does not: a micro-batch with 3
// valid tokens would weigh as much as one with 3000). `normalizer` may be 0
// only when this call has no non-ignored token (a step whose labels are all
// ignored, e.g. every completion truncated: stepTokenCount() is 0 then); such
// a call gives loss = 0 (kd and ce 0 too, or NaN for a term not computed, see
// below) with a zero gradient that still flows through backward, and
// tokens = 0. A normalizer of 0 with valid tokens, or a negative or non-finite
// one, is a UsageError.
//
// Definitions (docs/losses.md, "Definitions"): per non-ignored token, with
// p_S = softmax(z_S / T) and p_T = softmax(z_T / T): forward_kl, reverse_kl and
// jsd (times T^2), ce at temperature 1, loss = alpha * kd + (1 - alpha) * ce. A
// term whose weight is 0 is not computed at all; LossResult reports it as NaN.
//
// Top-k (sparse) teacher output (docs/losses.md, "Top-k teacher output"): the
// divergence is taken between two distributions over k+1 buckets, the k
// teacher tokens and one tail bucket, with the teacher's tail from `logTail`,
// else `logsumexp`, else none. reverse_kl with top-k needs one of them (else a
// ConfigError); a `logsumexp` that the top-k values contradict beyond
// kLogsumexpTolerance is a ProtocolError.
//
// Ids answers (IdsAnswer; docs/losses.md, "Ids answers"): the teacher's logits
// at ids the request named (e.g. the student's own top-k), its logsumexp and
// log tail. forward_kl, reverse_kl and jsd take them as top-k output over those
// ids (k + 1 buckets): the student's tail bucket is its mass outside the ids,
// the teacher's exp(log_tail - logsumexp). On the student's top-k that reverse
// KL is exact up to P_tail KL(p_S|tail || p_T|tail) >= 0, the part inside the
// tail: exact where the student's mass is.
//
// loss.kind sampled_token (docs/losses.md, "The sampled-token recipe"): ids [N, 1]
// the tokens x the student sampled. Per token d = log p_S(x) - log p_T(x) (at
// T), r = min(p_S(x) / p_sample(x), kSampledTokenMaxRatio) from
// IdsAnswer::samplingLogProbs (r = 1 without), kd = r d, and the gradient that
// of the policy-gradient loss -A r log p_S(x) with advantage A = -d, A and r
// detached: r d (onehot(x) - p_S) w.r.t. z / T (T^2-scaled like the others).
//
// Sampled targets (SampledAnswer; docs/losses.md, "Sampled targets"): ids drawn
// from p_T with replacement and their counts; forward_kl only (reverse_kl,
// jsd and sampled_token are a ConfigError: no unbiased estimator). kd is the
// cross-entropy -sum (counts/K) log p_S (the forward KL + the teacher's
// entropy, which samples do not give), its gradient p_S - counts/K w.r.t. z / T,
// unbiased for the full forward KL's p_S - p_T.
//
// Vocabularies that differ (docs/losses.md, "Vocabularies that differ";
// docs/vocab.md): V_t (TeacherOutput::vocab) > V_s is loss.vocab's choice
// (error, or truncate with the dropped mass measured); V_t < V_s is a
// ProtocolError.
//
// Gradients. Only the student logits get a gradient, and only through
// `loss`; `kd` and `ce` are detached values for logging. The gradient w.r.t.
// the student logits is computed chunk by chunk during the forward pass and
// kept until backward, which scales it by the incoming gradient in place
// (not at all when that is 1, as for loss.backward()) and hands it on
// (backward may run once per call). When the student logits do
// not require grad (or grad mode is off) only values are computed.
//
// Implementation and memory (docs/losses.md, "Implementation", "Memory
// bound"): chunks over valid tokens run through a row kernel chosen by device
// (loss/src/row_kernel.h: the CUDA row kernel, the fused CPU kernel), or through
// ATen ops where none takes them (detail::distillLossAtenOps). No [N, V]
// intermediate exists besides the inputs and the gradient; ignored tokens
// cost neither memory nor compute.
//
// Arithmetic is float32 for float16/bfloat16/float32 logits, float64 for
// double logits; teacher tensors are converted to that dtype chunk by chunk
// (top-k data, O(N k), at once).
//
// Errors: tensor shapes, dtypes or devices that do not fit -> ProtocolError
// naming what was expected and what was found (also labels or top-k indices
// out of range, and a teacher logsumexp that its own top-k contradicts); bad
// LossOptions -> ConfigError; a bad normalizer -> UsageError.
//
// Thread safety: none of these functions keep state; call them from any thread.

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "distill/core/options.h"
#include "distill/loss/answers.h"

namespace distill {

// The absolute part (log space, i.e. relative in probability) of the tolerance
// of the teacher-logsumexp check above. Rounding of float32 teacher outputs
// makes s - logsumexp at most ~1 eps32 |logsumexp| (measured: <= 1.2e-7
// |logsumexp| over top-64 of V = 32000, T 0.25..4, bfloat16 logits up to 450
// scaled), which the 8 eps |logsumexp| part covers 8 times over; 1e-4 covers
// small |logsumexp| and sloppier producers. A logsumexp at another temperature
// is off by O(max logit * |1/T - 1/T'|), orders of magnitude more.
constexpr double kLogsumexpTolerance = 1e-4;

// loss.kind sampled_token: the importance weight p_S(x) / p_sample(x) is
// truncated here (truncated importance sampling: variance bounded, biased only
// where the student moved far from the policy that sampled).
constexpr double kSampledTokenMaxRatio = 2.0;

struct LossResult {
  at::Tensor loss; // 0-dim: alpha * kd + (1 - alpha) * ce; the only one with a gradient
  at::Tensor kd; // 0-dim, detached: T^2-scaled divergence sum / normalizer; NaN when
                 // alpha == 0 (not computed)
  at::Tensor ce; // 0-dim, detached: cross-entropy sum / normalizer; NaN when alpha == 1
                 // (not computed)
  int64_t tokens = 0; // non-ignored tokens in this call (0: loss is 0, and so are kd, ce if computed)
  // loss.vocab truncate, when the teacher's vocabulary is larger: the teacher probability (at T) that
  // the dropped ids held, the largest of any non-ignored token and the sum over them (mean = sum /
  // tokens); -1 both when nothing was truncated (same vocabularies, or alpha = 0).
  double truncatedMassMax = -1;
  double truncatedMassSum = -1;
};

// Number of labels != ignoreIndex (synchronises with the device once).
int64_t countTokens(const at::Tensor& labels, int64_t ignoreIndex);

// Throws ConfigError when `options` are not usable by distillLoss.
void validateLossOptions(const LossOptions& options);

// The distillation loss of one micro-batch; see the top of this file.
// `normalizer`: the step's global count of non-ignored tokens (> 0, or 0 when
// this call has none).
LossResult distillLoss(const at::Tensor& studentLogits, const at::Tensor& labels, const TeacherOutput& teacher,
                       const LossOptions& options, double normalizer);

// The distillation loss of one micro-batch from the student's last hidden
// states and its output projection instead of its logits: the same value and
// gradients as distillLoss(hidden @ weight.T + bias, ...) (tests/loss checks
// them to 1e-6 relative in float64), without an [N, V] tensor ever alive.
//   hidden  [..., d] (leading dims flatten to the N tokens of `labels` and the
//           teacher output), floating
//   weight  [V, d], hidden's dtype and device; bias [V] or undefined (no bias)
// Teacher, labels, options and normalizer are distillLoss's (top of this file).
// The valid tokens go in chunks of `chunkTokens` rows (0: automatic; on CPU
// max(256, 2^23 / V), i.e. a chunk's logits hold ~8 M elements; on CUDA
// next_pow2(4 N / ceil(V / d)) within [256, 2048], i.e. a chunk buffer near
// 4 N d elements, four times Liger's rule, measured faster on an H200 for a
// quarter GiB more at N 8192, V 128256; LossOptions::chunk_tokens is not used here): each
// chunk's logits are computed (mm_out / addmm_out into one buffer reused by
// every chunk, in hidden's dtype), its loss and d loss / d logits formed (the
// row kernel of the device, else the ATen-op path) and written over that
// buffer in place (the CPU kernel, whose reverse KL and JSD reread the logits,
// writes a second buffer), and turned at once into the chunk's rows of d loss
// / d hidden (mm_out) and added to d loss / d weight (addmm_) and d loss / d
// bias. The loss parts stay on the device: no host sync in the loop. Forward
// computes the loss and these gradients in one pass and keeps them; backward
// scales them by the incoming gradient (Liger's fused-linear approach), once.
// The weight's gradient is accumulated in float32 at least, except on CUDA with
// 16-bit inputs: there in the input dtype (each chunk's GEMM accumulates in
// float32; a float32 accumulator would double its memory, as Liger's default).
// Memory beyond the inputs: the three gradients (hidden's, weight's, bias's
// size) and one [chunkTokens, V] buffer in hidden's dtype (two with the CPU
// kernel), plus the ATen-op path's temporaries there; ignored tokens cost
// nothing. Only the tensors that require grad get a gradient (a frozen output
// projection costs no weight gradient). Errors as distillLoss's, plus a
// ProtocolError naming hidden's, weight's and bias's shapes when they do not fit.
LossResult fusedLinearLoss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& options,
                           double normalizer, int64_t chunkTokens = 0);

namespace detail {
// distillLoss computed with ATen ops only, chunk by chunk: the path CUDA and
// half/bfloat16 student logits take. On CPU distillLoss uses a fused kernel
// instead (see "Implementation" above); tests/loss checks the two against
// each other.
LossResult distillLossAtenOps(const at::Tensor& studentLogits, const at::Tensor& labels, const TeacherOutput& teacher,
                              const LossOptions& options, double normalizer);
// fusedLinearLoss with the chunks' losses on the ATen-op path (as on CUDA).
LossResult fusedLinearLossAtenOps(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                  const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& options,
                                  double normalizer, int64_t chunkTokens = 0);
} // namespace detail

} // namespace distill
