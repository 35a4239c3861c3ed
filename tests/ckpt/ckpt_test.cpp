// Student-only checkpoints: real student processes (and a live teacher where it
// matters), a real TCPStore + gloo group, the real file system behind the
// fault seam. Children report on stderr ("KEY value" lines) which goes to a log
// file per rank that the test reads.
//
// This file: saving, loading and resuming (ckpt/src/checkpoint.cpp,
// checkpoint_publish.cpp), async saves, the config a checkpoint was saved under.
// ckpt_manifest_test.cpp: the manifest and scanning; ckpt_files_test.cpp: the
// files under kills and a full disk.

#include "ckpt_fixture.h"

// ---- roles -------------------------------------------------------------------

DISTILL_TEST_ROLE(teacher) {
  distill::TeacherContext ctx(distill::Topology::fromEnvironment(), distill::Config{});
  // Nothing here can reach a checkpoint: a CheckpointManager needs a StudentContext.
  static_assert(!std::is_constructible_v<distill::CheckpointManager, distill::TeacherContext&>);
  return dt::waitForSigterm(seconds(120)) ? 0 : 7;
}

// Creates the directory, then trains, saves and loads back at every step.
DISTILL_TEST_ROLE(hang) {
  Args a = parseArgs(args);
  return studentMain(a, [&](distill::StudentContext& ctx) {
    Trainer t(ctx);
    distill::CheckpointManager m(ctx);
    const int steps = std::stoi(get(a, "steps"));
    for (int s = 1; s <= steps; ++s) {
      t.step();
      if (!t.save(m)) return 1;
      auto l = t.load(m);
      if (!l || l->step != s || l->train.step != s) return 1;
    }
    report("RESULT ok " + std::to_string(steps));
    return 0;
  });
}

// Trains to `steps`, saving at `save_at`; resumes first when resume=1.
DISTILL_TEST_ROLE(train) {
  Args a = parseArgs(args);
  return studentMain(a, [&](distill::StudentContext& ctx) {
    Trainer t(ctx);
    distill::CheckpointManager m(ctx);
    if (get(a, "resume") == "1") {
      auto l = t.load(m);
      if (!l) return 1;
      report("RESUMED " + std::to_string(l->step));
    }
    const int64_t steps = std::stoll(get(a, "steps")), saveAt = std::stoll(get(a, "save_at", "-1"));
    while (t.train.step < steps) {
      float loss = t.step();
      report("LOSS " + std::to_string(t.train.step) + " " + hexBits(loss));
      if (t.train.step == saveAt && !t.save(m)) return 1;
    }
    return m.wait() ? 0 : 1;
  });
}

// Saves steps 1..steps with a fault: either rank `fault_rank` SIGKILLs itself
// after writing `kill_after`, or its file system fails the `nth` `op` of a path
// containing `match` with errno `err`. Prints "SAVE step ok".
DISTILL_TEST_ROLE(faulty) {
  Args a = parseArgs(args);
  return studentMain(a, [&](distill::StudentContext& ctx) {
    std::shared_ptr<distill::FileSystem> fs;
    bool mine = std::to_string(ctx.rank()) == get(a, "fault_rank", "-1");
    if (mine && !get(a, "kill_after").empty()) {
      fs = std::make_shared<KillingFileSystem>(get(a, "kill_after"));
    } else if (mine) {
      fs = std::make_shared<distill::FaultyFileSystem>(opNamed(get(a, "op")), std::stoll(get(a, "nth")),
                                                       std::stoi(get(a, "err")), get(a, "match"));
    }
    Trainer t(ctx);
    distill::CheckpointManager m(ctx, ctx.config().checkpoint, "teacher-v1", fs);
    const int steps = std::stoi(get(a, "steps"));
    for (int s = 1; s <= steps; ++s) {
      t.step();
      report("SAVE " + std::to_string(s) + " " + std::to_string(t.save(m)));
    }
    return 0;
  });
}

