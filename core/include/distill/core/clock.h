#pragma once

// Time is std::chrono. A timeout becomes a steady_clock deadline once, at the
// start of an operation; every wait below it is "until the deadline", never
// "for the timeout again", and expiry is decided on the untruncated clock.
//
// Conversions saturate: a timeout too long for the clock (a config value of
// 1e300 s, Millis::max()) becomes a deadline that never expires, never one that
// wrapped into the past and expires at once. The config keeps every duration
// in a stated range (options.h); saturation is the backstop for everything else.

#include <chrono>
#include <cstdint>
#include <ratio>
#include <type_traits>

namespace distill {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// `d` as a Clock::duration, clamped to [Clock::duration::min(), max()] instead
// of overflowing. Floating-point durations: NaN gives zero.
template <typename Rep, typename Period>
Clock::duration saturatingDuration(std::chrono::duration<Rep, Period> d) {
  if constexpr (!std::is_floating_point<Rep>::value && std::ratio_less_equal<Period, Clock::period>::value) {
    return std::chrono::duration_cast<Clock::duration>(d); // as fine as the clock or finer: a division
  } else {
    // The tick count in double: exact enough to decide the range, since
    // rounding is monotonic and 2^63 is a double (the first value past int64).
    constexpr double kLimit = 9223372036854775808.0;
    const double ticks = std::chrono::duration<double, Clock::period>(d).count();
    if (!(ticks == ticks)) return Clock::duration::zero(); // NaN
    if (ticks >= kLimit) return Clock::duration::max();
    if (ticks <= -kLimit) return Clock::duration::min();
    if constexpr (std::is_floating_point<Rep>::value) {
      return Clock::duration(static_cast<Clock::duration::rep>(ticks));
    } else {
      return std::chrono::duration_cast<Clock::duration>(d); // exact, and known to fit
    }
  }
}

// Seconds (a config value) as a Clock::duration, saturating; NaN gives zero.
inline Clock::duration secondsToDuration(double seconds) {
  return saturatingDuration(std::chrono::duration<double>(seconds));
}

// Seconds as whole milliseconds (rounded down), saturating at Millis::max():
// for APIs that take milliseconds (c10d stores, gloo).
inline Millis secondsToMillis(double seconds) {
  const double ms = seconds * 1000.0;
  if (!(ms == ms)) return Millis::zero();
  if (ms >= 9223372036854775808.0) return Millis::max();
  if (ms <= -9223372036854775808.0) return Millis::min();
  return Millis(static_cast<Millis::rep>(ms));
}

class Deadline {
 public:
  // A deadline `timeout` from now; one past the clock's range never expires.
  static Deadline after(Clock::duration timeout) {
    const auto now = Clock::now();
    if (timeout > Clock::duration::zero() && now > Clock::time_point::max() - timeout) return never();
    return Deadline(now + timeout);
  }
  // The same for any duration type (Millis, seconds, ...), converted saturating.
  template <typename Rep, typename Period>
  static Deadline after(std::chrono::duration<Rep, Period> timeout) {
    return after(saturatingDuration(timeout));
  }
  // A deadline `seconds` from now (a config value), saturating.
  static Deadline afterSeconds(double seconds) { return after(secondsToDuration(seconds)); }
  static Deadline at(Clock::time_point when) { return Deadline(when); }
  // A deadline that never expires; use only where a caller-level deadline exists.
  static Deadline never() { return Deadline(Clock::time_point::max()); }

  Clock::time_point when() const { return when_; }
  bool expired() const { return Clock::now() >= when_; }
  bool isNever() const { return when_ == Clock::time_point::max(); }
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

// Milliseconds (rounded down) from `start` to now, for messages.
inline int64_t msSince(Clock::time_point start) { return toMs(Clock::now() - start); }

// Nanoseconds since an arbitrary epoch of the steady clock; comparable across
// processes on one machine (CLOCK_MONOTONIC), so it is what shared memory stores.
inline int64_t monotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

} // namespace distill
