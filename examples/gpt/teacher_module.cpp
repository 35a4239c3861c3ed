// libdistill_gpt_teacher.so: the demo's C++ teacher for distill-teacher
// (teacher.kind registered, teacher.module gpt). The architecture comes from
// the weights file itself (saveGpt records it), so one registration serves
// any size:
//
//   teacher: {kind: registered, library: build/lib/libdistill_gpt_teacher.so,
//             module: gpt, weights: logs/demo/teacher/teacher.pt}
//
// With teacher.answer: hidden it answers with its final hidden states (the
// input of its output layer) and declares that layer as its head, so that the
// students compute its logits themselves (docs/teacher.md, "The hidden-state answer").
#include <distill/core/answer_kinds.h>
#include <distill/core/errors.h>
#include <distill/teacher/model.h>

#include "gpt.h"

namespace {

namespace ex = distill::examples;

// The demo's Gpt as ModuleTeacher serves it (its state and fingerprint), answering with its hidden
// states under teacher.answer: hidden, and declaring its head.
class GptTeacher final : public distill::ModuleTeacher<ex::GptImpl> {
 public:
  GptTeacher(ex::Gpt model, const distill::TeacherOptions& o)
      : ModuleTeacher(model.ptr(), o.output, distill::fileFingerprint(o.weights)),
        model_(std::move(model)),
        output_(o.output),
        hidden_(distill::answerKindOf(o) == distill::AnswerKind::kHidden) {}

  std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>& inputs) override {
    if (!hidden_) return ModuleTeacher::forward(inputs);
    return {{output_, model_->hidden(inputs.at(0))}};
  }
  // Its head, declared: the output layer's weight (no bias, no soft-cap), whatever teacher.head names.
  std::optional<distill::TeacherHead> head(const distill::TeacherOptions&) const override {
    distill::TeacherHead h;
    h.weight = model_->head->weight;
    return h;
  }

 private:
  ex::Gpt model_;
  std::string output_;
  bool hidden_;
};

} // namespace

DISTILL_REGISTER_TEACHER("gpt", [](const distill::TeacherOptions& o) {
  DISTILL_CHECK_T(ConfigError, !o.weights.empty(),
                  "teacher.module gpt needs teacher.weights: a file written by `distill-gpt train-teacher`");
  ex::Gpt model = ex::loadGpt(o.weights);
  model->to(torch::Device(o.device));
  return std::static_pointer_cast<distill::TeacherModel>(std::make_shared<GptTeacher>(model, o));
});
