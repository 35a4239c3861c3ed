// The teacher-output cache (teacher/src/cache/cache.h, issue 16): row keys, the
// answer context, the compact encoding, the LMDB store in one process, and a
// writer SIGKILLed mid-write (a real process, fork+exec of this binary). One
// test, teacher_cache_test, with the store's integrity in cache_integrity_test.cpp.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <lmdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "cache/cache.h"
#include "cache_store_dir.h"
#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/student/losses.h"
#include "distill/teacher/server.h"
#include "support/roles.h"
#include "cache_test_util.h"

using distill::Answer;
using distill::CacheKey;
using distill::TeacherCache;
namespace dt = distill::testing;
using namespace cache_testing;

namespace {

TEST(TeacherCacheKeys, SameRowSameKeyAnywhere) {
  at::Tensor a = ids(4, 16, 1);
  // Row 2 of a batch of 4; the same row alone; the same row at position 0 of a batch of 3.
  at::Tensor alone = a.narrow(0, 2, 1).clone();
  at::Tensor other = at::cat({a.narrow(0, 2, 1), ids(2, 16, 9)}, 0);
  const CacheKey k = distill::rowKey(kContext, kNames, {a}, 2);
  EXPECT_EQ(k, distill::rowKey(kContext, kNames, {alone}, 0));
  EXPECT_EQ(k, distill::rowKey(kContext, kNames, {other}, 0));
  // Anything else: another row, context, name, dtype, trailing shape.
  EXPECT_NE(k, distill::rowKey(kContext, kNames, {a}, 1));
  EXPECT_NE(k, distill::rowKey(kContext + " ", kNames, {a}, 2));
  EXPECT_NE(k, distill::rowKey(kContext, {"tokens"}, {a}, 2));
  EXPECT_NE(k, distill::rowKey(kContext, kNames, {a.to(at::kInt)}, 2));
  EXPECT_NE(k, distill::rowKey(kContext, kNames, {a.view({4, 4, 4})}, 2));
  // Every input counts.
  at::Tensor mask = at::ones({4, 16}, at::kLong);
  const CacheKey two = distill::rowKey(kContext, {"input_ids", "mask"}, {a, mask}, 2);
  mask[2][5] = 0;
  EXPECT_NE(two, distill::rowKey(kContext, {"input_ids", "mask"}, {a, mask}, 2));
}

struct Lin : torch::nn::Module {
  Lin() { fc = register_module("fc", torch::nn::Linear(4, 8)); }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};

TEST(TeacherCacheKeys, ContextNamesEverythingThatShapesTheAnswer) {
  torch::manual_seed(1);
  auto lin = std::make_shared<Lin>();
  distill::ModuleTeacher<Lin> model(lin, "logits");
  distill::TeacherOptions t;
  t.kind = distill::TeacherKind::kRegistered;
  const std::string base = distill::answerContext(t, 1.0, model);
  EXPECT_EQ(base, distill::answerContext(t, 1.0, model));
  // Full logits do not depend on the loss temperature; top-k answers do.
  EXPECT_EQ(base, distill::answerContext(t, 2.0, model));
  distill::TeacherOptions k8 = t;
  k8.topk = 8;
  EXPECT_NE(base, distill::answerContext(k8, 1.0, model));
  EXPECT_NE(distill::answerContext(k8, 1.0, model), distill::answerContext(k8, 2.0, model));
  distill::TeacherOptions k4 = k8;
  k4.topk = 4;
  EXPECT_NE(distill::answerContext(k8, 1.0, model), distill::answerContext(k4, 1.0, model));
  for (auto change : std::vector<std::function<void(distill::TeacherOptions&)>>{
           [](auto& o) { o.hidden_states = {"h"}; }, [](auto& o) { o.autocast = distill::Autocast::kBFloat16; },
           [](auto& o) { o.device = "cuda"; }, [](auto& o) { o.output = "out"; }, [](auto& o) { o.method = "score"; },
           [](auto& o) { o.payload_dtype = distill::PayloadDtype::kBFloat16; }}) {
    distill::TeacherOptions o = t;
    change(o);
    EXPECT_NE(base, distill::answerContext(o, 1.0, model));
  }
  // Other weights: one parameter changed by one ulp.
  {
    torch::NoGradGuard g;
    auto w = lin->fc->bias.data();
    w[3] = std::nextafter(w[3].item<float>(), 1e9f);
  }
  EXPECT_NE(base, distill::answerContext(t, 1.0, model));
  // A model with nothing to fingerprint is refused, naming the key.
  auto fn = distill::teacherFromFunction([](const std::vector<at::Tensor>& in) { return in[0]; });
  try {
    distill::answerContext(t, 1.0, *fn);
    ADD_FAILURE() << "no ConfigError";
  } catch (const distill::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("teacher.cache"), std::string::npos) << e.what();
  }
}

