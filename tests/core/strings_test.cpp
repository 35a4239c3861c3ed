// The one join (core/strings.h) and the one "milliseconds since" (core/clock.h)
// that every module's messages use.
#include <gtest/gtest.h>

#include "distill/core/clock.h"
#include "distill/core/strings.h"

namespace distill {
namespace {

TEST(Strings, JoinSeparatesItemsAndNothingElse) {
  EXPECT_EQ(join(std::vector<std::string>{}), "");
  EXPECT_EQ(join(std::vector<std::string>{"a"}), "a");
  EXPECT_EQ(join(std::vector<std::string>{"a", "", "c"}), "a, , c");
  EXPECT_EQ(join(std::vector<std::string>{"x", "y"}, " | "), "x | y");
  EXPECT_EQ(join(std::vector<int>{}), "");
  EXPECT_EQ(join(std::vector<int>{3, -1, 12}), "3, -1, 12");
  EXPECT_EQ(join(std::vector<int>{1, 2}, "+"), "1+2");
}

TEST(Clock, MsSinceCountsWholeMilliseconds) {
  const Clock::time_point start = Clock::now();
  EXPECT_GE(msSince(start), 0);
  const int64_t ms = msSince(start - std::chrono::milliseconds(1500)); // 1500 ms ago, plus the time since
  EXPECT_GE(ms, 1500);
  EXPECT_LT(ms, 1500 + 60'000);
  EXPECT_EQ(toMs(std::chrono::nanoseconds(2'999'999)), 2); // rounded down
}

} // namespace
} // namespace distill
