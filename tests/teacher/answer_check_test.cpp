// teacher.on_nonfinite's check (teacher/src/answer_check.h): -inf is legal,
// NaN and +inf are found and described by row, position and count, relative to
// a request's rows; masked tokens are marked as core/answer_kinds.h says.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "answer_check.h"
#include "distill/core/answer_kinds.h"
#include "distill/teacher/server.h"

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

TEST(AnswerCheck, MinusInfinityIsLegal) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    at::Tensor x = at::randn({3, 4, 16}).to(dtype);
    x[1][2].fill_(-kInf);
    EXPECT_FALSE(distill::findNonfinite(x).has_value()) << dtype;
  }
}

TEST(AnswerCheck, NanAndPlusInfinityAreFoundByRowAndPosition) {
  at::Tensor x = at::randn({3, 4, 16});
  x[0][2][7] = kInf;
  x[1][3][5] = kNan;
  x[1][3][6] = kNan;
  const auto nf = distill::findNonfinite(x);
  ASSERT_TRUE(nf.has_value());
  EXPECT_EQ(nf->values, 3);
  EXPECT_EQ(nf->count, 2);
  EXPECT_EQ(distill::describeNonfinite(x, *nf, 0, 3),
            "3 value(s) NaN or +inf in 2 token(s), the first at row 0, position 2 (+inf)");
  // A request of rows 1..2 of the batch: its own rows, counted from 0.
  EXPECT_EQ(distill::describeNonfinite(x, *nf, 1, 2),
            "2 value(s) NaN or +inf in 1 token(s), the first at row 0, position 3 (nan)");
  EXPECT_EQ(distill::describeNonfinite(x, *nf, 2, 1), "");
  EXPECT_EQ(distill::nonfiniteTokens(*nf, 1, 2), 1);
  // A float16 forward that overflowed: +inf in half.
  at::Tensor h = at::randn({2, 4, 16}).to(at::kHalf);
  h[1][0][0] = 70000.0; // past 65504
  ASSERT_TRUE(distill::findNonfinite(h).has_value());
}

TEST(AnswerCheck, MaskedTokensAreMarkedInFullAndTopkAnswers) {
  at::Tensor x = at::randn({2, 4, 16});
  x[1][2][3] = kNan;
  const auto nf = distill::findNonfinite(x);
  ASSERT_TRUE(nf.has_value());
  at::Tensor zeroed = x;
  distill::zeroNonfinite(zeroed, *nf);
  EXPECT_TRUE(at::isnan(x[1][2][3]).item<bool>()) << "the model's output is left as it is";
  EXPECT_FALSE(distill::findNonfinite(zeroed).has_value());
  std::map<std::string, at::Tensor> full{{distill::protocol::kLogits, zeroed.clone()}};
  distill::markMasked(full, distill::AnswerKind::kLogits, *nf);
  const at::Tensor rows = at::isnan(full.at(distill::protocol::kLogits)).all(-1);
  EXPECT_TRUE(at::equal(rows, nf->tokens));
  auto topk = distill::topkOutput(zeroed, 4, 1.0, at::kFloat);
  distill::markMasked(topk, distill::AnswerKind::kTopk, *nf);
  EXPECT_TRUE(at::equal(at::isnan(topk.at(distill::protocol::kLogsumexp)), nf->tokens));
  EXPECT_FALSE(at::isnan(topk.at(distill::protocol::kTopkValues)).any().item<bool>());
}

} // namespace
