#pragma once

// The demo's single-process phases: the teacher's own training and the
// label-only student. An ordinary LibTorch trainer without distill: the loop
// that train.cpp's distilled student is compared with.

#include "distill/core/options.h"

namespace distill::examples {

// Returns the process's exit status (128 + signal when stopped by SIGINT/SIGTERM).
int trainTeacher(const Config& cfg);
int trainLabelOnly(const Config& cfg);

} // namespace distill::examples
