// config_test: a config's values (core/src/config_values.cpp): its dump,
// hash and diff, the key order, the trainer section.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/payload.h"
#include "support/process.h"
#include "config_test_util.h"

using distill::Config;
using distill::ConfigError;
using distill::configHash;
using distill::configKeys;
using distill::dumpConfig;
using distill::parseConfig;
using namespace config_testing;

namespace {

TEST(Config, DumpAndHashAreStableAndSensitive) {
  const Config a = selfDefaults();
  EXPECT_EQ(dumpConfig(a), dumpConfig(selfDefaults()));
  EXPECT_EQ(dumpConfig(a).rfind("run:\n  name: \"distill\"\n  nproc_per_node: 3\n", 0), 0u);
  EXPECT_EQ(configHash(a), configHash(selfDefaults()));
  Config b = a;
  b.source = "elsewhere.yaml"; // not part of the experiment
  EXPECT_EQ(configHash(b), configHash(a));
  b.loss.alpha = 0.5000001;
  EXPECT_NE(configHash(b), configHash(a));
  EXPECT_NE(dumpConfig(b), dumpConfig(a));
  EXPECT_EQ(parseConfig(dumpConfig(b)).loss.alpha, 0.5000001); // doubles dump exactly
}

TEST(Config, KeysInSchemaOrder) {
  const auto keys = configKeys();
  EXPECT_EQ(keys.size(), 80u); // 62 + loss.vocab, loss.max_truncated_mass, teacher.payload_dtype, teacher.vocab_size,
                               // teacher.cache.keys, teacher.cache.dtype, teacher.on_nonfinite, loss.on_nonfinite,
                               // teacher.answer, teacher.hidden_size, teacher.head.{weight, bias, softcap, scale,
                               // on_change}, teacher.samples, transport.cuda_mps,
                               // teacher.request_ids
  EXPECT_EQ(keys.front(), "run.name");
  EXPECT_EQ(keys.back(), "checkpoint.on_corrupt");
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()).size(), keys.size());
}

TEST(Config, TrainerSectionPassesScalarsThrough) {
  const Config c = parseConfig(kSelf +
                                   "trainer:\n"
                                   "  data: /usr/share/common-licenses/GPL-3\n"
                                   "  steps: 600\n"
                                   "  lr: 3.0e-3\n"
                                   "  fast: true\n"
                                   "  note: \"a: b\"\n"
                                   "  nested.name: 7\n",
                               {"trainer.steps=700", "trainer.extra=x=y"});
  EXPECT_EQ(c.trainer.values,
            (std::map<std::string, std::string>{{"data", "/usr/share/common-licenses/GPL-3"},
                                                {"steps", "700"}, // --set wins
                                                {"lr", "3.0e-3"},
                                                {"fast", "true"},
                                                {"note", "a: b"},
                                                {"nested.name", "7"},
                                                {"extra", "x=y"}}));
  const distill::TrainerOptions& t = c.trainer;
  EXPECT_TRUE(t.has("lr"));
  EXPECT_FALSE(t.has("missing"));
  EXPECT_EQ(t.getString("data"), "/usr/share/common-licenses/GPL-3");
  EXPECT_EQ(t.getInt("steps"), 700);
  EXPECT_EQ(t.getDouble("lr"), 3e-3);
  EXPECT_EQ(t.getDouble("steps"), 700.0); // an integer is a number too
  EXPECT_TRUE(t.getBool("fast"));
  EXPECT_EQ(t.getInt("missing", 5), 5);
  EXPECT_EQ(t.getDouble("missing", 0.5), 0.5);
  EXPECT_EQ(t.getString("missing", "dflt"), "dflt");
  EXPECT_FALSE(t.getBool("missing", false));
  // distill's own sections are unaffected
  EXPECT_EQ(dumpConfig(parseConfig(kSelf)), dumpConfig(selfDefaults()));
  EXPECT_TRUE(parseConfig(kSelf + "trainer:\n").trainer.values.empty()); // every key commented out
}

