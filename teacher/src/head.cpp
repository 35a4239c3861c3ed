// The teacher's head: taken from the model, checked, published (head.h).
#include "head.h"

#include <ATen/ATen.h>

#include "answer_check.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/strings.h"

namespace distill {
namespace {

// "the TorchScript teacher '<path>'", "the registered teacher '<module>'", "the self teacher".
std::string modelName(const TeacherOptions& o) {
  switch (o.kind) {
    case TeacherKind::kTorchscript:
      return "the TorchScript teacher '" + o.path + "'";
    case TeacherKind::kRegistered:
      return "the registered teacher '" + o.module + "' of '" + o.library + "'";
    case TeacherKind::kSelf:
      break;
  }
  return "the teacher model (teacher.kind self)";
}

// Up to 8 of the model's state names, for "what it has".
std::string someStateNames(const TeacherModel& model) {
  std::vector<std::string> names;
  for (const auto& [name, t] : model.state()) {
    if (names.size() == 8) {
      names.push_back("...");
      break;
    }
    names.push_back(name + " " + describe(t));
  }
  return names.empty() ? std::string("(it exposes no state)") : join(names);
}

ipc::HeadDType headDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ipc::HeadDType::kFloat32;
    case at::kHalf:
      return ipc::HeadDType::kFloat16;
    case at::kBFloat16:
      return ipc::HeadDType::kBFloat16;
    default:
      break;
  }
  DISTILL_THROW(ConfigError, "teacher.head: the head's dtype ", c10::toString(t),
                " cannot be published (float32, float16 or bfloat16)");
}

} // namespace

TeacherHead modelHead(const TeacherModel& model, const TeacherOptions& o) {
  std::optional<TeacherHead> head = model.head(o);
  DISTILL_CHECK_T(ConfigError, head.has_value(), "teacher.head.weight: ", modelName(o), " has no parameter or buffer '",
                  o.head.weight, "' (teacher.answer hidden needs its output layer); its state: ",
                  someStateNames(model), "; name the head's weight, or declare the head (TeacherModel::head)");
  try {
    validateTeacherHead(*head);
  } catch (const Error& e) {
    DISTILL_THROW(ConfigError, "teacher.head: the head of ", modelName(o), " (teacher.head.weight '", o.head.weight,
                  "', teacher.head.bias '", o.head.bias, "') is not a head: ", e.message());
  }
  const int64_t vt = head->weight.size(0), dt = head->weight.size(1);
  DISTILL_CHECK_T(ConfigError, o.hidden_size == 0 || o.hidden_size == dt, "teacher.hidden_size: ", o.hidden_size,
                  " is not the width of the head of ", modelName(o), " (weight [", vt, ", ", dt, "]); set it to ", dt,
                  " or 0 (unknown)");
  DISTILL_CHECK_T(ConfigError, o.vocab_size == 0 || o.vocab_size == vt, "teacher.vocab_size: ", o.vocab_size,
                  " is not the vocabulary of the head of ", modelName(o), " (weight [", vt, ", ", dt, "]); set it to ",
                  vt, " or 0 (unknown)");
  return *head;
}

namespace {

// The head's bytes on the host; `w` and `b` hold them.
ipc::HeadBytes hostBytes(const TeacherHead& head, at::Tensor& w, at::Tensor& b) {
  at::NoGradGuard noGrad;
  w = head.weight.detach().cpu().contiguous();
  b = head.bias.defined() ? head.bias.detach().cpu().contiguous() : at::Tensor();
  ipc::HeadBytes bytes;
  bytes.dtype = headDtype(w.scalar_type());
  bytes.vocab = w.size(0);
  bytes.dim = w.size(1);
  bytes.weight = w.data_ptr();
  bytes.bias = b.defined() ? b.data_ptr() : nullptr;
  bytes.softcap = head.softcap;
  bytes.scale = head.scale;
  return bytes;
}

} // namespace

ipc::SharedHead publishHead(const std::string& segment, const TeacherHead& head) {
  at::Tensor w, b;
  return ipc::SharedHead::publish(segment, hostBytes(head, w, b));
}

ServedHead serveHead(const TeacherModel& model, const TeacherOptions& options, const std::string& segment,
                     int teacher) {
  ServedHead served;
  if (answerKindOf(options) != AnswerKind::kHidden) return served;
  const TeacherHead head = modelHead(model, options);
  served.vocab = head.weight.size(0);
  at::Tensor w, b;
  const ipc::HeadBytes bytes = hostBytes(head, w, b);
  served.fingerprint = ipc::headFingerprint(bytes);
  if (teacher != 0) return served; // one publisher per node: its first teacher (shared_head.h)
  served.shared = ipc::SharedHead::publish(segment, bytes);
  const ipc::SharedHead& s = *served.shared;
  DISTILL_LOG(kInfo) << "teacher " << teacher << " published its head /dev/shm/" << s.objectName() << ": ["
                     << s.vocab() << ", " << s.dim() << "] " << ipc::headDTypeName(s.dtype())
                     << (s.hasBias() ? " with bias" : " without bias") << ", softcap " << s.softcap() << ", scale "
                     << s.scale() << ", " << s.objectBytes() << " bytes, generation " << s.generation()
                     << ", fingerprint " << s.fingerprint();
  return served;
}

} // namespace distill
