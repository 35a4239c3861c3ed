// checkTagOrder: the teacher's per-student check that tags advance exactly as
// gradient accumulation says (docs/design.md, "The four hangs this design rules out":
// the teacher one step ahead).
#include <gtest/gtest.h>

#include "distill/teacher/server.h"

using distill::checkTagOrder;
using distill::Tag;

namespace {

Tag tag(uint64_t seq, int64_t step, int64_t acc) { return Tag{seq, step, acc}; }
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(CheckTagOrder, FirstRequestAndNextAccStepAreFine) {
  EXPECT_EQ(checkTagOrder(std::nullopt, tag(1, 0, 0), 4), "");
  EXPECT_EQ(checkTagOrder(tag(1, 0, 0), tag(2, 0, 1), 4), "");
  // A restarted teacher's first request may be anywhere in a step.
  EXPECT_EQ(checkTagOrder(std::nullopt, tag(9, 7, 2), 4), "");
}

TEST(CheckTagOrder, SkippedAccStepNamesItAndBothTags) {
  std::string why = checkTagOrder(tag(2, 0, 1), tag(3, 0, 3), 4);
  EXPECT_TRUE(has(why, "acc_step 2 skipped")) << why;
  EXPECT_TRUE(has(why, "(step 0, acc_step 3, seq 3)")) << why;
  EXPECT_TRUE(has(why, "(step 0, acc_step 1, seq 2)")) << why;
  EXPECT_TRUE(has(why, "grad_acc_steps=4")) << why;
  why = checkTagOrder(tag(1, 5, 0), tag(2, 5, 3), 8);
  EXPECT_TRUE(has(why, "acc_step 1 to 2 skipped")) << why;
}

TEST(CheckTagOrder, NewStepAfterTheLastAccStep) {
  EXPECT_EQ(checkTagOrder(tag(4, 0, 3), tag(5, 1, 0), 4), "");
  // Steps may jump (a trainer that skips steps without distillation).
  EXPECT_EQ(checkTagOrder(tag(4, 0, 3), tag(5, 3, 0), 4), "");
  EXPECT_EQ(checkTagOrder(tag(1, 0, 0), tag(2, 1, 0), 1), "");
}

TEST(CheckTagOrder, StepEndedEarly) {
  std::string why = checkTagOrder(tag(2, 0, 1), tag(3, 1, 0), 4);
  EXPECT_TRUE(has(why, "step 0 ended at acc_step 1, expected 3")) << why;
  EXPECT_TRUE(has(why, "(step 1, acc_step 0, seq 3)")) << why;
  EXPECT_TRUE(has(why, "(step 0, acc_step 1, seq 2)")) << why;
}

TEST(CheckTagOrder, NewStepMustStartAtZero) {
  std::string why = checkTagOrder(tag(4, 0, 3), tag(5, 1, 1), 4);
  EXPECT_TRUE(has(why, "must start at acc_step 0")) << why;
}

TEST(CheckTagOrder, StepBackAndRepeats) {
  std::string why = checkTagOrder(tag(4, 3, 3), tag(5, 2, 0), 4);
  EXPECT_TRUE(has(why, "step went back")) << why;
  EXPECT_TRUE(has(why, "(step 2, acc_step 0, seq 5) after (step 3, acc_step 3, seq 4)")) << why;
  why = checkTagOrder(tag(4, 3, 1), tag(5, 3, 1), 4);
  EXPECT_TRUE(has(why, "acc_step did not advance")) << why;
  why = checkTagOrder(tag(4, 3, 2), tag(5, 3, 1), 4);
  EXPECT_TRUE(has(why, "acc_step did not advance")) << why;
}

TEST(CheckTagOrder, AccStepOutOfRange) {
  for (int64_t acc : {4, 5, -1}) {
    std::string why = checkTagOrder(std::nullopt, tag(1, 0, acc), 4);
    EXPECT_TRUE(has(why, "acc_step must be in [0, 4)")) << why;
    why = checkTagOrder(tag(1, 0, 3), tag(2, 0, acc), 4);
    EXPECT_TRUE(has(why, "acc_step must be in [0, 4)")) << why;
  }
  EXPECT_NE(checkTagOrder(std::nullopt, tag(1, -1, 0), 4), "");
  EXPECT_NE(checkTagOrder(std::nullopt, tag(1, 0, 1), 1), "");
}

TEST(CheckTagOrder, SeqGap) {
  std::string why = checkTagOrder(tag(2, 0, 1), tag(4, 0, 2), 4);
  EXPECT_TRUE(has(why, "seq 4 does not follow seq 2")) << why;
  why = checkTagOrder(tag(2, 0, 1), tag(2, 0, 2), 4); // repeated seq
  EXPECT_TRUE(has(why, "seq 2 does not follow seq 2")) << why;
}

} // namespace
