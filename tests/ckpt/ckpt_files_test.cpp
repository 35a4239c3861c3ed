// The checkpoint's files (ckpt/src/checkpoint_files.cpp, file_system.cpp) under
// faults: a student killed at each file operation of a save, a disk that fills up.

#include "ckpt_fixture.h"

// ---- kill during save (issue 14, item 10) ------------------------------------------

namespace {

// Once armed, counts every file-system call of this process (caller's thread
// and background writer alike) and SIGKILLs the process at the `killAt`-th
// (0: never; then it keeps "op path" of each call). The fault hook runs before
// each system call, so each count is a point between two of them.
class KillAtFileSystem : public distill::PosixFileSystem {
 public:
  explicit KillAtFileSystem(int64_t killAt) : killAt_(killAt) {}
  void arm() { armed_ = true; }
  std::vector<std::string> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 protected:
  int fault(distill::FsOp op, const std::string& path) override {
    if (!armed_) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(calls_.size()) + 1 == killAt_) raise(SIGKILL);
    calls_.push_back(std::string(distill::fsOpName(op)) + " " + path.substr(path.rfind("/ckpt") + 5));
    return 0;
  }

 private:
  int64_t killAt_;
  std::atomic<bool> armed_{false};
  std::mutex mu_;
  std::vector<std::string> calls_;
};

} // namespace

// Saves (and waits for) steps 1..3, keep_last 2; rank `victim` dies at the
// `kill_at`-th file-system call of save 3. Prints "CALL k op path" for each
// call of save 3 (relative to the checkpoint directory).
DISTILL_TEST_ROLE(killsave) {
  Args a = parseArgs(args);
  return studentMain(a, [&](distill::StudentContext& ctx) {
    const bool victim = std::to_string(ctx.rank()) == get(a, "victim");
    auto fs = std::make_shared<KillAtFileSystem>(victim ? std::stoll(get(a, "kill_at", "0")) : 0);
    Trainer t(ctx);
    distill::CheckpointManager m(ctx, ctx.config().checkpoint, "teacher-v1", fs);
    for (int s = 1; s <= 3; ++s) {
      t.step();
      if (s == 3) fs->arm();
      if (!t.save(m) || !m.wait()) return 1;
    }
    auto calls = fs->calls();
    for (size_t i = 0; i < calls.size(); ++i) report("CALL " + std::to_string(i + 1) + " " + calls[i]);
    return 0;
  });
}

