// The teacher-output cache's keys (keys.h): the answer context, the model's
// digest, a row's key and a row's position keys, all SHA-256 (core/sha256.h).
#include "keys.h"

#include <cstdio>
#include <sstream>

#include "distill/core/answer_kinds.h"
#include "distill/core/errors.h"
#include "distill/core/sha256.h"

namespace distill {
namespace {

// A double exactly, as C's %a writes it: the context must tell 0.1 from 0.1 + 1 ulp.
std::string hexDouble(double v) {
  char text[64];
  std::snprintf(text, sizeof text, "%a", v);
  return text;
}

} // namespace

std::string keyHex(const CacheKey& k) { return hexBytes(k.data(), k.size()); }

std::string modelDigest(const TeacherModel& model) {
  const auto state = model.state();
  if (state.empty()) return "";
  Sha256 h;
  for (const auto& [name, t] : state) {
    at::Tensor c = t.detach().contiguous().cpu();
    h.addString(name);
    h.addString(c10::toString(c.scalar_type()));
    h.addInt(c.dim());
    for (int64_t d : c.sizes()) h.addInt(d);
    h.addInt(static_cast<int64_t>(c.nbytes()));
    h.add(c.data_ptr(), c.nbytes());
  }
  return keyHex(h.finish());
}

std::string answerContext(const TeacherOptions& t, double temperature, const TeacherModel& model,
                          const std::string& headFingerprint, int64_t seed) {
  std::string weights = modelDigest(model);
  if (weights.empty()) weights = model.fingerprint().empty() ? "" : "fingerprint " + model.fingerprint();
  DISTILL_CHECK_T(ConfigError, !weights.empty(), "teacher.cache: the teacher model (teacher.kind ", t.kind,
                  ") exposes neither its parameters (TeacherModel::state) nor a fingerprint, so its answers "
                  "could not be kept apart from another teacher's; set teacher.cache.mode to off");
  std::ostringstream os;
  os << "distill teacher cache format " << kCacheFormatVersion << "\nweights " << weights << "\nkind " << t.kind
     << "\nmethod " << t.method << "\noutput " << t.output;
  if (answerKindOf(t) == AnswerKind::kHidden) {
    // Hidden rows mean nothing without their head: another head's never read as this one's.
    os << "\nhidden states of head " << headFingerprint;
  } else if (answerKindOf(t) == AnswerKind::kTopk) {
    // logsumexp and log_tail are taken at the loss temperature; full logits do not depend on it.
    os << "\ntopk " << t.topk << " temperature " << hexDouble(temperature);
  } else if (answerKindOf(t) == AnswerKind::kSampled) {
    // Draws are K ids from softmax(logits / T) at uniforms keyed by run.seed (answer/answer.h's
    // sampleKey): a store of other K, T or seed is refused at open, never read as these draws.
    os << "\nsampled K=" << t.samples << " temperature " << hexDouble(temperature) << " run.seed " << seed;
  } else {
    os << "\nfull logits";
  }
  os << "\nhidden_states";
  for (const auto& h : t.hidden_states) os << " " << h;
  os << "\nautocast " << t.autocast << "\ndevice " << at::Device(t.device).type();
  // The dtype values travel in: a float32 answer and a bfloat16 one are not bit-equal.
  os << "\npayload_dtype " << t.payload_dtype;
  // float32 rows are not float16 rows (a store of float16 ones keeps its keys: no line for them).
  if (t.cache.dtype == CacheDtype::kFloat32) os << "\ncache dtype float32";
  return os.str();
}

CacheKey rowKey(const std::string& context, const std::vector<std::string>& names,
                const std::vector<at::Tensor>& inputs, int64_t row) {
  Sha256 h;
  h.addString(context);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    DISTILL_INTERNAL_ASSERT(t.is_contiguous() && t.device().is_cpu(), "rowKey needs contiguous CPU inputs");
    h.addString(names.at(i));
    h.addString(c10::toString(t.scalar_type()));
    h.addInt(t.dim() - 1);
    for (int64_t d = 1; d < t.dim(); ++d) h.addInt(t.size(d));
    const size_t rowBytes = t.nbytes() / static_cast<size_t>(t.size(0));
    h.addInt(static_cast<int64_t>(rowBytes));
    h.add(static_cast<const char*>(t.data_ptr()) + rowBytes * static_cast<size_t>(row), rowBytes);
  }
  return h.finish();
}

std::string prefixInputsProblem(const std::vector<std::string>& names, const std::vector<at::Tensor>& inputs) {
  const int64_t seq = inputs.at(0).dim() >= 2 ? inputs[0].size(1) : -1;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (seq > 0 && t.dim() >= 2 && t.size(1) == seq) continue;
    std::ostringstream os;
    os << "teacher.cache.keys: prefix keys answers per position of a sequence dimension (dim 1) of at least one "
          "position that every input shares; input '"
       << names.at(i) << "' has shape " << t.sizes();
    if (i > 0) os << ", input '" << names.at(0) << "' " << inputs[0].sizes();
    os << "; set teacher.cache.keys to row";
    return os.str();
  }
  return "";
}

std::vector<CacheKey> positionKeys(const std::string& context, const std::vector<std::string>& names,
                                   const std::vector<at::Tensor>& inputs, int64_t row) {
  const int64_t seq = inputs.at(0).dim() >= 2 ? inputs[0].size(1) : -1;
  std::vector<size_t> bytes; // of one position of each input
  const std::string problem = prefixInputsProblem(names, inputs);
  DISTILL_CHECK_T(ProtocolError, problem.empty(), problem);
  Sha256 first;
  first.addString(context);
  first.addString("prefix");
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    DISTILL_INTERNAL_ASSERT(t.is_contiguous() && t.device().is_cpu(), "positionKeys needs contiguous CPU inputs");
    first.addString(names.at(i));
    first.addString(c10::toString(t.scalar_type()));
    first.addInt(t.dim() - 2);
    for (int64_t d = 2; d < t.dim(); ++d) first.addInt(t.size(d));
    bytes.push_back(t.nbytes() / static_cast<size_t>(t.size(0) * seq));
    first.addInt(static_cast<int64_t>(bytes.back()));
  }
  auto addPosition = [&](Sha256& h, int64_t pos) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t at = bytes[i] * static_cast<size_t>(row * seq + pos);
      h.add(static_cast<const char*>(inputs[i].data_ptr()) + at, bytes[i]);
    }
  };
  std::vector<CacheKey> keys;
  addPosition(first, 0);
  keys.push_back(first.finish());
  for (int64_t pos = 1; pos < seq; ++pos) {
    Sha256 h;
    h.add(keys.back().data(), keys.back().size());
    addPosition(h, pos);
    keys.push_back(h.finish());
  }
  return keys;
}

} // namespace distill
