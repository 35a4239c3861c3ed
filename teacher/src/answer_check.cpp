// The checks of a teacher's answer (answer_check.h) and the marks of masked tokens.
#include "answer_check.h"

#include <ATen/ATen.h>

#include <limits>
#include <sstream>

#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/ipc/channel.h"

namespace distill {

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << " " << t.sizes();
  return os.str();
}

// A response holds at most ipc::kMaxTensors tensors: the answer kind's
// (answer_kinds.h) and the hidden states must fit, which is known at
// start-up; otherwise every reply would fail.
void checkResponseFits(const TeacherOptions& t) {
  const AnswerKindSpec& kind = answerKind(answerKindOf(t));
  std::string names;
  for (const AnswerTensor& a : kind.tensors) names += (names.empty() ? "" : ", ") + std::string(a.name);
  DISTILL_CHECK_T(ConfigError, kind.tensors.size() + t.hidden_states.size() <= size_t(ipc::kMaxTensors),
                  "teacher.hidden_states: ", t.hidden_states.size(),
                  " hidden state(s) do not fit in a response "
                  "next to ",
                  kind.tensors.size() > 1
                      ? "the " + std::string(kind.title) + " output (teacher.topk=" + std::to_string(t.topk) + ": " +
                          names + ")"
                      : "the " + names,
                  ": a message holds at most ", ipc::kMaxTensors, " tensors");
}

void checkOutputShape(const TeacherOptions& t, const at::Tensor& logits, const at::Tensor& input) {
  const int64_t batch = input.size(0);
  const std::string& name = t.output;
  const std::string input0 = "input '" + t.inputs.at(0) + "' of shape " + describe(input);
  DISTILL_CHECK_T(ProtocolError, logits.dim() >= 1 && logits.size(0) == batch, "teacher output '", name,
                  "' has shape ", logits.sizes(), " for ", input0, ": expected batch ", batch, " in dim 0");
  if (at::isIntegralType(input.scalar_type(), false) && input.dim() == 2 && logits.dim() == 3) {
    DISTILL_CHECK_T(ProtocolError, logits.size(1) == input.size(1), "teacher output '", name, "' has shape ",
                    logits.sizes(), " for ", input0, ": expected [", batch, ", ", input.size(1),
                    ", V], one row per input token (a forward that answers only the last position, as "
                    "nanoGPT's forward(idx) without targets does, cannot teach the others)");
  }
}

void checkVocab(const TeacherOptions& t, const at::Tensor& logits) {
  if (answerKindOf(t) == AnswerKind::kHidden) { // the hidden states' width, not a vocabulary
    const int64_t d = t.hidden_size;
    DISTILL_CHECK_T(ProtocolError, d == 0 || (logits.dim() >= 1 && logits.size(-1) == d), "teacher output '",
                    t.output, "' (its final hidden states, teacher.answer hidden) has shape ", logits.sizes(),
                    ": its width is not teacher.hidden_size=", d, " (the response slots were sized by it)");
    return;
  }
  const int64_t v = t.vocab_size;
  DISTILL_CHECK_T(ProtocolError, v == 0 || (logits.dim() >= 1 && logits.size(-1) == v), "teacher output '", t.output,
                  "' has shape ", logits.sizes(), ": its vocabulary is not teacher.vocab_size=", v,
                  " (the response slots were sized by it); set teacher.vocab_size to ",
                  logits.dim() >= 1 ? logits.size(-1) : 0, " or 0 (unknown)");
}

std::string nonfiniteError(int rank, int teacher, const Tag& tag, int student, const std::string& output,
                           const std::string& where) {
  return "teacher rank " + std::to_string(rank) + " (teacher " + std::to_string(teacher) +
      " of its node) computed an answer to the request (" + describe(tag) + ") of student rank " +
      std::to_string(student) + " whose output '" + output + "' is not finite: " + where +
      "; the teacher's model is at fault, not the student (a float16 forward overflows past 65504: run it in "
      "bfloat16 or float32); with teacher.on_nonfinite: mask such tokens learn from their labels only";
}

std::optional<Nonfinite> findNonfinite(const at::Tensor& logits) {
  if (!logits.defined() || logits.numel() == 0 || !at::isFloatingType(logits.scalar_type())) return std::nullopt;
  // max() propagates NaN, and is +inf when a value is: below +inf means every
  // value is finite or -inf. One pass, no temporary of the logits' size.
  if (logits.max().item<double>() < std::numeric_limits<double>::infinity()) return std::nullopt;
  // !(x < inf): NaN or +inf.
  const at::Tensor bad = at::lt(logits, std::numeric_limits<double>::infinity()).logical_not_();
  Nonfinite nf;
  nf.values = bad.sum().item<int64_t>();
  nf.tokens = logits.dim() >= 1 ? bad.any(-1) : bad;
  nf.count = nf.tokens.sum().item<int64_t>();
  return nf;
}

int64_t nonfiniteTokens(const Nonfinite& nf, int64_t offset, int64_t rows) {
  if (nf.tokens.dim() == 0) return nf.count;
  return nf.tokens.narrow(0, offset, rows).sum().item<int64_t>();
}

std::string describeNonfinite(const at::Tensor& logits, const Nonfinite& nf, int64_t offset, int64_t rows) {
  if (nf.tokens.dim() == 0) return std::to_string(nf.values) + " value(s) NaN or +inf";
  const at::Tensor tokens = nf.tokens.narrow(0, offset, rows);
  const int64_t count = tokens.sum().item<int64_t>();
  if (count == 0) return "";
  const at::Tensor part = logits.narrow(0, offset, rows);
  const at::Tensor bad = at::lt(part, std::numeric_limits<double>::infinity()).logical_not_();
  const int64_t values = bad.sum().item<int64_t>();
  const at::Tensor first = tokens.nonzero()[0]; // (row) or (row, position)
  at::Tensor row = part;
  for (int64_t d = 0; d < first.size(0); ++d) row = row.select(0, first[d].item<int64_t>());
  const double v = row.masked_select(at::lt(row, std::numeric_limits<double>::infinity()).logical_not_())[0]
                       .item<double>();
  std::ostringstream os;
  os << values << " value(s) NaN or +inf in " << count << " token(s), the first at row " << first[0].item<int64_t>();
  if (first.size(0) > 1) os << ", position " << first[1].item<int64_t>();
  os << " (" << (v != v ? "nan" : "+inf") << ")";
  return os.str();
}

void zeroNonfinite(at::Tensor& logits, const Nonfinite& nf) {
  logits = logits.clone(); // the model's output may be shared with it (a module's buffer, a view)
  logits.masked_fill_(nf.tokens.unsqueeze(-1), 0);
}

void markMasked(std::map<std::string, at::Tensor>& answer, AnswerKind kind, const Nonfinite& nf) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const AnswerKindSpec& spec = answerKind(kind);
  for (const AnswerTensor& a : spec.tensors) {
    auto it = answer.find(a.name);
    if (a.name != std::string(spec.masked) || it == answer.end()) continue;
    const at::Tensor tokens = nf.tokens.to(it->second.device());
    it->second.masked_fill_(a.shape == ShapeRule::kToken ? tokens : tokens.unsqueeze(-1), nan); // a row: all of it
  }
}

} // namespace distill