// A student is SIGKILLed at a file-system call of save 3 (of 3, keep_last 2),
// sync and async. Sync: student rank 0 at every call from its manifest write
// to pruning (manifest, directory rename, `latest`, each fsync between), at 2
// random calls among those that write data files and 2 among those that prune;
// rank 1 at 2 random calls. Async: rank 0 at every call from the directory
// rename to the one after `latest`'s, at 3 random others, rank 1 at 1. After every trial the
// loader's choice (scanCheckpoints, what student rank 0 runs; the real loader
// in processes for every 4th trial) is step 2 or 3, and `latest` names exactly
// that checkpoint, intact: never a missing one, never an older one.
TEST_F(CkptTest, KillDuringSaveTrials) {
  const char* seedEnv = std::getenv("DISTILL_CKPT_SEED");
  const uint64_t seed = seedEnv ? std::stoull(seedEnv) : static_cast<uint64_t>(::time(nullptr));
  std::printf("[ measure ] kill trials seed %llu (DISTILL_CKPT_SEED reproduces it)\n",
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](const std::vector<int64_t>& from, size_t n) {
    std::vector<int64_t> out;
    std::sample(from.begin(), from.end(), std::back_inserter(out), n, rng);
    return out;
  };
  // DISTILL_STRESS=1 (docs/building.md, "Tests"): more random calls besides the window's every one.
  const char* stressEnv = std::getenv("DISTILL_STRESS");
  const bool stress = stressEnv && std::string(stressEnv) == "1";
  int trials = 0, published = 0, loads = 0;
  const auto t0 = steady_clock::now();
  for (const std::string async : {"0", "1"}) {
    distill::PosixFileSystem().removeAll(ckpt());
    auto dry = run("killsave", 2, {"victim=0", "kill_at=0", "keep=2", "async=" + async});
    expectAllOk(dry);
    // Rank 0's calls of save 3, in order ("op path"): the index of the first that matches.
    auto calls = linesOf(dry.logs[0], "CALL");
    for (auto& c : calls) c = c.substr(c.find(' ') + 1);
    const int64_t rank1Calls = static_cast<int64_t>(linesOf(dry.logs[1], "CALL").size());
    auto first = [&](const std::string& what) -> int64_t {
      for (size_t i = 0; i < calls.size(); ++i) {
        if (contains(calls[i], what)) return static_cast<int64_t>(i) + 1;
      }
      ADD_FAILURE() << "no call " << what << " in\n" << dry.logs[0];
      return 1;
    };
    const int64_t manifest = first(" /step_3.tmp/manifest.json"), renameDir = first("rename /step_3.tmp");
    const int64_t renameLatest = first("rename /latest.tmp");
    int64_t pruneList = renameLatest; // the listing of the directory that starts pruning
    while (pruneList < static_cast<int64_t>(calls.size()) && calls[pruneList - 1] != "list ") ++pruneList;
    std::printf(
        "[ measure ] async=%s: save 3 makes %zu file-system calls on rank 0 (manifest at %lld, rename "
        "at %lld, latest at %lld), %lld on rank 1\n",
        async.c_str(), calls.size(), static_cast<long long>(manifest), static_cast<long long>(renameDir),
        static_cast<long long>(renameLatest), static_cast<long long>(rank1Calls));
    ASSERT_FALSE(HasFailure());
    std::vector<int64_t> writes, prunes, window, others;
    for (int64_t k = 1; k <= static_cast<int64_t>(calls.size()); ++k) {
      (k < manifest ? writes : k <= pruneList ? window : prunes).push_back(k);
      if (k < renameDir || k > renameLatest) others.push_back(k);
    }
    std::vector<std::pair<int, int64_t>> points; // (victim, kill_at)
    if (async == "0") {
      for (int64_t k : window) points.push_back({0, k});
      for (int64_t k : pick(writes, stress ? 2 : 1)) points.push_back({0, k});
      for (int64_t k : pick(prunes, stress ? 2 : 1)) points.push_back({0, k});
    } else {
      for (int64_t k = renameDir; k <= renameLatest + 1; ++k) points.push_back({0, k});
      for (int64_t k : pick(others, stress ? 3 : 2)) points.push_back({0, k});
    }
    std::vector<int64_t> rank1(static_cast<size_t>(rank1Calls));
    std::iota(rank1.begin(), rank1.end(), 1);
    for (int64_t k : pick(rank1, async == "0" && stress ? 2 : 1)) points.push_back({1, k});
    for (auto [victim, k] : points) {
      SCOPED_TRACE("async=" + async + " victim rank " + std::to_string(victim) + " killed at call " +
                   std::to_string(k) + (victim == 0 ? " (" + calls[k - 1] + ")" : ""));
      distill::PosixFileSystem().removeAll(ckpt());
      auto r = run("killsave", 2,
                   {"victim=" + std::to_string(victim), "kill_at=" + std::to_string(k), "keep=2", "async=" + async,
                    "timeout=5"});
      EXPECT_TRUE(!r.status[victim].exited && r.status[victim].signal == SIGKILL) << r.status[victim].describe() << "\n"
                                                                                  << r.logs[victim];
      distill::PosixFileSystem fs;
      auto scan = distill::scanCheckpoints(ckpt(), fs);
      ASSERT_TRUE(scan.chosen) << (scan.rejected.empty() ? "" : scan.rejected[0]);
      const std::string chosen = std::to_string(scan.chosen->step);
      EXPECT_TRUE(chosen == "2" || chosen == "3") << chosen;
      EXPECT_TRUE(scan.rejected.empty()) << scan.rejected[0];
      EXPECT_EQ(dt::readFile(ckpt("latest")), "step_" + chosen + "\n") << "`latest` lags the loader's choice";
      EXPECT_NO_THROW(distill::verifyCheckpoint(ckpt("step_" + chosen), fs));
      if (trials % 4 == 0) { // the real loader agrees
        auto load = run("resume", 2, {});
        expectAllOk(load);
        for (int i = 0; i < 2; ++i) EXPECT_EQ(linesOf(load.logs[i], "LOADED"), std::vector<std::string>{chosen});
        ++loads;
      }
      ++trials;
      published += chosen == "3";
      if (HasFailure()) return;
    }
  }
  std::printf("[ measure ] %d kill trials (%d checked by loading), step 3 published in %d, %.1f s\n", trials, loads,
              published, duration<double>(steady_clock::now() - t0).count());
}

