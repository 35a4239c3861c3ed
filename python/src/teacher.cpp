// distill.serve(model): the teacher's serving loop in C++, the forward in Python.
#include <optional>

#include "distill/core/errors.h"
#include "distill/loss/hidden_head.h"
#include "distill/teacher/model.h"
#include "distill/teacher/server.h"
#include "session.h"

namespace distill::py {

namespace {

// A torch.nn.Module (any callable) as a TeacherModel. forward() is called by
// the server's thread with the GIL released; it takes the GIL for the call.
class PyTeacher : public TeacherModel {
 public:
  PyTeacher(pyb::object module, std::string output, std::string fingerprint, std::optional<TeacherHead> head)
      : module_(std::move(module)), output_(std::move(output)), fingerprint_(std::move(fingerprint)),
        head_(std::move(head)) {
    // The cache keys on the weights: read their names once, here, with the GIL.
    if (pyb::hasattr(module_, "named_parameters")) {
      for (auto item : module_.attr("named_parameters")()) {
        auto pair = item.cast<pyb::tuple>();
        state_.emplace_back("parameter " + pair[0].cast<std::string>(), pair[1].cast<at::Tensor>());
      }
      for (auto item : module_.attr("named_buffers")()) {
        auto pair = item.cast<pyb::tuple>();
        state_.emplace_back("buffer " + pair[0].cast<std::string>(), pair[1].cast<at::Tensor>());
      }
    }
  }
  ~PyTeacher() override {
    pyb::gil_scoped_acquire gil;
    module_ = pyb::object();
  }

  // A Python exception of the forward goes on as itself (pybind11's
  // error_already_set): serve() fails with it in the teacher's process.
  std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& inputs) override {
    pyb::gil_scoped_acquire gil;
    pyb::tuple args(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) args[i] = pyb::cast(inputs[i]);
    pyb::object out = module_(*args);
    std::map<std::string, at::Tensor> named;
    if (pyb::isinstance<pyb::dict>(out)) {
      for (auto item : out.cast<pyb::dict>()) {
        named[pyb::str(item.first).cast<std::string>()] = entry(item.first, item.second);
      }
    } else if (pyb::isinstance<pyb::tuple>(out) && pyb::len(out) > 0) {
      named[output_] = tensorOf(out.cast<pyb::tuple>()[0], "its tuple's first element"); // as teacher.output says
    } else {
      named[output_] = tensorOf(out, "it");
    }
    return named;
  }
  std::string fingerprint() const override { return fingerprint_; }
  // The model's type, for messages ("function", "GPT").
  std::string typeName() const {
    pyb::gil_scoped_acquire gil;
    return pyb::str(pyb::type::handle_of(module_).attr("__qualname__")).cast<std::string>();
  }

  // One entry of a returned dict (a Hugging Face ModelOutput is one): a tensor,
  // or an error naming the entry and what it is.
  static at::Tensor entry(const pyb::handle& key, const pyb::handle& value) {
    DISTILL_CHECK_T(ProtocolError, THPVariable_Check(value.ptr()),
                    "the Python teacher's forward returned a dict whose '", pyb::str(key).cast<std::string>(),
                    "' is a ", pyb::str(pyb::type::handle_of(value).attr("__name__")).cast<std::string>(),
                    ", not a tensor: return tensors only (a Hugging Face model: distill.serve(session, model) with the "
                    "model itself runs it with use_cache=False and returns its teacher.output)");
    return THPVariable_Unpack(value.ptr());
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return state_; }
  // teacher.answer hidden: the head distill.serve found (a Hugging Face model's) or was given
  // (head=); none: teacher.head's names looked up in the module's parameters and buffers.
  std::optional<TeacherHead> head(const TeacherOptions& options) const override {
    return head_ ? head_ : TeacherModel::head(options);
  }

 private:
  // `value` as a tensor, or a ProtocolError saying what the forward returned.
  static at::Tensor tensorOf(const pyb::handle& value, const std::string& what) {
    if (THPVariable_Check(value.ptr())) return THPVariable_Unpack(value.ptr());
    const auto type = pyb::str(pyb::type::handle_of(value).attr("__qualname__")).cast<std::string>();
    DISTILL_THROW(ProtocolError,
                  "the Python teacher's forward must return a tensor, a tuple whose first element is "
                  "one, or a dict of tensors; ",
                  what, " is a ", type);
  }

  pyb::object module_;
  std::string output_, fingerprint_;
  std::vector<std::pair<std::string, at::Tensor>> state_;
  std::optional<TeacherHead> head_;
};

// distill.serve's head (python/distill/head.py): weight, bias or None, softcap, scale; None: not declared.
std::optional<TeacherHead> headOf(const pyb::object& head) {
  if (head.is_none()) return std::nullopt;
  auto t = head.cast<pyb::tuple>();
  TeacherHead h;
  h.weight = t[0].cast<at::Tensor>();
  if (!t[1].is_none()) h.bias = t[1].cast<at::Tensor>();
  h.softcap = t[2].cast<double>();
  h.scale = t[3].cast<double>();
  return h;
}

pyb::dict serveModule(const SessionPtr& s, pyb::object module, std::string fingerprint, const pyb::object& head) {
  DISTILL_CHECK_T(UsageError, s->session.teacher,
                  "distill.serve: this process is a student (serve the teacher on the teacher's rank: "
                  "`if session.is_teacher: distill.serve(session, model)`)");
  const bool noFingerprint = fingerprint.empty();
  auto model = std::make_shared<PyTeacher>(std::move(module), s->session.config.teacher.output, std::move(fingerprint),
                                           headOf(head));
  // The cache keys its answers on the weights: a teacher without parameters
  // (a function, a lambda) must name them. Said here, in Python's words.
  DISTILL_CHECK_T(ConfigError,
                  s->session.config.teacher.cache.mode == CacheMode::kOff || !noFingerprint || !model->state().empty(),
                  "distill.serve: teacher.cache keeps the teacher's answers by its weights, and this teacher (a ",
                  model->typeName(),
                  ") has no parameters or buffers to tell them by: pass the torch.nn.Module itself "
                  "(distill.serve(session, model)), or name its weights with "
                  "distill.serve(session, forward, fingerprint=\"...\") (e.g. the checkpoint's path and digest: "
                  "a new fingerprint is a new cache), or set teacher.cache.mode: off");
  ServeStats st;
  {
    pyb::gil_scoped_release nogil;
    st = serve(*s->session.teacher, model);
    model.reset(); // takes the GIL itself
  }
  pyb::dict d;
  d["requests"] = st.requests, d["errors"] = st.errors, d["batches"] = st.batches;
  d["masked"] = st.masked; // teacher.on_nonfinite mask: tokens answered masked
  d["forward_seconds"] = st.forwardSeconds, d["wall_seconds"] = st.wallSeconds, d["per_student"] = st.perStudent;
  return d;
}

} // namespace

void bindTeacher(pyb::module_& m) {
  m.def("_serve", &serveModule, pyb::arg("session"), pyb::arg("model"), pyb::arg("fingerprint") = "",
        pyb::arg("head") = pyb::none());
  // distill.head.head_logits: the students' own computation (loss/hidden_head.h), not a restatement of it.
  m.def(
      "_teacher_logits",
      [](const at::Tensor& hidden, const pyb::object& head, int64_t chunkTokens) {
        const TeacherHead h = *headOf(head);
        validateTeacherHead(h);
        pyb::gil_scoped_release nogil;
        return teacherLogits(hidden, h, chunkTokens);
      },
      pyb::arg("hidden"), pyb::arg("head"), pyb::arg("chunk_tokens") = 0);
}

} // namespace distill::py
