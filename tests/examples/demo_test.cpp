// The demo end to end at a tiny size: the teacher trained alone, a distilled
// run through distill-run interrupted with SIGINT after a checkpoint, then
// examples/gpt/demo.sh (what `cmake/distill.sh demo` runs) skipping the
// finished teacher, training the label-only student, resuming the distilled
// run where it stopped, and writing metrics, the plot and summary.json.
#include <signal.h>

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <regex>
#include <set>

#include "demo_common.h"
#include "demo_support.h"
#include "distill/ckpt/file_system.h"
#include "distill/core/config.h"
#include "distill/core/errors.h"

using namespace distill::testing;
using namespace distill::testing::demo;
namespace ex = distill::examples;

namespace {

uint32_t be32(const std::string& s, size_t at) {
  return (static_cast<uint32_t>(static_cast<uint8_t>(s[at])) << 24) |
      (static_cast<uint32_t>(static_cast<uint8_t>(s[at + 1])) << 16) |
      (static_cast<uint32_t>(static_cast<uint8_t>(s[at + 2])) << 8) | static_cast<uint8_t>(s[at + 3]);
}

// Checks a PNG's signature and every chunk's CRC; returns "WxH" from IHDR.
std::string checkPng(const std::string& png) {
  EXPECT_GE(png.size(), 8u + 25u + 12u);
  if (png.size() < 45) return "";
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  std::vector<std::string> types;
  for (size_t at = 8; at + 12 <= png.size();) {
    const uint32_t len = be32(png, at);
    EXPECT_LE(at + 12 + len, png.size());
    if (at + 12 + len > png.size()) break;
    const std::string type = png.substr(at + 4, 4);
    EXPECT_EQ(be32(png, at + 8 + len),
              static_cast<uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(png.data() + at + 4), 4 + len)))
        << "chunk " << type;
    types.push_back(type);
    at += 12 + len;
  }
  // IHDR first, image data, IEND last (matplotlib adds text and pHYs chunks between).
  EXPECT_TRUE(!types.empty() && types.front() == "IHDR" && types.back() == "IEND") << ::testing::PrintToString(types);
  EXPECT_NE(std::find(types.begin(), types.end(), "IDAT"), types.end()) << ::testing::PrintToString(types);
  return std::to_string(be32(png, 16)) + "x" + std::to_string(be32(png, 20));
}

} // namespace

