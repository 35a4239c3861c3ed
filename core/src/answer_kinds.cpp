#include "distill/core/answer_kinds.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "distill/core/errors.h"
#include "distill/core/payload.h"

namespace distill {
namespace {

std::string shapeText(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

bool dtypeFits(DtypeRule rule, c10::ScalarType t) {
  switch (rule) {
    case DtypeRule::kPayload:
      return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf;
    case DtypeRule::kInt32:
      return t == c10::kInt;
    case DtypeRule::kFloat32:
      return t == c10::kFloat;
    case DtypeRule::kInt16:
      return t == c10::kShort;
  }
  return false;
}

const char* dtypeRuleName(DtypeRule rule) {
  switch (rule) {
    case DtypeRule::kPayload:
      return "float32 | bfloat16 | float16 (teacher.payload_dtype)";
    case DtypeRule::kInt32:
      return "int32";
    case DtypeRule::kFloat32:
      return "float32";
    case DtypeRule::kInt16:
      return "int16";
  }
  return "?";
}

} // namespace

const std::vector<AnswerKindSpec>& answerKinds() {
  static const std::vector<AnswerKindSpec> kinds{
      {AnswerKind::kLogits,
       "logits",
       "full logits",
       {{protocol::kLogits, DtypeRule::kPayload, ShapeRule::kVocab, false}},
       protocol::kLogits,
       true},
      {AnswerKind::kTopk,
       "topk",
       "top-k",
       {{protocol::kTopkValues, DtypeRule::kPayload, ShapeRule::kTopk, false},
        {protocol::kTopkIndices, DtypeRule::kInt32, ShapeRule::kTopk, false},
        {protocol::kLogsumexp, DtypeRule::kFloat32, ShapeRule::kToken, true},
        {protocol::kLogTail, DtypeRule::kFloat32, ShapeRule::kToken, true}},
       protocol::kLogsumexp,
       true},
      {AnswerKind::kHidden,
       "hidden",
       "hidden states",
       {{protocol::kHidden, DtypeRule::kPayload, ShapeRule::kHiddenDim, false}},
       protocol::kHidden,
       false},
      {AnswerKind::kIds,
       "ids",
       "ids",
       {{protocol::kIdsValues, DtypeRule::kPayload, ShapeRule::kIds, false},
        {protocol::kLogsumexp, DtypeRule::kFloat32, ShapeRule::kToken, false},
        {protocol::kLogTail, DtypeRule::kFloat32, ShapeRule::kToken, true}},
       protocol::kLogsumexp,
       false},
      {AnswerKind::kSampled,
       "sampled",
       "sampled ids",
       {{protocol::kSampledIds, DtypeRule::kInt32, ShapeRule::kSamples, false},
        {protocol::kSampledCounts, DtypeRule::kInt16, ShapeRule::kSamples, false}},
       protocol::kSampledCounts,
       false},
  };
  return kinds;
}

const AnswerKindSpec* findAnswerKind(uint8_t code) {
  for (const AnswerKindSpec& k : answerKinds()) {
    if (static_cast<uint8_t>(k.kind) == code) return &k;
  }
  return nullptr;
}

const AnswerKindSpec& answerKind(AnswerKind kind) {
  const AnswerKindSpec* k = findAnswerKind(static_cast<uint8_t>(kind));
  DISTILL_INTERNAL_ASSERT(k != nullptr, "answer kind ", int(kind), " is in no row of answerKinds()");
  return *k;
}

AnswerKind answerKindOf(const TeacherOptions& t) {
  switch (t.answer) {
    case TeacherAnswer::kLogits:
      return AnswerKind::kLogits;
    case TeacherAnswer::kTopk:
      return AnswerKind::kTopk;
    case TeacherAnswer::kHidden:
      return AnswerKind::kHidden;
    case TeacherAnswer::kAuto:
      break;
  }
  if (t.samples > 0) return AnswerKind::kSampled;
  return t.topk > 0 ? AnswerKind::kTopk : AnswerKind::kLogits;
}

std::string describeAnswer(const TeacherOptions& t, const char* vocab) {
  if (answerKindOf(t) == AnswerKind::kTopk) return "top-" + std::to_string(t.topk);
  if (answerKindOf(t) == AnswerKind::kHidden) {
    return t.hidden_size > 0 ? "hidden states of d=" + std::to_string(t.hidden_size) : "hidden states";
  }
  if (answerKindOf(t) == AnswerKind::kSampled) return "sampled K=" + std::to_string(t.samples);
  return vocab && t.vocab_size > 0 ? "full logits of " + std::string(vocab) + std::to_string(t.vocab_size)
                                   : "full logits";
}

int64_t elementsPerToken(const TeacherOptions& t, ShapeRule rule) {
  switch (rule) {
    case ShapeRule::kVocab:
      return t.vocab_size;
    case ShapeRule::kTopk:
      return t.topk;
    case ShapeRule::kToken:
      return 1;
    case ShapeRule::kHiddenDim:
      return t.hidden_size;
    case ShapeRule::kIds:
      return t.request_ids;
    case ShapeRule::kSamples:
      return t.samples;
  }
  return 0;
}

int64_t elementBytes(const TeacherOptions& t, DtypeRule rule) {
  if (rule == DtypeRule::kPayload) return payloadValueBytes(t);
  return rule == DtypeRule::kInt16 ? 2 : 4;
}

namespace {

// `tokens` tokens of `kind` (per token, unaligned, with `align` 0); 0 when a size is unknown.
double kindBytes(const TeacherOptions& t, AnswerKind kind, int64_t tokens, int64_t align) {
  double total = 0;
  for (const AnswerTensor& a : answerKind(kind).tensors) {
    const int64_t each = elementsPerToken(t, a.shape);
    if (each <= 0) return 0;
    const int64_t bytes = tokens * each * elementBytes(t, a.dtype);
    total += align > 0 ? double((bytes + align - 1) / align * align) : double(bytes);
  }
  return total;
}

// The configured kind's bytes, or an ids answer's where requests may carry more (teacher.request_ids).
double mostBytes(const TeacherOptions& t, int64_t tokens, int64_t align) {
  const double configured = kindBytes(t, answerKindOf(t), tokens, align);
  if (t.request_ids <= 0 || configured == 0) return configured;
  return std::max(configured, kindBytes(t, AnswerKind::kIds, tokens, align));
}

} // namespace

int64_t answerBytes(const TeacherOptions& t, int64_t tokens, int64_t align) {
  return static_cast<int64_t>(mostBytes(t, tokens, align));
}

double answerBytesPerToken(const TeacherOptions& t) { return mostBytes(t, 1, 0); }

std::string answerMismatch(uint8_t code, const std::vector<TensorFacts>& tensors) {
  const AnswerKindSpec* kind = findAnswerKind(code);
  if (!kind) return "an answer of unknown kind " + std::to_string(int(code)) + " (a teacher of another build?)";
  std::ostringstream why;
  const std::string of = std::string("a ") + kind->name + " answer: ";
  std::set<std::string> seen;
  std::vector<int64_t> lead; // the leading dims, from the first per-token tensor met
  bool haveLead = false;
  for (const AnswerTensor& a : kind->tensors) {
    const TensorFacts* f = nullptr;
    for (const TensorFacts& t : tensors) {
      if (t.name == a.name) f = &t;
    }
    if (!f) {
      if (a.optional) continue;
      why << of << "no tensor '" << a.name << "'; found:";
      for (const TensorFacts& t : tensors) why << " " << t.name;
      return why.str();
    }
    if (!dtypeFits(a.dtype, f->dtype)) {
      return of + "'" + a.name + "' is " + c10::toString(f->dtype) + ", expected " + dtypeRuleName(a.dtype);
    }
    // The request's leading dims are the student's to choose (a request of any shape is answered in
    // it): only the kind's own trailing dim is required here; the loss checks the tokens.
    const size_t trailing = a.shape == ShapeRule::kToken ? 0 : 1;
    if (f->shape.size() < trailing) return of + "'" + a.name + "' has shape " + shapeText(f->shape);
    std::vector<int64_t> l(f->shape.begin(), f->shape.end() - trailing);
    if (haveLead && l != lead) {
      return of + "'" + a.name + "' has shape " + shapeText(f->shape) + ", its tokens " + shapeText(l) +
          " are not those of the answer's other tensors " + shapeText(lead);
    }
    lead = l;
    haveLead = true;
  }
  for (const TensorFacts& t : tensors) {
    if (!seen.insert(t.name).second) return of + "tensor '" + t.name + "' twice";
    bool own = false;
    for (const AnswerTensor& a : kind->tensors) own = own || t.name == a.name;
    if (!own && !kind->hiddenStates) return of + "tensor '" + t.name + "' is not one of its kind";
  }
  return "";
}

} // namespace distill
