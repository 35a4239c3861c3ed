#pragma once

// The teacher answering with its final hidden states instead of its logits
// (issue 43; docs/losses.md, "The teacher as hidden states"): its logits are
// z_T = transform(teacherHidden @ weight.T + bias), made from those hidden
// states and its output layer (the TeacherHead, shared once), chunk by chunk
// beside the student's, so that neither [N, V_s] nor [N, V_t] is ever held.
//
// Head transforms, in this order (the forms models declare; anything else is
// not a TeacherHead):
//   z = hidden @ weight.T + bias   (bias optional)
//   z = z * scale                  (scale != 1: Cohere's logit_scale, or
//                                   1 / Granite's logits_scaling)
//   z = softcap * tanh(z / softcap) (softcap > 0: Gemma 2's final logit soft-capping)
// The GEMM and the transforms run in the head's dtype, as the teacher's own
// forward would; the loss then reads z_T as it reads any teacher logits (a
// teacher of another dtype than the arithmetic converted chunk by chunk).
//
// Exactness. fusedLinearLoss with (teacherHidden, head) computes the same loss
// and gradients as fusedLinearLoss (or distillLoss on the student's
// materialised logits) given the dense teacher logits teacherLogits(teacherHidden,
// head): every kind, T, alpha, ignore index, normalizer, loss.vocab truncate
// (a head with more rows than the student's vocabulary: the dropped mass is
// measured chunk by chunk over the head's extra rows, reported in LossResult
// and checked against loss.max_truncated_mass after the chunks, with the
// messages of the materialised path), non-finite teacher logits as there. The
// full vocabulary, not a top-k: tests/loss/hidden_head_test.cpp checks it to
// 1e-9 in float64.
//
// Gradients: only the student's (hidden, weight, bias), as fusedLinearLoss;
// nothing flows into the teacher's hidden states or head, whether or not they
// require grad.
//
// Memory beyond the inputs: fusedLinearLoss's (the student's gradients and one
// or two [chunkTokens, V_s] buffers) plus one [chunkTokens, V_s] buffer of the
// teacher's logits in the head's dtype (and [chunkTokens, V_t - V_s] when
// truncating, with one float per valid token for the dropped mass), reused by
// every chunk.
//
// Errors: a head that is not one (shapes, dtypes, devices, softcap, scale) ->
// UsageError naming the field and what was found; teacher hidden states that
// do not fit the head or the tokens -> ProtocolError (what the teacher sent,
// as for its logits); everything else as fusedLinearLoss.
//
// Thread safety: no state; call from any thread. The head's tensors are only
// read (a head mapped read-only is fine).

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "distill/core/options.h"
#include "distill/loss/losses.h"

namespace distill {

// The teacher's output layer: what turns its final hidden states into logits.
struct TeacherHead {
  at::Tensor weight; // [V_t, d_t], floating: the output layer's weight (lm_head)
  at::Tensor bias; // [V_t] of the weight's dtype and device, or undefined: no bias
  double softcap = 0; // > 0: logits = softcap * tanh(logits / softcap), after the scale; 0: none
  double scale = 1; // > 0: logits = logits * scale, before the softcap; 1: none
};

// Throws UsageError naming the field when `head` is not a usable head: weight
// not a floating [V_t >= 1, d_t >= 1] tensor, bias not [V_t] of its dtype and
// device, softcap negative or not finite, scale not finite and > 0.
void validateTeacherHead(const TeacherHead& head);

// The materialised path: the teacher's full logits [..., V_t] from its hidden
// states [..., d_t] (any floating dtype, converted to the head's; the head's
// device), in the head's dtype, computed `chunkTokens` rows at a time (0:
// max(256, 2^23 / V_t)), without gradient. Give them to distillLoss or
// fusedLinearLoss as TeacherOutput::logits (and TeacherOutput::vocab = V_t).
// The result holds N * V_t elements: the fused loss below never does.
at::Tensor teacherLogits(const at::Tensor& teacherHidden, const TeacherHead& head, int64_t chunkTokens = 0);

// fusedLinearLoss (losses.h) with the teacher given as its final hidden states
// [..., d_t] (the N tokens of `labels`; any floating dtype, converted to the
// head's chunk by chunk) and its head, on the student's device. Per chunk one
// more GEMM (two when truncating a larger head) for the teacher's logits, into
// a buffer reused by every chunk. Everything else (the student's side, options,
// normalizer, chunkTokens, the result) as fusedLinearLoss's.
LossResult fusedLinearLoss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                           const at::Tensor& labels, const at::Tensor& teacherHidden, const TeacherHead& teacherHead,
                           const LossOptions& options, double normalizer, int64_t chunkTokens = 0);

namespace detail {
// The same with the chunks' losses on the ATen-op path (as on CUDA), for tests.
LossResult fusedLinearLossAtenOps(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                  const at::Tensor& labels, const at::Tensor& teacherHidden,
                                  const TeacherHead& teacherHead, const LossOptions& options, double normalizer,
                                  int64_t chunkTokens = 0);
} // namespace detail

} // namespace distill
