// distill-run's balance verdict (launcher/src/balance.cpp): in-process units.

#include <gtest/gtest.h>

#include <string>

#include "balance.h"
#include "distill/core/config.h"
#include "console.h"
#include "launch.h"

using namespace distill::testing;

// Issue 27: the teacher.procs advice weighs what the node has. On 2 cores
// with 2 students a second teacher made the job slower (83.0 s vs 66.6 s)
// though the verdict advised it: now it says more teachers cannot help there,
// caps the advice at what the node holds, and names a pool larger than that.
TEST(BalanceVerdict, TeacherProcsAdviceWeighsTheNodesCoresAndGpus) {
  using distill::launcher::balanceVerdict;
  using distill::launcher::NodeShape;
  using distill::launcher::teacherRoom;
  NodeShape twoCores;
  twoCores.teachers = 1, twoCores.students = 2, twoCores.cores = 2;
  EXPECT_EQ(teacherRoom(twoCores), 0);
  const std::string full = balanceVerdict(0.41, 0.95, std::nullopt, twoCores);
  EXPECT_TRUE(has(full,
                  "more teacher processes cannot help here (the node's 2 cores already run 2 students and 1 "
                  "teacher: another would share them and slow every process down); what can: a smaller or "
                  "faster teacher"))
      << full;
  EXPECT_FALSE(has(full, "teacher.procs: 2")) << full;
  EXPECT_FALSE(has(balanceVerdict(0.41, std::nullopt, std::nullopt, twoCores), "more teacher processes (")) << full;

  // 8 cores, 2 students, teachers of 2 threads: room for 3; 1.6 teachers' worth -> 2.
  NodeShape eight = twoCores;
  eight.cores = 8, eight.teacherThreads = 2;
  EXPECT_EQ(teacherRoom(eight), 3);
  const std::string fits = balanceVerdict(0.41, 0.95, std::nullopt, eight);
  EXPECT_TRUE(has(fits, "teacher.procs: 2 (their work at the students' pace is 1.6 teachers' worth), ")) << fits;
  // 6 teachers' worth wanted, 3 fit.
  const std::string capped = balanceVerdict(0.84, 0.95, std::nullopt, eight);
  EXPECT_TRUE(has(capped,
                  "teacher.procs: 3 (their work at the students' pace is 5.9 teachers' worth; 7 would, but "
                  "the node's 8 cores hold 3 next to its 2 students)"))
      << capped;
  EXPECT_TRUE(has(balanceVerdict(0.41, std::nullopt, std::nullopt, eight), "(teacher.procs, up to 3 on this node)"));

  // 2 teachers on 2 cores next to 2 students: fewer may be faster, whatever the bound.
  NodeShape crowded = twoCores;
  crowded.teachers = 2;
  const std::string slow = balanceVerdict(0.02, 0.3, std::nullopt, crowded);
  EXPECT_TRUE(has(slow,
                  "; teacher.procs: 2 is more than the node holds (the node's 2 cores already run 2 students "
                  "and 2 teachers): fewer teachers (teacher.procs: 1) may be faster"))
      << slow;
  EXPECT_FALSE(has(balanceVerdict(0.02, 0.3, std::nullopt, eight), "more than the node holds"));

  // GPU teachers: one per GPU.
  NodeShape gpus;
  gpus.teachers = 2, gpus.students = 6, gpus.cores = 64, gpus.gpus = 2, gpus.teacherOnGpu = true;
  EXPECT_EQ(teacherRoom(gpus), 2);
  const std::string gpuFull = balanceVerdict(0.5, 0.9, std::nullopt, gpus);
  EXPECT_TRUE(has(gpuFull, "more teacher processes cannot help here (the node's 2 GPUs already hold 2 teachers"))
      << gpuFull;
  gpus.gpus = 8;
  EXPECT_TRUE(has(balanceVerdict(0.5, 0.9, std::nullopt, gpus), "teacher.procs: 4 (")) << gpuFull;
  gpus.gpus = 0; // unknown: no bound
  EXPECT_EQ(teacherRoom(gpus), -1);
}

// Issue 16: the verdict's closed forms (launcher/src/balance.cpp).
TEST(BalanceVerdict, NamesTheBoundAndWhatAKeptUpTeacherWouldGive) {
  using distill::launcher::balanceVerdict;
  // 41 % waiting: a step 41 % shorter is 1 / 0.59 = 1.69x the throughput.
  const std::string bound = balanceVerdict(0.41, 0.95, std::nullopt);
  EXPECT_EQ(bound.rfind("teacher-bound: students waited 41 % of each step, the teacher 95 % busy; a teacher that kept "
                        "up would make each step 41 % shorter (1.69x the throughput)",
                        0),
            0u)
      << bound;
  EXPECT_TRUE(has(bound, "teacher.cache.mode: readwrite")) << bound;
  // 0.95 busy at 0.59 of today's step: 1.6 teachers' worth, 2 teachers below 90 % each.
  EXPECT_TRUE(has(bound, "teacher.procs: 2 (their work at the students' pace is 1.6 teachers' worth)")) << bound;
  const std::string pool = balanceVerdict(0.5, 0.9, std::nullopt, 2);
  EXPECT_TRUE(has(pool, "the 2 teachers 90 % busy")) << pool;
  EXPECT_TRUE(has(pool, "teacher.procs: 4 (their work at the students' pace is 3.6 teachers' worth)")) << pool;
  const std::string cached = balanceVerdict(0.2, std::nullopt, 0.5);
  EXPECT_TRUE(has(cached, "students waited 20 % of each step, 50 % of its rows answered from its cache")) << cached;
  EXPECT_TRUE(has(cached, "more cache hits")) << cached;
  EXPECT_EQ(balanceVerdict(0.1, 0.7, std::nullopt),
            "balanced: students waited 10 % of each step, the teacher 70 % busy; the teacher nearly keeps up");
  EXPECT_EQ(balanceVerdict(0.02, 0.3, std::nullopt),
            "student-bound: students waited 2 % of each step, the teacher 30 % busy; the teacher keeps up with room "
            "for a larger teacher or more students");
}

