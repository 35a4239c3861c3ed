// The shapers of issue 44's answers (teacher/src/answer/): ids answers are a
// gather from the full logits, bit for bit, with the logsumexp and log tail
// of the top-k shaper; sampled answers are reproducible from (seed, student,
// tag, row, position), differ for another, draw nothing of probability 0, and
// their counts / K average to the teacher's softmax at the loss temperature.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <set>

#include "answer/answer.h"
#include "distill/core/errors.h"
#include "distill/teacher/server.h"

namespace distill {
namespace {

at::Tensor logitsFor(uint64_t seed, std::vector<int64_t> shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kFloat) * 3;
}

TEST(Shapers, IdsAreAGatherFromTheFullLogitsBitForBit) {
  const at::Tensor logits = logitsFor(1, {2, 5, 50});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  at::Tensor ids = at::empty({2, 5, 4}, at::kInt);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < 5; ++t) ids[b][t].copy_(at::randperm(50, gen, at::kLong).narrow(0, 0, 4));
  }
  for (PayloadDtype pd : {PayloadDtype::kFloat32, PayloadDtype::kBFloat16}) {
    TeacherOptions opt;
    opt.payload_dtype = pd;
    const double temp = 1.7;
    Answer a = shapeIds(logits, ids, ShapeContext{opt, temp, {}});
    const at::Tensor& v = a.at(protocol::kIdsValues);
    const at::ScalarType dt = pd == PayloadDtype::kFloat32 ? at::kFloat : at::kBFloat16;
    ASSERT_EQ(v.scalar_type(), dt);
    ASSERT_EQ(v.sizes(), ids.sizes());
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t t = 0; t < 5; ++t) {
        for (int64_t j = 0; j < 4; ++j) {
          // Indexing the full logits, in the payload dtype.
          at::Tensor want = logits[b][t][ids[b][t][j].item<int64_t>()].to(dt);
          EXPECT_TRUE(at::equal(v[b][t][j], want)) << b << " " << t << " " << j;
        }
      }
    }
    at::Tensor scaled = logits / temp;
    at::Tensor tail = at::logsumexp(scaled.scatter(-1, ids.to(at::kLong), -INFINITY), -1);
    EXPECT_TRUE(at::equal(a.at(protocol::kLogTail), tail));
    if (pd == PayloadDtype::kFloat32) {
      EXPECT_TRUE(at::equal(a.at(protocol::kLogsumexp), at::logsumexp(scaled, -1)));
    } else { // the rounded values' buckets sum to 1
      at::Tensor lse = at::logaddexp(at::logsumexp(v.to(at::kFloat) / temp, -1), tail);
      EXPECT_TRUE(at::equal(a.at(protocol::kLogsumexp), lse));
    }
  }
  TeacherOptions opt;
  EXPECT_THROW(shapeIds(logits, ids.add(50), ShapeContext{opt, 1.0, {}}), ProtocolError) << "ids beyond V";
  EXPECT_THROW(shapeIds(logits, ids.narrow(1, 0, 4), ShapeContext{opt, 1.0, {}}), ProtocolError) << "other positions";
}

Answer sampled(const at::Tensor& logits, int64_t k, const at::Tensor& keys, double temp = 1.0) {
  TeacherOptions opt;
  opt.samples = k;
  ShapeContext c{opt, temp, {}};
  c.rowKeys = keys;
  return shapeAnswer(logits, c);
}

