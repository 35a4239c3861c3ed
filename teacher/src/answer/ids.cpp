// The ids shaper (answer.h): the teacher's logits at the ids a request named,
// as the top-k shaper sends its own top-k (teacher/src/answer/topk.cpp).
#include <limits>

#include "answer.h"
#include "distill/core/errors.h"
#include "distill/teacher/server.h"

namespace distill {

Answer shapeIds(const at::Tensor& logits, const at::Tensor& ids, const ShapeContext& c) {
  const int64_t v = logits.dim() >= 1 ? logits.size(-1) : 0;
  DISTILL_CHECK_T(ProtocolError,
                  ids.defined() && ids.dim() == logits.dim() && !at::isFloatingType(ids.scalar_type()) &&
                      ids.sizes().slice(0, ids.dim() - 1) == logits.sizes().slice(0, logits.dim() - 1),
                  "a request's ids: expected integer [..., k] with the leading dims of the teacher's output ",
                  logits.sizes(), ", found ", ids.defined() ? ids.sizes() : at::IntArrayRef{});
  at::Tensor idx = ids.to(logits.device(), at::kLong);
  DISTILL_CHECK_T(ProtocolError, idx.numel() == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < v),
                  "a request's ids: every id must be in [0, ", v, ") (the teacher's vocabulary)");
  const at::ScalarType dtype = payloadDtype(c.teacher, logits.scalar_type());
  at::Tensor sent = toPayloadDtype(logits.gather(-1, idx), dtype, "teacher logits at the request's ids: a logit");
  // As topkOutput: float32 logits / T; the tail summed over the other ids, never a difference.
  at::Tensor scaled = logits.to(at::kFloat).div(c.temperature);
  at::Tensor lse = at::logsumexp(scaled, -1);
  scaled.scatter_(-1, idx, -std::numeric_limits<float>::infinity());
  at::Tensor tail = at::logsumexp(scaled, -1);
  if (c10::elementSize(dtype) < c10::elementSize(logits.scalar_type())) {
    // Rounded values: the k + 1 buckets the student sees still sum to 1 (losses.h checks it).
    lse = at::logaddexp(at::logsumexp(sent.to(at::kFloat).div(c.temperature), -1), tail);
  }
  return {{protocol::kIdsValues, sent.contiguous()},
          {protocol::kLogsumexp, lse.contiguous()},
          {protocol::kLogTail, tail.contiguous()}};
}

} // namespace distill
