// Sampled answers in the teacher-output cache (issue 44, "cached like any
// answer"): records keep the ids and int16 counts bit for bit in about
// 4 K bytes per token (ids in uint16 below 65 536 entries); rows the cache
// computes, all or a subset of a batch's, and positions it computes alone
// (prefix keys) draw what they would draw without it; a row answered again
// returns its first draws; a store of other draws (K, temperature, run.seed)
// is refused naming both. Part of teacher_cache_test.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "answer/answer.h"
#include "cache_test_util.h"
#include "distill/core/errors.h"
#include "distill/teacher/model.h"

using namespace cache_testing;
namespace protocol = distill::protocol;

namespace {

constexpr int64_t kK = 8, kVocab = 64, kSeq = 6;
constexpr int64_t kSeed = 11;

// What the server keys request q's row r by in batch `pass` (a tag of its own per pass).
uint64_t rowKey(int pass, size_t q, int64_t r) {
  return distill::sampleKey(kSeed, 0, distill::Tag{uint64_t(pass), int64_t(q), 0}, r);
}

Answer shapeSampled(const at::Tensor& logits, const at::Tensor& keys) {
  distill::TeacherOptions t;
  t.samples = kK;
  distill::ShapeContext c{t, 2.0, keys};
  return distill::shapeAnswer(logits, c);
}

// Request q's answer without the cache: every row shaped with its own key.
Answer direct(const at::Tensor& x, int pass, size_t q) {
  at::Tensor keys = at::empty({x.size(0)}, at::kLong);
  for (int64_t r = 0; r < x.size(0); ++r) keys[r] = int64_t(rowKey(pass, q, r));
  return shapeSampled(tableLogits(x, kVocab), keys);
}

// The server's compute for the cache: the keys of the rows (and, prefix keys,
// the positions) the cache asks for, from computingRows() (pending.cpp's sampleKeys).
struct SampledTeacher {
  TeacherCache* cache = nullptr;
  int pass = 1;
  int64_t rowsComputed = 0;
  TeacherCache::Computed operator()(const std::vector<at::Tensor>& in, const at::Tensor& positions) {
    const auto& rows = cache->computingRows();
    EXPECT_EQ(int64_t(rows.size()), in.at(0).size(0));
    rowsComputed += int64_t(rows.size());
    std::vector<int64_t> keys;
    for (const auto& [q, r] : rows) keys.push_back(int64_t(rowKey(pass, q, r)));
    at::Tensor logits = tableLogits(in.at(0), kVocab);
    if (!positions.defined()) return {shapeSampled(logits, at::tensor(keys, at::kLong)), kVocab};
    std::vector<int64_t> perPosition;
    for (int64_t i = 0; i < positions.numel(); ++i) {
      const int64_t at = positions[i].item<int64_t>();
      perPosition.push_back(int64_t(distill::positionSampleKey(uint64_t(keys.at(size_t(at / kSeq))), at % kSeq)));
    }
    logits = distill::gatherPositions({{protocol::kLogits, logits}}, {}, positions, kSeq).at(protocol::kLogits);
    return {shapeSampled(logits, at::tensor(perPosition, at::kLong)), kVocab};
  }
};

std::vector<Answer> answerAll(TeacherCache& cache, SampledTeacher& teacher, const std::vector<at::Tensor>& requests) {
  std::vector<std::vector<at::Tensor>> in;
  for (const at::Tensor& x : requests) in.push_back({x});
  teacher.cache = &cache;
  return cache.answer(in, TeacherCache::ComputePositions(std::ref(teacher)), at::kCPU);
}

struct Lin : torch::nn::Module {
  Lin() { fc = register_module("fc", torch::nn::Linear(4, 8)); }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};

} // namespace

TEST(TeacherCacheSampled, RecordsKeepIdsAndCountsInFourBytesADraw) {
  for (int64_t vocab : {kVocab, int64_t(1000), int64_t(70000)}) {
    SCOPED_TRACE(vocab);
    at::Tensor logits = at::randn({1, 16, vocab}, at::make_generator<at::CPUGeneratorImpl>(5)) * 3;
    const Answer a = shapeSampled(logits, at::tensor({int64_t(rowKey(1, 0, 0))}, at::kLong));
    const std::string record = distill::encodeRow(a, vocab);
    const Answer b = distill::decodeRow(record.data(), record.size());
    EXPECT_TRUE(bitEqual(a, b)) << "int32 ids and int16 counts back as they were";
    EXPECT_EQ(b.at(protocol::kSampledCounts).scalar_type(), at::kShort);
    EXPECT_EQ(distill::encodeRow(b, vocab), record);
    // 16 tokens x K: ids in 1, 2 or 4 bytes, counts in 2.
    const size_t idBytes = vocab <= 256 ? 1 : vocab <= 65536 ? 2 : 4;
    const size_t payload = 16 * kK * (idBytes + 2);
    EXPECT_GT(record.size(), payload);
    EXPECT_LT(record.size(), payload + 100) << "header overhead";
    // A position record (prefix keys) of one token of it.
    Answer one;
    for (const auto& [name, t] : a) one[name] = t.narrow(1, 3, 1);
    const std::string position = distill::encodeRow(one, vocab, {}, distill::RecordKind::kPosition);
    EXPECT_TRUE(bitEqual(one, distill::decodeRow(position.data(), position.size())));
    EXPECT_LT(position.size(), kK * (idBytes + 2) + 30);
  }
}

