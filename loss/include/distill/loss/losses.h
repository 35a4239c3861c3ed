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
// Definitions, per non-ignored token, with p_S = softmax(z_S / T) and
// p_T = softmax(z_T / T) over the vocabulary:
//   forward_kl  KL(p_T || p_S)                                 * T^2
//   reverse_kl  KL(p_S || p_T)                                 * T^2
//   jsd         beta KL(p_T || M) + (1-beta) KL(p_S || M)      * T^2,
//               M = beta p_T + (1-beta) p_S, beta = jsd_beta
//   ce          -log softmax(z_S)[label]   (temperature 1)
//   loss        alpha * kd + (1 - alpha) * ce
// with 0 log 0 = 0. A term whose weight is 0 is not computed at all (alpha = 0:
// no kd, and the teacher output is not read beyond the input checks; alpha = 1:
// no ce), so an infinite term of weight 0 cannot make the loss NaN; LossResult
// reports such a term as NaN, meaning "not computed" (0 would read as a
// perfect match). Everything is computed from log-probabilities: log M of the
// JSD is logaddexp(log beta + log p_T, log(1-beta) + log p_S), finite wherever
// p_T or p_S is, also when both underflow in probability space.
//
// Top-k (sparse) teacher output: the divergence is taken between two
// distributions over k+1 buckets, the k teacher tokens and one "tail" bucket
// holding every other token, never by pretending the k teacher probabilities
// are the whole distribution of the student.
//   student: P_i = p_S[index_i] from the student's FULL softmax at T, and
//            P_tail = sum of p_S over the other V-k tokens, computed as
//            exp(logsumexp(non-top-k logits / T) - logsumexp(all / T)), not
//            as 1 - sum P_i (which cancels catastrophically when P_tail is tiny).
//   teacher, by what it sent (the server sends values, indices, logsumexp and
//   logTail; the other forms are for other producers and older teachers):
//     `logTail` (the teacher's logsumexp(z_T / T) over its NON-top-k tokens,
//            -inf when k = V): q = softmax([values / T, logTail]) over the
//            k+1 buckets, i.e. q_i = exp(values_i / T - lse) and
//            q_tail = exp(logTail - lse) with lse = logaddexp(logsumexp(
//            values / T), logTail): exact bucket probabilities, the tail
//            included, however small (no 1 - sum q_i anywhere). The sparse KL
//            is then the exact KL of the bucketed distributions; with k = V
//            (or a teacher tail of -inf logits) it equals the dense loss.
//     `logsumexp` only (the teacher's logsumexp(z_T / T) over the full
//            vocabulary): q_i = exp(values_i / T - logsumexp) and q_tail =
//            1 - sum q_i, which rounding decides only down to a resolution
//            r = 4 eps max(1, |logsumexp|) (eps of the coarsest dtype among the
//            values, the logsumexp and the arithmetic). Below r the tail is
//            taken as 0 where the student's tail is empty too (k = V, or every
//            non-top-k student logit -inf: the loss is then that of the dense
//            teacher) and as r elsewhere, then the k+1 buckets are
//            renormalised. So the loss is always finite where the mathematics
//            is; a reverse KL against a teacher tail below r is a lower bound
//            of the exact value (send logTail for the exact one).
//     neither: the k values are all there is, so q_i = softmax(values / T)
//            over the k entries and q_tail = 0 (the teacher is taken to put no
//            mass outside its top-k: the usual truncated target, biased when
//            the teacher's tail is heavy).
//   reverse_kl with top-k needs `logsumexp` or `logTail`: with q_tail = 0 and
//   P_tail > 0 it is infinite, so that combination is a ConfigError.
//   With `logsumexp`, every non-ignored row is checked (with the other input
//   checks, one device sync) against the values: s = logsumexp(values / T),
//   with `logTail` s = logaddexp(that, logTail), must satisfy
//       s - logsumexp <= kLogsumexpTolerance + 8 eps |logsumexp|
//   (with `logTail` also logsumexp - s <= the same, since then the two must
//   agree): top-k probabilities that sum above 1 by more than rounding mean
//   the logsumexp belongs to other logits or, most often, another temperature;
//   that is a ProtocolError naming the row and both values, never a silent
//   renormalisation. Within the tolerance, rounding is absorbed by
//   renormalising the buckets.
//
// Vocabularies that differ (docs/vocab.md). The teacher's vocabulary V_t is
// TeacherOutput::vocab (what the teacher stated; for a dense teacher also its
// logits' width) and the student's V_s the logits' width (fusedLinearLoss: the
// weight's rows). With V_t == V_s, or V_t not stated by a top-k teacher,
// nothing changes. V_t > V_s:
//   loss.vocab error     ProtocolError naming both sizes and loss.vocab (as
//                        any teacher output of the wrong width was before).
//   loss.vocab truncate  the teacher's distribution at T is restricted to the
//     ids < V_s and renormalised: q'_j = q_j / (1 - m) for j < V_s, where
//     m = sum_{j >= V_s} q_j is the dropped mass. Dense: the teacher's columns
//     [0, V_s) and its softmax over them; m = exp(logsumexp(z_T[V_s:] / T) -
//     logsumexp(z_T / T)). Top-k: the entries with index >= V_s leave the top-k
//     (D, the dropped ones), so m = sum_{i in D} exp(v_i / T - L) with L the
//     teacher's full logsumexp (its logsumexp, or logaddexp(logsumexp(v / T),
//     logTail); with neither, the softmax over the k values). The kept buckets
//     are renormalised by replacing L with L' = L + log(1 - m): with logTail,
//     L' = logaddexp(logsumexp(kept v / T), logTail); with the logsumexp only,
//     L' = L + log1mexp(logsumexp(dropped v / T) - L); with neither, the
//     softmax over the kept values. The tail bucket keeps the teacher's tail:
//     the teacher does not say how much of it lies at ids >= V_s, so the
//     measured m is the top-k's part of the dropped mass (a lower bound; exact
//     for padding rows, which never reach the top-k). Every non-ignored token
//     with m > loss.max_truncated_mass is a ProtocolError naming the mass: the
//     dropped ids were not padding. The mass is measured in the arithmetic
//     dtype (float32 for float32/half/bfloat16 logits).
// V_t < V_s is a ProtocolError in both modes: the student has ids the teacher
// gives no probability (reverse KL would be infinite), and padding the teacher
// with zero-probability ids would train the student's extra rows towards -inf.
//
// Gradients. Only the student logits get a gradient, and only through
// `loss`; `kd` and `ce` are detached values for logging. The gradient w.r.t.
// the student logits is computed chunk by chunk during the forward pass and
// kept until backward, which scales it by the incoming gradient in place
// (not at all when that is 1, as for loss.backward()) and hands it on
// (backward may run once per call). When the student logits do
// not require grad (or grad mode is off) only values are computed.
//
// Implementation. The chunks run through a row kernel chosen by device
// (loss/src/row_kernel.h), or through ATen ops where none takes them. On CUDA,
// for float32, float16 and bfloat16 logits with contiguous rows, one CUDA row
// kernel (loss/src/cuda/loss_rows.cu): a thread block per valid row, online max
// and sum of exp for the student (and the teacher at T), then the divergence
// and the gradient, float32 arithmetic, loss parts kept on the device (no host
// sync after the input checks); a top-k teacher's ids are marked in a
// shared-memory bitmap of the vocabulary (k and V whose bitmap and buckets pass
// 160 KiB take the ATen-op path). On CPU, for float32 and float64 student logits with
// contiguous rows, a fused kernel (loss/src/cpu/loss_kernel_impl.h, built for
// AVX-512, AVX2+FMA and any CPU, picked at run time as ATen picks its own)
// handles each valid row on its own: the row is read from cache a few times
// (maxima; sums of exp; divergence and gradient, written once into the [N, V]
// gradient), parallel over rows with at::parallel_for, with sums in double per
// row and added in row order (the same value for any thread count). Top-k:
// the k teacher values are a (k+1)-bucket array per row, the student's tail
// log-sum-exp is taken over its own logits (the top-k masked), never as a
// difference. Elsewhere (CPU half/bfloat16 logits, other devices, CUDA float64)
// the same formulas run as ATen ops chunk by chunk (detail::distillLossAtenOps;
// tests/losses checks the paths against each other and, on a GPU, the CUDA
// kernel against the float64 CPU path).
//
// Memory bound: besides the inputs and the [N, V] gradient in the student's
// dtype (both inherent; the gradient is allocated in forward and handed to
// autograd in backward without a copy), the fused CPU kernel needs one row of
// scratch per thread (plus, for a teacher of another dtype than the
// arithmetic, that chunk's teacher rows converted: one [chunk_tokens, V]
// buffer) and O(N k) vectors. The ATen-op path needs at most about 10
// [chunk_tokens, V] buffers in the arithmetic dtype (dense teacher; ~3 for
// top-k) plus O(N * k) vectors, independent of N. No [N, V] intermediate
// exists and no chunk's buffers outlive its chunk. Measured on CPU
// (tests/losses), float32, V = 128000, N = 512, chunk_tokens = 64: beyond
// inputs and gradient 0.0 MiB for dense forward_kl and jsd, 0.3 MiB for
// top-k (the ATen-op path: 258 MiB, 281 MiB, 94 MiB, i.e. 8.3, 9.0 and 3.0
// buffers of 31 MiB); plain autograd over the batch: 1000 MiB beyond the
// gradient. On the ATen-op path the default chunk_tokens = 4096 costs ~2 GB
// per buffer at that V: lower it for big vocabularies there. Ignored tokens
// cost neither memory nor compute: chunks are taken over valid tokens.
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
// gradients as distillLoss(hidden @ weight.T + bias, ...) (tests/losses checks
// them to 1e-6 relative in float64), without an [N, V] tensor ever alive.
//   hidden  [..., d] (leading dims flatten to the N tokens of `labels` and the
//           teacher output), floating
//   weight  [V, d], hidden's dtype and device; bias [V] or undefined (no bias)
// Teacher, labels, options and normalizer are distillLoss's (top of this file).
// The valid tokens go in chunks of `chunkTokens` rows (0: automatic; on CPU
// max(256, 2^23 / V), i.e. a chunk's logits hold ~8 M elements; on CUDA
// Liger's rule, next_pow2(N / ceil(V / d)) within [256, 2048], i.e. a chunk
// buffer near N d elements; LossOptions::chunk_tokens is not used here): each
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
// instead (see "Implementation" above); tests/losses checks the two against
// each other.
LossResult distillLossAtenOps(const at::Tensor& studentLogits, const at::Tensor& labels, const TeacherOutput& teacher,
                              const LossOptions& options, double normalizer);
// fusedLinearLoss with the chunks' losses on the ATen-op path (as on CUDA).
LossResult fusedLinearLossAtenOps(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                  const at::Tensor& labels, const TeacherOutput& teacher, const LossOptions& options,
                                  double normalizer, int64_t chunkTokens = 0);
} // namespace detail

} // namespace distill
