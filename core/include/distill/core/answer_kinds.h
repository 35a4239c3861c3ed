#pragma once

// The answer kinds: what a teacher's answer to one request is. This table is
// the one place that says it; everything else asks it (payload sizes, the
// teacher's shapers in teacher/src/answer/, the loss's readers in
// loss/src/targets/, the cache's records, the student's decoding, the Python
// binding). A new kind is a row here, one shaper and one reader.
//
// A response message carries its kind (ipc's SlotHeader::answer, one byte),
// so no reader guesses a kind from tensor names. Its tensors are the kind's
// (below, by name), in the dtypes and shapes the rules say, plus, where the
// kind allows it, the hidden states teacher.hidden_states names. A response
// whose kind is unknown or whose tensors do not match it is a ProtocolError at
// the student (answerMismatch says why).
//
// | kind    | tensors (B, T: the request's leading dims)                      |
// | logits  | logits [B, T, V] payload dtype; + teacher.hidden_states         |
// | topk    | topk_values [B, T, k] payload dtype, topk_indices [B, T, k]     |
// |         | int32, logsumexp [B, T] float32, log_tail [B, T] float32        |
// | hidden  | hidden [B, T, d_t] payload dtype: the input of the teacher's     |
// |         | output layer; the layer itself (its head) is published once per  |
// |         | node beside the segment (ipc/shared_head.h), never in a response |
// | ids     | ids_values [B, T, k] payload dtype, logsumexp [B, T] float32,   |
// |         | log_tail [B, T] float32: the logits at the REQUEST's ids         |
// |         | [B, T, k] (which the request carries and the answer does not)  |
// | sampled | sampled_ids [B, T, K] int32, sampled_counts [B, T, K] int16:    |
// |         | K = teacher.samples draws from softmax(logits / T), with        |
// |         | replacement; each drawn id once with its count, padded with     |
// |         | count 0 (6 K bytes per token)                                   |
//
// logsumexp = logsumexp(logits / T) over the vocabulary; log_tail = the same
// over the NON-top-k tokens (-inf when k = V): the exact tail mass; for ids,
// over the ids not requested. A producer
// other than the teacher server may leave the optional tensors out
// (loss/losses.h says what the loss makes of that); the server sends them all.
//
// Masked tokens (teacher.on_nonfinite: mask): a token whose teacher output held
// NaN or +inf is answered marked, in the tensors it already has (the kind's
// `masked` tensor): full logits, its row all NaN; top-k and ids, its logsumexp
// NaN (its values and indices those of a row of zeros). Sampled answers cannot
// mark a token (integer counts): teacher.on_nonfinite mask does not apply to them. A teacher sends NaN nowhere else
// (it checks every answer), so a student's Steps reads the mark as "learn this
// token from its label only".
//
// Thread safety: constant data and pure functions; any thread.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "distill/core/options.h"