TEST(TeacherCacheEncoding, RoundTripsCompactly) {
  for (int64_t vocab : {64, 1000, 70000}) {
    SCOPED_TRACE(vocab);
    at::Tensor x = ids(1, 16, 3, 64);
    Answer a = shaped(x, 8, vocab).answer;
    const std::string record = distill::encodeRow(a, vocab);
    Answer b = distill::decodeRow(record.data(), record.size());
    // Indices, logsumexp and log_tail exactly; values rounded to float16 and back.
    EXPECT_TRUE(bitEqual(a.at("topk_indices"), b.at("topk_indices")));
    EXPECT_TRUE(bitEqual(a.at("logsumexp"), b.at("logsumexp")));
    EXPECT_TRUE(bitEqual(a.at("log_tail"), b.at("log_tail")));
    EXPECT_TRUE(bitEqual(a.at("topk_values").to(at::kHalf).to(at::kFloat), b.at("topk_values")));
    // Decoding is a fixed point: encode(decode(r)) == r.
    EXPECT_EQ(distill::encodeRow(b, vocab), record);
    // 16 tokens x 8: values 2 bytes, indices 1, 2 or 4 bytes, plus 2 x 4 bytes per token.
    const size_t indexBytes = vocab <= 256 ? 1 : vocab <= 65536 ? 2 : 4;
    const size_t payload = 16 * 8 * (2 + indexBytes) + 16 * 8;
    EXPECT_GT(record.size(), payload);
    EXPECT_LT(record.size(), payload + 200) << "header overhead";
  }
  // Full logits of another dtype and other outputs: their own dtype, bit for
  // bit; float32 full logits through float16, read back as float32.
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    Answer a{{"logits", at::randn({1, 16, 64}).to(dtype)}, {"h", at::randn({1, 16, 3})}};
    const std::string record = distill::encodeRow(a, 64);
    Answer b = distill::decodeRow(record.data(), record.size());
    EXPECT_TRUE(bitEqual(a.at("h"), b.at("h")));
    EXPECT_TRUE(
        bitEqual(dtype == at::kFloat ? a.at("logits").to(at::kHalf).to(at::kFloat) : a.at("logits"), b.at("logits")));
    EXPECT_EQ(record.size(), 16 * 64 * (dtype == at::kFloat ? 2 : c10::elementSize(dtype)) + 16 * 3 * 4 + 72);
  }
  // A top-k value float16 cannot hold: that row stays float32.
  Answer big = shaped(ids(1, 4, 5), 4).answer;
  big["topk_values"][0][1][0] = 1e6f;
  const std::string record = distill::encodeRow(big, 64);
  EXPECT_TRUE(bitEqual(big.at("topk_values"), distill::decodeRow(record.data(), record.size()).at("topk_values")));
  Answer bigDense{{"logits", at::randn({1, 4, 64})}};
  bigDense["logits"][0][2][7] = -1e6f;
  const std::string dense = distill::encodeRow(bigDense, 64);
  EXPECT_TRUE(bitEqual(bigDense.at("logits"), distill::decodeRow(dense.data(), dense.size()).at("logits")));
  // A damaged record is an error, never a wild read.
  EXPECT_THROW(distill::decodeRow(record.data(), record.size() - 3), distill::IpcError);
  EXPECT_THROW(distill::decodeRow(record.data(), 2), distill::IpcError);
}

