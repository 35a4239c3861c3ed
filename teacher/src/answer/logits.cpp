// The full-logits shaper (answer.h): the logits in the payload dtype.
#include "answer.h"

#include "distill/teacher/server.h"

namespace distill {

Answer shapeLogits(const at::Tensor& logits, const ShapeContext& c) {
  const at::ScalarType dtype = payloadDtype(c.teacher, logits.scalar_type());
  return {{protocol::kLogits, toPayloadDtype(logits, dtype, "teacher logits: a value").contiguous()}};
}

} // namespace distill
