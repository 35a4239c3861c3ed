// The teacher-output cache end to end (issue 16): real processes — two
// students (this binary in a role) and bin/distill-teacher with teacher.cache
// — a real segment and a real LMDB store shared by successive jobs.
#include <gtest/gtest.h>
#include <lmdb.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

#include "distill/core/errors.h"
#include "distill/ipc/segment.h"
#include "distill/student/init.h"
#include "e2e_common.h"
#include "job_fixture.h"
#include "support/roles.h"
#include "tiny_mlp.h"

using namespace std::chrono;
namespace dt = distill::testing;
using distill::testing::e2e::jobYaml;
using distill::testing::e2e::kSeq;
using distill::testing::e2e::kVocab;

namespace {

constexpr int64_t kRows = 24; // rows per student

// Student `rank`'s rows: [kRows, kSeq] int64, the same in every epoch.
at::Tensor studentRows(int rank) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(777 + uint64_t(rank));
  return at::randint(0, kVocab, {kRows, kSeq}, g, at::kLong);
}

} // namespace

// Sends its rows through the teacher: epoch 1 in order, 2 rows a request;
// epoch 2 shuffled, 3 rows a request. Saves every row's answer, in row order
// (each tensor of a row, by name), to args[1] with torch::save.
DISTILL_TEST_ROLE(cache_student) {
  const int epoch = std::stoi(args.at(0));
  int argc = 1;
  char arg0[] = "student";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  at::Tensor rows = studentRows(s.topology.studentRank);
  at::Tensor order = epoch == 1 ? at::arange(kRows, at::kLong)
                                : at::randperm(kRows, at::make_generator<at::CPUGeneratorImpl>(31 + epoch), at::kLong);
  const int64_t per = epoch == 1 ? 2 : 3;
  std::vector<std::vector<at::Tensor>> answers(kRows);
  for (int64_t step = 0; step * per < kRows; ++step) {
    at::Tensor idx = order.narrow(0, step * per, per);
    distill::TeacherReply reply = s.client->get(s.client->submit(rows.index_select(0, idx), step, 0));
    const distill::TeacherOutput o = reply.output();
    std::vector<at::Tensor> parts;
    for (const at::Tensor* t : o.tensors()) {
      if (t->defined()) parts.push_back(t->cpu().clone());
    }
    for (int64_t j = 0; j < per; ++j) {
      for (const at::Tensor& t : parts) answers[size_t(idx[j].item<int64_t>())].push_back(t[j].clone());
    }
  }
  s.client->finish();
  std::vector<at::Tensor> flat;
  for (auto& a : answers) flat.insert(flat.end(), a.begin(), a.end());
  torch::save(flat, args.at(1));
  std::fprintf(stderr, "RESULT saved %zu tensors\n", flat.size());
  return 0;
}

namespace {

// teacher.cache.keys prefix: on-policy groups of G rows sharing a P-token
// prompt (the student's own, by rank), responses of R tokens; row 1 a response
// of length 0 (the prompt, then padding 0), the same row in every group.
constexpr int64_t kGroupP = 10, kGroupR = kSeq - kGroupP, kGroupG = 4;

at::Tensor groupRows(int rank, int group) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + uint64_t(rank));
  at::Tensor prompt = at::randint(1, kVocab, {1, kGroupP}, g, at::kLong);
  auto r = at::make_generator<at::CPUGeneratorImpl>(600 + 10 * uint64_t(rank) + uint64_t(group));
  at::Tensor responses = at::randint(1, kVocab, {kGroupG, kGroupR}, r, at::kLong);
  // First response tokens distinct across groups: no new response shares a prefix with an old one.
  responses.select(1, 0).copy_(at::arange(1, kGroupG + 1, at::kLong) + kGroupG * group);
  responses[1].fill_(0);
  return at::cat({prompt.expand({kGroupG, kGroupP}), responses}, 1).contiguous();
}

} // namespace

