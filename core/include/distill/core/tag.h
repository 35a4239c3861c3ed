#pragma once

// The identity of one teacher request and its answer: set by the student,
// carried through the rings, echoed by the teacher, checked on both sides and
// shown in every error, hang report and flight-recorder line that concerns it.
// One type and one spelling ("step 3, acc_step 1, seq 7") for all of them.

#include <cstdint>
#include <ostream>
#include <string>

namespace distill {

struct Tag {
  uint64_t seq = 0; // per-student message number (1, 2, ... in the order sent)
  int64_t step = 0; // training step
  int64_t accStep = 0; // gradient-accumulation index within the step
};

inline bool operator==(const Tag& a, const Tag& b) {
  return a.seq == b.seq && a.step == b.step && a.accStep == b.accStep;
}
inline bool operator!=(const Tag& a, const Tag& b) { return !(a == b); }

// "step 3, acc_step 1, seq 7" (callers add the parentheses where they want them).
inline std::string describe(const Tag& t) {
  return "step " + std::to_string(t.step) + ", acc_step " + std::to_string(t.accStep) + ", seq " +
      std::to_string(t.seq);
}
inline std::ostream& operator<<(std::ostream& os, const Tag& t) { return os << describe(t); }

} // namespace distill
