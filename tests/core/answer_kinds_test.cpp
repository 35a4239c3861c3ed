// The answer kinds table (core/answer_kinds.h): each kind's bytes per token
// are what the payload sizes took before the table owned them, and a
// response's tensors are checked against the kind it says it is.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "distill/core/answer_kinds.h"
#include "distill/core/payload.h"

namespace {

using distill::AnswerKind;
using distill::TensorFacts;
namespace protocol = distill::protocol;

int64_t aligned(int64_t n) { return (n + 63) / 64 * 64; }

TEST(AnswerKinds, BytesPerTokenAreTheKindsTensors) {
  distill::TeacherOptions t;
  t.vocab_size = 1000;
  t.payload_dtype = distill::PayloadDtype::kBFloat16;
  EXPECT_EQ(distill::answerKindOf(t), AnswerKind::kLogits);
  EXPECT_EQ(distill::answerBytes(t, 10, 64), aligned(10 * 1000 * 2));
  EXPECT_EQ(distill::answerBytesPerToken(t), 2000.0);
  t.topk = 8;
  EXPECT_EQ(distill::answerKindOf(t), AnswerKind::kTopk);
  EXPECT_EQ(distill::answerBytes(t, 10, 64), aligned(10 * 8 * 2) + aligned(10 * 8 * 4) + 2 * aligned(10 * 4));
  EXPECT_EQ(distill::answerBytesPerToken(t), double(8 * (2 + 4) + 8));
  t.samples = 8; // sampled: K int32 ids + K int16 counts, whatever teacher.topk says
  EXPECT_EQ(distill::answerKindOf(t), AnswerKind::kSampled);
  EXPECT_EQ(distill::answerBytesPerToken(t), double(8 * 6));
  EXPECT_EQ(distill::answerBytes(t, 10, 64), aligned(10 * 8 * 4) + aligned(10 * 8 * 2));
  EXPECT_EQ(distill::describeAnswer(t), "sampled K=8");
  t.samples = 0;
  t.topk = 0;
  t.vocab_size = 0;
  EXPECT_EQ(distill::answerBytes(t, 10, 64), 0) << "full logits of an unknown vocabulary";
}

TEST(AnswerKinds, EveryKindHasARowAndItsMaskedTensor) {
  for (const auto& k : distill::answerKinds()) {
    EXPECT_EQ(distill::findAnswerKind(static_cast<uint8_t>(k.kind)), &k);
    bool masked = false;
    for (const auto& a : k.tensors) masked = masked || std::string(a.name) == k.masked;
    EXPECT_TRUE(masked) << k.name;
  }
  EXPECT_EQ(distill::findAnswerKind(0), nullptr);
  EXPECT_EQ(distill::findAnswerKind(99), nullptr);
}

// The teacher cache stores a position record's tensor names as their index in
// the table's order (teacher/src/cache/records.cpp): today's tensors keep their
// codes 1-11 for the stores written so far (sampled ids and counts, 10 and 11,
// since sampled answers are cached); a new kind's tensors come after them.
TEST(AnswerKinds, TheTablesFirstTensorsKeepTheCacheNameCodes) {
  std::vector<std::string> names;
  for (const auto& k : distill::answerKinds()) {
    for (const auto& a : k.tensors) names.push_back(a.name);
  }
  const std::vector<std::string> stored = {protocol::kLogits,     protocol::kTopkValues,   protocol::kTopkIndices,
                                           protocol::kLogsumexp,  protocol::kLogTail,      protocol::kHidden,
                                           protocol::kIdsValues,  protocol::kLogsumexp,    protocol::kLogTail,
                                           protocol::kSampledIds, protocol::kSampledCounts};
  ASSERT_GE(names.size(), stored.size());
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + int64_t(stored.size())), stored);
}