// Loads the newest checkpoint; prints "LOADED step" or "LOADED none".
DISTILL_TEST_ROLE(resume) {
  Args a = parseArgs(args);
  return studentMain(a, [&](distill::StudentContext& ctx) {
    Trainer t(ctx);
    distill::CheckpointManager m(ctx, ctx.config().checkpoint, "teacher-v1");
    auto l = t.load(m);
    report("LOADED " + (l ? std::to_string(l->step) : std::string("none")));
    return 0;
  });
}

// Async: a save returns before its files are written; an injected write error
// (rank 1, step 3) surfaces at the next call.
DISTILL_TEST_ROLE(async) {
  Args a = parseArgs(args);
  a["async"] = "1";
  return studentMain(a, [&](distill::StudentContext& ctx) {
    auto fs = std::make_shared<GatedFileSystem>("step_2.tmp/rank_", ctx.rank() == 1 ? "step_3.tmp/rank_1.pt" : "");
    Trainer t(ctx);
    distill::CheckpointManager m(ctx, ctx.config().checkpoint, "", fs);
    t.step();
    report("SAVE 1 " + std::to_string(t.save(m)));
    report("WAIT 1 " + std::to_string(m.wait()));
    t.step();
    auto start = steady_clock::now();
    bool ok = t.save(m);
    auto returnedUs = duration_cast<microseconds>(steady_clock::now() - start).count();
    bool early = !fs->passed() && !fileExists(get(a, "dir") + "/step_2");
    report("SAVE 2 " + std::to_string(ok) + " returned_before_write=" + std::to_string(early) +
           " in_us=" + std::to_string(returnedUs));
    t.step(); // training collectives go on while the writer waits at the gate
    fs->open();
    bool waited = m.wait();
    report("WAIT 2 " + std::to_string(waited) +
           " published=" + std::to_string(fileExists(get(a, "dir") + "/step_2/manifest.json")));
    report("SAVE 3 " + std::to_string(t.save(m))); // rank 1's write fails in the background
    t.step();
    report("SAVE 4 " + std::to_string(t.save(m))); // ... and surfaces here
    report("WAIT 4 " + std::to_string(m.wait()));
    return 0;
  });
}

// ---- tests -------------------------------------------------------------------

// The production hang (docs/design.md: checkpoint set-up) as a regression: 3 students make the
// directory, save and load at every step, with a live teacher that calls nothing.
TEST_F(CkptTest, StudentsCheckpointWhileTeacherNeverJoins) {
  auto r = run("hang", 3, {"steps=50"}, /*teacher=*/true);
  expectAllOk(r);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(contains(r.logs[i], "RESULT ok 50")) << r.logs[i];
  RecordProperty("elapsed_ms", std::to_string(r.ms));
  std::printf("[ measure ] 3 students, 50 x (train + save + load), teacher alive: %lld ms\n",
              static_cast<long long>(r.ms));
  EXPECT_LT(r.ms, 60000);
  // keep_last = 3 complete checkpoints, and `latest` names the newest.
  EXPECT_TRUE(fileExists(ckpt("step_50/manifest.json")));
  EXPECT_TRUE(fileExists(ckpt("step_48")));
  EXPECT_FALSE(fileExists(ckpt("step_47")));
  EXPECT_EQ(dt::readFile(ckpt("latest")), "step_50\n");
}

// The permission bits of `path` (-1: no such file).
int modeOf(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int>(st.st_mode & 07777) : -1;
}

// Issue 27 (4.11): checkpoints hold model state: they were 0644 files in 0755
// folders; now owner-only by default, group-readable with run.file_mode: group
// (less the umask, as open and mkdir have it).
TEST_F(CkptTest, CheckpointsAreOwnerOnlyByDefaultAndGroupReadableWithFileModeGroup) {
  const mode_t mask = ::umask(022);
  ::umask(mask);
  for (const std::string mode : {"private", "group"}) {
    SCOPED_TRACE(mode);
    distill::PosixFileSystem().removeAll(ckpt());
    expectAllOk(run("faulty", 2, {"steps=2", "file_mode=" + mode}));
    const int dirMode = (mode == "group" ? 0750 : 0700) & ~mask, fileMode = (mode == "group" ? 0640 : 0600) & ~mask;
    for (const std::string d : {"", "step_1", "step_2"}) EXPECT_EQ(modeOf(ckpt(d)), dirMode) << ckpt(d);
    EXPECT_EQ(modeOf(ckpt("latest")), fileMode);
    for (const std::string f :
         {"manifest.json", "model.pt", "optimizer.pt", "train_state.pt", "rank_0.pt", "rank_1.pt", "config.yaml"})
      EXPECT_EQ(modeOf(ckpt("step_2/" + f)), fileMode) << f;
  }
}

