#include "distill/core/payload.h"

#include <algorithm>
#include <sstream>

#include "distill/core/answer_kinds.h"
#include "distill/core/errors.h"

namespace distill {
namespace {

constexpr int64_t kAlign = 64; // ipc's wire::kPayloadAlign: every tensor starts at a multiple of it
constexpr int64_t kFallbackResponse = int64_t(64) << 20;

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Every input at 8 bytes per token, and the ids a request may carry (int32, teacher.request_ids).
int64_t requestBytes(const TeacherOptions& t, int64_t tokens) {
  return int64_t(t.inputs.size()) * aligned(tokens * 8) + (t.request_ids > 0 ? aligned(tokens * t.request_ids * 4) : 0);
}

// The answer's known part for `tokens` tokens (the answer kinds table); 0
// when unknown (full logits of an unknown vocabulary).
int64_t responseBytes(const TeacherOptions& t, int64_t tokens) { return answerBytes(t, tokens, kAlign); }

// The most tokens per request whose bytes (fn) fit `capacity`.
template <class Fn>
int64_t tokensFitting(int64_t capacity, int64_t most, Fn fn) {
  int64_t lo = 0, hi = most;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fn(mid) <= capacity) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

std::string mib(int64_t bytes) {
  std::ostringstream os;
  os.precision(bytes >= (int64_t(10) << 20) ? 0 : 2);
  os << std::fixed << double(bytes) / double(1 << 20) << " MiB";
  return os.str();
}

} // namespace

int64_t payloadValueBytes(const TeacherOptions& t) {
  switch (t.payload_dtype) {
    case PayloadDtype::kFloat32:
      return 4;
    case PayloadDtype::kBFloat16:
    case PayloadDtype::kFloat16:
      return 2;
    case PayloadDtype::kAuto:
      break;
  }
  return t.autocast == Autocast::kNone ? 4 : 2;
}

SlotBytes slotBytesNeeded(const Config& c) {
  const TeacherOptions& t = c.teacher;
  SlotBytes s;
  s.tokens = t.max_batch_tokens;
  s.request = requestBytes(t, s.tokens);
  s.requestPerToken = 8.0 * double(t.inputs.size()) + 4.0 * double(t.request_ids);
  s.response = responseBytes(t, s.tokens);
  s.responsePerToken = answerBytesPerToken(t);
  if (s.responsePerToken == 0) {
    s.unknown = answerKindOf(t) == AnswerKind::kHidden ? "hidden states of an unknown width (teacher.hidden_size: 0)"
                                                       : "full logits of an unknown vocabulary (teacher.vocab_size: 0)";
  } else if (!t.hidden_states.empty()) {
    s.unknown = "teacher.hidden_states, whose size the first answer tells";
  }
  return s;
}

int64_t requestSlotBytes(const Config& c) {
  if (c.transport.max_request_bytes > 0) return c.transport.max_request_bytes;
  return std::max<int64_t>(slotBytesNeeded(c).request, 1);
}

int64_t responseSlotBytes(const Config& c) {
  if (c.transport.max_response_bytes > 0) return c.transport.max_response_bytes;
  const SlotBytes s = slotBytesNeeded(c);
  return s.unknown.empty() ? std::max<int64_t>(s.response, 1) : std::max(s.response, kFallbackResponse);
}

void checkSlotBytes(const Config& c) {
  const SlotBytes s = slotBytesNeeded(c);
  const TeacherOptions& t = c.teacher;
  const int64_t req = c.transport.max_request_bytes;
  if (req > 0 && req < s.request) {
    const int64_t fits = tokensFitting(req, s.tokens, [&](int64_t n) { return requestBytes(t, n); });
    DISTILL_THROW(ConfigError, "transport.max_request_bytes: ", req, " bytes is below the ", s.request,
                  " bytes a request of teacher.max_batch_tokens=", s.tokens, " tokens needs (", t.inputs.size(),
                  " input(s) of teacher.inputs, 8 bytes per token each",
                  t.request_ids > 0 ? ", and 4 bytes per id of teacher.request_ids" : "", "); set transport.max_request_bytes to at "
                  "least ",
                  s.request, " (or auto), or lower teacher.max_batch_tokens to ", fits, " or fewer");
  }
  const int64_t resp = c.transport.max_response_bytes;
  if (resp > 0 && resp < s.response) {
    const int64_t fits = tokensFitting(resp, s.tokens, [&](int64_t n) { return responseBytes(t, n); });
    DISTILL_THROW(ConfigError, "transport.max_response_bytes: ", resp, " bytes is below the ", s.response,
                  " bytes an answer to teacher.max_batch_tokens=", s.tokens, " tokens needs (",
                  describeAnswer(t, ""),
                  " in ", payloadValueBytes(t) * 8, "-bit values (teacher.payload_dtype: ", t.payload_dtype,
                  ", teacher.autocast: ", t.autocast, "), ", s.responsePerToken,
                  " bytes per token); set transport.max_response_bytes to at least ", s.response,
                  " (or auto), or lower teacher.max_batch_tokens to ", fits, " or fewer");
  }
}

std::string describeSlotBytes(const Config& c) {
  const SlotBytes s = slotBytesNeeded(c);
  const TeacherOptions& t = c.teacher;
  std::ostringstream os;
  os << "slots: request " << requestSlotBytes(c) << " B ("
     << (c.transport.max_request_bytes > 0 ? "transport.max_request_bytes" : "auto") << "; " << s.requestPerToken
     << " B/token x teacher.max_batch_tokens=" << s.tokens << " = " << mib(s.request) << " needed), response "
     << responseSlotBytes(c) << " B (" << (c.transport.max_response_bytes > 0 ? "transport.max_response_bytes" : "auto")
     << "; ";
  if (s.responsePerToken > 0) {
    os << describeAnswer(t) << " in "
       << payloadValueBytes(t) * 8 << "-bit values, " << s.responsePerToken << " B/token = " << mib(s.response)
       << " needed";
  }
  if (!s.unknown.empty()) os << (s.responsePerToken > 0 ? ", plus " : "") << s.unknown;
  os << "); x " << c.transport.slots << " slots per student";
  return os.str();
}

} // namespace distill
