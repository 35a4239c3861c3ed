#pragma once

// A teacher's answer for one micro-batch as the loss takes it: one struct per
// answer kind (core/answer_kinds.h), held in TeacherOutput's variant. Each
// struct lists its tensors in the kinds table's order (tensors()), so that
// the conversions below from and to named tensors (a message, a Python dict)
// are written once for every kind. A new kind is a struct here, its row in the
// table, a shaper on the teacher (teacher/src/answer/) and a reader here
// (loss/src/targets/).
//
//   TeacherOutput dense{LogitsAnswer{logits}};                 // full logits
//   TeacherOutput sparse{TopkAnswer{values, indices, lse, tail}, vocab};
//   if (const TopkAnswer* k = sparse.topk()) use(k->values);
//
// Shapes and dtypes the loss accepts: losses.h. Plain values: any thread.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "distill/core/answer_kinds.h"

namespace distill {

struct TeacherHead; // loss/hidden_head.h

// Full logits (AnswerKind::kLogits).
struct LogitsAnswer {
  static constexpr AnswerKind kKind = AnswerKind::kLogits;
  at::Tensor logits; // [N, V] (or the student's shape): full teacher logits

  std::array<at::Tensor*, 1> tensors() { return {&logits}; }
  std::array<const at::Tensor*, 1> tensors() const { return {&logits}; }
};

// The top-k (AnswerKind::kTopk).
struct TopkAnswer {
  static constexpr AnswerKind kKind = AnswerKind::kTopk;
  at::Tensor values; // [N, k]: the teacher's logits of its top-k tokens
  at::Tensor indices; // [N, k] int32 | int64: their token ids, unique per row
  at::Tensor logsumexp; // optional [N]: logsumexp(teacher logits / T) over the full vocab
  at::Tensor logTail; // optional [N]: logsumexp(teacher logits / T) over the NON-top-k
                      // tokens, -inf when k = V: the exact tail mass (losses.h)

  std::array<at::Tensor*, 4> tensors() { return {&values, &indices, &logsumexp, &logTail}; }
  std::array<const at::Tensor*, 4> tensors() const { return {&values, &indices, &logsumexp, &logTail}; }
};

// The teacher's final hidden states (AnswerKind::kHidden): its logits are
// made from them and its head (loss/hidden_head.h), chunk by chunk in the
// fused loss, materialised by distillLoss. The head does not travel with the
// answer: the student's Client attaches the node's mapped one
// (student/teacher_head.h); a caller of the loss sets it itself.
struct HiddenAnswer {
  static constexpr AnswerKind kKind = AnswerKind::kHidden;
  at::Tensor hidden; // [N, d_t] (or [B, T, d_t]): the input of the teacher's output layer
  std::shared_ptr<const TeacherHead> head; // its output layer; null: the loss refuses the answer

  std::array<at::Tensor*, 1> tensors() { return {&hidden}; }
  std::array<const at::Tensor*, 1> tensors() const { return {&hidden}; }
};

// The teacher's logits at ids the request named (AnswerKind::kIds): the
// student's own top-k, or the tokens it sampled (losses.h, "Ids answers").
// Only values, logsumexp and logTail travel; `ids` and `samplingLogProbs` are
// the student's, attached where it reads the answer.
struct IdsAnswer {
  static constexpr AnswerKind kKind = AnswerKind::kIds;
  at::Tensor values; // [N, k]: the teacher's logits at `ids`
  at::Tensor logsumexp; // [N]: logsumexp(teacher logits / T) over the full vocab
  at::Tensor logTail; // optional [N]: the same over the ids NOT in `ids` (-inf when k = V)
  at::Tensor ids; // [N, k] int32 | int64, unique per row: the ids the request named (not sent back)
  at::Tensor samplingLogProbs; // optional [N], loss.kind sampled_token: log-prob of ids[:, 0] under
                               // the policy that sampled it (importance weight; not sent)

  std::array<at::Tensor*, 3> tensors() { return {&values, &logsumexp, &logTail}; }
  std::array<const at::Tensor*, 3> tensors() const { return {&values, &logsumexp, &logTail}; }
};

// K ids drawn from the teacher's distribution at the loss temperature, with
// replacement (AnswerKind::kSampled): counts / K is an unbiased estimate of it
// (losses.h, "Sampled targets").
struct SampledAnswer {
  static constexpr AnswerKind kKind = AnswerKind::kSampled;
  at::Tensor ids; // [N, K] int32 | int64: the drawn ids (entries of count 0 are padding)
  at::Tensor counts; // [N, K] int16 | int32 | int64 | floating: draws of each; a row sums to K

