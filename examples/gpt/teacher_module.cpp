// libdistill_gpt_teacher.so: the demo's C++ teacher for distill-teacher
// (teacher.kind registered, teacher.module gpt). The architecture comes from
// the weights file itself (saveGpt records it), so one registration serves
// any size:
//
//   teacher: {kind: registered, library: build/lib/libdistill_gpt_teacher.so,
//             module: gpt, weights: logs/demo/teacher/teacher.pt}
#include <distill/core/errors.h>
#include <distill/teacher/model.h>

#include "gpt.h"

DISTILL_REGISTER_TEACHER("gpt", [](const distill::TeacherOptions& o) {
  DISTILL_CHECK_T(ConfigError, !o.weights.empty(),
                  "teacher.module gpt needs teacher.weights: a file written by `distill-gpt train-teacher`");
  distill::examples::Gpt model = distill::examples::loadGpt(o.weights);
  model->to(torch::Device(o.device));
  return std::static_pointer_cast<distill::TeacherModel>(
      std::make_shared<distill::ModuleTeacher<distill::examples::GptImpl>>(model.ptr(), o.output,
                                                                           distill::fileFingerprint(o.weights)));
});