// ---- out of space (issue 14, item 10) -----------------------------------------------

namespace {

// Bytes of the regular files under `dir`, recursively.
int64_t bytesUnder(const std::string& dir) {
  int64_t total = 0;
  distill::PosixFileSystem fs;
  std::vector<std::string> names;
  try {
    names = fs.list(dir);
  } catch (const distill::CheckpointError&) {
    return 0; // removed meanwhile
  }
  for (const auto& n : names) {
    struct stat st;
    const std::string p = dir + "/" + n;
    if (::lstat(p.c_str(), &st) != 0) continue;
    total += S_ISDIR(st.st_mode) ? bytesUnder(p) : static_cast<int64_t>(st.st_size);
  }
  return total;
}

// A device with room for `quota` bytes under `root`: a write that would go
// beyond it fails with ENOSPC, through the real error path (the fault hook
// fails its first write(2)), like a full disk.
class QuotaFileSystem : public distill::PosixFileSystem {
 public:
  QuotaFileSystem(std::string root, int64_t quota) : root_(std::move(root)), quota_(quota) {}
  void writeFile(const std::string& path, const std::string& bytes) override {
    full_ = bytesUnder(root_) + static_cast<int64_t>(bytes.size()) > quota_;
    PosixFileSystem::writeFile(path, bytes);
  }

 protected:
  int fault(distill::FsOp op, const std::string&) override { return op == distill::FsOp::kWrite && full_ ? ENOSPC : 0; }

 private:
  std::string root_;
  int64_t quota_;
  std::atomic<bool> full_{false};
};

} // namespace

// Saves steps 1..steps (every one; a wait() after each when async) with
// student rank 0's device limited to `quota` bytes (0: no limit). Prints
// "SAVE step ok" and, at the end, "BYTES n" (the checkpoint directory's size).
DISTILL_TEST_ROLE(quota) {
  Args a = parseArgs(args);
  return studentMain(a, [&](distill::StudentContext& ctx) {
    const int64_t quota = std::stoll(get(a, "quota", "0"));
    std::shared_ptr<distill::FileSystem> fs;
    if (ctx.rank() == 0 && quota > 0) fs = std::make_shared<QuotaFileSystem>(get(a, "dir"), quota);
    Trainer t(ctx);
    distill::CheckpointManager m(ctx, ctx.config().checkpoint, "teacher-v1", fs);
    const int steps = std::stoi(get(a, "steps"));
    for (int s = 1; s <= steps; ++s) {
      t.step();
      bool ok = t.save(m);
      if (ctx.config().checkpoint.async) ok = m.wait(); // this save's own outcome
      report("SAVE " + std::to_string(s) + " " + std::to_string(ok));
    }
    report("BYTES " + std::to_string(bytesUnder(get(a, "dir"))));
    return 0;
  });
}

