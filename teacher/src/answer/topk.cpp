// The top-k shaper (answer.h; topkOutput, server.h): values, int32 indices,
// and the logsumexp and log tail at the loss temperature, in one pass.
#include "answer.h"

#include <limits>

#include "distill/core/errors.h"
#include "distill/teacher/server.h"

namespace distill {

std::map<std::string, at::Tensor> topkOutput(const at::Tensor& logits, int64_t k, double temperature,
                                             at::ScalarType valueDtype) {
  DISTILL_CHECK_T(ConfigError, logits.dim() >= 1 && k >= 1 && k <= logits.size(-1), "teacher.topk=", k,
                  " exceeds the vocabulary of ", logits.dim() >= 1 ? logits.size(-1) : 0);
  std::map<std::string, at::Tensor> out;
  auto [values, indices] = at::topk(logits, k, -1);
  // One float32 buffer of logits / T (a new tensor: div never aliases): the
  // logsumexp over everything, then, with the top-k masked out in place, over
  // the tail. The tail is summed, never taken as a difference, which cancels
  // to 0 when the top-k holds nearly all the mass.
  at::Tensor scaled = logits.to(at::kFloat).div(temperature);
  at::Tensor lse = at::logsumexp(scaled, -1);
  scaled.scatter_(-1, indices, -std::numeric_limits<float>::infinity());
  at::Tensor tail = at::logsumexp(scaled, -1);
  at::Tensor sent = toPayloadDtype(values, valueDtype, "teacher top-k values: a logit");
  if (c10::elementSize(valueDtype) < c10::elementSize(values.scalar_type())) {
    // Rounded values: logsumexp = logaddexp(logsumexp(rounded / T), log_tail),
    // so that the k + 1 buckets the student sees still sum to 1 (losses.h checks it).
    lse = at::logaddexp(at::logsumexp(sent.to(at::kFloat).div(temperature), -1), tail);
  }
  out[protocol::kLogsumexp] = lse.contiguous();
  out[protocol::kLogTail] = tail.contiguous();
  out[protocol::kTopkValues] = sent.contiguous();
  out[protocol::kTopkIndices] = indices.to(at::kInt).contiguous();
  return out;
}

Answer shapeTopk(const at::Tensor& logits, const ShapeContext& c) {
  return topkOutput(logits, c.teacher.topk, c.temperature, payloadDtype(c.teacher, logits.scalar_type()));
}

} // namespace distill
