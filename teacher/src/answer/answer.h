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

#include <cstdint>
#include <map>
#include <string>

#include "distill/core/answer_kinds.h"
#include "distill/core/options.h"
#include "distill/core/tag.h"

namespace distill {

using Answer = std::map<std::string, at::Tensor>; // by protocol name, dim 0 = rows

// The shaper's inputs besides the logits.
struct ShapeContext {
  const TeacherOptions& teacher;
  double temperature = 1.0; // loss.temperature: top-k's logsumexp and log tail are taken at it
  // Sampled answers: one key per row of the batch (int64 [B], CPU; sampleKey), from which each
  // position's draws follow; undefined otherwise.
  at::Tensor rowKeys;
};

// The key of the draws of one request row: a hash of the run's seed, the
// student, the request's tag (step, acc_step, seq) and the row within the
// request. The same request answered again (a replay, a restarted teacher)
// draws the same ids; another row, tag or seed draws others.
uint64_t sampleKey(int64_t seed, int student, const Tag& tag, int64_t row); // sampled.cpp
// The key whose draws at position 0 are those of `rowKey` at `position`: a position
// shaped alone ([N, 1, V], teacher.cache.keys prefix) draws what its row would.
uint64_t positionSampleKey(uint64_t rowKey, int64_t position); // sampled.cpp

// The configured kind's answer for `logits`.
Answer shapeAnswer(const at::Tensor& logits, const ShapeContext& c);

Answer shapeLogits(const at::Tensor& logits, const ShapeContext& c); // logits.cpp
Answer shapeTopk(const at::Tensor& logits, const ShapeContext& c); // topk.cpp (topkOutput, server.h)
Answer shapeHidden(const at::Tensor& hidden, const ShapeContext& c); // hidden.cpp: `logits` are the hidden states
// K = teacher.samples draws per position from softmax(logits / T) with replacement, by inverse
// CDF at uniforms hashed from (c.rowKeys[b], position, draw): unique ids (ascending) and counts,
// padded with count 0 (answer_kinds.h). Logits [B, ..., V].
Answer shapeSampled(const at::Tensor& logits, const ShapeContext& c); // sampled.cpp
// The logits at `ids` [..., k] (the request's, any integer dtype; the logits' leading dims) in the
// payload dtype, with the logsumexp and the log tail (over the other ids) at c.temperature.
Answer shapeIds(const at::Tensor& logits, const at::Tensor& ids, const ShapeContext& c); // ids.cpp

} // namespace distill