// Room for two checkpoints, keep_last 3 (the default): when a save runs out
// of space, the oldest checkpoint goes (never the newest) and the save is
// written again, so saving goes on for ever, sync and async. Before, pruning
// came only after publishing, so no save after the second ever succeeded.
TEST_F(CkptTest, OutOfSpaceRemovesTheOldestAndSavingGoesOn) {
  auto dry = run("quota", 2, {"steps=1"});
  expectAllOk(dry);
  auto bytes = linesOf(dry.logs[0], "BYTES");
  ASSERT_EQ(bytes.size(), 1u) << dry.logs[0];
  const int64_t one = std::stoll(bytes[0]); // one checkpoint (and `latest`)
  for (const std::string async : {"0", "1"}) {
    SCOPED_TRACE("async=" + async);
    distill::PosixFileSystem().removeAll(ckpt());
    auto r = run("quota", 2,
                 {"steps=6", "keep=3", "on_error=continue", "async=" + async, "quota=" + std::to_string(one * 5 / 2)});
    expectAllOk(r);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(linesOf(r.logs[i], "SAVE"), (std::vector<std::string>{"1 1", "2 1", "3 1", "4 1", "5 1", "6 1"}))
          << r.logs[i];
    }
    EXPECT_TRUE(contains(r.logs[0], "checkpoint step 3: no space left in " + ckpt() + "; removed step_1")) << r.logs[0];
    EXPECT_EQ(dt::readFile(ckpt("latest")), "step_6\n");
    distill::PosixFileSystem fs;
    EXPECT_EQ(distill::verifyCheckpoint(ckpt("step_6"), fs).step, 6);
    EXPECT_EQ(distill::verifyCheckpoint(ckpt("step_5"), fs).step, 5);
    EXPECT_FALSE(fileExists(ckpt("step_4")));
  }
}

// Room for one checkpoint and a half: the newest is never removed before a
// newer one is published, so the second save fails, saying why and what is
// kept; room for less than one: the message says there is no earlier one.
TEST_F(CkptTest, OutOfSpaceSaysWhyAndWhatIsKept) {
  auto dry = run("quota", 2, {"steps=1"});
  expectAllOk(dry);
  const int64_t one = std::stoll(linesOf(dry.logs[0], "BYTES").at(0));
  distill::PosixFileSystem().removeAll(ckpt());
  auto r = run("quota", 2, {"steps=3", "keep=1", "on_error=continue", "quota=" + std::to_string(one * 3 / 2)});
  expectAllOk(r);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(linesOf(r.logs[i], "SAVE"), (std::vector<std::string>{"1 1", "2 0", "3 0"})) << r.logs[i];
    EXPECT_TRUE(contains(r.logs[i], "needs room for at least two checkpoints")) << r.logs[i];
    EXPECT_TRUE(contains(r.logs[i], "the newest checkpoint, " + ckpt("step_1") + ", is left as it was")) << r.logs[i];
    EXPECT_FALSE(contains(r.logs[i], "previous checkpoint is intact")) << r.logs[i];
  }
  EXPECT_TRUE(contains(r.logs[0], "No space left on device")) << r.logs[0];
  auto again = run("resume", 2, {});
  expectAllOk(again);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 1")) << again.logs[i];

  distill::PosixFileSystem().removeAll(ckpt());
  auto none = run("quota", 2, {"steps=1", "on_error=continue", "quota=" + std::to_string(one / 2)});
  expectAllOk(none);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(linesOf(none.logs[i], "SAVE"), std::vector<std::string>{"1 0"}) << none.logs[i];
    EXPECT_TRUE(contains(none.logs[i], "there is no earlier checkpoint in " + ckpt())) << none.logs[i];
    EXPECT_FALSE(contains(none.logs[i], "previous checkpoint is intact")) << none.logs[i];
  }
}
