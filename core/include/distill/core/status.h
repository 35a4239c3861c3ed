#pragma once

// What a student reports about its training, each step or as often as it
// likes: Client::publishStatus (student/client.h) writes it into the student's
// area of the node's segment (a few relaxed stores, no system call), and
// distill-run reads it from there for its status line and summary. A field
// left NaN (step: -1) is not reported and not shown.
//
// A trainer fills it in StepsOptions::onStatus or hands it to
// Client::publishStatus (docs/cpp.md, "Installed headers").
//
// For distill's own developers: a new field goes at the end here and in the
// segment's status area (the segment layout in distill's sources, ipc/src, which
// is not installed; spare values are reserved there), with the segment's layout
// version bumped.

#include <cstdint>
#include <limits>

namespace distill {

struct StudentStatus {
  static constexpr double kUnset = std::numeric_limits<double>::quiet_NaN();

  int64_t step = -1; // the step just finished
  double loss = kUnset; // the loss of that step (what the trainer minimises)
  double kd = kUnset; // its distillation term
  double ce = kUnset; // its cross-entropy term (labels)
  double tokens_per_s = kUnset; // this student's throughput
  double teacher_wait_share = kUnset; // share (0..1) of the step spent waiting for the teacher
  double truncated_mass = kUnset; // loss.vocab truncate: the most teacher probability one token of the
                                  // step lost (ids >= the student's vocabulary); unset otherwise
  double masked_tokens = kUnset; // teacher.on_nonfinite mask: tokens whose teacher answer was not finite,
                                 // all students, since the run started; unset otherwise
  double skipped_steps = kUnset; // loss.on_nonfinite skip_step: steps whose update no student applied
                                 // (a loss or gradient not finite), since the run started; unset otherwise
};

} // namespace distill
