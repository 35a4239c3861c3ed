// The conversions of answers.h, written once for every kind: a kind's struct
// lists its tensors in the order of its row of the kinds table.
#include "distill/loss/answers.h"

#include <ATen/ATen.h>

#include "distill/core/errors.h"

namespace distill {
namespace {

template <class A>
AnswerTensors fromNamed(const std::function<at::Tensor(const std::string&)>& tensor) {
  A a;
  const AnswerKindSpec& spec = answerKind(A::kKind);
  auto fields = a.tensors();
  DISTILL_INTERNAL_ASSERT(fields.size() == spec.tensors.size(), spec.name, ": ", fields.size(),
                          " tensors in its struct, ", spec.tensors.size(), " in the kinds table");
  for (size_t i = 0; i < fields.size(); ++i) *fields[i] = tensor(spec.tensors[i].name);
  return a;
}

// The struct of `kind`: the alternative of AnswerTensors whose kKind it is.
template <size_t I = 0>
AnswerTensors fromKind(AnswerKind kind, const std::function<at::Tensor(const std::string&)>& tensor) {
  if constexpr (I == std::variant_size_v<AnswerTensors>) {
    DISTILL_THROW(InternalError, "answer kind ", int(kind), " has no struct in AnswerTensors (answers.h)");
  } else {
    using A = std::variant_alternative_t<I, AnswerTensors>;
    return A::kKind == kind ? fromNamed<A>(tensor) : fromKind<I + 1>(kind, tensor);
  }
}

} // namespace

std::vector<at::Tensor*> TeacherOutput::tensors() {
  return std::visit(
      [](auto& a) {
        auto f = a.tensors();
        return std::vector<at::Tensor*>(f.begin(), f.end());
      },
      answer);
}

std::vector<const at::Tensor*> TeacherOutput::tensors() const {
  return std::visit(
      [](const auto& a) {
        auto f = a.tensors();
        return std::vector<const at::Tensor*>(f.begin(), f.end());
      },
      answer);
}

TeacherOutput teacherOutputFrom(AnswerKind kind, const std::function<at::Tensor(const std::string&)>& tensor,
                                int64_t vocab) {
  TeacherOutput o;
  o.vocab = vocab;
  o.answer = fromKind(kind, tensor);
  return o;
}

AnswerKind answerKindNamed(const std::function<bool(const std::string&)>& has) {
  for (const AnswerKindSpec& k : answerKinds()) {
    if (has(k.tensors.front().name)) return k.kind;
  }
  return AnswerKind::kLogits;
}

std::vector<std::pair<std::string, at::Tensor>> namedTensors(const TeacherOutput& t) {
  const AnswerKindSpec& spec = answerKind(t.kind());
  const auto fields = t.tensors();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (fields[i]->defined()) out.emplace_back(spec.tensors[i].name, *fields[i]);
  }
  return out;
}

at::Tensor maskedMarks(const TeacherOutput& t) {
  const AnswerKindSpec& spec = answerKind(t.kind());
  const auto fields = t.tensors();
  for (size_t i = 0; i < fields.size(); ++i) {
    if (std::string(spec.tensors[i].name) != spec.masked) continue;
    const at::Tensor& m = *fields[i];
    if (!m.defined()) return {};
    if (spec.tensors[i].shape == ShapeRule::kToken) return at::isnan(m);
    if (m.dim() < 1 || m.size(-1) == 0) return {};
    return at::isnan(m.select(-1, 0)); // the row is all NaN
  }
  return {};
}

} // namespace distill