// Epoch 2 in one process: the same rows shuffled and re-batched hit, with no
// compute, bit-equal to epoch 1's answers; new rows next to hits are computed
// in one call holding only them.
TEST(TeacherCacheStore, ShuffledRebatchedRowsHitBitEqual) {
  TempDir dir;
  TeacherCache cache(options(dir.path, "readwrite"), kContext, kNames, 2.0);
  int computes = 0;
  int64_t lastRows = 0;
  auto compute = [&](const std::vector<at::Tensor>& in) {
    ++computes;
    lastRows = in[0].size(0);
    return shaped(in[0], 8);
  };
  at::Tensor all = ids(12, 16, 7);
  std::vector<Answer> epoch1 = cache.answer({{all.narrow(0, 0, 5)}, {all.narrow(0, 5, 7)}}, compute, at::kCPU);
  EXPECT_EQ(computes, 1);
  EXPECT_EQ(lastRows, 12);
  EXPECT_EQ(cache.stats().inserted, 12);
  auto answerOf = [&](int64_t r) { return r < 5 ? rowOf(epoch1[0], r) : rowOf(epoch1[1], r - 5); };
  // The miss answer is what the store holds: top-k values went through float16.
  EXPECT_TRUE(bitEqual(answerOf(3).at("topk_values"),
                       rowOf(shaped(all, 8).answer, 3).at("topk_values").to(at::kHalf).to(at::kFloat)));

  at::Tensor perm = at::randperm(12, at::make_generator<at::CPUGeneratorImpl>(3), at::kLong);
  at::Tensor shuffled = all.index_select(0, perm);
  std::vector<std::vector<at::Tensor>> batches;
  for (int64_t start = 0; start < 12; start += 3) batches.push_back({shuffled.narrow(0, start, 3)});
  std::vector<Answer> epoch2 = cache.answer(batches, compute, at::kCPU);
  EXPECT_EQ(computes, 1) << "epoch 2 made a forward";
  EXPECT_EQ(cache.stats().hits, 12);
  for (int64_t i = 0; i < 12; ++i) {
    EXPECT_TRUE(bitEqual(rowOf(epoch2[size_t(i / 3)], i % 3), answerOf(perm[i].item<int64_t>()))) << "row " << i;
  }

  // Mixed: two known rows around two new ones; one compute of the 2 new rows.
  at::Tensor fresh = ids(2, 16, 99);
  at::Tensor mixed = at::cat({all.narrow(0, 0, 1), fresh, all.narrow(0, 6, 1)}, 0);
  std::vector<Answer> m = cache.answer({{mixed}}, compute, at::kCPU);
  EXPECT_EQ(computes, 2);
  EXPECT_EQ(lastRows, 2);
  EXPECT_TRUE(bitEqual(rowOf(m[0], 0), answerOf(0)));
  EXPECT_TRUE(bitEqual(rowOf(m[0], 3), answerOf(6)));
  EXPECT_EQ(m[0].at("topk_values").size(0), 4);

  // Mode read: lookups only, nothing stored; mode write: every row computed.
  TeacherCache reader(options(dir.path, "read"), kContext, kNames, 2.0);
  at::Tensor unseen = ids(1, 16, 1234);
  reader.answer({{all.narrow(0, 0, 2)}, {unseen}}, compute, at::kCPU);
  EXPECT_EQ(reader.stats().hits, 2);
  EXPECT_EQ(reader.stats().inserted, 0);
  TeacherCache writer(options(dir.path, "write"), kContext, kNames, 2.0);
  const int before = computes;
  writer.answer({{all.narrow(0, 0, 2)}}, compute, at::kCPU);
  EXPECT_EQ(computes, before + 1);
  EXPECT_EQ(writer.stats().hits, 0);
  // Another context (another teacher, another signal) over the same store: refused at open in
  // every mode, naming what the store holds and what this teacher answers; the store is unchanged.
  for (const char* mode : {"read", "readwrite", "write"}) {
    try {
      TeacherCache other(options(dir.path, mode), kContext + "\nweights other", kNames, 2.0);
      ADD_FAILURE() << "mode " << mode << ": no ConfigError";
    } catch (const distill::ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("written by another teacher or for another signal: it holds answers of [(nothing)] where "
                       "this teacher answers [weights other]"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find(dir.path), std::string::npos) << m;
    }
  }
  TeacherCache again(options(dir.path, "read"), kContext, kNames, 2.0);
  again.answer({{all.narrow(0, 0, 2)}}, compute, at::kCPU);
  EXPECT_EQ(again.stats().hits, 2);
}

