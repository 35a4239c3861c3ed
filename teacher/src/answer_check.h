#pragma once

// The checks of what a teacher answers (server.cpp): that a response can hold
// it, the shape and vocabulary of the model's output, and its finiteness.
//
// teacher.on_nonfinite: every answer the teacher computes is checked before it
// is shaped, sent or cached (server.cpp): one reduction over the model's output
// (a max, which NaN propagates), so a finite answer costs one pass over its
// logits (bench_payload's "nonfinite_check" row: its share of an answer's time).
// -inf is a legal logit (a token the teacher rules out); NaN and +inf are not.
//
// error: each request holding such a token is answered with the teacher's error
// (naming the teacher, the request's tag and student, the row, the position and
// how many values). mask: the token's answer is marked (answer_kinds.h, "Masked
// tokens") and the student's Steps drops its kd term; it learns from its label.
// Either way no such answer is ever stored in the teacher cache.
//
// Not thread-safe state: functions only.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "distill/core/answer_kinds.h"
#include "distill/core/options.h"
#include "distill/core/tag.h"

namespace distill {

// "Float [2, 16]": a tensor's dtype and shape, for messages.
std::string describe(const at::Tensor& t);

// ConfigError at start-up when the output (the logits, or the top-k's four
// tensors) and teacher.hidden_states do not fit in one response
// (ipc::kMaxTensors); otherwise every reply would fail.
void checkResponseFits(const TeacherOptions& t);

// ProtocolError unless the model's output `logits` fits its first input: the
// batch in dim 0 and, for token ids [B, T] answered per position ([B, T', V]),
// one row per token.
void checkOutputShape(const TeacherOptions& t, const at::Tensor& logits, const at::Tensor& input);

// ProtocolError unless teacher.vocab_size, when set, is the output's last
// dimension (the response slots were sized by it).
void checkVocab(const TeacherOptions& t, const at::Tensor& logits);

// The tokens of an output [..., V] whose values hold NaN or +inf.
struct Nonfinite {
  at::Tensor tokens; // bool, the output's shape without its last dim
  int64_t values = 0; // values that are NaN or +inf
  int64_t count = 0; // tokens holding one
};

// nullopt when every value of `logits` is finite or -inf (one reduction);
// else where the others are (a few more passes, only then).
std::optional<Nonfinite> findNonfinite(const at::Tensor& logits);

// Of rows [offset, offset + rows) of `logits`: "N value(s) NaN or +inf in M
// token(s), first at row r, position t (nan)"; "" when they hold none.
std::string describeNonfinite(const at::Tensor& logits, const Nonfinite& nf, int64_t offset, int64_t rows);

// The error answered (teacher.on_nonfinite error) to the request `tag` of
// student rank `student` by teacher rank `rank` (index `teacher` on its node),
// `where` from describeNonfinite.
std::string nonfiniteError(int rank, int teacher, const Tag& tag, int student, const std::string& output,
                           const std::string& where);

// The tokens of `nf` in rows [offset, offset + rows).
int64_t nonfiniteTokens(const Nonfinite& nf, int64_t offset, int64_t rows);

// mask: the bad tokens' logits set to 0, in place, so that they can be shaped.
void zeroNonfinite(at::Tensor& logits, const Nonfinite& nf);

// mask: the shaped answer's masked tokens marked as answer_kinds.h says, in
// the kind's `masked` tensor (full logits: the row all NaN; top-k: logsumexp NaN).
void markMasked(std::map<std::string, at::Tensor>& answer, AnswerKind kind, const Nonfinite& nf);

} // namespace distill