TEST(Shapers, SampledDrawsAreReproducibleFromSeedTagRowAndPosition) {
  at::Tensor logits = logitsFor(3, {3, 7, 40});
  logits.select(-1, 5).fill_(-std::numeric_limits<float>::infinity()); // never drawn
  auto keysFor = [](int64_t seed, Tag tag) {
    at::Tensor k = at::empty({3}, at::kLong);
    for (int64_t r = 0; r < 3; ++r) k[r] = static_cast<int64_t>(sampleKey(seed, 1, tag, r));
    return k;
  };
  const Tag tag{7, 2, 1};
  Answer a = sampled(logits, 16, keysFor(11, tag));
  Answer again = sampled(logits.clone(), 16, keysFor(11, tag));
  EXPECT_TRUE(at::equal(a.at(protocol::kSampledIds), again.at(protocol::kSampledIds)));
  EXPECT_TRUE(at::equal(a.at(protocol::kSampledCounts), again.at(protocol::kSampledCounts)));
  // One row alone (another batch) draws what it drew in the batch.
  Answer alone = sampled(logits.narrow(0, 1, 1), 16, keysFor(11, tag).narrow(0, 1, 1));
  EXPECT_TRUE(at::equal(alone.at(protocol::kSampledIds)[0], a.at(protocol::kSampledIds)[1]));
  for (Tag other : {Tag{8, 2, 1}, Tag{7, 3, 1}, Tag{7, 2, 0}}) {
    Answer b = sampled(logits, 16, keysFor(11, other));
    EXPECT_FALSE(at::equal(a.at(protocol::kSampledIds), b.at(protocol::kSampledIds))) << describe(other);
  }
  EXPECT_FALSE(at::equal(a.at(protocol::kSampledIds), sampled(logits, 16, keysFor(12, tag)).at(protocol::kSampledIds)));
  EXPECT_NE(sampleKey(11, 1, tag, 0), sampleKey(11, 2, tag, 0)) << "another student";

  const at::Tensor ids = a.at(protocol::kSampledIds), counts = a.at(protocol::kSampledCounts);
  ASSERT_EQ(ids.scalar_type(), at::kInt);
  ASSERT_EQ(counts.scalar_type(), at::kShort);
  ASSERT_EQ(ids.sizes(), (std::vector<int64_t>{3, 7, 16}));
  EXPECT_TRUE((counts.to(at::kLong).sum(-1) == 16).all().item<bool>());
  EXPECT_FALSE(((ids == 5) & (counts > 0)).any().item<bool>()) << "probability 0 drawn";
  at::Tensor fi = ids.reshape({21, 16}), fc = counts.reshape({21, 16});
  for (int64_t r = 0; r < 21; ++r) { // ascending unique ids, then padding of count 0
    int64_t last = -1;
    for (int64_t j = 0; j < 16 && fc[r][j].item<int>() > 0; ++j) {
      EXPECT_GT(fi[r][j].item<int64_t>(), last);
      last = fi[r][j].item<int64_t>();
    }
  }
}

// counts / K averaged over many positions with the same logits converges to softmax(logits / T).
TEST(Shapers, SampledCountsEstimateTheSoftmaxAtTheTemperature) {
  const int64_t v = 30, positions = 4000, k = 16;
  const double temp = 2.0;
  at::Tensor row = logitsFor(4, {v});
  at::Tensor logits = row.expand({1, positions, v}).contiguous();
  Answer a = sampled(logits, k, at::full({1}, 99, at::kLong), temp);
  at::Tensor est = at::zeros({v}, at::kDouble);
  est.scatter_add_(0, a.at(protocol::kSampledIds).reshape({-1}).to(at::kLong),
                   a.at(protocol::kSampledCounts).reshape({-1}).to(at::kDouble));
  est.div_(double(positions * k));
  at::Tensor q = at::softmax(row.to(at::kDouble) / temp, 0);
  // 5 standard errors per id: sqrt(q (1 - q) / (K positions)).
  at::Tensor tol = (q * (1 - q) / double(positions * k)).sqrt() * 5;
  EXPECT_TRUE(((est - q).abs() <= tol).all().item<bool>()) << (est - q).abs().max().item<double>();
  at::Tensor atT1 = at::softmax(row.to(at::kDouble), 0);
  EXPECT_FALSE(((est - atT1).abs() <= tol).all().item<bool>()) << "drawn at T = 1, not the loss temperature";
}

} // namespace
} // namespace distill