TEST(TeacherCacheStore, RefusesWhatItCannotServe) {
  TempDir dir;
  try {
    TeacherCache c(options(dir.path, "read"), kContext, kNames);
    ADD_FAILURE() << "no ConfigError";
  } catch (const distill::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path + " holds no cache"), std::string::npos) << e.what();
  }
  { TeacherCache c(options(dir.path, "readwrite"), kContext, kNames); }
  // A store of another format version: its header rewritten by hand.
  MDB_env* env = nullptr;
  ASSERT_EQ(mdb_env_create(&env), 0);
  ASSERT_EQ(mdb_env_open(env, dir.path.c_str(), 0, 0644), 0);
  MDB_txn* txn = nullptr;
  MDB_dbi dbi;
  ASSERT_EQ(mdb_txn_begin(env, nullptr, 0, &txn), 0);
  ASSERT_EQ(mdb_dbi_open(txn, nullptr, 0, &dbi), 0);
  std::string k = "distill-teacher-cache", v = "format 999";
  MDB_val key{k.size(), k.data()}, val{v.size(), v.data()};
  ASSERT_EQ(mdb_put(txn, dbi, &key, &val, 0), 0);
  ASSERT_EQ(mdb_txn_commit(txn), 0);
  mdb_env_close(env);
  for (const char* mode : {"read", "readwrite"}) {
    try {
      TeacherCache c(options(dir.path, mode), kContext, kNames);
      ADD_FAILURE() << "no ConfigError";
    } catch (const distill::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("has cache format 999, this teacher reads and writes format " +
                                           std::to_string(distill::kCacheFormatVersion)),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(dir.path), std::string::npos) << e.what();
    }
  }
}

// A full store stops inserting with one warning and keeps serving.
TEST(TeacherCacheStore, FullStoreSaysSoOnceAndKeepsServing) {
  TempDir dir;
  TeacherCache cache(options(dir.path, "readwrite", int64_t(1) << 20), kContext, kNames);
  auto compute = [](const std::vector<at::Tensor>& in) { return shaped(in[0], 0, 1024); }; // 64 KiB a row
  at::Tensor first = ids(4, 16, 1);
  std::vector<Answer> kept = cache.answer({{first}}, compute, at::kCPU);
  ASSERT_EQ(cache.stats().inserted, 4);
  ::testing::internal::CaptureStderr();
  for (uint64_t seed = 100; seed < 140; ++seed) {
    at::Tensor x = ids(4, 16, seed);
    std::vector<Answer> a = cache.answer({{x}}, compute, at::kCPU);
    EXPECT_TRUE(bitEqual(a[0].at("logits"), asStored(tableLogits(x, 1024)))); // answered all the same
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(cache.full());
  size_t warnings = 0;
  for (size_t at = err.find(" is full"); at != std::string::npos; at = err.find(" is full", at + 1)) ++warnings;
  EXPECT_EQ(warnings, 1u) << err;
  EXPECT_NE(err.find(dir.path + " is full (teacher.cache.max_bytes=1048576)"), std::string::npos) << err;
  EXPECT_LT(cache.stats().inserted, 4 + 40 * 4);
  EXPECT_LE(cache.storeBytes(), int64_t(1) << 20);
  // What was stored before still hits.
  const int64_t hits = cache.stats().hits;
  std::vector<Answer> again = cache.answer({{first}}, compute, at::kCPU);
  EXPECT_EQ(cache.stats().hits, hits + 4);
  EXPECT_TRUE(bitEqual(again[0], kept[0]));
}

// The rows the SIGKILL test writes: batch i is ids(8, 16, seed 5000 + i).
at::Tensor killBatch(int64_t i) { return ids(8, 16, 5000 + uint64_t(i)); }
TeacherCache::Computed killAnswer(const at::Tensor& x) { return shaped(x, 0, 2048); } // 128 KiB a row

} // namespace

// Writes batch after batch into the store at args[0]; after each commit writes
// one byte to fd args[1]. Runs until killed.
DISTILL_TEST_ROLE(cache_writer) {
  TeacherCache cache(options(args.at(0), "readwrite", int64_t(1) << 30), kContext, kNames);
  const int fd = std::stoi(args.at(1));
  for (int64_t i = 0;; ++i) {
    cache.answer(
        {{killBatch(i)}}, [](const std::vector<at::Tensor>& in) { return killAnswer(in[0]); }, at::kCPU);
    const char byte = 1;
    if (::write(fd, &byte, 1) != 1) return 3;
  }
}

