#pragma once

// Teacher models, as the teacher server sees them.
//
// Three sources (teacher.kind in the config):
//  * torchscript: a file exported from Python (torch.jit.script / trace),
//    called through teacher.method with the request tensors in teacher.inputs
//    order; a tensor result is teacher.output, a tuple's first element is, and
//    a dict's entries are looked up by name (teacher.output, teacher.hidden_states).
//  * registered: a C++ model registered under a name by DISTILL_REGISTER_TEACHER
//    or DISTILL_REGISTER_TEACHER_MODULE in a shared library the config names
//    (teacher.library, dlopen'ed by the teacher), weights from teacher.weights.
//  * self: the trainer binary in teacher role hands its own model to serve().
//
// forward() is called by the server thread only, under inference mode.

#include <torch/nn/module.h>
#include <torch/serialize.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distill/core/options.h"
#include "distill/loss/hidden_head.h"

namespace distill {

class TeacherModel {
 public:
  virtual ~TeacherModel() = default;
  // inputs: the request tensors in teacher.inputs order, batched along dim 0.
  // Returns named outputs, each with the same dim 0; must hold teacher.output.
  virtual std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& inputs) = 0;
  // Identifies the weights (checkpoint manifests record it). "" if unknown.
  virtual std::string fingerprint() const { return ""; }
  // The tensors its answers depend on (parameters and buffers), by name: the
  // teacher-output cache (teacher.cache) keys on a digest of them. Empty if unknown.
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const { return {}; }
  // Its output layer, for teacher.answer hidden (whose forward then returns
  // the layer's input, its final hidden states, as teacher.output): published
  // once per node at start-up (docs/teacher.md, "The hidden-state answer").
  // The default looks teacher.head.weight and teacher.head.bias up in state()
  // (a parameter or buffer of that name) and takes softcap and scale from
  // teacher.head; nullopt when state() has no tensor of that weight name. A C++
  // teacher whose head is not in its state, or that transforms its logits,
  // overrides it ("declares its head"). The server refuses a head that is not
  // one (validateTeacherHead) with a ConfigError naming the model and the names.
  virtual std::optional<TeacherHead> head(const TeacherOptions& options) const;
};

// A model given as a function of the inputs returning the output tensor.
std::shared_ptr<TeacherModel> teacherFromFunction(std::function<at::Tensor(const std::vector<at::Tensor>&)> fn,
                                                  std::string outputName = "logits");

// Wraps a torch::nn::Module whose forward takes one tensor and returns logits.
template <typename M>
class ModuleTeacher : public TeacherModel {
 public:
  ModuleTeacher(std::shared_ptr<M> module, std::string outputName, std::string fingerprint = "")
      : module_(std::move(module)), output_(std::move(outputName)), fingerprint_(std::move(fingerprint)) {}
  std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& inputs) override {
    return {{output_, module_->forward(inputs.at(0))}};
  }
  std::string fingerprint() const override { return fingerprint_; }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : module_->named_parameters(true)) out.emplace_back("parameter " + p.key(), p.value());
    for (const auto& b : module_->named_buffers(true)) out.emplace_back("buffer " + b.key(), b.value());
    return out;
  }

 private:
  std::shared_ptr<M> module_;
  std::string output_;
  std::string fingerprint_;
};

using TeacherFactory = std::function<std::shared_ptr<TeacherModel>(const TeacherOptions&)>;

// Registers a factory under `name` (teacher.module). Returns true; meant for a
// static initialiser in a shared library. A second registration of a name is
// an error at lookup time.
bool registerTeacher(const std::string& name, TeacherFactory factory);
std::vector<std::string> registeredTeachers();

// Loads the model the options name (torchscript or registered; dlopens
// teacher.library first). ConfigError for kind self, a missing file, an
// unknown module; the message lists what is registered.
std::shared_ptr<TeacherModel> loadTeacherModel(const TeacherOptions& options);

// "<path> <size> bytes <mtime>": cheap identity of a weights file.
std::string fileFingerprint(const std::string& path);

// The teacher's identity in every answer it sends (the slot header's 64-bit
// `teacher` field; the student refuses answers of two teachers in one run):
// the first 8 bytes of a SHA-256 (core/sha256.h) of state()'s names, dtypes
// and shapes and 16 evenly spaced values of each tensor (one small copy per
// tensor: cheap at any size, and another checkpoint of the same model differs
// in them), or of fingerprint() when the model exposes no state; `head`
// (teacher.answer hidden's head fingerprint) is mixed in. 0 ("not stated": no
// check) when there is none of these.
uint64_t teacherFingerprint(const TeacherModel& model, const std::string& head = "");

} // namespace distill

#define DISTILL_TEACHER_CONCAT_(a, b) a##b
#define DISTILL_TEACHER_CONCAT(a, b) DISTILL_TEACHER_CONCAT_(a, b)

// DISTILL_REGISTER_TEACHER(name, [](const distill::TeacherOptions& o) { return ...; });
#define DISTILL_REGISTER_TEACHER(name, factory) \
  static const bool DISTILL_TEACHER_CONCAT(distillTeacherReg_, __LINE__) = ::distill::registerTeacher(name, factory)

// Registers torch::nn module type M (default-constructible, forward(Tensor) ->
// logits); the factory loads teacher.weights with torch::load if set and moves
// it to teacher.device in eval mode.
#define DISTILL_REGISTER_TEACHER_MODULE(name, M)                                                            \
  DISTILL_REGISTER_TEACHER(name, [](const ::distill::TeacherOptions& o) {                                   \
    auto m = std::make_shared<M>();                                                                         \
    std::shared_ptr<::torch::nn::Module> base = m;                                                          \
    if (!o.weights.empty()) ::torch::load(base, o.weights);                                                 \
    m->to(::torch::Device(o.device));                                                                       \
    m->eval();                                                                                              \
    return std::static_pointer_cast<::distill::TeacherModel>(std::make_shared<::distill::ModuleTeacher<M>>( \
        m, o.output, o.weights.empty() ? "" : ::distill::fileFingerprint(o.weights)));                      \
  })
