#pragma once

// Names of the tensors students and teachers exchange. A request carries the
// inputs named by teacher.inputs (e.g. "input_ids" [B, T]); a response carries
// either the full logits and up to three named hidden states, or the top-k
// (values, indices, logsumexp, log_tail: the four tensors a message holds).
//
// Masked tokens (teacher.on_nonfinite: mask): a token whose teacher output held
// NaN or +inf is answered marked, in the tensors it already has: full logits,
// its row all NaN; top-k, its logsumexp NaN (its values and indices those of a
// row of zeros). A teacher sends NaN nowhere else (it checks every answer), so
// a student's Steps reads the mark as "learn this token from its label only".

namespace distill::protocol {

constexpr const char* kLogits = "logits"; // [B, T, V] teacher logits
constexpr const char* kTopkValues = "topk_values"; // [B, T, k] teacher logits of its top-k tokens
constexpr const char* kTopkIndices = "topk_indices"; // [B, T, k] int32 token ids
constexpr const char* kLogsumexp = "logsumexp"; // [B, T] logsumexp(logits / T) over the vocab
constexpr const char* kLogTail = "log_tail"; // [B, T] logsumexp(logits / T) over the NON-top-k
                                             // tokens (-inf when k = V): the exact tail mass

} // namespace distill::protocol