// Issue 27 (4.10): a FIFO in place of model.pt blocked the load until the
// watchdog fired; it is a corrupt checkpoint naming the file and what it is,
// and the one before it loads.
TEST_F(CkptTest, AFifoInPlaceOfModelPtIsSkippedAtOnceNamingIt) {
  expectAllOk(run("faulty", 2, {"steps=2"}));
  ASSERT_EQ(::unlink(ckpt("step_2/model.pt").c_str()), 0);
  ASSERT_EQ(::mkfifo(ckpt("step_2/model.pt").c_str(), 0600), 0);
  auto again = run("resume", 2, {}, false, seconds(40));
  expectAllOk(again);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 1")) << again.logs[i];
  EXPECT_TRUE(contains(again.logs[0],
                       "cannot read " + ckpt("step_2/model.pt") + ": it is a FIFO (named pipe), not a regular file"))
      << again.logs[0];
}

// 40 steps straight == 20 (+5 more after an async save at 20) then new
// processes resuming at 20 for 20 more, bit for bit, on every rank.
TEST_F(CkptTest, ResumeIsExact) {
  auto losses = [](const std::string& log) {
    std::map<int, std::string> m;
    for (const auto& l : linesOf(log, "LOSS")) m[std::stoi(l)] = l.substr(l.find(' ') + 1);
    return m;
  };
  auto straight = run("train", 2, {"steps=40"});
  expectAllOk(straight);
  distill::PosixFileSystem().removeAll(ckpt());
  auto first = run("train", 2, {"steps=25", "save_at=20", "async=1"});
  expectAllOk(first);
  auto second = run("train", 2, {"steps=40", "resume=1"});
  expectAllOk(second);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(second.logs[r], "RESUMED 20")) << second.logs[r];
    auto want = losses(straight.logs[r]);
    auto a = losses(first.logs[r]), b = losses(second.logs[r]);
    ASSERT_EQ(want.size(), 40u) << straight.logs[r];
    ASSERT_EQ(b.size(), 20u) << second.logs[r];
    for (int s = 1; s <= 40; ++s) {
      const std::string& got = s <= 20 ? a[s] : b[s];
      EXPECT_EQ(got, want[s]) << "rank " << r << " step " << s;
      if (s > 20 && s <= 25) {
        EXPECT_EQ(a[s], want[s]) << "rank " << r << " step " << s << " (after the async save)";
      }
    }
  }
  EXPECT_NE(losses(straight.logs[0])[40], losses(straight.logs[1])[40]); // per-rank data and dropout
}

// Rank 1 dies in the middle of save 2 (after writing its rank file): the others
// fail naming it, promptly; a fresh run loads step 1 and names the partial one.
TEST_F(CkptTest, StudentKilledMidSave) {
  auto r = run("faulty", 3, {"steps=2", "fault_rank=1", "kill_after=step_2.tmp/rank_1.pt", "timeout=20"});
  EXPECT_TRUE(!r.status[1].exited && r.status[1].signal == SIGKILL) << r.status[1].describe() << r.logs[1];
  for (int i : {0, 2}) {
    EXPECT_TRUE(r.status[i].exited && (r.status[i].code == 3 || r.status[i].code == 4))
        << r.status[i].describe() << "\n"
        << r.logs[i];
    EXPECT_TRUE(contains(r.logs[i], "student rank(s) 1 never entered it")) << r.logs[i];
    EXPECT_TRUE(contains(r.logs[i], "checkpoint step 2")) << r.logs[i];
    auto after = linesOf(r.logs[i], "ERROR after");
    ASSERT_FALSE(after.empty()) << r.logs[i];
    std::printf("[ measure ] rank %d failed %s ms after start\n", i, after[0].substr(0, after[0].find(' ')).c_str());
  }
  EXPECT_LT(r.ms, 40000) << "detection must be within 2x the 20 s collective timeout";
  EXPECT_TRUE(fileExists(ckpt("step_2.tmp/rank_1.pt")));
  auto again = run("resume", 3, {});
  expectAllOk(again);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 1")) << again.logs[i];
  EXPECT_TRUE(contains(again.logs[0], "skipping partial checkpoint " + ckpt("step_2.tmp"))) << again.logs[0];
}