// Sends its groups args[0] (comma-separated group numbers) one request each, in
// order, and saves every answer tensor to args[1] (torch::save). With args[0]
// "flat": one request of ids without a sequence dimension, which must be refused
// naming teacher.cache.keys.
DISTILL_TEST_ROLE(group_student) {
  int argc = 1;
  char arg0[] = "student";
  char* argv[] = {arg0, nullptr};
  distill::Session s = distill::init(argc, argv);
  const int rank = s.topology.studentRank;
  if (args.at(0) == "flat") {
    try {
      s.client->get(s.client->submit(groupRows(rank, 1).select(1, 0).contiguous(), 0, 0));
      std::fprintf(stderr, "NOT REJECTED\n");
      return 1;
    } catch (const distill::ProtocolError& e) {
      std::fprintf(stderr, "REJECTED: %s\n", e.what());
    }
    s.client->finish();
    return 0;
  }
  std::vector<at::Tensor> saved;
  std::stringstream groups(args.at(0));
  int64_t step = 0;
  for (std::string g; std::getline(groups, g, ',');) {
    const distill::TeacherOutput o = s.client->get(s.client->submit(groupRows(rank, std::stoi(g)), step++, 0)).output();
    for (const at::Tensor* t : o.tensors()) {
      if (t->defined()) saved.push_back(t->cpu().clone());
    }
  }
  s.client->finish();
  torch::save(saved, args.at(1));
  std::fprintf(stderr, "RESULT saved %zu tensors\n", saved.size());
  return 0;
}

