// The teacher-output cache with prefix keys (teacher.cache.keys: prefix,
// teacher/src/cache/cache.h): an on-policy group's prompt answered once, the same
// bytes as row keys give, positions counted, a later group of the same prompt
// (same store, and the store reopened) computing only its new responses, and
// the misuses that can be detected named by the key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cstring>

#include "cache/cache.h"
#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/teacher/server.h"
#include "cache_store_dir.h"
#include "support/process.h"

using distill::Answer;
using distill::TeacherCache;
namespace dt = distill::testing;

namespace {

constexpr int64_t kVocab = 64, kDim = 16, kP = 12, kR = 5, kG = 4, kPad = 0;
const std::vector<std::string> kNames = {"input_ids"};
const std::string kContext = "prefix test context";

using TempDir = dt::CacheStoreDir;

distill::TeacherOptions::CacheOptions options(const std::string& path, const std::string& keys,
                                              const std::string& mode = "readwrite") {
  distill::TeacherOptions::CacheOptions o;
  o.path = path;
  o.mode = *distill::parseEnum<distill::CacheMode>(mode);
  o.max_bytes = int64_t(64) << 20;
  o.keys = *distill::parseEnum<distill::CacheKeys>(keys);
  return o;
}

// A causal teacher: embedding, cumulative mean over the positions, linear.
// Its answer at position t depends on ids[0..t] alone, bit for bit.
at::Tensor causalLogits(const at::Tensor& ids) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(4242);
  static const at::Tensor emb = at::randn({kVocab, kDim}, g, at::kFloat);
  static const at::Tensor w = at::randn({kDim, kVocab}, g, at::kFloat) * 3;
  at::Tensor x = emb.index_select(0, ids.reshape(-1)).view({ids.size(0), ids.size(1), kDim});
  at::Tensor n = at::arange(1, ids.size(1) + 1, at::kFloat).view({1, -1, 1});
  return at::matmul(x.cumsum(1) / n, w);
}

// G rows of one prompt, each a response of its own (row 1: length 0, padding).
at::Tensor group(const at::Tensor& prompt, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor responses = at::randint(1, kVocab, {kG, kR}, g, at::kLong);
  // First response tokens distinct across groups: no new response shares a prefix with an old one.
  responses.select(1, 0).copy_(at::arange(1, kG + 1, at::kLong) + kG * int64_t(seed));
  responses[1].fill_(kPad);
  return at::cat({prompt.expand({kG, kP}), responses}, 1).contiguous();
}

at::Tensor prompt(uint64_t seed) {
  return at::randint(1, kVocab, {1, kP}, at::make_generator<at::CPUGeneratorImpl>(seed), at::kLong);
}

bool bitEqual(const Answer& a, const Answer& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) return false;
    at::Tensor x = t.contiguous(), y = it->second.contiguous();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes() ||
        std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

// Answers with the positions the cache asks for: shaped (top-k k, or full logits) only there.
struct Teacher {
  int64_t k;
  int forwards = 0;
  int64_t shapedPositions = 0;
  TeacherCache::Computed operator()(const std::vector<at::Tensor>& in, const at::Tensor& positions) {
    ++forwards;
    std::map<std::string, at::Tensor> raw{{distill::protocol::kLogits, causalLogits(in.at(0))}};
    if (positions.defined()) raw = distill::gatherPositions(raw, {}, positions, in[0].size(1));
    at::Tensor logits = raw.at(distill::protocol::kLogits);
    shapedPositions += logits.size(0) * logits.size(1);
    if (k == 0) return {{{distill::protocol::kLogits, logits}}, kVocab};
    return {distill::topkOutput(logits, k, 2.0), kVocab};
  }
};

Answer answerOne(TeacherCache& cache, Teacher& teacher, const at::Tensor& rows) {
  return cache.answer({{rows}}, TeacherCache::ComputePositions(std::ref(teacher)), at::kCPU).at(0);
}

} // namespace