// The rows the cache computes (all of a first batch, the new ones of a later
// batch beside hits) draw what they draw without the cache; a row answered
// again returns its first draws, whatever its new request's tag.
TEST(TeacherCacheSampled, ComputedRowsDrawAsWithoutTheCacheAndHitsKeepTheFirstDraws) {
  TempDir dir;
  TeacherCache cache(options(dir.path, "readwrite"), kContext, kNames, 2.0);
  SampledTeacher teacher;
  const at::Tensor a = ids(3, kSeq, 1), b = ids(2, kSeq, 2), fresh = ids(2, kSeq, 3);
  const std::vector<Answer> first = answerAll(cache, teacher, {a, b});
  EXPECT_TRUE(bitEqual(first[0], direct(a, 1, 0)));
  EXPECT_TRUE(bitEqual(first[1], direct(b, 1, 1)));

  // Pass 2, other tags: request 0 is b's row 1 and two new rows, request 1 is a (all hits).
  teacher.pass = 2;
  teacher.rowsComputed = 0;
  const at::Tensor mixed = at::cat({b.narrow(0, 1, 1), fresh}, 0);
  const std::vector<Answer> second = answerAll(cache, teacher, {mixed, a});
  EXPECT_EQ(teacher.rowsComputed, 2) << "only the new rows";
  EXPECT_TRUE(bitEqual(second[1], first[0])) << "hits: the first draws";
  EXPECT_TRUE(bitEqual(rowOf(second[0], 0), rowOf(first[1], 1)));
  EXPECT_FALSE(bitEqual(second[1], direct(a, 2, 1))) << "pass 2's tags would have drawn others";
  // The two new rows, rows 1 and 2 of request 0, as pass 2 draws them without the cache.
  const Answer alone = direct(mixed, 2, 0);
  for (int64_t r : {1, 2}) EXPECT_TRUE(bitEqual(rowOf(second[0], r), rowOf(alone, r))) << r;
}

// Prefix keys: a position shaped alone draws what its row draws at it, so a
// group through prefix keys is bit-equal to the same rows through row keys;
// the group's shared prompt is drawn once, by its first row.
TEST(TeacherCacheSampled, PositionsShapedAloneDrawAsTheirRow) {
  TempDir rowsDir, prefixDir;
  distill::TeacherOptions::CacheOptions o = options(prefixDir.path, "readwrite");
  o.keys = distill::CacheKeys::kPrefix;
  TeacherCache rows(options(rowsDir.path, "readwrite"), kContext, kNames, 2.0), prefix(o, kContext, kNames, 2.0);
  SampledTeacher byRow, byPosition;
  const at::Tensor x = ids(3, kSeq, 7);
  const Answer viaRows = answerAll(rows, byRow, {x}).at(0);
  const Answer viaPrefix = answerAll(prefix, byPosition, {x}).at(0);
  EXPECT_TRUE(bitEqual(viaRows, viaPrefix));

  // Two rows sharing a 4-token prompt: its positions are computed once, from row 0.
  at::Tensor group = ids(2, kSeq, 8);
  group[1].narrow(0, 0, 4).copy_(group[0].narrow(0, 0, 4));
  const Answer g = answerAll(prefix, byPosition, {group}).at(0);
  for (const auto& [name, t] : g) {
    EXPECT_TRUE(bitEqual(t[1].narrow(0, 0, 4), t[0].narrow(0, 0, 4))) << name;
  }
  EXPECT_TRUE(bitEqual(rowOf(g, 0), rowOf(direct(group, 1, 0), 0)));
}

// A store keeps the answer context of the teacher that made it: sampled draws
// of another K, temperature or run.seed, or another kind, are refused at open.
TEST(TeacherCacheSampled, AStoreOfOtherDrawsIsRefusedNamingBoth) {
  torch::manual_seed(3);
  distill::ModuleTeacher<Lin> model(std::make_shared<Lin>(), "logits");
  distill::TeacherOptions k8;
  k8.kind = distill::TeacherKind::kRegistered;
  k8.samples = 8;
  distill::TeacherOptions k16 = k8, top8 = k8;
  k16.samples = 16;
  top8.samples = 0;
  top8.topk = 8;
  const std::string context = distill::answerContext(k8, 2.0, model, "", 42);
  EXPECT_EQ(context, distill::answerContext(k8, 2.0, model, "", 42));
  EXPECT_NE(context, distill::answerContext(k8, 1.0, model, "", 42));
  EXPECT_NE(context, distill::answerContext(k8, 2.0, model, "", 43));
  EXPECT_EQ(distill::answerContext(top8, 2.0, model, "", 42), distill::answerContext(top8, 2.0, model, "", 43))
      << "run.seed keys sampled answers only";

  TempDir dir;
  { TeacherCache writer(options(dir.path, "readwrite"), context, kNames, 2.0); }
  auto refusal = [&](const std::string& other) -> std::string {
    try {
      TeacherCache c(options(dir.path, "readwrite"), other, kNames, 2.0);
    } catch (const distill::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  std::string m = refusal(distill::answerContext(k16, 2.0, model, "", 42));
  EXPECT_NE(m.find("it holds answers of [sampled K=8 temperature 0x1p+1 run.seed 42] where this teacher answers "
                   "[sampled K=16 temperature 0x1p+1 run.seed 42]"),
            std::string::npos)
      << m;
  m = refusal(distill::answerContext(k8, 2.0, model, "", 7));
  EXPECT_NE(m.find("where this teacher answers [sampled K=8 temperature 0x1p+1 run.seed 7]"), std::string::npos) << m;
  m = refusal(distill::answerContext(top8, 2.0, model, "", 42));
  EXPECT_NE(m.find("[sampled K=8 temperature 0x1p+1 run.seed 42] where this teacher answers [topk 8 temperature"),
            std::string::npos)
      << m;
}
