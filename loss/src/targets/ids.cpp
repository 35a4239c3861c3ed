// The reader of ids answers (targets.h): the teacher's logits at the ids the
// request named. They are read as a top-k answer over those ids (the k + 1
// buckets of losses.h, "Ids answers"), or, for loss.kind sampled_token, as the
// teacher's log-probability of the one sampled id per token.
#include "targets.h"

#include "distill/core/errors.h"

namespace distill::loss_impl {

int64_t answerWidth(const IdsAnswer&) { return -1; }

void readTarget(Problem& pb, const IdsAnswer& a, const StudentShape& z, ReadState& s) {
  DISTILL_CHECK_T(ProtocolError, a.ids.defined(), pb.fn,
                  ": an ids answer without the request's ids: set IdsAnswer::ids to the [", pb.n,
                  ", k] ids the request named (the answer does not carry them back)");
  DISTILL_CHECK_T(ProtocolError, a.logsumexp.defined(), pb.fn,
                  ": an ids answer without the teacher's logsumexp: the logits at a few ids say nothing of their "
                  "probabilities without it");
  if (pb.sampledToken) {
    DISTILL_CHECK_T(ProtocolError, a.ids.dim() >= 1 && a.ids.size(-1) == 1, pb.fn,
                    ": loss.kind sampled_token: expected one id per token (the sampled token, ids [", pb.n,
                    ", 1]), found ids ", shapeOf(a.ids));
    // The CPU kernel computes the chunks (cpu/loss_kernel_sampled.h), sampled_chunks.cpp elsewhere;
    // with loss.vocab truncate (a sampled id may lie beyond the student's) only the latter.
    if (s.truncate) s.cpuFused = false;
  }
  // The top-k reader checks shapes, ranges, repeats and the logsumexp against the values.
  readTarget(pb, TopkAnswer{a.values, a.ids, a.logsumexp, a.logTail}, z, s);
  if (!pb.sampledToken) return;
  if (a.samplingLogProbs.defined()) {
    const at::Tensor& l = a.samplingLogProbs;
    DISTILL_CHECK_T(ProtocolError, l.numel() == pb.n && at::isFloatingType(l.scalar_type()), pb.fn,
                    ": sampling log-probs: expected floating [", pb.n, "], found ", shapeOf(l), " ",
                    c10::toString(l.scalar_type()));
    checkDevice("sampling log-probs", l, z);
    pb.tSamplingLogp = l.reshape({pb.n});
  }
  if (s.cpuFused) { // as sampled_chunks.cpp computes them, op for op
    pb.kLogq = pb.tValues.reshape({pb.n}).to(pb.compute).div(pb.temperature).sub_(pb.tLse.to(pb.compute)).contiguous();
    if (pb.tSamplingLogp.defined()) pb.kSamplingLogp = pb.tSamplingLogp.to(pb.compute).contiguous();
  }
}

} // namespace distill::loss_impl
