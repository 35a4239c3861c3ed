#pragma once

// The teacher's head for teacher.answer hidden (docs/teacher.md, "The
// hidden-state answer"): taken from the model (TeacherModel::head), checked,
// and published once per node beside the segment (ipc/shared_head.h), so that
// every student of the node maps one read-only copy. The server publishes it
// at start-up, before admission completes; a restarted teacher publishes it
// again (a new generation, which students compare by fingerprint).
//
// CPU only for now: a head on a CUDA device is copied to the host to be
// published (a CUDA student copies it to its device once per mapping); the
// head by CUDA IPC is issue 42's GPU work.
//
// Called by the server thread; no state.

#include <optional>
#include <string>

#include "distill/core/options.h"
#include "distill/ipc/shared_head.h"
#include "distill/loss/hidden_head.h"
#include "distill/teacher/model.h"

namespace distill {

// The model's head, checked (validateTeacherHead) and against teacher.hidden_size
// and teacher.vocab_size when they are set: ConfigError naming the model and
// teacher.head.* when it has none, or one that is not a head.
TeacherHead modelHead(const TeacherModel& model, const TeacherOptions& options);

// Publishes `head` beside segment `segment` (its tensors copied to the host,
// contiguous, where they are not); SharedHead::publish's errors. ConfigError
// for a dtype a head cannot travel in (float32, float16, bfloat16 only).
ipc::SharedHead publishHead(const std::string& segment, const TeacherHead& head);

// What the server keeps of its head (teacher.answer hidden).
struct ServedHead {
  int64_t vocab = 0; // V_t: stated in every response (0: not answering hidden states)
  std::string fingerprint; // ipc::headFingerprint: in the cache's keys
  std::optional<ipc::SharedHead> shared; // the node's first teacher's publication, held mapped
};

// teacher.answer hidden: the model's head checked (modelHead) and, by the
// node's first teacher (`teacher` 0), published beside `segment` and logged;
// other answers: an empty ServedHead, nothing done.
ServedHead serveHead(const TeacherModel& model, const TeacherOptions& options, const std::string& segment, int teacher);

} // namespace distill
