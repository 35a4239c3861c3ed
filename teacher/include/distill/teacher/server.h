#pragma once

// The teacher server: a stateless loop that answers every request of the local
// students of its node with the teacher's output for it.
//
//   attach to the node's segment -> wait for every local student (admission,
//   run.startup_timeout_s) -> loop { take the ready requests of any students,
//   batch them (teacher.max_batch_tokens), forward under inference mode, shape
//   the output (full logits or top-k), answer each request with its own tag;
//   with teacher.cache, rows answered before come from the cache and only the
//   others go through forward: teacher/src/cache/cache.h }
//   -> stop when every student has sent finish.
//
// It never counts steps. Per student it checks that tags advance exactly as
// gradient accumulation says — (step, acc_step) goes (s, 0), (s, 1), ..,
// (s, G-1), then (s', 0) with s' > s — and answers an error message, not
// silence, to a request that breaks the order, has a wrong dtype or shape, or
// makes the model fail. It joins no collective: it has a TeacherContext only.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distill/core/context.h"
#include "distill/teacher/teacher_main.h"
#include "distill/core/tag.h"
#include "distill/teacher/model.h"

namespace distill {

struct ServeStats {
  int64_t requests = 0; // requests answered with teacher output
  int64_t errors = 0; // requests answered with an error
  int64_t masked = 0; // tokens answered masked: not finite, teacher.on_nonfinite mask
  int64_t batches = 0; // forward calls (teacher.cache: batches with a row to compute)
  double forwardSeconds = 0; // time inside forward + output shaping
  double wallSeconds = 0; // from admission to the last finish
  std::vector<int64_t> perStudent; // requests answered, by local student
};

// Serves until every local student has sent finish. Throws PeerLostError when a
// student dies before finishing, TimeoutError when admission fails.
ServeStats serve(TeacherContext& ctx, std::shared_ptr<TeacherModel> model);

// The top-k output the server sends for `logits` [..., V] (teacher.topk = k
// > 0), by protocol name: topk_values [..., k] in `values` (the logits of the
// top-k tokens), topk_indices [..., k] int32, logsumexp [...] float32 =
// logsumexp(logits / T) over the vocabulary, and log_tail [...] float32 = the
// same over the V - k other tokens (-inf when k = V), computed in one pass.
// Values rounded to a narrower dtype than the logits': the logsumexp is taken
// of the rounded values and the tail, so that the k + 1 buckets sum to 1.
// See student/losses.h for how the student uses them. ConfigError if k is
// outside 1..V; ProtocolError if a finite value overflows `values` (float16).
// Any thread; under inference mode or not.
std::map<std::string, at::Tensor> topkOutput(const at::Tensor& logits, int64_t k, double temperature,
                                             at::ScalarType values = at::kFloat);

// The dtype logits or top-k values travel in (teacher.payload_dtype) for an
// output of dtype `output`: the configured one; auto: teacher.autocast's dtype
// when set, else `output` if float16 or bfloat16, else float32.
at::ScalarType payloadDtype(const TeacherOptions& t, at::ScalarType output);

// `t` in `dtype`; ProtocolError naming `what` and teacher.payload_dtype if a
// finite value overflows it (float16).
at::Tensor toPayloadDtype(const at::Tensor& t, at::ScalarType dtype, const char* what);

// "" if `next` may follow `prev` (nullopt: the student's first request) with
// grad_acc_steps G; otherwise why not, naming both tags.
std::string checkTagOrder(const std::optional<Tag>& prev, const Tag& next, int gradAccSteps);

} // namespace distill
