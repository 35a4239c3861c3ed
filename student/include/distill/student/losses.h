#pragma once

// Distillation losses on the student side: forward KL, reverse KL and JSD at a
// temperature, mixed with hard-label cross-entropy; dense or sparse (top-k)
// teacher output; ignore-index masking; chunked over tokens so that memory is
// bounded in forward AND backward.
//
// Shapes. Student logits [..., V] (leading dims are flattened to N tokens),
// labels [...] with N elements (int64). Teacher: full logits with the student's
// shape, or top-k: values [N, k] (the teacher's LOGITS of its top-k tokens,
// not probabilities) and indices [N, k] (int32 or int64, unique per row), with
// an optional per-token log-sum-exp [N]. Any leading dims may be used as long
// as they flatten to N. Every tensor must be on the student logits' device.
//
// Normalisation. kd and ce are SUMS over the non-ignored tokens of this call
// divided by `normalizer`, which the caller passes: the number of non-ignored
// tokens of the WHOLE optimizer step, over all micro-batches and all students
// (countTokens() per micro-batch, summed and all-reduced before the step).
// Then summing the gradients of the grad_acc_steps micro-batches and
// all-reducing them with SUM gives exactly the gradient of the same tokens as
// one batch, also when micro-batches hold different numbers of valid tokens
// (dividing each micro-batch by its own count does not: a micro-batch with 3
// valid tokens would weigh as much as one with 3000).
//
// Definitions, per non-ignored token, with p_S = softmax(z_S / T) and
// p_T = softmax(z_T / T) over the vocabulary:
//   forward_kl  KL(p_T || p_S)                                 * T^2
//   reverse_kl  KL(p_S || p_T)                                 * T^2
//   jsd         beta KL(p_T || M) + (1-beta) KL(p_S || M)      * T^2,
//               M = beta p_T + (1-beta) p_S, beta = jsd_beta
//   ce          -log softmax(z_S)[label]   (temperature 1)
//   loss        alpha * kd + (1 - alpha) * ce
// with 0 log 0 = 0.
//
// Top-k (sparse) teacher output: the divergence is taken between two
// distributions over k+1 buckets, the k teacher tokens and one "tail" bucket
// holding every other token, never by pretending the k teacher probabilities
// are the whole distribution of the student.
//   student: P_i = p_S[index_i] from the student's FULL softmax at T, and
//            P_tail = sum of p_S over the other V-k tokens, computed as
//            exp(logsumexp(non-top-k logits / T) - logsumexp(all / T)), not
//            as 1 - sum P_i (which cancels catastrophically when P_tail is tiny).
//   teacher: without `logsumexp`, the k values are all it sent, so
//            q_i = softmax(values / T) over the k entries and q_tail = 0 (the
//            teacher is taken to put no mass outside its top-k: the usual
//            truncated target, biased when the teacher's tail is heavy).
//            With `logsumexp` (the teacher's logsumexp(z_T / T) over the full
//            vocabulary, per token), q_i = exp(values_i / T - logsumexp) and
//            q_tail = 1 - sum q_i (clamped at 0 against rounding): exact bucket
//            probabilities, so the sparse KL is the exact KL of the bucketed
//            distributions and tends to the dense one as the tail shrinks.
//   reverse_kl with top-k needs `logsumexp`: with q_tail = 0 and P_tail > 0
//   it is infinite, so that combination is a ConfigError.
//
// Gradients. Only the student logits get a gradient, and only through
// `loss`; `kd` and `ce` are detached values for logging. The gradient w.r.t.
// the student logits is computed chunk by chunk during the forward pass and
// kept until backward, which scales it by the incoming gradient in place and
// hands it on (backward may run once per call). When the student logits do
// not require grad (or grad mode is off) only values are computed.
//
// Memory bound (CPU or GPU): besides the inputs and the [N, V] gradient in
// the student's dtype (both inherent; the gradient is allocated in forward and
// handed to autograd in backward without a copy), the peak is at most about 7
// [chunk_tokens, V] buffers in the arithmetic dtype (dense teacher; ~3 for
// top-k) plus O(N * k) vectors, independent of N. No [N, V] intermediate exists
// and no chunk's buffers outlive its chunk. Measured on CPU (tests/losses),
// float32, V = 128000, N = 512, chunk_tokens = 64 (31 MiB per buffer): beyond
// inputs and gradient, dense forward_kl 164 MiB, dense jsd 195 MiB, top-k 94
// MiB; plain autograd over the batch: 1000 MiB beyond the gradient. So N = 4096
// needs the 2 GB gradient plus the same ~200 MiB. The default chunk_tokens =
// 4096 costs ~2 GB per buffer at that V: lower it for big vocabularies. Ignored
// tokens cost neither memory nor compute: chunks are taken over valid tokens.
//
// Arithmetic is float32 for float16/bfloat16/float32 logits, float64 for
// double logits; teacher tensors are converted to that dtype chunk by chunk.
//
// Errors: tensor shapes, dtypes or devices that do not fit -> ProtocolError
// naming what was expected and what was found (also labels or top-k indices
// out of range); bad LossOptions or normalizer -> ConfigError.
//
// Thread safety: none of these functions keep state; call them from any thread.

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "distill/core/options.h"

namespace distill {

// What the teacher sent for one micro-batch: dense when `logits` is defined,
// top-k otherwise.
struct TeacherOutput {
  at::Tensor logits;       // [N, V] (or the student's shape): full teacher logits
  at::Tensor topkValues;   // [N, k]: the teacher's logits of its top-k tokens
  at::Tensor topkIndices;  // [N, k] int32 | int64: their token ids, unique per row
  at::Tensor logsumexp;    // optional [N]: logsumexp(teacher logits / T) over the full vocab
  at::Tensor logTail;      // optional [N]: logsumexp(teacher logits / T) over the NON-top-k
                           // tokens, -inf when k = V: the exact tail mass (see above)
};

struct LossResult {
  at::Tensor loss;     // 0-dim: alpha * kd + (1 - alpha) * ce; the only one with a gradient
  at::Tensor kd;       // 0-dim, detached: T^2-scaled divergence sum / normalizer
  at::Tensor ce;       // 0-dim, detached: cross-entropy sum / normalizer
  int64_t tokens = 0;  // non-ignored tokens in this call
};

// Number of labels != ignoreIndex (synchronises with the device once).
int64_t countTokens(const at::Tensor& labels, int64_t ignoreIndex);

// Throws ConfigError when `options` are not usable by distillLoss.
void validateLossOptions(const LossOptions& options);

// The distillation loss of one micro-batch; see the top of this file.
// `normalizer` > 0: the step's global count of non-ignored tokens.
LossResult distillLoss(const at::Tensor& studentLogits, const at::Tensor& labels,
                       const TeacherOutput& teacher, const LossOptions& options,
                       double normalizer);

}  // namespace distill
