// distill::Tag: the one (seq, step, acc_step) type and its one spelling, used by
// the student's errors, the teacher's order check, the hang report and the
// flight recorder alike.
#include <gtest/gtest.h>

#include <sstream>

#include "distill/core/tag.h"

namespace {

TEST(Tag, DescribeSpellsStepAccStepSeq) {
  const distill::Tag t{7, 3, 1};
  EXPECT_EQ(describe(t), "step 3, acc_step 1, seq 7");
  std::ostringstream os;
  os << t;
  EXPECT_EQ(os.str(), "step 3, acc_step 1, seq 7");
}

TEST(Tag, EqualityComparesAllThreeFields) {
  const distill::Tag t{7, 3, 1};
  EXPECT_EQ(t, (distill::Tag{7, 3, 1}));
  EXPECT_NE(t, (distill::Tag{8, 3, 1}));
  EXPECT_NE(t, (distill::Tag{7, 4, 1}));
  EXPECT_NE(t, (distill::Tag{7, 3, 2}));
}

} // namespace