namespace distill {

// A response's kind, as the slot header carries it (one byte; 0 is never sent).
enum class AnswerKind : uint8_t { kLogits = 1, kTopk = 2, kHidden = 3, kIds = 4, kSampled = 5 };

// The names answer tensors travel under: spelled here and nowhere else
// (tests/structure checks it). TeacherReply::tensor(protocol::kLogits) reads one.
namespace protocol {
constexpr const char* kLogits = "logits"; // [B, T, V] teacher logits
constexpr const char* kTopkValues = "topk_values"; // [B, T, k] teacher logits of its top-k tokens
constexpr const char* kTopkIndices = "topk_indices"; // [B, T, k] int32 token ids
constexpr const char* kLogsumexp = "logsumexp"; // [B, T] logsumexp(logits / T) over the vocab
constexpr const char* kLogTail = "log_tail"; // [B, T] logsumexp(logits / T) over the NON-top-k tokens
constexpr const char* kHidden = "hidden"; // [B, T, d_t] the teacher's final hidden states (its head's input)
constexpr const char* kIdsValues = "ids_values"; // [B, T, k] teacher logits at the request's ids
constexpr const char* kSampledIds = "sampled_ids"; // [B, T, K] int32 ids drawn from the teacher
constexpr const char* kSampledCounts = "sampled_counts"; // [B, T, K] int16: how often each was drawn
// In a REQUEST beside teacher.inputs: [B, T, k] integer ids (k <= teacher.request_ids) the teacher
// answers its logits at (an ids answer). The student keeps them; the answer does not carry them back.
constexpr const char* kRequestIds = "request_ids";
} // namespace protocol

// The dtype an answer tensor travels in.
enum class DtypeRule : uint8_t {
  kPayload, // teacher.payload_dtype (float32, bfloat16 or float16; payloadValueBytes)
  kInt32,
  kFloat32,
  kInt16,
};

// Its shape: the request's leading dims [B, T] and then
enum class ShapeRule : uint8_t {
  kVocab, // V: teacher.vocab_size (0: unknown until the first answer)
  kTopk, // k: teacher.topk
  kToken, // nothing: one value per token
  kHiddenDim, // d_t: teacher.hidden_size (0: unknown until the first answer)
  kIds, // k: the request's ids (at most teacher.request_ids: elementsPerToken says that many)
  kSamples, // K: teacher.samples
};

struct AnswerTensor {
  const char* name; // protocol::k*
  DtypeRule dtype;
  ShapeRule shape;
  bool optional; // a producer other than the teacher server may leave it out
};

struct AnswerKindSpec {
  AnswerKind kind;
  const char* name; // "logits", "topk": Python's Reply.kind, logs
  const char* title; // "full logits", "top-k": messages
  std::vector<AnswerTensor> tensors; // in the order the per-kind structs list them (loss/answers.h)
  const char* masked; // the tensor a masked token is marked in (see above)
  bool hiddenStates; // may carry teacher.hidden_states beside its tensors
};

// Every kind, in AnswerKind order.
const std::vector<AnswerKindSpec>& answerKinds();
// The kind's row; nullptr for a code that names no kind (a message's byte).
const AnswerKindSpec* findAnswerKind(uint8_t code);
// The kind's row; InternalError for an unknown kind (ours: use findAnswerKind for a peer's byte).
const AnswerKindSpec& answerKind(AnswerKind kind);
// The kind a teacher with these options answers in: teacher.answer, and with
// auto sampled when teacher.samples > 0, top-k when teacher.topk > 0, else
// full logits. A request that carries ids is answered in ids whatever this says.
AnswerKind answerKindOf(const TeacherOptions& t);
// "top-8", "hidden states of d=4096", or "full logits of " + `vocab` + "32000"
// (vocab nullptr, or teacher.vocab_size 0: "full logits"): the configured
// answer, for messages.
std::string describeAnswer(const TeacherOptions& t, const char* vocab = "V=");

// Elements per token of a tensor of `rule` (0: unknown, teacher.vocab_size 0).
int64_t elementsPerToken(const TeacherOptions& t, ShapeRule rule);
// Bytes per element of a tensor of `rule`.
int64_t elementBytes(const TeacherOptions& t, DtypeRule rule);
// Payload bytes of the configured kind's tensors (optional ones included: the
// server sends them) for `tokens` tokens, each tensor rounded up to `align`;
// 0 when a size is unknown (full logits of teacher.vocab_size 0). With
// teacher.request_ids k > 0, the larger of that and an ids answer of k ids.
int64_t answerBytes(const TeacherOptions& t, int64_t tokens, int64_t align);
// The same per token, before alignment (0 when unknown).
double answerBytesPerToken(const TeacherOptions& t);

// A received tensor's name, dtype and shape, as answerMismatch checks them.
struct TensorFacts {
  std::string name;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};
// "" when `tensors` are an answer of kind `code`: a known kind, each of its
// tensors present (optional ones may be missing) in its dtype, the per-token
// tensors sharing the leading dims, no tensor twice and nothing else unless
// the kind carries hidden states; otherwise why not, naming the tensor, what
// was expected and what was found.
std::string answerMismatch(uint8_t code, const std::vector<TensorFacts>& tensors);

} // namespace distill
