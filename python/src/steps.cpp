// distill::Steps for a Python trainer: the same object, its model reached
// through Python callables (ExternalModel).
#include <pybind11/functional.h>

#include <optional>

#include "distill/core/errors.h"
#include "distill/train/steps.h"
#include "session.h"

namespace distill::py {

namespace {

// The Python object outlives close(): after it, the step counters read what
// they were at close() and every other call is an error naming close().
struct PySteps {
  SessionPtr session;
  std::unique_ptr<Steps> steps;
  struct Final {
    int64_t step = 0, resumedStep = 0;
    double stepTokens = 0;
    bool stopped = false, saved = false;
    std::string resumedRankExtra;
  } final;

  Steps& live(const char* call) const {
    DISTILL_CHECK_T(UsageError, steps != nullptr, "distill.Steps.", call, ": this Steps was closed (close())");
    return *steps;
  }
  void close() {
    if (!steps) return;
    final.step = steps->step();
    final.resumedStep = steps->resumedStep();
    final.stepTokens = steps->stepTokens();
    final.stopped = steps->stopped();
    final.saved = steps->saved();
    final.resumedRankExtra = steps->resumedRankExtra();
    steps.reset();
  }
};
using StepsPtr = std::shared_ptr<PySteps>;

// The trainer's pieces, as distill.Steps (python/distill/steps.py) hands them.
StepsPtr makeSteps(const SessionPtr& s, std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                   bool trainerAverages, bool cuda, std::function<pyb::tuple()> saveState,
                   std::function<void(pyb::bytes, pyb::bytes)> loadState, std::function<void(pyb::dict)> onStep,
                   std::string fingerprint, std::function<pyb::bytes(int64_t)> rankExtra) {
  ExternalModel model;
  model.parameters = std::move(params);
  model.buffers = std::move(buffers);
  model.trainerAverages = trainerAverages;
  model.cuda = cuda;
  model.saveState = [saveState]() {
    pyb::gil_scoped_acquire gil;
    pyb::tuple t = saveState();
    return std::make_pair(t[0].cast<std::string>(), t[1].cast<std::string>());
  };
  model.loadState = [loadState](const std::string& m, const std::string& o) {
    pyb::gil_scoped_acquire gil;
    loadState(pyb::bytes(m), pyb::bytes(o));
  };
  StepsOptions options;
  options.teacherFingerprint = std::move(fingerprint);
  if (rankExtra) {
    options.checkpointRankExtra = [rankExtra](int64_t step) {
      pyb::gil_scoped_acquire gil;
      return std::string(rankExtra(step));
    };
  }
  if (onStep) {
    options.onStep = [onStep](const StepReport& r) {
      pyb::gil_scoped_acquire gil;
      pyb::dict d;
      d["step"] = r.step, d["loss"] = r.loss, d["kd"] = r.kd, d["ce"] = r.ce, d["tokens"] = r.tokens;
      d["seconds"] = r.seconds, d["tokens_per_s"] = r.tokensPerS, d["teacher_wait_share"] = r.teacherWaitShare;
      d["stop"] = r.stop;
      d["masked_tokens"] = r.maskedTokens; // teacher.on_nonfinite mask
      d["skipped"] = r.skipped, d["skipped_steps"] = r.skippedSteps; // loss.on_nonfinite skip_step
      if (r.truncatedMassMax >= 0) { // loss.vocab truncate
        d["truncated_mass_max"] = r.truncatedMassMax, d["truncated_mass_mean"] = r.truncatedMassMean;
      }
      onStep(d);
    };
  }
  auto p = std::make_shared<PySteps>();
  p->session = s;
  pyb::gil_scoped_release nogil;
  p->steps = std::make_unique<Steps>(s->session, std::move(model), std::move(options));
  return p;
}

// The loader: a Python callable returning (inputs, labels), (inputs, labels, ids) or
// (inputs, labels, ids, sampling_logprobs) (MicroBatch's optional fields; None: left out), or None.
std::optional<MicroBatch> loadOne(const pyb::function& loader) {
  pyb::gil_scoped_acquire gil;
  pyb::object item = loader();
  if (item.is_none()) return std::nullopt;
  auto typeOf = [](const pyb::handle& h) {
    return pyb::str(pyb::type::handle_of(h).attr("__qualname__")).cast<std::string>();
  };
  const bool sequence = pyb::isinstance<pyb::tuple>(item) || pyb::isinstance<pyb::list>(item);
  const size_t n = sequence ? pyb::len(item) : 0;
  DISTILL_CHECK_T(UsageError, n >= 2 && n <= 4,
                  "distill.Steps: the loader must yield (inputs, labels) pairs of tensors (or (inputs, labels, ids"
                  "[, sampling_logprobs])), got ",
                  sequence ? "a " + typeOf(item) + " of " + std::to_string(n) + " items" : "a " + typeOf(item));
  pyb::sequence seq = item.cast<pyb::sequence>();
  static const char* const kWhat[] = {"inputs are", "labels are", "ids are", "sampling_logprobs are"};
  at::Tensor parts[4];
  for (size_t i = 0; i < n; ++i) {
    if (i >= 2 && seq[i].is_none()) continue;
    DISTILL_CHECK_T(UsageError, THPVariable_Check(seq[i].ptr()),
                    "distill.Steps: the loader must yield (inputs, labels) pairs of tensors; its ", kWhat[i], " a ",
                    typeOf(seq[i]));
    parts[i] = THPVariable_Unpack(seq[i].ptr());
  }
  return MicroBatch{parts[0], parts[1], parts[2], parts[3]};
}

pyb::object next(PySteps& p, const pyb::function& loader) {
  std::optional<StepItem> item;
  {
    pyb::gil_scoped_release nogil;
    item = p.live("next").next([&loader]() { return loadOne(loader); });
  }
  if (!item) return pyb::none();
  return pyb::make_tuple(item->inputs, item->labels, item->step, item->accStep);
}

pyb::tuple backward(PySteps& p, const at::Tensor& logits) {
  LossResult r;
  {
    pyb::gil_scoped_release nogil;
    r = p.live("backward").backward(logits);
  }
  return pyb::make_tuple(r.loss.detach(), r.kd, r.ce, r.tokens, r.truncatedMassMax, r.truncatedMassSum);
}

pyb::tuple backwardLinear(PySteps& p, const at::Tensor& hidden, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, int64_t chunkTokens) {
  LossResult r;
  {
    pyb::gil_scoped_release nogil;
    r = p.live("backward").backward(hidden, OutputHead{weight, bias.value_or(at::Tensor()), chunkTokens});
  }
  return pyb::make_tuple(r.loss.detach(), r.kd, r.ce, r.tokens, r.truncatedMassMax, r.truncatedMassSum);
}

} // namespace

void bindSteps(pyb::module_& m) {
  pyb::class_<PySteps, StepsPtr>(m, "Steps")
      .def("next", &next)
      .def("backward", &backward)
      .def("backward_linear", &backwardLinear)
      .def("set_loss_scale", [](PySteps& p, const at::Tensor& scale) { p.live("set_loss_scale").setLossScale(scale); })
      .def("step_ends", [](const PySteps& p) { return p.live("step_ends").stepEnds(); })
      .def_property_readonly("step", [](const PySteps& p) { return p.steps ? p.steps->step() : p.final.step; })
      .def_property_readonly("step_tokens",
                             [](const PySteps& p) { return p.steps ? p.steps->stepTokens() : p.final.stepTokens; })
      .def_property_readonly("resumed_step",
                             [](const PySteps& p) { return p.steps ? p.steps->resumedStep() : p.final.resumedStep; })
      .def_property_readonly("resumed_rank_extra",
                             [](const PySteps& p) {
                               return pyb::bytes(p.steps ? p.steps->resumedRankExtra() : p.final.resumedRankExtra);
                             })
      .def_property_readonly("stopped", [](const PySteps& p) { return p.steps ? p.steps->stopped() : p.final.stopped; })
      .def_property_readonly("saved", [](const PySteps& p) { return p.steps ? p.steps->saved() : p.final.saved; })
      .def(
          "close", [](PySteps& p) { p.close(); }, pyb::call_guard<pyb::gil_scoped_release>());
  m.def("_steps", &makeSteps, pyb::arg("session"), pyb::arg("parameters"), pyb::arg("buffers"),
        pyb::arg("trainer_averages"), pyb::arg("cuda"), pyb::arg("save_state"), pyb::arg("load_state"),
        pyb::arg("on_step"), pyb::arg("fingerprint") = "", pyb::arg("rank_extra") = nullptr);
}

} // namespace distill::py