  std::array<at::Tensor*, 2> tensors() { return {&ids, &counts}; }
  std::array<const at::Tensor*, 2> tensors() const { return {&ids, &counts}; }
};

using AnswerTensors = std::variant<LogitsAnswer, TopkAnswer, HiddenAnswer, IdsAnswer, SampledAnswer>;

// What the teacher sent for one micro-batch: its answer, of one kind, and the
// vocabulary it stated.
struct TeacherOutput {
  AnswerTensors answer; // default: full logits, undefined (the loss refuses it)
  int64_t vocab = 0; // the teacher's vocabulary size V_t as it stated it (0: not stated; the width
                     // of `logits` then for a dense teacher); checked against the student's, see
                     // losses.h, "Vocabularies that differ"

  TeacherOutput() = default;
  TeacherOutput(LogitsAnswer a, int64_t v = 0) : answer(std::move(a)), vocab(v) {}
  TeacherOutput(TopkAnswer a, int64_t v = 0) : answer(std::move(a)), vocab(v) {}
  TeacherOutput(HiddenAnswer a, int64_t v = 0) : answer(std::move(a)), vocab(v) {}
  TeacherOutput(IdsAnswer a, int64_t v = 0) : answer(std::move(a)), vocab(v) {}
  TeacherOutput(SampledAnswer a, int64_t v = 0) : answer(std::move(a)), vocab(v) {}

  AnswerKind kind() const {
    return std::visit([](const auto& a) { return std::decay_t<decltype(a)>::kKind; }, answer);
  }
  // The answer as that kind; nullptr when it is another.
  const LogitsAnswer* logits() const { return std::get_if<LogitsAnswer>(&answer); }
  LogitsAnswer* logits() { return std::get_if<LogitsAnswer>(&answer); }
  const TopkAnswer* topk() const { return std::get_if<TopkAnswer>(&answer); }
  TopkAnswer* topk() { return std::get_if<TopkAnswer>(&answer); }
  const HiddenAnswer* hidden() const { return std::get_if<HiddenAnswer>(&answer); }
  HiddenAnswer* hidden() { return std::get_if<HiddenAnswer>(&answer); }
  const IdsAnswer* ids() const { return std::get_if<IdsAnswer>(&answer); }
  IdsAnswer* ids() { return std::get_if<IdsAnswer>(&answer); }
  const SampledAnswer* sampled() const { return std::get_if<SampledAnswer>(&answer); }
  SampledAnswer* sampled() { return std::get_if<SampledAnswer>(&answer); }
  // The answer as that kind, made so (its tensors undefined) when it holds another: to fill it in place,
  // e.g. `TeacherOutput t; t.makeTopk().values = v;`.
  LogitsAnswer& makeLogits() { return logits() ? *logits() : answer.emplace<LogitsAnswer>(); }
  TopkAnswer& makeTopk() { return topk() ? *topk() : answer.emplace<TopkAnswer>(); }
  HiddenAnswer& makeHidden() { return hidden() ? *hidden() : answer.emplace<HiddenAnswer>(); }
  // Every tensor of the answer, in the kinds table's order (undefined where left out).
  std::vector<at::Tensor*> tensors();
  std::vector<const at::Tensor*> tensors() const;
};

// The answer of `kind` from named tensors: `tensor(name)` gives each of the
// kind's tensors (answer_kinds.h), undefined when absent.
TeacherOutput teacherOutputFrom(AnswerKind kind, const std::function<at::Tensor(const std::string&)>& tensor,
                                int64_t vocab);

// The kind of the named tensors a user hands over (a Python dict): the first
// kind, in the table's order, whose first tensor is among `names`; the full
// logits when none is (the loss then names what is missing).
AnswerKind answerKindNamed(const std::function<bool(const std::string&)>& has);

// The answer's defined tensors by name, in the table's order.
std::vector<std::pair<std::string, at::Tensor>> namedTensors(const TeacherOutput& t);

// The tokens the teacher marked as masked (answer_kinds.h, "Masked tokens"):
// bool with one entry per token of the answer's leading dims, from the kind's
// `masked` tensor (NaN); undefined when that tensor is not there.
at::Tensor maskedMarks(const TeacherOutput& t);

} // namespace distill