// The plot (examples/gpt/plot.py, matplotlib) from a phase folder's files: a
// whole PNG of 900 x 560; a missing file is an error naming it.
TEST(DemoPieces, PlotScriptDrawsThePhases) {
  TinyDemo demo;
  auto write = [&](const std::string& phase, const std::string& file, const std::string& text) {
    ex::makeDirs(demo.logDir + "/" + phase);
    std::ofstream(demo.phaseFile(phase, file)) << text;
  };
  write("teacher", "done.json", "{\"val_loss\": 2.0, \"steps\": 10}\n");
  write("distilled", "done.json", "{\"val_loss\": 2.1, \"steps\": 10}\n");
  for (const char* phase : {"distilled", "label_only"}) {
    write(phase, "metrics.jsonl",
          "{\"step\": 0, \"val_loss\": 3.0}\n{\"step\": 1, \"loss\": 2.9}\n{\"step\": 10, \"val_loss\": 2.2}\n");
  }
  const std::vector<std::string> plot = {DISTILL_GPT_PYTHON, sourcePath("examples/gpt/plot.py"), demo.logDir};
  Console ok(plot);
  const ExitStatus st = ok.finish(Ms(60000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << ok.text();
  EXPECT_EQ(checkPng(readFile(demo.logDir + "/val_loss.png")), "900x560");

  ex::removeTree(demo.phaseFile("label_only", "metrics.jsonl"));
  Console missing(plot);
  const ExitStatus st2 = missing.finish(Ms(60000));
  EXPECT_TRUE(st2.exited && st2.code == 1) << st2.describe();
  EXPECT_NE(missing.text().find(demo.phaseFile("label_only", "metrics.jsonl")), std::string::npos) << missing.text();
}

TEST(DemoPieces, JsonRoundTrip) {
  const std::string line = ex::JsonLine().add("phase", "a \"b\"\n").add("step", int64_t{12}).add("loss", 1.5).str();
  auto obj = ex::parseJson(line);
  EXPECT_EQ(obj["phase"], "a \"b\"\n");
  EXPECT_EQ(ex::jsonNumber(obj, "step", -1), 12);
  EXPECT_EQ(ex::jsonNumber(obj, "loss", -1), 1.5);
  EXPECT_THROW(ex::parseJson("{\"a\": 1"), std::runtime_error);
}

// The shipped demo configs load, and their trainer sections hold only known keys.
TEST(DemoPieces, ShippedConfigsAreValid) {
  for (const char* name : {"configs/demo.yaml", "configs/demo-torchscript.yaml"}) {
    SCOPED_TRACE(name);
    const distill::Config cfg = distill::loadConfig(sourcePath(name));
    const ex::Settings s = ex::Settings::fromConfig(cfg);
    EXPECT_EQ(cfg.run.nproc_per_node, 3);
    EXPECT_EQ(cfg.teacher.threads, 1);
    EXPECT_EQ(s.threads, 1);
  }
  const distill::Config cfg = distill::loadConfig(sourcePath("configs/demo.yaml"));
  EXPECT_EQ(cfg.teacher.weights, ex::Settings::fromConfig(cfg).teacherWeights);
  // A typo in a trainer key is an error naming it.
  try {
    ex::Settings::fromConfig(distill::loadConfig(sourcePath("configs/demo.yaml"), {"trainer.studnet_dim=8"}));
    ADD_FAILURE() << "no ConfigError";
  } catch (const distill::ConfigError& e) {
    EXPECT_NE(e.message().find("trainer.studnet_dim: unknown key; did you mean trainer.student_dim?"),
              std::string::npos)
        << e.message();
  }
}

TEST(Demo, InterruptedDistilledRunResumesAndTheDemoFinishes) {
  TinyDemo demo;
  const auto t0 = SteadyClock::now();

  // 1. The teacher, alone.
  {
    Console teacher({binPath("distill-gpt"), "train-teacher", "--config", demo.config});
    const ExitStatus st = teacher.finish(Ms(60000));
    ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << teacher.text();
    ASSERT_TRUE(ex::fileExists(demo.weights)) << teacher.text();
  }

  // 2. A distilled run that would never end on its own, stopped by SIGINT to
  //    distill-run once a checkpoint exists.
  int64_t stoppedAt = -1;
  {
    Console run({binPath("distill-run"), "--config", demo.config, "--set", "run.steps=100000", "--",
                 binPath("distill-gpt"), "distill"},
                {{"OMP_NUM_THREADS", "1"}});
    ASSERT_TRUE(run.waitFor("checkpoint saved at step 5", Ms(40000))) << run.text();
    ::kill(run.pid(), SIGINT);
    const ExitStatus st = run.finish(Ms(30000));
    EXPECT_TRUE(st.exited && st.code == 128 + SIGINT) << st.describe() << "\n" << run.text();
    std::smatch m;
    const std::string text = run.text();
    ASSERT_TRUE(std::regex_search(text, m, std::regex(R"(\[distilled\] stopped at step (\d+))"))) << text;
    stoppedAt = std::stoll(m[1]);
    EXPECT_GE(stoppedAt, 5);
    EXPECT_NE(text.find("checkpoint saved at step " + std::to_string(stoppedAt)), std::string::npos) << text;
  }

  // 3. The demo script, as `cmake/distill.sh demo` runs it: the teacher is
  //    skipped, the distilled run resumes at stoppedAt + 1.
  const int64_t steps = stoppedAt + 12;
  Console script({"bash", sourcePath("examples/gpt/demo.sh"), "--build", binPath(".."), "--config", demo.config,
                  "--set", "run.steps=" + std::to_string(steps)});
  const ExitStatus st = script.finish(Ms(60000));
  const std::string text = script.text();
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << text;
  EXPECT_NE(text.find("[teacher] already finished"), std::string::npos) << text;
  EXPECT_NE(text.find("[distilled] resumed from step " + std::to_string(stoppedAt) + " (launch 2)"), std::string::npos)
      << text;
  EXPECT_EQ(text.find("[label_only] resumed"), std::string::npos) << text;
  // Issue 27: the cached phase runs with checkpoint.dir "": no save, and no word of a failed one.
  EXPECT_EQ(text.find("[distilled_cached] checkpoint"), std::string::npos) << text;
  EXPECT_EQ(text.find("not saved"), std::string::npos) << text;

  // Every step trained exactly once: the first launch up to the stop, the second after it.
  for (const char* phase : {"distilled", "label_only"}) {
    SCOPED_TRACE(phase);
    std::map<int64_t, int> seen;
    std::set<int64_t> valSteps;
    for (auto& rec : readMetrics(demo.phaseFile(phase, "metrics.jsonl"))) {
      const int64_t step = static_cast<int64_t>(ex::jsonNumber(rec, "step", -1));
      const int64_t launch = static_cast<int64_t>(ex::jsonNumber(rec, "launch", -1));
      if (rec.count("val_loss")) {
        valSteps.insert(step);
        EXPECT_TRUE(std::isfinite(ex::jsonNumber(rec, "val_loss", NAN)));
        continue;
      }
      ++seen[step];
      EXPECT_TRUE(std::isfinite(ex::jsonNumber(rec, "loss", NAN))) << step;
      const bool interrupted = std::string(phase) == "distilled";
      EXPECT_EQ(launch, interrupted && step > stoppedAt ? 2 : 1) << "step " << step;
      if (interrupted) {
        EXPECT_TRUE(rec.count("kd")) << step;
      }
    }
    ASSERT_EQ(seen.size(), static_cast<size_t>(steps));
    EXPECT_EQ(seen.begin()->first, 1);
    EXPECT_EQ(seen.rbegin()->first, steps);
    for (auto& [step, n] : seen) EXPECT_EQ(n, 1) << "step " << step << " trained " << n << " times";
    EXPECT_TRUE(valSteps.count(0) && valSteps.count(10) && valSteps.count(steps)) << valSteps.size();
  }

  // summary.json: exactly these keys, numbers. The second distilled student
  // (phase 4, loss.temperature 2) was answered from the cache the first one
  // wrote across its two launches: every row it asked for was stored (the
  // share is the teacher's, published after each batch).
  auto summary = ex::parseJson(readFile(demo.logDir + "/summary.json"));
  std::set<std::string> keys;
  for (auto& kv : summary) keys.insert(kv.first);
  EXPECT_EQ(keys,
            (std::set<std::string>{"teacher_val_loss", "label_only_val_loss", "distilled_val_loss", "steps", "seconds",
                                   "distilled_cached_val_loss", "teacher_cache_hit_share", "label_only_seconds",
                                   "distilled_seconds", "distilled_cached_seconds", "cache_bytes_per_token"}));
  EXPECT_EQ(ex::jsonNumber(summary, "steps", -1), steps);
  for (const char* k : {"teacher_val_loss", "label_only_val_loss", "distilled_val_loss", "seconds",
                        "distilled_cached_val_loss", "distilled_cached_seconds", "cache_bytes_per_token"}) {
    const double v = ex::jsonNumber(summary, k, NAN);
    EXPECT_TRUE(std::isfinite(v) && v > 0) << k << " = " << v;
  }
  EXPECT_GE(ex::jsonNumber(summary, "teacher_cache_hit_share", NAN), 0.9) << readFile(demo.logDir + "/summary.json");
  // Another temperature, the same teacher answers: another loss.
  EXPECT_NE(ex::jsonNumber(summary, "distilled_cached_val_loss", NAN),
            ex::jsonNumber(summary, "distilled_val_loss", NAN));
  EXPECT_NE(text.find("took "), std::string::npos) << text;
  EXPECT_NE(text.find("distilled student"), std::string::npos) << text; // the closing table
  EXPECT_EQ(checkPng(readFile(demo.logDir + "/val_loss.png")), "900x560");

  // Running it again is quick: every phase is finished.
  Console again({"bash", sourcePath("examples/gpt/demo.sh"), "--build", binPath(".."), "--config", demo.config, "--set",
                 "run.steps=" + std::to_string(steps)});
  const ExitStatus st2 = again.finish(Ms(30000));
  EXPECT_TRUE(st2.exited && st2.code == 0) << again.text();
  for (const char* phase : {"teacher", "label_only", "distilled", "distilled_cached"}) {
    EXPECT_NE(again.text().find(std::string("[") + phase + "] already finished"), std::string::npos) << again.text();
  }
  std::printf("tiny demo with an interruption: %.1f s\n",
              std::chrono::duration<double>(SteadyClock::now() - t0).count());
}

// Issue 14 items 7 and 9, through the demo as written: with checkpoint.async
// the stop checkpoint that the trainer reports saved is published before the
// students leave (before: step_N.tmp, "never published", and the rerun
// started from an earlier checkpoint or step 0); when every checkpoint is
// corrupt the rerun fails naming each, and metrics.jsonl is left alone
// (before: a silent start from step 0 that truncated it); repaired, it resumes.
TEST(Demo, AsyncStopCheckpointIsPublishedAndCorruptCheckpointsStopTheRun) {
  TinyDemo demo;
  {
    Console teacher({binPath("distill-gpt"), "train-teacher", "--config", demo.config});
    const ExitStatus st = teacher.finish(Ms(60000));
    ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << teacher.text();
  }
  auto distilled = [&](int64_t steps) {
    return std::vector<std::string>{binPath("distill-run"),
                                    "--config",
                                    demo.config,
                                    "--set",
                                    "run.steps=" + std::to_string(steps),
                                    "--set",
                                    "checkpoint.async=true",
                                    "--",
                                    binPath("distill-gpt"),
                                    "distill"};
  };
  int64_t stoppedAt = -1;
  {
    Console run(distilled(100000), {{"OMP_NUM_THREADS", "1"}});
    ASSERT_TRUE(run.waitFor("checkpoint saved at step 5", Ms(40000))) << run.text();
    ::kill(run.pid(), SIGINT);
    const ExitStatus st = run.finish(Ms(30000));
    EXPECT_TRUE(st.exited && st.code == 128 + SIGINT) << st.describe() << "\n" << run.text();
    std::smatch m;
    const std::string text = run.text();
    ASSERT_TRUE(std::regex_search(text, m, std::regex(R"(\[distilled\] stopped at step (\d+))"))) << text;
    stoppedAt = std::stoll(m[1]);
    EXPECT_EQ(text.find("never published"), std::string::npos) << text;
  }
  const std::string ckpt = demo.logDir + "/distilled/checkpoints";
  const std::string stopped = "step_" + std::to_string(stoppedAt);
  EXPECT_EQ(readFile(ckpt + "/latest"), stopped + "\n");
  EXPECT_TRUE(ex::fileExists(ckpt + "/" + stopped + "/manifest.json"));
  EXPECT_FALSE(ex::fileExists(ckpt + "/" + stopped + ".tmp"));

  // Every checkpoint corrupt: the run fails naming each; nothing is lost.
  std::vector<std::string> steps;
  for (const auto& name : distill::PosixFileSystem().list(ckpt)) {
    if (name.rfind("step_", 0) == 0 && name.find(".tmp") == std::string::npos) steps.push_back(name);
  }
  ASSERT_FALSE(steps.empty());
  auto flip = [](const std::string& path) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(64);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(64);
    f.write(&c, 1);
  };
  for (const auto& s : steps) flip(ckpt + "/" + s + "/model.pt");
  const std::string metrics = readFile(demo.phaseFile("distilled", "metrics.jsonl"));
  ASSERT_FALSE(metrics.empty());
  {
    Console run(distilled(stoppedAt + 3), {{"OMP_NUM_THREADS", "1"}});
    const ExitStatus st = run.finish(Ms(60000));
    const std::string text = run.text();
    EXPECT_FALSE(st.exited && st.code == 0) << st.describe() << "\n" << text;
    EXPECT_NE(text.find("no intact checkpoint in " + ckpt), std::string::npos) << text;
    for (const auto& s : steps) EXPECT_NE(text.find(ckpt + "/" + s + ": corrupt file"), std::string::npos) << text;
    EXPECT_EQ(text.find("[distilled] resumed"), std::string::npos) << text;
  }
  EXPECT_EQ(readFile(demo.phaseFile("distilled", "metrics.jsonl")), metrics);

  // Repaired: the run resumes where it stopped and finishes.
  for (const auto& s : steps) flip(ckpt + "/" + s + "/model.pt");
  Console run(distilled(stoppedAt + 3), {{"OMP_NUM_THREADS", "1"}});
  const ExitStatus st = run.finish(Ms(60000));
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << run.text();
  EXPECT_NE(run.text().find("[distilled] resumed from step " + std::to_string(stoppedAt) + " (launch 2)"),
            std::string::npos)
      << run.text();
}
