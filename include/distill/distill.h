#pragma once

// The one include a trainer needs:
//
//   #include <distill/distill.h>
//
// distill::init() gives a student session (client to the teacher, student
// group) or the teacher's; see docs/cpp.md, "C++ trainers".

#include "distill/build_config.h"
#include "distill/ckpt/checkpoint.h"
#include "distill/core/clock.h"
#include "distill/core/config.h"
#include "distill/core/context.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/options.h"
#include "distill/core/answer_kinds.h"
#include "distill/core/status.h"
#include "distill/core/topology.h"
#include "distill/core/version.h"
#include "distill/group/student_context.h"
#include "distill/group/student_group.h"
#include "distill/student/client.h"
#include "distill/student/grad.h"
#include "distill/student/grad_sync.h"
#include "distill/student/init.h"
#include "distill/student/teacher_head.h"
#include "distill/loss/hidden_head.h"
#include "distill/loss/losses.h"
#include "distill/teacher/model.h"
#include "distill/teacher/server.h"
#include "distill/train/steps.h"