// Issue 27: one cache hit share, hits / rows looked up since the job began, in
// the verdict as in the status line and the teacher's summary: the last share
// the teachers published, not a mean over the status ticks (that weighed the
// first epoch's empty cache in: 17-20 % where the teacher counted 46-57 %).
// A full cache says so in both, with its bytes per stored token.
TEST(BalanceVerdict, CacheHitShareIsTheJobsAndAFullCacheIsLoud) {
  std::vector<distill::launcher::Rank> ranks(1);
  ranks[0].published = distill::StudentStatus{};
  ranks[0].published->teacher_wait_share = 0.2;
  distill::launcher::Balance balance;
  for (double hits : {0.0, 0.0, 0.0, 0.0, 0.1, 0.3, 0.5}) balance.sample(ranks, 0.9, hits);
  const std::string note = "the cache is full (teacher.cache.max_bytes=1073741824 at 3126 bytes per stored token)";
  const std::string v = balance.verdict(1, note);
  EXPECT_TRUE(has(v, "the teacher 90 % busy, 50 % of its rows answered from its cache, " + note)) << v;
  const std::string status = distill::launcher::statusText(ranks, {0.9}, 0.5, "cache full (3126 B/token)");
  EXPECT_TRUE(has(status, "teacher busy=90% cache hits=50% cache full (3126 B/token) teacher wait=20%")) << status;
}

// loss.vocab truncate: the status line shows the most teacher probability any
// student's last step dropped (docs/vocab.md); nothing when none published it.
TEST(StatusLine, ShowsTheTruncatedTeacherMass) {
  std::vector<distill::launcher::Rank> ranks(2);
  ranks[0].published = distill::StudentStatus{};
  ranks[1].published = distill::StudentStatus{};
  EXPECT_FALSE(has(distill::launcher::statusText(ranks, {0.5}, std::nullopt, ""), "truncated"));
  ranks[0].published->truncated_mass = 2e-6;
  ranks[1].published->truncated_mass = 3e-5;
  const std::string status = distill::launcher::statusText(ranks, {0.5}, std::nullopt, "");
  EXPECT_TRUE(has(status, "truncated mass=3e-05")) << status;
}

// Issue 39 item 5: the verdict advised teacher.topk to a job that had top-64 set.
// Advice names only what the config does not already do: no teacher.topk with
// top-k answers, no "turn the cache on" with the cache on; nodeShape reads both.
TEST(BalanceVerdict, AdviceNamesOnlyWhatTheConfigDoesNotAlreadyDo) {
  using distill::launcher::balanceVerdict;
  using distill::launcher::NodeShape;
  NodeShape full;
  const std::string dense = balanceVerdict(0.41, 0.95, std::nullopt, full);
  EXPECT_TRUE(has(dense, "a smaller or faster teacher, the teacher-output cache (teacher.cache.mode: readwrite) from "
                         "the second epoch on, or teacher.topk to shrink its answers"))
      << dense;
  NodeShape topk = full;
  topk.topk = 64;
  const std::string sparse = balanceVerdict(0.41, 0.95, std::nullopt, topk);
  EXPECT_FALSE(has(sparse, "teacher.topk")) << sparse;
  EXPECT_TRUE(has(sparse, "a smaller or faster teacher, or the teacher-output cache (teacher.cache.mode: readwrite)"))
      << sparse;
  NodeShape cached = topk;
  cached.cacheOn = true; // on, in mode write: no hit share published
  const std::string writing = balanceVerdict(0.41, 0.95, std::nullopt, cached);
  EXPECT_FALSE(has(writing, "teacher.cache.mode")) << writing;
  EXPECT_TRUE(has(writing, "a smaller or faster teacher, or more cache hits")) << writing;

  distill::Config cfg = distill::parseConfig(
      "run:\n  nproc_per_node: 3\nteacher:\n  kind: self\n  topk: 64\n  cache:\n    path: /tmp/c\n    mode: write\n");
  const NodeShape fromConfig = distill::launcher::nodeShape(cfg);
  EXPECT_EQ(fromConfig.topk, 64);
  EXPECT_TRUE(fromConfig.cacheOn);
}