namespace {

struct CacheDir {
  std::string path = ::testing::TempDir() + dt::uniqueName("distill-cache-e2e");
  ~CacheDir() { // an LMDB store: data.mdb and lock.mdb (no std::filesystem: libtorch.so exports a clashing copy)
    ::unlink((path + "/data.mdb").c_str());
    ::unlink((path + "/lock.mdb").c_str());
    ::rmdir(path.c_str());
  }
};

std::string cacheYaml(const std::string& path, const std::string& mode) {
  return "  cache:\n    path: " + path + "\n    mode: " + mode + "\n";
}

std::string scriptTeacher(int topk) {
  return "  kind: torchscript\n  path: " DISTILL_TINY_LM "\n  topk: " + std::to_string(topk) + "\n";
}

struct JobResult {
  std::string teacherLog;
  double hitShare = -1; // as the teacher published it in the segment
  std::vector<std::string> studentLogs;
};

// One job: `students` students in `role` with `args` (a "%d" in an arg
// becomes the student's rank) and bin/distill-teacher. Fails the test if any
// process fails (ok), or if the teacher does not fail (!ok).
JobResult runJob(const std::string& yaml, const std::string& role, const std::vector<std::string>& args,
                 int students = 2, bool ok = true) {
  dt::Job job(students, yaml);
  std::vector<dt::Child> kids;
  kids.push_back(job.spawnTeacherBinary());
  for (int i = 0; i < students; ++i) {
    std::vector<std::string> a = args;
    for (auto& x : a) {
      if (auto at = x.find("%d"); at != std::string::npos) x.replace(at, 2, std::to_string(i));
    }
    kids.push_back(job.spawnRole(role, i, a));
  }
  auto st = dt::joinAll(kids, seconds(90));
  const std::string teacherLog = job.log(job.teacherRank());
  if (!ok) {
    EXPECT_TRUE(st[0].exited && st[0].code != 0) << "teacher: " << st[0].describe() << "\n" << teacherLog;
    return JobResult{teacherLog, -1, {}};
  }
  EXPECT_TRUE(st[0].exited && st[0].code == 0) << "teacher: " << st[0].describe() << "\n" << teacherLog;
  for (int i = 0; i < students; ++i) {
    EXPECT_TRUE(st[i + 1].exited && st[i + 1].code == 0) << "student " << i << ": " << st[i + 1].describe() << "\n"
                                                         << job.log(i);
  }
  JobResult r;
  r.teacherLog = teacherLog;
  r.hitShare =
      distill::ipc::Segment::attach(job.segment(), job.jobId(), std::nullopt, distill::Deadline::after(seconds(5)))
          .teacherCacheHits();
  for (int i = 0; i < students; ++i) r.studentLogs.push_back(job.log(i));
  return r;
}

std::vector<at::Tensor> loadAnswers(const std::string& path) {
  std::vector<at::Tensor> v;
  torch::load(v, path);
  return v;
}

bool bitEqual(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor x = a.contiguous(), y = b.contiguous();
  return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() &&
      std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

std::string line(const std::string& log, const std::string& start) {
  const size_t at = log.find(start);
  return at == std::string::npos ? "" : log.substr(at, log.find('\n', at) - at);
}

// Epoch 2 over the same rows, shuffled and re-batched, is answered from the
// cache with no forward, every answer bit-equal to epoch 1's; a teacher with
// other weights over the same store is refused at start, naming both.
TEST(TeacherCacheEndToEnd, SecondEpochHitsBitEqualWithoutForward) {
  CacheDir dir;
  const std::string yaml = jobYaml(scriptTeacher(8) + cacheYaml(dir.path, "readwrite"), 1, 2);
  const std::string out = ::testing::TempDir() + dt::uniqueName("answers");
  auto [log1, hits1, studentLogs1] = runJob(yaml, "cache_student", {"1", out + "-e1-%d.pt"});
  const std::string sum1 = line(log1, "teacher cache " + dir.path + ": ");
  EXPECT_NE(sum1.find(": 48 rows (768 tokens), 48 looked up, 0 hits"), std::string::npos) << log1;
  EXPECT_NE(sum1.find(" 48 rows stored"), std::string::npos) << log1;
  EXPECT_EQ(hits1, 0.0);

  auto [log2, hits2, studentLogs2] = runJob(yaml, "cache_student", {"2", out + "-e2-%d.pt"});
  const std::string sum2 = line(log2, "teacher cache " + dir.path + ": ");
  EXPECT_NE(sum2.find(": 48 rows (768 tokens), 48 looked up, 48 hits (100% of the rows looked up, 768 tokens), 0 "
                      "damaged, 0 forwards, 0 rows stored"),
            std::string::npos)
      << log2;
  EXPECT_NE(log2.find(" in 0 batches"), std::string::npos) << "no forward in epoch 2\n" << log2;
  EXPECT_EQ(hits2, 1.0);
  for (int s = 0; s < 2; ++s) {
    const auto e1 = loadAnswers(out + "-e1-" + std::to_string(s) + ".pt");
    const auto e2 = loadAnswers(out + "-e2-" + std::to_string(s) + ".pt");
    ASSERT_EQ(e1.size(), size_t(kRows * 4));
    ASSERT_EQ(e2.size(), e1.size());
    for (size_t i = 0; i < e1.size(); ++i) EXPECT_TRUE(bitEqual(e1[i], e2[i])) << "student " << s << " tensor " << i;
    std::remove((out + "-e1-" + std::to_string(s) + ".pt").c_str());
    std::remove((out + "-e2-" + std::to_string(s) + ".pt").c_str());
  }

  // Another teacher (the registered TinyMlp) over the same store and rows: kept apart.
  const std::string weights = ::testing::TempDir() + dt::uniqueName("tiny-mlp") + ".pt";
  torch::manual_seed(99);
  std::shared_ptr<torch::nn::Module> mlp = std::make_shared<dt::TinyMlp>();
  torch::save(mlp, weights);
  const std::string mlpYaml =
      jobYaml("  kind: registered\n  library: " DISTILL_TEST_TEACHER_LIB "\n  module: tiny_mlp\n  weights: " + weights +
                  "\n  topk: 8\n" + cacheYaml(dir.path, "readwrite"),
              1, 2);
  const std::string log3 = runJob(mlpYaml, "cache_student", {"2", out + "-mlp-%d.pt"}, 2, false).teacherLog;
  EXPECT_NE(log3.find("teacher.cache.path: the store in " + dir.path + " was written by another teacher or for "
                      "another signal: it holds answers of [weights "),
            std::string::npos)
      << log3;
  EXPECT_NE(log3.find("kind torchscript] where this teacher answers [weights "), std::string::npos) << log3;
  std::remove(weights.c_str());
  for (int s = 0; s < 2; ++s) std::remove((out + "-mlp-" + std::to_string(s) + ".pt").c_str());
}

// A sweep: a second student run with another alpha and temperature (full
// logits do not depend on T) reads the cache the first wrote: all hits, no
// forward, and the students' losses match their in-process teacher's.
TEST(TeacherCacheEndToEnd, SweepSecondRunAllHits) {
  CacheDir dir;
  const int steps = 3, G = 4;
  std::string yaml = jobYaml(scriptTeacher(0) + cacheYaml(dir.path, "readwrite"), G, 2);
  auto [log1, hits1, studentLogs1] = runJob(yaml, "distill_student", {"script", std::to_string(steps)});
  EXPECT_EQ(hits1, 0.0);
  std::string sweep = jobYaml(scriptTeacher(0) + cacheYaml(dir.path, "read"), G, 2);
  sweep.replace(sweep.find("alpha: 0.5"), 10, "alpha: 0.9");
  sweep.replace(sweep.find("temperature: 2.0"), 16, "temperature: 1.0");
  auto [log2, hits2, studentLogs2] = runJob(sweep, "distill_student", {"script", std::to_string(steps)});
  const int rows = 2 * steps * G * int(distill::testing::e2e::kBatch);
  EXPECT_NE(line(log2, "teacher cache " + dir.path + ": ")
                .find(": " + std::to_string(rows) + " rows (" + std::to_string(rows * kSeq) + " tokens), " +
                      std::to_string(rows) + " looked up, " + std::to_string(rows) + " hits (100%"),
            std::string::npos)
      << log2;
  EXPECT_NE(log2.find(" in 0 batches"), std::string::npos) << log2;
  EXPECT_EQ(hits2, 1.0);
  // Each student's loss with the cached answers equals its loss with the teacher run in its own process.
  for (const std::string& log : studentLogs2) {
    EXPECT_LE(dt::numberAfter(log, "max_loss_diff="), 1e-6) << log;
  }
}

// A copy of the store at `from` in `to` (a new owner-only folder) with one
// row's record damaged: its last byte flipped. Returns that row's key (hex).
std::string copyWithOneRowDamaged(const std::string& from, const std::string& to) {
  std::ifstream in(from + "/data.mdb", std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  std::string file = os.str();
  MDB_env* env = nullptr;
  EXPECT_EQ(mdb_env_create(&env), 0);
  EXPECT_EQ(mdb_env_open(env, from.c_str(), MDB_RDONLY, 0600), 0);
  MDB_txn* txn = nullptr;
  MDB_dbi dbi;
  MDB_cursor* cur = nullptr;
  EXPECT_EQ(mdb_txn_begin(env, nullptr, MDB_RDONLY, &txn), 0);
  EXPECT_EQ(mdb_dbi_open(txn, nullptr, 0, &dbi), 0);
  EXPECT_EQ(mdb_cursor_open(txn, dbi, &cur), 0);
  MDB_val key, data;
  std::string keyHex;
  for (int rc = mdb_cursor_get(cur, &key, &data, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &key, &data, MDB_NEXT)) {
    if (key.mv_size != 32) continue; // the header
    const std::string record(static_cast<const char*>(data.mv_data), data.mv_size);
    // Every copy of it: LMDB's copy-on-write leaves older versions in free pages,
    // and the first one found need not be the live one.
    size_t copies = 0;
    for (size_t at = file.find(record); at != std::string::npos; at = file.find(record, at + 1), ++copies)
      file[at + record.size() - 1] ^= 0x04;
    EXPECT_GT(copies, 0u);
    static const char* digits = "0123456789abcdef";
    for (size_t i = 0; i < 32; ++i) {
      const auto b = static_cast<const uint8_t*>(key.mv_data)[i];
      keyHex += digits[b >> 4];
      keyHex += digits[b & 15];
    }
    break;
  }
  mdb_cursor_close(cur);
  mdb_txn_abort(txn);
  mdb_env_close(env);
  EXPECT_EQ(::mkdir(to.c_str(), 0700), 0);
  std::ofstream out(to + "/data.mdb", std::ios::binary);
  out.write(file.data(), std::streamsize(file.size()));
  EXPECT_TRUE(out.good());
  out.close();
  ::chmod((to + "/data.mdb").c_str(), 0600);
  return keyHex;
}

// Issue 27 item 4.1: a read job over a copy of a good store with one row's
// record damaged never serves it: that row is computed (the same bytes as the
// store held before the damage), the teacher names the store and the key and
// counts it; the hit share is hits / rows looked up, as its summary says.
TEST(TeacherCacheEndToEnd, ReadJobNeverServesADamagedRow) {
  CacheDir dir, copy;
  const std::string out = ::testing::TempDir() + dt::uniqueName("answers");
  runJob(jobYaml(scriptTeacher(8) + cacheYaml(dir.path, "readwrite"), 1, 2), "cache_student", {"1", out + "-e1-%d.pt"});
  const std::string key = copyWithOneRowDamaged(dir.path, copy.path);
  ASSERT_EQ(key.size(), 64u);
  auto [log, hits, studentLogs] =
      runJob(jobYaml(scriptTeacher(8) + cacheYaml(copy.path, "read"), 1, 2), "cache_student", {"2", out + "-e2-%d.pt"});
  EXPECT_NE(log.find("teacher cache " + copy.path + ": the row with key " + key +
                     " is damaged (its record fails its CRC32C); it is computed instead, never served from the store"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("teacher cache " + copy.path +
                     ": 48 rows (768 tokens), 48 looked up, 47 hits (97.9167% of the rows looked up, 752 tokens), 1 "
                     "damaged, 1 forwards"),
            std::string::npos)
      << log;
  EXPECT_DOUBLE_EQ(hits, 47.0 / 48.0);
  // Every hit is bit-equal to the first job's answer. The damaged row is
  // computed afresh: a cache-off answer, which the store's 16-bit values
  // round (so its request's tensor may differ from the first job's within
  // that rounding, and it is the only one that may).
  int differing = 0;
  for (int s = 0; s < 2; ++s) {
    const auto e1 = loadAnswers(out + "-e1-" + std::to_string(s) + ".pt");
    const auto e2 = loadAnswers(out + "-e2-" + std::to_string(s) + ".pt");
    ASSERT_EQ(e2.size(), e1.size());
    for (size_t i = 0; i < e1.size(); ++i) {
      if (bitEqual(e1[i], e2[i])) continue;
      ++differing;
      EXPECT_TRUE(at::allclose(e1[i].to(at::kDouble), e2[i].to(at::kDouble), 2e-3, 1e-3))
          << "student " << s << " tensor " << i;
    }
    std::remove((out + "-e1-" + std::to_string(s) + ".pt").c_str());
    std::remove((out + "-e2-" + std::to_string(s) + ".pt").c_str());
  }
  EXPECT_LE(differing, 2) << "only the damaged row's request may differ (its values and their logsumexp)";
}

// Issue 30 §2, teacher.cache.keys prefix, with real processes (distill-teacher
// serving the registered CausalMean, top-k 8, whose answers at a position are
// the same bits whatever follows it and whatever rows share its forward): (a) every group's answer is
// bit-equal to the same groups answered through row keys; (b) the first group
// of a prompt computes P + G * R positions, a second group of the same prompt
// in a later step only its new responses' positions (row 1, the empty
// response, is the same row in every group: found), and so does a third in a
// later run over the reopened store; (c) a request without a sequence
// dimension is refused naming the key.
TEST(TeacherCacheEndToEnd, PrefixKeysAnswerGroupsOnceBitEqualToRowKeys) {
  CacheDir rowDir, prefixDir;
  const std::string out = ::testing::TempDir() + dt::uniqueName("groups");
  const std::string weights = out + "-causal-mean.pt";
  torch::manual_seed(7);
  std::shared_ptr<torch::nn::Module> model = std::make_shared<dt::CausalMean>();
  torch::save(model, weights);
  auto yaml = [&](const CacheDir& d, const std::string& keys) {
    return jobYaml("  kind: registered\n  library: " DISTILL_TEST_TEACHER_LIB "\n  module: causal_mean\n  weights: " +
                       weights + "\n  topk: 8\n" + cacheYaml(d.path, "readwrite") + "    keys: " + keys + "\n",
                   1, 1);
  };
  const int64_t T = kSeq, P = kGroupP, R = kGroupR, G = kGroupG;
  auto positions = [&](const JobResult& r, int64_t n, int64_t hits, int64_t computed) {
    EXPECT_NE(line(r.teacherLog, "teacher cache " + prefixDir.path + ": ")
                  .find("; prefix keys: " + std::to_string(n) + " positions, " + std::to_string(hits) + " hits, " +
                        std::to_string(computed) + " computed"),
              std::string::npos)
        << r.teacherLog;
  };
  // Two students, each its own prompt: groups 1 and 2 in run 1, group 3 in run 2.
  JobResult first = runJob(yaml(prefixDir, "prefix"), "group_student", {"1,2", out + "-p1-%d.pt"});
  positions(first, 2 * 2 * G * T, 2 * (G * P + R), 2 * (P + G * R + (G - 1) * R));
  JobResult later = runJob(yaml(prefixDir, "prefix"), "group_student", {"3", out + "-p2-%d.pt"});
  positions(later, 2 * G * T, 2 * (G * P + R), 2 * (G - 1) * R);
  EXPECT_DOUBLE_EQ(later.hitShare, double(G * P + R) / double(G * T)) << "the share of positions found";
  runJob(yaml(rowDir, "row"), "group_student", {"1,2", out + "-r1-%d.pt"});
  runJob(yaml(rowDir, "row"), "group_student", {"3", out + "-r2-%d.pt"});
  for (const std::string run : {"1", "2"}) {
    for (int s = 0; s < 2; ++s) {
      const std::string suffix = run + "-" + std::to_string(s) + ".pt";
      const auto viaPrefix = loadAnswers(out + "-p" + suffix), viaRows = loadAnswers(out + "-r" + suffix);
      ASSERT_EQ(viaPrefix.size(), run == "1" ? 8u : 4u);
      ASSERT_EQ(viaRows.size(), viaPrefix.size());
      for (size_t i = 0; i < viaRows.size(); ++i) {
        EXPECT_TRUE(bitEqual(viaPrefix[i], viaRows[i])) << "run " << run << " student " << s << " tensor " << i;
      }
      std::remove((out + "-p" + suffix).c_str());
      std::remove((out + "-r" + suffix).c_str());
    }
  }
  // (c): refused, naming the key; the teacher serves on.
  JobResult flat = runJob(yaml(prefixDir, "prefix"), "group_student", {"flat"});
  for (const std::string& log : flat.studentLogs) {
    EXPECT_NE(log.find("REJECTED: "), std::string::npos) << log;
    EXPECT_NE(log.find("teacher rejected the request of student rank"), std::string::npos) << log;
    EXPECT_NE(log.find("teacher.cache.keys: prefix keys answers per position of a sequence dimension (dim 1)"),
              std::string::npos)
        << log;
  }
  std::remove(weights.c_str());
}

// Issue 39 item 5: with teacher.cache.dtype float32 a cached job's answers
// are the uncached job's, bit for bit, when they miss (epoch 1) and when they
// hit (epoch 2): full logits and top-k alike. The default, float16, stores
// float32 logits rounded, so its answers differ from the uncached ones.
TEST(TeacherCacheEndToEnd, Float32RowsAnswerAsTheUncachedTeacherBitForBit) {
  const std::string out = ::testing::TempDir() + dt::uniqueName("dtype");
  // One request (32 tokens) per forward in every job, so that no row's numbers depend on how
  // the teacher happened to batch the students' requests; epoch 2's requests (48) are all hits.
  auto yaml = [](const std::string& teacher) {
    std::string y = jobYaml(teacher, 1, 2);
    const std::string from = "max_batch_tokens: 1024";
    return y.replace(y.find(from), from.size(), "max_batch_tokens: 48");
  };
  for (int topk : {0, 8}) {
    SCOPED_TRACE("teacher.topk " + std::to_string(topk));
    CacheDir f32, f16;
    runJob(yaml(scriptTeacher(topk)), "cache_student", {"1", out + "-off-%d.pt"});
    const std::string cached = yaml(scriptTeacher(topk) + cacheYaml(f32.path, "readwrite") + "    dtype: float32\n");
    JobResult miss = runJob(cached, "cache_student", {"1", out + "-miss-%d.pt"});
    EXPECT_NE(line(miss.teacherLog, "teacher cache " + f32.path + ": ").find(" 48 rows stored"), std::string::npos)
        << miss.teacherLog;
    JobResult hit = runJob(cached, "cache_student", {"2", out + "-hit-%d.pt"});
    EXPECT_EQ(hit.hitShare, 1.0) << hit.teacherLog;
    if (topk == 0) {
      runJob(yaml(scriptTeacher(0) + cacheYaml(f16.path, "readwrite")), "cache_student", {"1", out + "-f16-%d.pt"});
    }
    for (int s = 0; s < 2; ++s) {
      const std::string suffix = "-" + std::to_string(s) + ".pt";
      const auto off = loadAnswers(out + "-off" + suffix);
      ASSERT_EQ(off.size(), size_t(kRows * (topk ? 4 : 1)));
      for (const std::string run : {"-miss", "-hit"}) {
        const auto got = loadAnswers(out + run + suffix);
        ASSERT_EQ(got.size(), off.size());
        for (size_t i = 0; i < off.size(); ++i) {
          EXPECT_TRUE(bitEqual(off[i], got[i])) << run << " student " << s << " tensor " << i;
        }
        std::remove((out + run + suffix).c_str());
      }
      if (topk == 0) {
        const auto rounded = loadAnswers(out + "-f16" + suffix);
        ASSERT_EQ(rounded.size(), off.size());
        size_t differ = 0;
        for (size_t i = 0; i < off.size(); ++i) differ += bitEqual(off[i], rounded[i]) ? 0 : 1;
        EXPECT_GT(differ, 0u) << "float16 rows are rounded: the uncached answers differ";
        std::remove((out + "-f16" + suffix).c_str());
      }
      std::remove((out + "-off" + suffix).c_str());
    }
  }
}

} // namespace