// A flipped byte is caught by the checksum: the corrupt checkpoint is skipped
// with a warning naming the file, the previous one loads. A different student
// world size is refused, saying why.
TEST_F(CkptTest, CorruptCheckpointIsSkippedAndWorldSizeIsChecked) {
  auto r = run("faulty", 2, {"steps=2"});
  expectAllOk(r);
  {
    std::fstream f(ckpt("step_2/model.pt"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(100);
    f.write(&c, 1);
  }
  auto again = run("resume", 2, {});
  expectAllOk(again);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 1")) << again.logs[i];
  EXPECT_TRUE(contains(again.logs[0], "skipping corrupt checkpoint " + ckpt("step_2"))) << again.logs[0];
  EXPECT_TRUE(contains(again.logs[0], "corrupt file " + ckpt("step_2/model.pt"))) << again.logs[0];

  auto three = run("resume", 3, {});
  for (int i = 0; i < 3; ++i) {
    expectExit(three, i, 2);
    EXPECT_TRUE(contains(three.logs[i], "saved by 2 student ranks, this run has 3")) << three.logs[i];
    EXPECT_TRUE(contains(three.logs[i], "cannot be re-split")) << three.logs[i];
  }
}

// Disk full on rank 1's rank file, on_error=continue: save 2 fails on every
// rank (false), training goes on, save 3 works; the error names path and errno.
TEST_F(CkptTest, DiskFullWithContinue) {
  auto r = run(
      "faulty", 2,
      {"steps=3", "on_error=continue", "fault_rank=1", "op=write", "nth=1", "err=28", "match=step_2.tmp/rank_1.pt"});
  expectAllOk(r);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(linesOf(r.logs[i], "SAVE"), (std::vector<std::string>{"1 1", "2 0", "3 1"})) << r.logs[i];
  }
  EXPECT_TRUE(contains(r.logs[1], "cannot write " + ckpt("step_2.tmp/rank_1.pt") + ": No space left on device"))
      << r.logs[1];
  EXPECT_TRUE(contains(r.logs[0], "student rank(s) 1 could not write")) << r.logs[0];
  EXPECT_FALSE(fileExists(ckpt("step_2")));
  EXPECT_FALSE(fileExists(ckpt("step_2.tmp")));
  distill::PosixFileSystem fs;
  EXPECT_EQ(distill::verifyCheckpoint(ckpt("step_1"), fs).step, 1);
  EXPECT_EQ(distill::verifyCheckpoint(ckpt("step_3"), fs).step, 3);
}

// Disk full on rank 0's model file, on_error=stop: a CheckpointError on every
// rank; the previous checkpoint loads.
TEST_F(CkptTest, DiskFullWithStop) {
  auto r =
      run("faulty", 2,
          {"steps=3", "on_error=stop", "fault_rank=0", "op=write", "nth=1", "err=28", "match=step_2.tmp/model.pt"});
  for (int i = 0; i < 2; ++i) {
    expectExit(r, i, 2);
    EXPECT_EQ(linesOf(r.logs[i], "SAVE"), std::vector<std::string>{"1 1"}) << r.logs[i];
  }
  EXPECT_TRUE(
      contains(r.logs[0], "cannot write " + ckpt("step_2.tmp/model.pt") + ": No space left on device (errno 28)"))
      << r.logs[0];
  EXPECT_TRUE(contains(r.logs[1], "student rank(s) 0 could not write")) << r.logs[1];
  auto again = run("resume", 2, {});
  expectAllOk(again);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 1")) << again.logs[i];
}

// Publishing fails on rank 0 (rename EIO), on_error=continue: every rank hears it.
TEST_F(CkptTest, PublishFailureReachesEveryRank) {
  auto r = run("faulty", 2,
               {"steps=3", "on_error=continue", "fault_rank=0", "op=rename", "nth=1", "err=5", "match=step_2.tmp"});
  expectAllOk(r);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(linesOf(r.logs[i], "SAVE"), (std::vector<std::string>{"1 1", "2 0", "3 1"})) << r.logs[i];
  }
  EXPECT_TRUE(contains(r.logs[0], "cannot rename " + ckpt("step_2.tmp"))) << r.logs[0];
  EXPECT_TRUE(contains(r.logs[1], "student rank 0 could not publish it")) << r.logs[1];
}