namespace {

// A writer SIGKILLed while it writes leaves a store that opens and holds only
// correct rows: every committed batch whole, every entry equal to recomputing it.
TEST(TeacherCacheStore, SigkillMidWriteLeavesACorrectStore) {
  TempDir dir;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  dt::Child writer = dt::spawnRole("cache_writer", {dir.path, std::to_string(fds[1])});
  ::close(fds[1]);
  // Wait (deadline 60 s) for 6 commits, then kill it while it writes the next ones.
  int committed = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (committed < 6 && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 1000) > 0) {
      char buf[16];
      const ssize_t n = ::read(fds[0], buf, sizeof buf);
      if (n <= 0) break;
      committed += int(n);
    }
  }
  ASSERT_GE(committed, 6) << "the writer did not commit 6 batches in 60 s";
  writer.kill(SIGKILL);
  auto st = writer.join(std::chrono::seconds(10));
  EXPECT_FALSE(st.exited);
  EXPECT_EQ(st.signal, SIGKILL);
  ::close(fds[0]);

  // The store opens (the dead writer's lock and reader slot are recovered) and
  // holds every batch reported committed, each row bit-equal to recomputing it,
  // and no entry besides those, the header and the signal record.
  TeacherCache cache(options(dir.path, "readwrite"), kContext, kNames);
  int64_t found = 0;
  for (int64_t i = 0; i < committed + 64; ++i) {
    at::Tensor x = killBatch(i);
    const int64_t hits = cache.stats().hits;
    std::vector<Answer> a = cache.answer(
        {{x}}, [&](const std::vector<at::Tensor>& in) { return killAnswer(in[0]); }, at::kCPU);
    const int64_t rowsHit = cache.stats().hits - hits;
    if (i < committed) {
      EXPECT_EQ(rowsHit, 8) << "batch " << i << " was committed";
    }
    EXPECT_TRUE(rowsHit == 0 || rowsHit == 8) << "batch " << i << " half stored: " << rowsHit;
    if (rowsHit == 8) {
      EXPECT_TRUE(bitEqual(a[0].at("logits"), asStored(tableLogits(x, 2048)))) << "batch " << i;
      found += 8;
    }
    if (rowsHit == 0 && i >= committed) break;
  }
  MDB_env* env = nullptr;
  ASSERT_EQ(mdb_env_create(&env), 0);
  ASSERT_EQ(mdb_env_open(env, dir.path.c_str(), MDB_RDONLY, 0644), 0);
  MDB_stat stat;
  ASSERT_EQ(mdb_env_stat(env, &stat), 0);
  mdb_env_close(env);
  // Entries: the rows found before this test's own inserts (the first miss), plus the header and
  // the signal record.
  EXPECT_GE(int64_t(stat.ms_entries), found + 2);
  EXPECT_LE(int64_t(stat.ms_entries), found + 2 + 8); // + the batch this check inserted itself
  std::printf("writer killed after %d reported commits; %lld rows found intact\n", committed,
              static_cast<long long>(found));
}

// What float16 top-k values do to the loss: the tiny script teacher's top-8
// answer at T=2, with the values as stored vs float32, on a random student.
TEST(TeacherCacheEncoding, Float16ValuesBarelyMoveTheLoss) {
  at::Tensor x = ids(8, 64, 11);
  auto exact = shaped(x, 8).answer;
  Answer rounded = exact;
  distill::roundForStorage(rounded, 2.0);
  EXPECT_TRUE(bitEqual(rounded.at("topk_values"), exact.at("topk_values").to(at::kHalf).to(at::kFloat)));
  EXPECT_TRUE(bitEqual(rounded.at("log_tail"), exact.at("log_tail")));
  EXPECT_LT((rounded.at("logsumexp") - exact.at("logsumexp")).abs().max().item<float>(), 1e-2);
  distill::LossOptions lo;
  lo.temperature = 2.0;
  lo.alpha = 1.0;
  at::Tensor student = at::randn({8, 64, 64}, at::make_generator<at::CPUGeneratorImpl>(2)) * 2;
  at::Tensor labels = at::randint(0, 64, {8, 64}, at::make_generator<at::CPUGeneratorImpl>(3), at::kLong);
  auto out = [&](const Answer& a) {
    distill::TeacherOutput o;
    o.makeTopk().values = a.at("topk_values");
    o.makeTopk().indices = a.at("topk_indices");
    o.makeTopk().logsumexp = a.at("logsumexp");
    o.makeTopk().logTail = a.at("log_tail");
    return distill::distillLoss(student, labels, o, lo, 8 * 64).loss.item<double>();
  };
  const double l32 = out(exact), l16 = out(rounded);
  std::printf("top-8 KL loss, values float32 %.9f, float16 %.9f, relative difference %.2e\n", l32, l16,
              std::abs(l16 - l32) / std::abs(l32));
  EXPECT_LT(std::abs(l16 - l32), 1e-3 * std::abs(l32));
}