TEST(AnswerKinds, AResponseMustMatchItsKind) {
  const uint8_t topk = static_cast<uint8_t>(AnswerKind::kTopk);
  const uint8_t logits = static_cast<uint8_t>(AnswerKind::kLogits);
  std::vector<TensorFacts> sent{{protocol::kTopkValues, c10::kHalf, {2, 3, 8}},
                                {protocol::kTopkIndices, c10::kInt, {2, 3, 8}},
                                {protocol::kLogsumexp, c10::kFloat, {2, 3}},
                                {protocol::kLogTail, c10::kFloat, {2, 3}}};
  EXPECT_EQ(distill::answerMismatch(topk, sent), "");
  EXPECT_NE(distill::answerMismatch(logits, sent).find("no tensor 'logits'"), std::string::npos);
  EXPECT_NE(distill::answerMismatch(7, sent).find("unknown kind 7"), std::string::npos);
  auto wrong = sent;
  wrong[1].dtype = c10::kLong;
  EXPECT_NE(distill::answerMismatch(topk, wrong).find("'topk_indices' is Long, expected int32"), std::string::npos)
      << distill::answerMismatch(topk, wrong);
  wrong = sent;
  wrong[2].shape = {2, 4};
  EXPECT_NE(distill::answerMismatch(topk, wrong).find("'logsumexp' has shape [2, 4]"), std::string::npos);
  const uint8_t sampled = static_cast<uint8_t>(AnswerKind::kSampled);
  std::vector<TensorFacts> draws{{protocol::kSampledIds, c10::kInt, {2, 3, 8}},
                                 {protocol::kSampledCounts, c10::kShort, {2, 3, 8}}};
  EXPECT_EQ(distill::answerMismatch(sampled, draws), "");
  draws[1].dtype = c10::kInt;
  EXPECT_NE(distill::answerMismatch(sampled, draws).find("expected int16"), std::string::npos);
  const uint8_t ids = static_cast<uint8_t>(AnswerKind::kIds);
  std::vector<TensorFacts> atIds{{protocol::kIdsValues, c10::kBFloat16, {2, 3, 1}},
                                 {protocol::kLogsumexp, c10::kFloat, {2, 3}}};
  EXPECT_EQ(distill::answerMismatch(ids, atIds), "") << "the log tail is optional";
  atIds.pop_back();
  EXPECT_NE(distill::answerMismatch(ids, atIds).find("no tensor 'logsumexp'"), std::string::npos);
  std::vector<TensorFacts> dense{{protocol::kLogits, c10::kFloat, {2, 3, 50}}, {"h", c10::kFloat, {2, 3, 16}}};
  EXPECT_EQ(distill::answerMismatch(logits, dense), "") << "hidden states ride along";
}

} // namespace

// Issue 43: the hidden-state kind answers d_t payload values per token (the
// head travels once, beside the segment), its code is 3, and its one tensor
// has the code after the five stored ones.
TEST(AnswerKinds, HiddenStatesAreDPayloadValuesPerToken) {
  distill::TeacherOptions t;
  t.answer = distill::TeacherAnswer::kHidden;
  t.hidden_size = 4096;
  t.vocab_size = 128256;
  t.payload_dtype = distill::PayloadDtype::kBFloat16;
  EXPECT_EQ(distill::answerKindOf(t), AnswerKind::kHidden);
  EXPECT_EQ(static_cast<int>(AnswerKind::kHidden), 3);
  EXPECT_EQ(distill::answerBytesPerToken(t), 8192.0);
  EXPECT_EQ(distill::answerBytes(t, 10, 64), aligned(10 * 4096 * 2));
  t.hidden_size = 0;
  EXPECT_EQ(distill::answerBytes(t, 10, 64), 0) << "hidden states of an unknown width";
  const uint8_t hidden = static_cast<uint8_t>(AnswerKind::kHidden);
  EXPECT_EQ(distill::answerMismatch(hidden, {{protocol::kHidden, c10::kBFloat16, {2, 3, 16}}}), "");
  EXPECT_NE(distill::answerMismatch(hidden, {{protocol::kHidden, c10::kLong, {2, 3, 16}}}).find("'hidden' is Long"),
            std::string::npos);
  EXPECT_NE(distill::answerMismatch(hidden, {{protocol::kHidden, c10::kFloat, {2, 3, 16}}, {"h", c10::kFloat, {2, 3}}})
                .find("'h' is not one of its kind"),
            std::string::npos)
      << "nothing rides along with the hidden states";
  std::vector<std::string> names;
  for (const auto& k : distill::answerKinds()) {
    for (const auto& a : k.tensors) names.push_back(a.name);
  }
  ASSERT_GE(names.size(), 6u);
  EXPECT_EQ(names[5], protocol::kHidden);
}
