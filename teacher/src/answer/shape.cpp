// The shapers' dispatch (answer.h).
#include "answer.h"

#include "distill/core/errors.h"

namespace distill {

Answer shapeAnswer(const at::Tensor& logits, const ShapeContext& c) {
  const AnswerKind kind = answerKindOf(c.teacher);
  switch (kind) {
    case AnswerKind::kLogits:
      return shapeLogits(logits, c);
    case AnswerKind::kTopk:
      return shapeTopk(logits, c);
    case AnswerKind::kHidden:
      return shapeHidden(logits, c);
    case AnswerKind::kSampled:
      return shapeSampled(logits, c);
    case AnswerKind::kIds: // per request: the server calls shapeIds with the request's ids
      break;
  }
  DISTILL_THROW(InternalError, "answer kind ", int(kind), " has no shaper (teacher/src/answer/)");
}

} // namespace distill
