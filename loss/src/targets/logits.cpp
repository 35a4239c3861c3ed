// The reader of full-logits answers (targets.h).
#include "targets.h"

#include "distill/core/errors.h"

namespace distill::loss_impl {

int64_t answerWidth(const LogitsAnswer& a) { return a.logits.defined() && a.logits.dim() >= 1 ? a.logits.size(-1) : -1; }

void readTarget(Problem& pb, const LogitsAnswer& a, const StudentShape& z, ReadState&) {
  const at::Tensor& tl = a.logits;
  DISTILL_CHECK_T(ProtocolError, tl.defined(), pb.fn, ": teacher output has neither logits nor top-k values and indices");
  DISTILL_CHECK_T(ProtocolError, nkShape(pb, tl, pb.vt) && at::isFloatingType(tl.scalar_type()), pb.fn,
                  ": teacher logits: expected floating [", pb.n, ", ", pb.vt, "] (or the student's ", z.shape,
                  "), found ", shapeOf(tl), " ", c10::toString(tl.scalar_type()));
  checkDevice("teacher logits", tl, z);
  pb.tLogits = tl.reshape({pb.n, pb.vt});
  if (pb.vt > pb.v) { // loss.vocab truncate: the student's ids only (loss_vocab.cpp)
    pb.tFull = pb.tLogits;
    pb.tLogits = pb.tFull.narrow(1, 0, pb.v);
  }
}

} // namespace distill::loss_impl
