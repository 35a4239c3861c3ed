// The low-level student API (Client: submit/get) and the loss, on torch tensors.
#include <memory>
#include <optional>

#include "distill/core/answer_kinds.h"
#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/loss/losses.h"
#include "distill/student/client.h"
#include "session.h"

namespace distill::py {

namespace {

// A teacher's answer. Copy mode: owned tensors. View mode: the tensors lie in
// the ring's slot; each holds this reply alive, so the slot is freed when the
// last of them is gone or at release() (after which they must not be read).
struct PyReply {
  SessionPtr session; // the client (and its mapping) outlive the views
  TeacherReply reply;
  bool view = false;

  at::Tensor hold(const std::shared_ptr<PyReply>& self, const at::Tensor& t) const {
    if (!view || !t.defined()) return t;
    auto keep = self; // the deleter owns a reference: the slot lives while the tensor does
    return at::from_blob(
        t.data_ptr(), t.sizes(), t.strides(), [keep](void*) {}, t.options());
  }
};
using ReplyPtr = std::shared_ptr<PyReply>;

// The answer as a dict: its kind's tensors by their protocol names (core/answer_kinds.h) and "vocab".
pyb::dict outputDict(const ReplyPtr& r) {
  TeacherOutput o = r->reply.output();
  pyb::dict d;
  for (auto& [name, t] : namedTensors(o)) d[pyb::str(name)] = r->hold(r, t);
  if (const IdsAnswer* a = o.ids(); a && a->ids.defined()) d[protocol::kRequestIds] = a->ids; // the request's
  if (o.vocab > 0) d["vocab"] = o.vocab;
  return d;
}

// The student's side of an ids answer in a dict: the request's ids and the sampling log-probabilities.
constexpr const char* kSamplingLogprobs = "sampling_logprobs";

// A Reply as C++ reads it (in place), or a user's dict of named tensors (docs/python-api.md): its
// kind is the one whose first tensor it holds (answerKindNamed).
TeacherOutput teacherOutputOf(const pyb::object& teacher) {
  if (pyb::isinstance<PyReply>(teacher)) return teacher.cast<ReplyPtr>()->reply.output();
  auto d = teacher.cast<pyb::dict>();
  auto has = [&](const std::string& k) { return d.contains(pyb::str(k)); };
  auto get = [&](const std::string& k) { return has(k) ? d[pyb::str(k)].cast<at::Tensor>() : at::Tensor(); };
  TeacherOutput t = teacherOutputFrom(answerKindNamed(has), get, d.contains("vocab") ? d["vocab"].cast<int64_t>() : 0);
  if (IdsAnswer* a = t.ids()) {
    a->ids = get(protocol::kRequestIds);
    a->samplingLogProbs = get(kSamplingLogprobs);
  }
  return t;
}

// A dict of hidden states (no head travels with them) gets the session's: the node's mapped head,
// as a Reply has it. No session, or one whose teacher publishes none: a UsageError saying so.
void attachHead(TeacherOutput& t, PySession* s, const char* fn) {
  HiddenAnswer* h = t.hidden();
  if (h == nullptr || h->head != nullptr) return;
  DISTILL_CHECK_T(UsageError, s != nullptr, fn,
                  ": the teacher's answer is hidden states, and a dict of them brings no head: pass the Reply "
                  "itself, or session= (its teacher's head, mapped)");
  h->head = s->client().teacherHead();
  DISTILL_CHECK_T(UsageError, h->head != nullptr, fn,
                  ": the teacher's answer is hidden states, and this session's teacher publishes no head "
                  "(teacher.answer is not hidden)");
}

// The answer kinds table for Python (distill._C.answer_kinds): {kind: [tensor names]}.
pyb::dict answerKindsDict() {
  pyb::dict d;
  for (const AnswerKindSpec& k : answerKinds()) {
    pyb::list names;
    for (const AnswerTensor& a : k.tensors) names.append(pyb::str(a.name));
    d[pyb::str(k.name)] = names;
  }
  return d;
}

std::vector<std::pair<std::string, at::Tensor>> inputsOf(const PySession& s, const pyb::object& inputs) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (pyb::isinstance<pyb::dict>(inputs)) {
    for (auto item : inputs.cast<pyb::dict>())
      out.emplace_back(item.first.cast<std::string>(), item.second.cast<at::Tensor>());
    return out;
  }
  const auto& names = s.session.config.teacher.inputs;
  DISTILL_CHECK_T(ConfigError, !names.empty(), "teacher.inputs is empty");
  out.emplace_back(names.front(), inputs.cast<at::Tensor>());
  return out;
}

// The loss options of the session's config (none: the defaults) with
// `overrides` ({"temperature": 2.0}: loss.* keys), checked as the config is.
LossOptions lossOptions(const PySession* s, const pyb::dict& overrides) {
  if (s && overrides.empty()) return s->session.config.loss;
  std::vector<std::string> sets;
  for (auto item : overrides) {
    const std::string key = item.first.cast<std::string>();
    sets.push_back((key.rfind("loss.", 0) == 0 ? key : "loss." + key) + "=" +
                   pyb::str(item.second).cast<std::string>());
  }
  return parseConfig(s ? dumpConfig(s->session.config) : "teacher: {kind: self}\n", sets).loss;
}

pyb::tuple loss(const at::Tensor& logits, const at::Tensor& labels, const pyb::object& teacher, double normalizer,
                const pyb::object& session, const pyb::dict& overrides) {
  TeacherOutput t = teacherOutputOf(teacher);
  PySession* s = session.is_none() ? nullptr : session.cast<SessionPtr>().get();
  attachHead(t, s, "distill.loss");
  LossOptions o = lossOptions(s, overrides);
  LossResult r;
  {
    pyb::gil_scoped_release nogil;
    r = distillLoss(logits, labels, t, o, normalizer);
  }
  return pyb::make_tuple(r.loss, r.kd, r.ce, r.tokens, r.truncatedMassMax, r.truncatedMassSum);
}

pyb::tuple fusedLinearLoss(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const at::Tensor& labels, const pyb::object& teacher, double normalizer,
                           const pyb::object& session, int64_t chunkTokens, const pyb::dict& overrides) {
  TeacherOutput t = teacherOutputOf(teacher);
  PySession* s = session.is_none() ? nullptr : session.cast<SessionPtr>().get();
  attachHead(t, s, "distill.fused_linear_loss");
  LossOptions o = lossOptions(s, overrides);
  LossResult r;
  {
    pyb::gil_scoped_release nogil;
    r = distill::fusedLinearLoss(hidden, weight, bias.value_or(at::Tensor()), labels, t, o, normalizer, chunkTokens);
  }
  return pyb::make_tuple(r.loss, r.kd, r.ce, r.tokens, r.truncatedMassMax, r.truncatedMassSum);
}

} // namespace

