// checkTagOrder (server.h): the teacher's per-student check that the tags of
// its requests advance exactly as a trainer's steps and micro-batches do.
#include <optional>
#include <string>

#include "distill/core/tag.h"
#include "distill/teacher/server.h"

namespace distill {
namespace {

std::string tagString(const Tag& t) { return "(" + describe(t) + ")"; }

} // namespace

std::string checkTagOrder(const std::optional<Tag>& prev, const Tag& next, int gradAccSteps) {
  const std::string g = " (student.grad_acc_steps=" + std::to_string(gradAccSteps) + ")";
  if (next.step < 0 || next.accStep < 0 || next.accStep >= gradAccSteps) {
    return "request " + tagString(next) + ": acc_step must be in [0, " + std::to_string(gradAccSteps) +
        ") and step >= 0" + g;
  }
  if (!prev) return ""; // the first request (or the first a restarted teacher sees)
  const std::string pair = "request " + tagString(next) + " after " + tagString(*prev) + ": ";
  if (next.seq != prev->seq + 1) {
    return pair + "seq " + std::to_string(next.seq) + " does not follow seq " + std::to_string(prev->seq);
  }
  if (next.step < prev->step) return pair + "step went back";
  if (next.step == prev->step) {
    if (next.accStep <= prev->accStep) return pair + "acc_step did not advance" + g;
    if (next.accStep > prev->accStep + 1) {
      return pair + "acc_step " + std::to_string(prev->accStep + 1) +
          (next.accStep > prev->accStep + 2 ? " to " + std::to_string(next.accStep - 1) : "") + " skipped" + g;
    }
    return "";
  }
  if (prev->accStep != gradAccSteps - 1) {
    return pair + "step " + std::to_string(prev->step) + " ended at acc_step " + std::to_string(prev->accStep) +
        ", expected " + std::to_string(gradAccSteps - 1) + g;
  }
  if (next.accStep != 0) return pair + "a new step must start at acc_step 0" + g;
  return "";
}

} // namespace distill
