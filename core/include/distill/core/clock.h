#pragma once

// Time is std::chrono. A timeout becomes a steady_clock deadline once, at the
// start of an operation; every wait below it is "until the deadline", never
// "for the timeout again", and expiry is decided on the untruncated clock.

#include <chrono>
#include <cstdint>

namespace distill {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

class Deadline {
 public:
  // A deadline `timeout` from now.
  static Deadline after(Clock::duration timeout) { return Deadline(Clock::now() + timeout); }
  static Deadline at(Clock::time_point when) { return Deadline(when); }
  // A deadline that never expires; use only where a caller-level deadline exists.
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  Clock::time_point when() const { return when_; }
  bool expired() const { return Clock::now() >= when_; }
  // Time left, zero once expired.
  Clock::duration remaining() const {
    auto now = Clock::now();
    return now >= when_ ? Clock::duration::zero() : when_ - now;
  }
  // The earlier of two deadlines.
  Deadline min(Deadline other) const { return other.when_ < when_ ? other : *this; }

 private:
  explicit Deadline(Clock::time_point when) : when_(when) {}
  Clock::time_point when_;
};

// Milliseconds (rounded down) in a duration, for messages.
template <typename D>
int64_t toMs(D d) {
  return std::chrono::duration_cast<Millis>(d).count();
}

// Nanoseconds since an arbitrary epoch of the steady clock; comparable across
// processes on one machine (CLOCK_MONOTONIC), so it is what shared memory stores.
inline int64_t monotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace distill