// (a), (b): a group through prefix keys is bit-equal to row keys (top-k and
// full logits); the first group computes P + G * R positions, a second group
// of the same prompt only its new responses' positions (its prompt from the
// store), in the same store and after it is reopened; a group answered before
// needs no forward. Row 1 of every group (a response of length 0: the prompt,
// then padding) is the same row in every group: answered from the store after
// the first.
TEST(TeacherCachePrefix, GroupsShareTheirPromptBitEqualToRowKeys) {
  for (int64_t k : {int64_t(8), int64_t(0)}) {
    SCOPED_TRACE("topk " + std::to_string(k));
    TempDir rowDir, prefixDir;
    TeacherCache rows(options(rowDir.path, "row"), kContext, kNames, 2.0);
    Teacher rowTeacher{k}, prefixTeacher{k};
    const at::Tensor p = prompt(11), first = group(p, 1), second = group(p, 2), third = group(p, 3);
    {
      TeacherCache prefix(options(prefixDir.path, "prefix"), kContext, kNames, 2.0);
      EXPECT_TRUE(bitEqual(answerOne(prefix, prefixTeacher, first), answerOne(rows, rowTeacher, first)));
      EXPECT_EQ(prefix.stats().positions, kG * (kP + kR));
      EXPECT_EQ(prefix.stats().positionHits, 0);
      EXPECT_EQ(prefix.stats().positionsComputed, kP + kG * kR);
      EXPECT_EQ(prefixTeacher.shapedPositions, kP + kG * kR) << "only the missing positions are shaped";
      EXPECT_EQ(prefix.stats().inserted, kP + kG * kR);

      EXPECT_TRUE(bitEqual(answerOne(prefix, prefixTeacher, second), answerOne(rows, rowTeacher, second)));
      EXPECT_EQ(prefix.stats().positionHits, kG * kP + kR);
      EXPECT_EQ(prefix.stats().positionsComputed, kP + kG * kR + (kG - 1) * kR);
      EXPECT_EQ(prefixTeacher.shapedPositions, kP + kG * kR + (kG - 1) * kR);
      EXPECT_EQ(prefix.stats().forwards, 2);
      EXPECT_EQ(prefix.stats().hits, 1); // row 1

      // The first group again: every row hit, no forward.
      EXPECT_TRUE(bitEqual(answerOne(prefix, prefixTeacher, first), answerOne(rows, rowTeacher, first)));
      EXPECT_EQ(prefix.stats().forwards, 2);
      EXPECT_EQ(prefix.stats().hits, 1 + kG);
      EXPECT_NE(prefix.summary().find("prefix keys: " + std::to_string(3 * kG * (kP + kR)) + " positions, " +
                                      std::to_string(kG * kP + kR + kG * (kP + kR)) + " hits, " +
                                      std::to_string(kP + kG * kR + (kG - 1) * kR) + " computed"),
                std::string::npos)
          << prefix.summary();
    }
    // A later run (the store reopened): the prompt is found, the new responses computed.
    TeacherCache reopened(options(prefixDir.path, "prefix"), kContext, kNames, 2.0);
    EXPECT_TRUE(bitEqual(answerOne(reopened, prefixTeacher, third), answerOne(rows, rowTeacher, third)));
    EXPECT_EQ(reopened.stats().positionHits, kG * kP + kR);
    EXPECT_EQ(reopened.stats().positionsComputed, (kG - 1) * kR);
    // Row keys stored every position of 10 rows (4 + 3 + 3); prefix keys each distinct prefix once.
    EXPECT_EQ(rows.stats().insertedTokens, (kG + 2 * (kG - 1)) * (kP + kR));
  }
}

// Rows of several requests in one batch: each distinct position computed once,
// every row in its request's order; a request of other rows than a group too.
TEST(TeacherCachePrefix, RequestsOfOneBatchShareAndKeepTheirOrder) {
  TempDir rowDir, prefixDir;
  TeacherCache rows(options(rowDir.path, "row"), kContext, kNames, 2.0);
  TeacherCache prefix(options(prefixDir.path, "prefix"), kContext, kNames, 2.0);
  Teacher rowTeacher{8}, prefixTeacher{8};
  const at::Tensor a = group(prompt(21), 4), b = group(prompt(22), 5);
  const std::vector<std::vector<at::Tensor>> requests = {{a.narrow(0, 0, 2)}, {b}, {a.narrow(0, 2, 2)}};
  auto viaPrefix = prefix.answer(requests, TeacherCache::ComputePositions(std::ref(prefixTeacher)), at::kCPU);
  auto viaRows = rows.answer(requests, TeacherCache::ComputePositions(std::ref(rowTeacher)), at::kCPU);
  ASSERT_EQ(viaPrefix.size(), 3u);
  for (size_t q = 0; q < 3; ++q) EXPECT_TRUE(bitEqual(viaPrefix[q], viaRows[q])) << "request " << q;
  EXPECT_EQ(prefix.stats().positionsComputed, 2 * (kP + kG * kR));
  EXPECT_EQ(prefixTeacher.forwards, 1);
}