TEST(TeacherCacheEncoding, DenseRowsTakeTwoBytesPerLogit) {
  for (int64_t vocab : {1551, 32000}) {
    double perToken[2] = {0, 0};
    for (int half = 0; half < 2; ++half) {
      TempDir dir;
      TeacherCache cache(options(dir.path, "write", int64_t(256) << 20), kContext, kNames);
      const int64_t before = cache.storeBytes();
      // "logits" float32 goes through float16; the same tensor under another name stays float32.
      const std::string name = half ? "logits" : "h";
      cache.answer(
          {{ids(16, 64, 77)}},
          [&](const std::vector<at::Tensor>& in) {
            Answer a{{name, at::randn({in[0].size(0), 64, vocab}) * 4}};
            return TeacherCache::Computed{a, vocab};
          },
          at::kCPU);
      perToken[half] = double(cache.storeBytes() - before) / (16 * 64);
      const double estimate = cache.bytesPerStoredToken();
      EXPECT_NEAR(estimate, perToken[half], 0.05 * perToken[half]) << "the estimate the gauges publish";
    }
    std::printf("V=%lld dense row of 64 tokens: %.0f bytes per stored token as float32, %.0f as float16\n",
                static_cast<long long>(vocab), perToken[0], perToken[1]);
    EXPECT_GE(perToken[0], 4.0 * double(vocab));
    EXPECT_LT(perToken[1], 2.0 * double(vocab) * 1.02);
  }
  // The loss on float16 full logits: KL at T=2 of a random student.
  at::Tensor x = ids(8, 64, 12);
  at::Tensor exact = tableLogits(x, 64) * 2;
  distill::LossOptions lo;
  lo.temperature = 2.0;
  lo.alpha = 1.0;
  at::Tensor student = at::randn({8, 64, 64}, at::make_generator<at::CPUGeneratorImpl>(5)) * 2;
  at::Tensor labels = at::randint(0, 64, {8, 64}, at::make_generator<at::CPUGeneratorImpl>(6), at::kLong);
  auto loss = [&](const at::Tensor& logits) {
    distill::TeacherOutput o;
    o.makeLogits().logits = logits;
    return distill::distillLoss(student, labels, o, lo, 8 * 64).loss.item<double>();
  };
  const double l32 = loss(exact), l16 = loss(asStored(exact));
  std::printf("full-logits KL loss, float32 %.9f, float16 %.9f, relative difference %.2e\n", l32, l16,
              std::abs(l16 - l32) / std::abs(l32));
  EXPECT_LT(std::abs(l16 - l32), 1e-3 * std::abs(l32));
}

} // namespace

// Issue 28 item 2: answers whose values travel in bfloat16 or float16
// (teacher.payload_dtype) are stored as they are, 2 bytes a value, and come
// back bit-equal in their own dtype: top-k values and full logits alike.
TEST(TeacherCacheEncoding, HalfPayloadsRoundTripBitEqualInTheirDtype) {
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::Tensor logits = tableLogits(ids(1, 16, 3), 32000).reshape({16, 32000});
    Answer topk = distill::topkOutput(logits, 64, 2.0, dtype);
    Answer dense{{distill::protocol::kLogits, logits.to(dtype)}};
    for (Answer* a : {&topk, &dense}) {
      Answer stored = *a;
      distill::roundForStorage(stored, 2.0); // leaves 2-byte values alone
      Answer row;
      for (const auto& [name, t] : stored) row[name] = t.narrow(0, 5, 1);
      const std::string record = distill::encodeRow(row, 32000);
      Answer back = distill::decodeRow(record.data(), record.size());
      for (const auto& [name, t] : row) EXPECT_TRUE(bitEqual(t, back.at(name))) << name;
      const int64_t values = a == &topk ? 64 : 32000;
      // 2 bytes a value (+ 2 per uint16 index for top-k), plus the record's headers.
      EXPECT_LT(int64_t(record.size()), values * (a == &topk ? 4 : 2) + 256) << record.size();
    }
  }
}