void bindClient(pyb::module_& m) {
  pyb::class_<Handle>(m, "Handle")
      .def_readonly("seq", &Handle::seq)
      .def_readonly("step", &Handle::step)
      .def_readonly("acc_step", &Handle::accStep)
      .def("__repr__", [](const Handle& h) {
        return "Handle(seq=" + std::to_string(h.seq) + ", step=" + std::to_string(h.step) +
            ", acc_step=" + std::to_string(h.accStep) + ")";
      });
  pyb::class_<PyReply, ReplyPtr>(m, "Reply")
      .def_property_readonly("handle", [](const PyReply& r) { return r.reply.handle(); })
      .def_property_readonly("output", &outputDict)
      .def("tensor", [](const ReplyPtr& r, const std::string& name) { return r->hold(r, r->reply.tensor(name)); })
      .def("has", [](const PyReply& r, const std::string& name) { return r.reply.has(name); })
      .def_property_readonly("kind", [](const PyReply& r) { return answerKind(r.reply.kind()).name; })
      .def_property_readonly("teacher_fingerprint", [](const PyReply& r) { return r.reply.teacherFingerprint(); })
      .def("release", [](PyReply& r) { r.reply.release(); });
  m.attr("answer_kinds") = answerKindsDict();
  m.def(
      "_submit",
      [](const SessionPtr& s, const pyb::object& inputs, int64_t step, int64_t accStep) {
        auto named = inputsOf(*s, inputs);
        pyb::gil_scoped_release nogil;
        return s->client().submit(named, step, accStep);
      },
      pyb::arg("session"), pyb::arg("inputs"), pyb::arg("step"), pyb::arg("acc_step"));
  m.def(
      "_get",
      [](const SessionPtr& s, const Handle& h, bool view) {
        auto r = std::make_shared<PyReply>();
        r->session = s;
        r->view = view;
        pyb::gil_scoped_release nogil;
        r->reply = s->client().get(h, view ? ReplyMode::kView : ReplyMode::kCopy);
        return r;
      },
      pyb::arg("session"), pyb::arg("handle"), pyb::arg("view") = false);
  m.def(
      "_finish", [](const SessionPtr& s) { s->client().finish(); }, pyb::call_guard<pyb::gil_scoped_release>());
  m.def("_stop_requested", [](const SessionPtr& s) { return s->client().stopRequested(); });
  m.def("_request_stop", [](const SessionPtr& s) { s->client().requestStop(); });
  m.def("_outstanding", [](const SessionPtr& s) { return s->client().outstanding(); });
  m.def("_teacher_wait_seconds", [](const SessionPtr& s) { return s->client().teacherWaitSeconds(); });
  m.def("_teacher_cache_hit_share", [](const SessionPtr& s) { return s->client().teacherCacheHitShare(); });
  m.def(
      "_publish_status",
      [](const SessionPtr& s, int64_t step, double loss, double kd, double ce, double tokensPerS, double wait,
         double truncated) {
        StudentStatus st;
        st.step = step, st.loss = loss, st.kd = kd, st.ce = ce, st.tokens_per_s = tokensPerS;
        st.teacher_wait_share = wait, st.truncated_mass = truncated;
        s->client().publishStatus(st);
      },
      pyb::arg("session"), pyb::arg("step"), pyb::arg("loss") = StudentStatus::kUnset,
      pyb::arg("kd") = StudentStatus::kUnset, pyb::arg("ce") = StudentStatus::kUnset,
      pyb::arg("tokens_per_s") = StudentStatus::kUnset, pyb::arg("teacher_wait_share") = StudentStatus::kUnset,
      pyb::arg("truncated_mass") = StudentStatus::kUnset);
  m.def("_loss", &loss, pyb::arg("logits"), pyb::arg("labels"), pyb::arg("teacher"), pyb::arg("normalizer"),
        pyb::arg("session") = pyb::none(), pyb::arg("overrides") = pyb::dict());
  m.def("_fused_linear_loss", &fusedLinearLoss, pyb::arg("hidden"), pyb::arg("weight"), pyb::arg("bias"),
        pyb::arg("labels"), pyb::arg("teacher"), pyb::arg("normalizer"), pyb::arg("session") = pyb::none(),
        pyb::arg("chunk_tokens") = 0, pyb::arg("overrides") = pyb::dict());
  m.def("count_tokens", &countTokens, pyb::arg("labels"), pyb::arg("ignore_index") = -100);
}

} // namespace distill::py
