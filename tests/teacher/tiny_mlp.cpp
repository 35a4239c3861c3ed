// libdistill_test_teacher.so: registers TinyMlp as teacher.module "tiny_mlp".
#include "tiny_mlp.h"

#include "distill/teacher/model.h"

DISTILL_REGISTER_TEACHER_MODULE("tiny_mlp", distill::testing::TinyMlp);
DISTILL_REGISTER_TEACHER_MODULE("causal_mean", distill::testing::CausalMean);
