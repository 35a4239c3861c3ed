// What a teacher answers beyond the model's forward: the top-k shape of its
// output (server.h, topkOutput) and the payload's dtype.
#include <ATen/ATen.h>

#include <limits>
#include <map>
#include <optional>
#include <string>

#include "distill/core/errors.h"
#include "distill/core/protocol.h"
#include "distill/core/tag.h"
#include "distill/teacher/server.h"

namespace distill {

at::Tensor toPayloadDtype(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  at::Tensor sent = t.to(dtype);
  if (dtype != t.scalar_type()) {
    const at::Tensor lost = at::isfinite(t).logical_and(at::isfinite(sent).logical_not());
    DISTILL_CHECK_T(ProtocolError, !lost.any().item<bool>(), what, " of magnitude ",
                    t.masked_select(lost)[0].item<double>(), " overflows ", c10::toString(dtype),
                    " (teacher.payload_dtype): use bfloat16 or float32");
  }
  return sent;
}

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

at::ScalarType payloadDtype(const TeacherOptions& t, at::ScalarType output) {
  switch (t.payload_dtype) {
    case PayloadDtype::kFloat32:
      return at::kFloat;
    case PayloadDtype::kBFloat16:
      return at::kBFloat16;
    case PayloadDtype::kFloat16:
      return at::kHalf;
    case PayloadDtype::kAuto:
      break;
  }
  if (t.autocast == Autocast::kBFloat16) return at::kBFloat16;
  if (t.autocast == Autocast::kFloat16) return at::kHalf;
  return output == at::kHalf || output == at::kBFloat16 ? output : at::kFloat;
}

} // namespace distill
