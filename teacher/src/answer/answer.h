#pragma once

// The teacher's shapers, one per answer kind (core/answer_kinds.h): the
// model's output for a batch (teacher.output, [B, T, V]; with teacher.answer
// hidden its final hidden states [B, T, d_t]) made into the
// tensors of the configured kind, by their protocol names, in the payload
// dtype (teacher.payload_dtype). shapeAnswer picks the shaper by kind
// (answerKindOf); the server adds hidden states and moves the answer where it
// travels. A new kind is one more file here and its case in shape.cpp.
//
// Any thread; under inference mode or not.

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "distill/core/answer_kinds.h"
#include "distill/core/options.h"

namespace distill {

using Answer = std::map<std::string, at::Tensor>; // by protocol name, dim 0 = rows

// The shaper's inputs besides the logits.
struct ShapeContext {
  const TeacherOptions& teacher;
  double temperature = 1.0; // loss.temperature: top-k's logsumexp and log tail are taken at it
};

// The configured kind's answer for `logits`.
Answer shapeAnswer(const at::Tensor& logits, const ShapeContext& c);

Answer shapeLogits(const at::Tensor& logits, const ShapeContext& c); // logits.cpp
Answer shapeTopk(const at::Tensor& logits, const ShapeContext& c); // topk.cpp (topkOutput, server.h)
Answer shapeHidden(const at::Tensor& hidden, const ShapeContext& c); // hidden.cpp: `logits` are the hidden states

} // namespace distill
