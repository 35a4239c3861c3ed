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

TEST(Strings, SourceLocationsOfGlooAndC10dMessagesGo) {
  EXPECT_EQ(withoutSourceLocations("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by "
                                   "peer [127.0.0.1]:4995"),
            "Connection closed by peer [127.0.0.1]:4995");
  EXPECT_EQ(withoutSourceLocations("[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
                                   "op.preamble.length <= op.nbytes. 8 vs 4"),
            "op.preamble.length <= op.nbytes. 8 vs 4");
  EXPECT_EQ(withoutSourceLocations("a [x.hpp:12]b [y.cu:3] c"), "a b c");
  // distill's own, of an error quoted inside another's message.
  EXPECT_EQ(withoutSourceLocations("Gloo connectFullMesh failed with [n0 r1 student] lost the store "
                                   "(its process is gone?) [awaiting: store] (job_store.cpp:205)"),
            "Gloo connectFullMesh failed with [n0 r1 student] lost the store (its process is gone?) [awaiting: store]");
  // Not a source location: kept as it is.
  for (const std::string kept : {"[127.0.0.1]:4995", "[rank 1] done", "[a.cc:] x", "[a.cc:12x] y", "[cc:12] z",
                                 "(.cc:12) w", "f(x) (2 of 3)", "unclosed [a.cc:12", ""}) {
    EXPECT_EQ(withoutSourceLocations(kept), kept);
  }
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