TEST(Config, TrainerGettersNameTheKey) {
  const Config c =
      parseConfig(kSelf + "trainer: {lr: fast, steps: 2.5, big: 99999999999999999999, flag: 1}\n", {}, "exp.yaml");
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const ConfigError& e) {
      return e.message();
    }
    return std::string("no ConfigError");
  };
  const distill::TrainerOptions& t = c.trainer;
  EXPECT_EQ(message([&] { t.getDouble("lr"); }),
            "config exp.yaml: 1 problem(s):\ntrainer.lr: expected a number, found \"fast\"");
  EXPECT_EQ(message([&] { t.getInt("steps", 1); }),
            "config exp.yaml: 1 problem(s):\ntrainer.steps: expected an integer, found \"2.5\"");
  EXPECT_EQ(message([&] { t.getInt("big"); }),
            "config exp.yaml: 1 problem(s):\ntrainer.big: must be in [-9223372036854775808, "
            "9223372036854775807], found 99999999999999999999");
  EXPECT_EQ(message([&] { t.getBool("flag"); }),
            "config exp.yaml: 1 problem(s):\ntrainer.flag: expected a boolean, found \"1\"");
  EXPECT_EQ(message([&] { t.getString("data"); }),
            "config exp.yaml: 1 problem(s):\ntrainer.data: required by the trainer, missing");
  EXPECT_EQ(message([&] {
              t.expectOnly({"lr", "steps", "big", "flags", "data"});
            }),
            "config exp.yaml: 1 problem(s):\ntrainer.flag: unknown key; did you mean trainer.flags?");
  EXPECT_EQ(message([&] { t.expectOnly({"data"}); }),
            "config exp.yaml: 4 problem(s):\n"
            "trainer.big: unknown key; valid keys in trainer: data\n"
            "trainer.flag: unknown key; valid keys in trainer: data\n"
            "trainer.lr: unknown key; valid keys in trainer: data\n"
            "trainer.steps: unknown key; valid keys in trainer: data");
  EXPECT_NO_THROW(t.expectOnly({"lr", "steps", "big", "flag"}));
}

TEST(Config, TrainerOverridesAreCheckedForShape) {
  EXPECT_EQ(problemsOf(kSelf, {"trainer.sizes=[1, 2]"}),
            std::vector<std::string>{"trainer.sizes: expected a scalar (the trainer's keys take strings, numbers "
                                     "or booleans), found a list (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"trainer=3"}),
            std::vector<std::string>{"trainer: expected trainer.KEY=value (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"trainer.=3"}),
            std::vector<std::string>{"trainer.: expected trainer.KEY=value (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"trainer.x=[a"}).size(), 1u);
}

TEST(Config, TrainerSectionRoundTripsAndIsHashed) {
  const Config c = parseConfig(kSelf + "trainer:\n  data: \"we \\\"said\\\" hi\"\n  'odd key': 3\n  on: yes\n");
  EXPECT_EQ(c.trainer.values.at("data"), "we \"said\" hi");
  EXPECT_EQ(c.trainer.values.at("odd key"), "3");
  const std::string dumped = dumpConfig(c);
  EXPECT_NE(dumped.find("trainer:\n"), std::string::npos) << dumped;
  const Config again = parseConfig(dumped);
  EXPECT_EQ(again.trainer.values, c.trainer.values);
  EXPECT_EQ(configHash(again), configHash(c));
  Config d = c;
  d.trainer.values["data"] = "other";
  EXPECT_NE(configHash(d), configHash(c));
  // Without a trainer section the dump (and the hash checkpoints record) is what it was before.
  EXPECT_EQ(dumpConfig(selfDefaults()).find("trainer"), std::string::npos);
}

// What a checkpoint's "saved under another config" warning rests on: keys that
// cannot change the training (log_dir, ports, timeouts, checkpoint schedule)
// keep configHash and are left out of configDiff(..., trainingOnly); a training
// key changes the hash and is named, as is a trainer key set on one side only.
TEST(Config, HashAndDiffCoverTrainingKeysOnly) {
  const Config a = selfDefaults();
  Config runtime = a;
  runtime.run.log_dir = "/elsewhere";
  runtime.run.master_port = a.run.master_port + 1;
  runtime.run.collective_timeout_s = a.run.collective_timeout_s * 2;
  runtime.checkpoint.every_steps = 7;
  runtime.checkpoint.on_corrupt = distill::OnCorrupt::kRestart;
  EXPECT_EQ(configHash(runtime), configHash(a));
  EXPECT_TRUE(distill::configDiff(a, runtime, /*trainingOnly=*/true).empty());
  EXPECT_EQ(distill::configDiff(a, runtime),
            (std::vector<std::string>{"run.master_port", "run.log_dir", "run.collective_timeout_s",
                                      "checkpoint.every_steps", "checkpoint.on_corrupt"}));

  Config training = runtime;
  training.loss.alpha = 0.9;
  training.run.seed = a.run.seed + 1;
  training.trainer.values["lr"] = "1e-3";
  EXPECT_NE(configHash(training), configHash(a));
  EXPECT_EQ(distill::configDiff(a, training, true), (std::vector<std::string>{"run.seed", "loss.alpha", "trainer.lr"}));
  // configEntries says which keys are which.
  for (const auto& e : distill::configEntries(a)) {
    if (e.key == "run.log_dir" || e.key == "checkpoint.on_corrupt") {
      EXPECT_FALSE(e.training) << e.key;
    }
    if (e.key == "loss.alpha" || e.key == "run.seed") {
      EXPECT_TRUE(e.training) << e.key;
    }
  }
}

} // namespace
