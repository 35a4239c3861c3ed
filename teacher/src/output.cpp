// The payload's dtype (server.h): the dtype logits and top-k values travel in.
#include <ATen/ATen.h>

#include <limits>
#include <map>
#include <optional>
#include <string>

#include "distill/core/errors.h"
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
