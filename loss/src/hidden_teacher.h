#pragma once

// The teacher as hidden states + head inside the fused linear loss (internal
// to loss/src; the API is distill/loss/hidden_head.h):
//   hidden_head.cpp   the head checked, a chunk's teacher logits (GEMM +
//                     transforms), the dropped mass of a truncated head, the
//                     Problem of a call whose teacher logits do not exist yet
//   fused_linear.cpp  the chunks: with a HiddenTeacher, one more GEMM per chunk
//                     into a reused buffer, handed to the loss as that chunk's
//                     dense teacher logits

#include <ATen/ATen.h>

#include "distill/loss/hidden_head.h"
#include "loss_problem.h"

namespace distill::loss_impl {

// The teacher's side of one call, checked and flattened.
struct HiddenTeacher {
  at::Tensor h; // [N_h, d_t] the teacher's hidden states, detached, any floating dtype (N_h checked by prepareHidden)
  at::Tensor w, b; // [V_t, d_t], [V_t] or undefined: the head, detached
  double softcap = 0, scale = 1;
  int64_t vt = 0; // V_t: the head's rows
  double maxTruncatedMass = 1; // loss.max_truncated_mass (checked after the chunks)
};

// The head checked (UsageError, validateTeacherHead; its device against
// `device`) and the hidden states against it (ProtocolError: floating,
// [..., d_t]); `fn` names the call in messages.
HiddenTeacher hiddenTeacher(const at::Tensor& teacherHidden, const TeacherHead& head, const at::Device& device,
                            const char* fn);

// The teacher's logits of hidden rows `hc` [C, d_t] for the head's rows
// [col0, col0 + out.size(1)), written into `out` [C, cols] (contiguous rows, the
// head's dtype): one GEMM (addmm with the bias), then the transforms in place.
void headLogits(const HiddenTeacher& t, const at::Tensor& hc, int64_t col0, const at::Tensor& out);

// prepare() for a teacher given as hidden states: the inputs checked, the
// teacher's vocabulary compared with the student's (loss.vocab), the hidden
// states' token count with the labels'. pb.tLogits is left undefined (each
// chunk sets its own); pb.vt is V_t.
Problem prepareHidden(const StudentShape& z, const at::Tensor& labels, const HiddenTeacher& t, const LossOptions& o,
                      double normalizer);

// A truncated head: the teacher's probability (at pb.temperature) of the ids
// >= V_s of each row, from the chunk's kept [C, V_s] and dropped [C, V_t - V_s]
// logits, into `mass` [C] (pb.compute). Computed as exp(lse_dropped -
// logaddexp(lse_kept, lse_dropped)), never as 1 - a sum; NaN where the logits
// are NaN or +inf (as the materialised path measures them).
void droppedMass(const Problem& pb, const at::Tensor& keep, const at::Tensor& drop, const at::Tensor& mass);

// After the chunks: the dropped masses [Nv] into pb.massMax / massSum and
// checked (checkTruncatedMass; the message's top dropped id from the row's
// logits, made again).
void checkHiddenMass(Problem& pb, const HiddenTeacher& t, const at::Tensor& mass);

// fused_linear.cpp: fusedLinearLoss with the teacher as hidden states + head.
LossResult fusedLinearHidden(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                             const at::Tensor& labels, const HiddenTeacher& teacher, const LossOptions& options,
                             double normalizer, int64_t chunkTokens, bool allowFused);

} // namespace distill::loss_impl
