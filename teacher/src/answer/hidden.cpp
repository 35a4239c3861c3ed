// The hidden-state shaper (answer.h): the model's teacher.output is its final
// hidden states [B, T, d_t] (its head's input), sent in the payload dtype; the
// head itself is published once per node (teacher/src/head.h), never here.
#include "answer.h"

#include "distill/teacher/server.h"

namespace distill {

Answer shapeHidden(const at::Tensor& hidden, const ShapeContext& c) {
  const at::ScalarType dtype = payloadDtype(c.teacher, hidden.scalar_type());
  return {{protocol::kHidden, toPayloadDtype(hidden, dtype, "teacher hidden states: a value").contiguous()}};
}

} // namespace distill