// (c) What can be detected of a teacher that is not answered per position:
// inputs without a sequence dimension, inputs of different lengths, an output
// without one: a ProtocolError naming teacher.cache.keys.
TEST(TeacherCachePrefix, MisuseIsAnErrorNamingTheKey) {
  TempDir dir;
  TeacherCache cache(options(dir.path, "prefix"), kContext, {"input_ids", "attention_mask"}, 2.0);
  Teacher teacher{8};
  auto expectKeyNamed = [&](const std::vector<at::Tensor>& in, const std::string& what) {
    try {
      cache.answer({in}, TeacherCache::ComputePositions(std::ref(teacher)), at::kCPU);
      ADD_FAILURE() << "no error for " << what;
    } catch (const distill::ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find("teacher.cache.keys"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const at::Tensor ids = group(prompt(31), 6);
  expectKeyNamed({ids.select(1, 0).contiguous(), ids.select(1, 0).contiguous()}, "input 'input_ids' has shape [4]");
  expectKeyNamed({ids, at::ones({kG, kP}, at::kLong)},
                 "input 'attention_mask' has shape [4, 12], input 'input_ids' [4, 17]");
  EXPECT_NE(distill::prefixInputsProblem({"input_ids", "attention_mask"}, {ids, at::ones({kG, 3}, at::kLong)}), "");
  EXPECT_EQ(distill::prefixInputsProblem({"input_ids", "attention_mask"}, {ids, at::ones_like(ids)}), "");

  // A teacher answering one vector per row ([B, V], no positions).
  TeacherCache one(options(dir.path + "-pooled", "prefix"), kContext, kNames, 2.0);
  auto pooled = [](const std::vector<at::Tensor>& in) {
    return TeacherCache::Computed{{{distill::protocol::kLogits, causalLogits(in[0]).mean(1)}}, kVocab};
  };
  try {
    one.answer({{ids}}, pooled, at::kCPU);
    ADD_FAILURE() << "no error for an output without positions";
  } catch (const distill::ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("teacher.cache.keys: prefix keys answers per position, but the teacher's "
                                         "output 'logits' has shape [4, 64] for inputs of 17 positions"),
              std::string::npos)
        << e.what();
  }
  ::unlink((dir.path + "-pooled/data.mdb").c_str());
  ::unlink((dir.path + "-pooled/lock.mdb").c_str());
  ::rmdir((dir.path + "-pooled").c_str());
}

// A position's record (RecordKind::kPosition): every tensor back bit-equal in
// its dtype and shape [1, 1, ...] (float16 values, uint8 and uint16 indices, a
// value float16 cannot hold kept float32, a hidden state under its own name),
// about a third of a row layout's bytes for a top-8 position, sealed by its
// CRC32C like a row's, and a short record an error, never a wild read.
TEST(TeacherCachePrefix, PositionRecordsRoundTripCompactly) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  for (int64_t vocab : {int64_t(64), int64_t(1000), int64_t(100000)}) {
    Answer a = distill::topkOutput(at::randn({1, 1, vocab}, g, at::kFloat) * 4, 8, 2.0);
    distill::roundForStorage(a, 2.0);
    a["layer_3"] = at::randn({1, 1, 5}, g, at::kFloat);
    const distill::CacheKey key{{7}};
    const std::string record = distill::encodeRow(a, vocab, key, distill::RecordKind::kPosition);
    EXPECT_TRUE(bitEqual(distill::decodeRow(record.data(), record.size()), a)) << "vocab " << vocab;
    EXPECT_TRUE(distill::recordIntact(key, record.data(), record.size()));
    EXPECT_FALSE(distill::recordIntact(distill::CacheKey{{8}}, record.data(), record.size()));
    std::string flipped = record;
    flipped.back() ^= 1;
    EXPECT_FALSE(distill::recordIntact(key, flipped.data(), flipped.size()));
    EXPECT_THROW(distill::decodeRow(record.data(), record.size() - 1), distill::IpcError);
    a.erase("layer_3");
    const size_t compact = distill::encodeRow(a, vocab, key, distill::RecordKind::kPosition).size();
    const size_t asRow = distill::encodeRow(a, vocab, key).size();
    if (vocab == 64) {
      EXPECT_LE(compact, 66u) << "a top-8 position with uint8 indices";
    }
    EXPECT_LE(compact * 2, asRow) << "vocab " << vocab;
  }
  Answer big{{distill::protocol::kLogits, at::full({1, 1, 4}, 1e6f)}};
  const std::string record = distill::encodeRow(big, 4, {}, distill::RecordKind::kPosition);
  EXPECT_TRUE(bitEqual(distill::decodeRow(record.data(), record.size()), big));
}