// The directory cannot be made (EACCES; chmod does not stop root, so the seam
// injects it): a CheckpointError on every rank at construction.
TEST_F(CkptTest, UnwritableDirectory) {
  auto r = run("faulty", 2, {"steps=1", "fault_rank=0", "op=mkdir", "nth=1", "err=13", "match=/ckpt"});
  for (int i = 0; i < 2; ++i) expectExit(r, i, 2);
  EXPECT_TRUE(contains(r.logs[0], "cannot create directory " + ckpt() + ": Permission denied")) << r.logs[0];
  EXPECT_TRUE(contains(r.logs[1], "student rank 0 could not create " + ckpt())) << r.logs[1];
}

// Async, on_error=continue: save returns before the write; the step-3 write
// error of rank 1 surfaces at save 4 on every rank; step 4 is then published.
TEST_F(CkptTest, AsyncSaveAndDeferredError) {
  auto r = run("async", 2, {"on_error=continue"});
  expectAllOk(r);
  for (int i = 0; i < 2; ++i) {
    const auto& log = r.logs[i];
    EXPECT_TRUE(contains(log, "SAVE 2 1 returned_before_write=1")) << log;
    EXPECT_TRUE(contains(log, "WAIT 2 1 published=1")) << log;
    EXPECT_TRUE(contains(log, "SAVE 3 1\n")) << log;
    EXPECT_TRUE(contains(log, "SAVE 4 0\n")) << log;
    EXPECT_TRUE(contains(log, "WAIT 4 1\n")) << log;
    std::smatch m;
    if (std::regex_search(log, m, std::regex("in_us=(\\d+)")))
      std::printf("[ measure ] rank %d async save() returned in %s us\n", i, m[1].str().c_str());
  }
  EXPECT_TRUE(contains(
      r.logs[1],
      "checkpoint step 3 not saved: cannot write " + ckpt("step_3.tmp/rank_1.pt") + ": No space left on device"))
      << r.logs[1];
  EXPECT_TRUE(contains(r.logs[0], "checkpoint step 3 not saved: student rank(s) 1")) << r.logs[0];
  EXPECT_FALSE(fileExists(ckpt("step_3")));
  EXPECT_EQ(dt::readFile(ckpt("latest")), "step_4\n");
}

// Async, on_error=stop: the deferred error is a CheckpointError at save 4.
TEST_F(CkptTest, AsyncDeferredErrorStops) {
  auto r = run("async", 2, {"on_error=stop"});
  for (int i = 0; i < 2; ++i) {
    expectExit(r, i, 2);
    EXPECT_TRUE(contains(r.logs[i], "SAVE 3 1\n")) << r.logs[i];
    EXPECT_FALSE(contains(r.logs[i], "SAVE 4")) << r.logs[i];
  }
  EXPECT_TRUE(contains(r.logs[1], "No space left on device")) << r.logs[1];
  EXPECT_TRUE(fileExists(ckpt("step_2/manifest.json")));
}

// ---- async: published before the process leaves (issue 14, item 7) ------------------

