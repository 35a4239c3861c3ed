// The reader of sampled answers (targets.h): K ids drawn from the teacher's
// distribution and their counts, read as weights counts / K (losses.h,
// "Sampled targets"). Forward KL only: no unbiased estimate of the reverse KL
// or the JSD exists from such draws.
#include "targets.h"

#include "distill/core/errors.h"

namespace distill::loss_impl {

int64_t answerWidth(const SampledAnswer&) { return -1; }

void readTarget(Problem& pb, const SampledAnswer& a, const StudentShape& z, ReadState& s) {
  DISTILL_CHECK_T(ConfigError, !pb.needKd || (pb.kind == Kind::kForward && !pb.sampledToken),
                  "loss.kind ", pb.sampledToken ? "sampled_token" : pb.kind == Kind::kReverse ? "reverse_kl" : "jsd",
                  " with sampled teacher answers (teacher.samples): ids drawn from the teacher give unbiased "
                  "estimates of expectations under the TEACHER (the forward KL's gradient p_S - q), but the reverse "
                  "KL and the JSD need log q at the student's ids and the student's own expectation, of which such "
                  "draws carry no unbiased estimate; use loss.kind forward_kl, or top-k / ids answers");
  DISTILL_CHECK_T(ConfigError, !s.truncate, pb.fn, ": sampled answers from a teacher vocabulary of ", pb.vt,
                  " ids for a student of ", pb.v, ": loss.vocab truncate does not apply to sampled answers "
                  "(drawn ids beyond the student's have no renormalisation)");
  const at::Tensor &ti = a.ids, &tc = a.counts;
  DISTILL_CHECK_T(ProtocolError, ti.defined() && tc.defined(), pb.fn, ": sampled answer without ids or counts");
  const int64_t k = ti.dim() >= 1 ? ti.size(-1) : 0;
  DISTILL_CHECK_T(ProtocolError, k >= 1 && nkShape(pb, ti, k) && (ti.scalar_type() == at::kInt || ti.scalar_type() == at::kLong),
                  pb.fn, ": sampled ids: expected int32|int64 [", pb.n, ", K], found ", shapeOf(ti), " ",
                  c10::toString(ti.scalar_type()));
  DISTILL_CHECK_T(ProtocolError, nkShape(pb, tc, k) && tc.scalar_type() != at::kBool, pb.fn,
                  ": sampled counts: expected [", pb.n, ", ", k, "] like the ids, found ", shapeOf(tc), " ",
                  c10::toString(tc.scalar_type()));
  checkDevice("sampled ids", ti, z);
  checkDevice("sampled counts", tc, z);
  pb.tIndices = ti.reshape({pb.n, k}).to(at::kLong);
  at::Tensor c = tc.reshape({pb.n, k}).to(pb.compute);
  at::Tensor total = c.sum(1, /*keepdim=*/true);
  pb.tWeights = c / total.clamp_min(1e-30);
  s.checks.push_back({((pb.tIndices >= 0) & (pb.tIndices < pb.v)).all(), [&pb] {
                        DISTILL_THROW(ProtocolError, pb.fn, ": sampled ids: every id must be in [0, ", pb.v, ")");
                      }});
  s.checks.push_back({(c >= 0).all().logical_and((~s.keep).logical_or(total.squeeze(1) > 0).all()), [&pb] {
                        DISTILL_THROW(ProtocolError, pb.fn,
                                      ": sampled counts: a count is negative, or a token's counts sum to 0 "
                                      "(every answered token has K > 0 draws)");
                      }});
  // Where the CPU kernel runs (s.cpuFused) it computes the chunks (cpu/loss_kernel_sampled.h), elsewhere
  // sampled_chunks.cpp does; pb.tIndices and pb.tWeights, contiguous, serve both.
}

} // namespace distill::loss_impl
