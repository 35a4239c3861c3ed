#pragma once

// Names of the tensors students and teachers exchange. A request carries the
// inputs named by teacher.inputs (e.g. "input_ids" [B, T]); a response carries
// either the full logits or the top-k, plus any named hidden states.

namespace distill::protocol {

constexpr const char* kLogits = "logits";            // [B, T, V] teacher logits
constexpr const char* kTopkValues = "topk_values";   // [B, T, k] teacher logits of its top-k tokens
constexpr const char* kTopkIndices = "topk_indices"; // [B, T, k] int32 token ids
constexpr const char* kLogsumexp = "logsumexp";      // [B, T] logsumexp(logits / T) over the vocab

}  // namespace distill::protocol