// The demo's loop: trains to `stop_at`, saving (async) every 3 steps and at
// the stop, then leaves through the normal path: no wait(), only the
// CheckpointManager's destructor. Prints "SAVED step ok".
DISTILL_TEST_ROLE(asyncstop) {
  Args a = parseArgs(args);
  a["async"] = "1";
  return studentMain(a, [&](distill::StudentContext& ctx) {
    Trainer t(ctx);
    distill::CheckpointManager m(ctx, ctx.config().checkpoint, "teacher-v1");
    const int64_t stopAt = std::stoll(get(a, "stop_at"));
    while (t.train.step < stopAt) {
      t.step();
      if (t.train.step % 3 == 0 || t.train.step == stopAt) {
        report("SAVED " + std::to_string(t.train.step) + " " + std::to_string(t.save(m)));
      }
    }
    return 0;
  });
}

// 2 students, async, stop at step 7 (after saves at 3 and 6): the stop
// checkpoint is published by the time the processes have left, without a
// wait(); a new run resumes from step 7. (Before: step_7.tmp stayed
// unpublished, "never published", and the rerun resumed from 6.)
TEST_F(CkptTest, AsyncStopCheckpointIsPublishedBeforeExit) {
  auto r = run("asyncstop", 2, {"stop_at=7"});
  expectAllOk(r);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(linesOf(r.logs[i], "SAVED"), (std::vector<std::string>{"3 1", "6 1", "7 1"})) << r.logs[i];
    EXPECT_FALSE(contains(r.logs[i], "never published")) << r.logs[i];
  }
  EXPECT_EQ(dt::readFile(ckpt("latest")), "step_7\n");
  EXPECT_FALSE(fileExists(ckpt("step_7.tmp")));
  auto again = run("resume", 2, {});
  expectAllOk(again);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(contains(again.logs[i], "LOADED 7")) << again.logs[i];
}

// ---- the config a checkpoint was saved under (issue 14, item 14) -----------------------

// The warning names the training keys that differ, with both values; keys that
// cannot change the training (log_dir, timeouts) change nothing and are not named.
TEST_F(CkptTest, ConfigChangeWarningNamesTheKeys) {
  auto r = run("faulty", 2, {"steps=1"});
  expectAllOk(r);
  EXPECT_TRUE(fileExists(ckpt("step_1/config.yaml")));
  auto runtimeOnly = run("resume", 2, {"timeout=30", "log_dir=/elsewhere"});
  expectAllOk(runtimeOnly);
  EXPECT_TRUE(contains(runtimeOnly.logs[0], "LOADED 1")) << runtimeOnly.logs[0];
  EXPECT_FALSE(contains(runtimeOnly.logs[0], "another config")) << runtimeOnly.logs[0];

  auto changed = run("resume", 2, {"alpha=0.9", "seed=7", "log_dir=/elsewhere"});
  expectAllOk(changed);
  const std::string& log = changed.logs[0];
  EXPECT_TRUE(contains(log, "LOADED 1")) << log;
  EXPECT_TRUE(contains(log, "checkpoint " + ckpt("step_1") + " was saved under another config")) << log;
  EXPECT_TRUE(contains(log, "loss.alpha: 0.5 -> 0.9")) << log;
  EXPECT_TRUE(contains(log, "run.seed: 0 -> 7")) << log;
  EXPECT_FALSE(contains(log, "run.log_dir")) << log;
  EXPECT_FALSE(contains(log, "collective_timeout_s")) << log;
}

TEST(CkptUnit, ConfigChangesNameTrainingKeysWithBothValues) {
  distill::Config saved;
  saved.teacher.kind = distill::TeacherKind::kSelf;
  saved.trainer.values["lr"] = "3e-3";
  distill::Config now = saved;
  EXPECT_TRUE(distill::configChanges(distill::dumpConfig(saved), now).empty());
  now.run.log_dir = "/x";
  now.loss.temperature = 2.0;
  now.trainer.values.erase("lr");
  now.trainer.values["batch"] = "8";
  EXPECT_EQ(distill::configChanges(distill::dumpConfig(saved), now),
            (std::vector<std::string>{"loss.temperature: 1 -> 2", "trainer.batch: (unset) -> \"8\"",
                                      "trainer.lr: \"3e-3\" -> (unset)"}));
  EXPECT_THROW(distill::configChanges("loss: [", now), distill::ConfigError);
}
