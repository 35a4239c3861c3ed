// The reader of hidden-state answers (targets.h) for distillLoss, the
// materialised path: the teacher's logits made from its hidden states and its
// head (teacherLogits, chunk by chunk, in the head's dtype), then read as full
// logits. fusedLinearLoss never comes here: it makes them chunk by chunk
// beside the student's (fused_linear.cpp hands the answer to hidden_head.cpp).
#include "targets.h"

#include "distill/core/errors.h"
#include "distill/loss/hidden_head.h"

namespace distill::loss_impl {

int64_t answerWidth(const HiddenAnswer& a) {
  return a.head && a.head->weight.defined() && a.head->weight.dim() == 2 ? a.head->weight.size(0) : -1;
}

void readTarget(Problem& pb, const HiddenAnswer& a, const StudentShape& z, ReadState& s) {
  DISTILL_CHECK_T(UsageError, a.head != nullptr, pb.fn,
                  ": the teacher answered with its hidden states but no head came with them (a Client attaches the "
                  "node's mapped head; a caller of the loss sets HiddenAnswer::head)");
  const at::Tensor& h = a.hidden;
  const int64_t d = a.head->weight.defined() && a.head->weight.dim() == 2 ? a.head->weight.size(1) : -1;
  DISTILL_CHECK_T(ProtocolError, h.defined() && at::isFloatingType(h.scalar_type()) && nkShape(pb, h, d), pb.fn,
                  ": teacher hidden states: expected floating [", pb.n, ", ", d, "] (d_t: the head's columns; or [",
                  z.shape, " without V, d_t]), found ",
                  h.defined() ? shapeOf(h) + " " + std::string(c10::toString(h.scalar_type())) : "undefined");
  checkDevice("teacher hidden states", h, z);
  LogitsAnswer dense;
  dense.logits = teacherLogits(h.reshape({pb.n, d}), *a.head); // [N, V_t]: the materialised path holds them
  readTarget(pb, dense, z, s);
}

} // namespace distill::loss_impl
