// config_test: reading a config (core/src/config_read.cpp): sizes, --set
// overrides, YAML errors, files, suggestions for a misspelt key.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "distill/core/answer_kinds.h"
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

TEST(Config, ByteSizes) {
  auto bytes = [](const std::string& v) {
    return parseConfig(kSelf + "transport:\n  max_request_bytes: " + v + "\n").transport.max_request_bytes;
  };
  EXPECT_EQ(bytes("4096"), 4096);
  EXPECT_EQ(bytes("2KiB"), 2048);
  EXPECT_EQ(bytes("64MiB"), int64_t{64} << 20);
  EXPECT_EQ(bytes("1 GiB"), int64_t{1} << 30);
  EXPECT_EQ(bytes("\"8MiB\""), int64_t{8} << 20);
  EXPECT_EQ(bytes("3GiB"), int64_t{3} << 30); // past int32
  EXPECT_EQ(bytes("auto"), 0); // computed from the teacher's keys (core/payload.h)
  EXPECT_EQ(bytes("0"), 0);

  auto problem = [](const std::string& v) {
    const auto p = problemsOf(kSelf + "transport:\n  max_request_bytes: " + v + "\n");
    return p.empty() ? std::string() : p[0];
  };
  const std::string key = "transport.max_request_bytes: ";
  EXPECT_EQ(problem("1.5GiB"), key + "expected a byte size or auto, found string \"1.5GiB\"");
  EXPECT_EQ(problem("MiB"), key + "expected a byte size or auto, found string \"MiB\"");
  EXPECT_EQ(problem("\"4096\""), key + "expected a byte size or auto, found string \"4096\"");
  EXPECT_EQ(problem("[1]"), key + "expected a byte size or auto, found a list");
  EXPECT_EQ(problem("Auto"), key + "expected a byte size or auto, found string \"Auto\"");
  EXPECT_EQ(problem("-1"), key + "must be >= 0, found -1");
  EXPECT_EQ(problem("99999999999GiB"),
            key + "must be in [-9223372036854775808, 9223372036854775807], found 99999999999GiB");
}

TEST(Config, ExtractSetOverrides) {
  std::vector<std::string> args = {"prog",        "--set", "a.b=1", "--config", "x.yaml",
                                   "--set=c.d=2", "--",    "--set", "e.f=3"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int argc = static_cast<int>(args.size());
  EXPECT_EQ(distill::extractSetOverrides(argc, argv.data()), (std::vector<std::string>{"a.b=1", "c.d=2"}));
  ASSERT_EQ(argc, 6);
  EXPECT_EQ(std::vector<std::string>(argv.begin(), argv.begin() + argc),
            (std::vector<std::string>{"prog", "--config", "x.yaml", "--", "--set", "e.f=3"}));
  EXPECT_EQ(argv[argc], nullptr);

  std::vector<std::string> bad = {"prog", "--set"};
  std::vector<char*> badArgv = {bad[0].data(), bad[1].data(), nullptr};
  int badArgc = 2;
  EXPECT_THROW(distill::extractSetOverrides(badArgc, badArgv.data()), ConfigError);
}

TEST(Config, SyntaxErrorNamesLineAndColumn) {
  try {
    parseConfig("loss:\n  alpha: [1, 2\n", {}, "exp.yaml");
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message().rfind("config exp.yaml: YAML syntax error at line ", 0), 0u) << e.message();
    EXPECT_NE(e.message().find(", column "), std::string::npos) << e.message();
  }
}

TEST(Config, LoadConfig) {
  const std::string missing = "/nonexistent/distill/exp.yaml";
  try {
    distill::loadConfig(missing);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(e.message().find(missing), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("No such file or directory"), std::string::npos) << e.message();
  }

  const std::string path = "/tmp/" + distill::testing::uniqueName() + ".yaml";
  std::ofstream(path) << kSelf << "loss:\n  alpha: 2\n";
  try {
    distill::loadConfig(path);
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(), "config " + path + ": 1 problem(s):\nloss.alpha: must be in [0, 1], found 2");
  }
  const Config c = distill::loadConfig(path, {"loss.alpha=0.75"});
  EXPECT_EQ(c.source, path);
  EXPECT_EQ(c.loss.alpha, 0.75);
  ::unlink(path.c_str());
}

TEST(Config, ReferenceFileSetsEveryKeyToItsDefault) {
  const std::string path = distill::testing::sourcePath("configs/reference.yaml");
  const std::string text = distill::testing::readFile(path);
  ASSERT_FALSE(text.empty()) << path;

  // The keys the file spells out: "section:" lines, then indented "key:" lines;
  // a key line with no value opens a group ("  cache:"), whose keys are indented further.
  std::vector<std::string> present;
  std::string section, group;
  for (const std::string& line : splitLines(text)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (line[0] != ' ') {
      section = line.substr(0, colon);
      group.clear();
      continue;
    }
    const size_t start = line.find_first_not_of(' ');
    const std::string name = line.substr(start, colon - start);
    const size_t value = line.find_first_not_of(' ', colon + 1);
    if (start == 2 && (value == std::string::npos || line[value] == '#')) {
      group = name;
    } else if (start == 2) {
      group.clear();
      present.push_back(section + "." + name);
    } else {
      present.push_back(section + "." + group + "." + name);
    }
  }
  EXPECT_EQ(present, configKeys());

  const Config c = distill::loadConfig(path);
  Config expected;
  expected.teacher.kind = distill::TeacherKind::kTorchscript;
  expected.teacher.path = "teacher.pt";
  EXPECT_EQ(dumpConfig(c), dumpConfig(expected));
}

// Issue 14 item 12: an override is one line; DISTILL_SET hands them to the
// ranks one per line, so a newline would make the launcher and the ranks read
// different configs. Refused, naming the key.
TEST(Config, OverridesRefuseControlCharacters) {
  const std::string hint = " (a double-quoted YAML value can carry it escaped) (from --set)";
  EXPECT_EQ(problemsOf(kSelf, {"run.name=a\nrun.seed=5"}),
            std::vector<std::string>{"run.name: an override must be one line of printable text, found the control "
                                     "character \\n at byte 10" +
                                     hint});
  EXPECT_EQ(problemsOf(kSelf, {"trainer.data=x\ty"}),
            std::vector<std::string>{"trainer.data: an override must be one line of printable text, found the "
                                     "control character \\t at byte 14" +
                                     hint});
  EXPECT_EQ(problemsOf(kSelf, {"lo\rss.alpha=1"}),
            std::vector<std::string>{"lo\\x0dss.alpha: an override must be one line of printable text, found the "
                                     "control character \\x0d at byte 2" +
                                     hint});
  // Escaped in a YAML double-quoted value it is one line, and means the same everywhere.
  EXPECT_EQ(parseConfig(kSelf, {"run.name=\"a\\nb\""}).run.name, "a\nb");
}

// A string option becomes an override that reads back exactly: no YAML
// meaning (a colon, a '#', brackets, a leading '*') gets in the way.
TEST(Config, StringOverrideReadsBackVerbatim) {
  for (const std::string v : {"/tmp/a: b", "#not a comment", "[x, y]", "*alias", "  spaced  ", "it's \"q\"",
                              "tab\there", "new\nline", "yes", "1e3", "~"}) {
    SCOPED_TRACE(v);
    const std::string o = distill::stringOverride("run.log_dir", v);
    EXPECT_EQ(o.find('\n'), std::string::npos) << o;
    EXPECT_EQ(parseConfig(kSelf, {o}).run.log_dir, v);
  }
  EXPECT_EQ(parseConfig(kSelf, {distill::stringOverride("trainer.data", "a: b")}).trainer.values.at("data"), "a: b");
}

// Issue 39 item 5: `--set checkpoint.dir=` was refused as null; an empty value is the
// empty string, as `dir: ""` in the file (checkpoints off), for any string key and the
// trainer's; a key of another type says it found an empty string.
TEST(Config, EmptyOverrideIsTheEmptyString) {
  const Config c = parseConfig(kSelf + "checkpoint:\n  dir: /tmp/ckpt\n",
                               {"checkpoint.dir=", "teacher.cache.path= ", "trainer.note="});
  EXPECT_EQ(c.checkpoint.dir, "");
  EXPECT_EQ(c.teacher.cache.path, "");
  EXPECT_EQ(c.trainer.values.at("note"), "");
  EXPECT_EQ(problemsOf(kSelf, {"run.steps="}),
            std::vector<std::string>{"run.steps: expected an integer, found string \"\" (from --set)"});
}

// Issue 14 item 12: a file with a second YAML document was read up to the
// `---` and the rest silently dropped.
TEST(Config, SecondYamlDocumentIsAnError) {
  const std::string path = "/tmp/" + distill::testing::uniqueName() + ".yaml";
  std::ofstream(path) << kSelf << "loss:\n  alpha: 0.1\n---\nloss:\n  alpha: 0.9\n";
  try {
    distill::loadConfig(path);
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(),
              "config " + path +
                  ": holds 2 YAML documents (the second from line 6); a config is one document: "
                  "remove the '---' line(s) or split the file");
  }
  ::unlink(path.c_str());
  EXPECT_THROW(parseConfig(kSelf + "---\n"), ConfigError);
  EXPECT_THROW(parseConfig(kSelf + "...\n---\nrun: {seed: 1}\n"), ConfigError);
  // One document with its explicit start (and end) marker is fine.
  EXPECT_EQ(parseConfig("---\n" + kSelf + "run: {seed: 4}\n...\n").run.seed, 4);
}

// distill-run's options are overrides of their keys: the schema's ranges
// apply, and a problem names the option the user typed.
TEST(Config, OptionOverridesNameTheirOption) {
  const std::string path = "/tmp/" + distill::testing::uniqueName() + ".yaml";
  std::ofstream(path) << kSelf;
  try {
    distill::loadConfig(path,
                        std::vector<distill::ConfigOverride>{{"run.master_port=70000", "--master-port"},
                                                             {"run.nproc_per_node=2000000000", "--nproc-per-node"},
                                                             {"run.nnodes=x", "--nnodes"},
                                                             {"loss.alpha=2", "--set"}});
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(),
              "config " + path +
                  ": 4 problem(s):\n"
                  "run.nproc_per_node: must be in [2, 256], found 2000000000 (from --nproc-per-node)\n"
                  "run.nnodes: expected an integer, found string \"x\" (from --nnodes)\n"
                  "run.master_port: must be in [0, 65535], found 70000 (from --master-port)\n"
                  "loss.alpha: must be in [0, 1], found 2 (from --set)");
  }
  const Config c = distill::loadConfig(
      path,
      std::vector<distill::ConfigOverride>{{"run.nproc_per_node=4", "--nproc-per-node"},
                                           {"run.nproc_per_node=5", "--set"},
                                           {distill::stringOverride("run.log_dir", "/tmp/x y"), "--log-dir"}});
  EXPECT_EQ(c.run.nproc_per_node, 5); // the later one wins
  EXPECT_EQ(c.run.log_dir, "/tmp/x y");
  ::unlink(path.c_str());
}

// Issue 14 item 15: `trainer.lrate` suggested `trainer.data` (3 edits, as many
// as to `lr`): a name that starts the typo, or is spelled inside it, is what
// the user meant.
TEST(Config, SuggestionsPreferPrefixesAndSubsequences) {
  const Config c = parseConfig(kSelf + "trainer: {lrate: 1, studnet_dim: 2, bsz: 3, warmup_step: 4}\n", {}, "x.yaml");
  try {
    c.trainer.expectOnly({"data", "lr", "student_dim", "batch_size", "warmup_steps", "eval_every"});
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(),
              "config x.yaml: 4 problem(s):\n"
              "trainer.bsz: unknown key; did you mean trainer.batch_size?\n"
              "trainer.lrate: unknown key; did you mean trainer.lr?\n"
              "trainer.studnet_dim: unknown key; did you mean trainer.student_dim?\n"
              "trainer.warmup_step: unknown key; did you mean trainer.warmup_steps?");
  }
  EXPECT_EQ(problemsOf(kSelf + "loss:\n  temp: 2\n"),
            std::vector<std::string>{"loss.temp: unknown key; did you mean loss.temperature?"});
  EXPECT_EQ(problemsOf(kSelf + "student:\n  grad_acc: 2\n"),
            std::vector<std::string>{"student.grad_acc: unknown key; did you mean student.grad_acc_steps?"});
  EXPECT_EQ(problemsOf(kSelf + "run:\n  timeout_s: 2\n"),
            std::vector<std::string>{"run.timeout_s: unknown key; did you mean run.hang_timeout_s?"});
}

// Issue 16: teacher.cache is a group of keys, written as a nested map in a file
// and as the whole path in --set; its keys get the same errors as any other.
TEST(Config, NestedCacheKeys) {
  const std::string teacher = "teacher:\n  kind: self\n";
  const Config c = parseConfig(teacher + "  cache:\n    path: /tmp/c\n    mode: readwrite\n    max_bytes: 4GiB\n");
  EXPECT_EQ(c.teacher.cache.path, "/tmp/c");
  EXPECT_EQ(c.teacher.cache.mode, distill::CacheMode::kReadWrite);
  EXPECT_EQ(c.teacher.cache.max_bytes, int64_t(4) << 30);
  EXPECT_EQ(Config().teacher.cache.mode, distill::CacheMode::kOff);
  const Config o = parseConfig(teacher, {"teacher.cache.mode=read", "teacher.cache.path=/x"});
  EXPECT_EQ(o.teacher.cache.mode, distill::CacheMode::kRead);
  EXPECT_EQ(o.teacher.cache.path, "/x");
  // The dump writes the group nested and reads back the same.
  EXPECT_NE(dumpConfig(c).find("  cache:\n    path: "), std::string::npos) << dumpConfig(c);
  EXPECT_EQ(dumpConfig(parseConfig(dumpConfig(c))), dumpConfig(c));
  // Runtime keys: the cache changes no answer, so not what is trained.
  EXPECT_EQ(configHash(c), configHash(parseConfig(teacher)));

  EXPECT_EQ(problemsOf(teacher + "  cache:\n    pth: /x\n"),
            (std::vector<std::string>{"teacher.cache.pth: unknown key; did you mean teacher.cache.path?"}));
  EXPECT_EQ(
      problemsOf(teacher, {"teacher.cache.mod=read"}),
      (std::vector<std::string>{"teacher.cache.mod: unknown key; did you mean teacher.cache.mode? (from --set)"}));
  EXPECT_EQ(problemsOf(teacher + "  cache: on\n"),
            (std::vector<std::string>{
                "teacher.cache: expected a map of path, mode, max_bytes, on_corrupt, keys, dtype, found string \"on\""}));
  EXPECT_EQ(
      problemsOf(teacher + "  cache:\n    mode: always\n"),
      (std::vector<std::string>{"teacher.cache.mode: must be one of off, read, write, readwrite; found \"always\""}));
  EXPECT_EQ(problemsOf(teacher + "  cache:\n    mode: read\n"),
            (std::vector<std::string>{"teacher.cache.path: required when teacher.cache.mode is read"}));
  EXPECT_EQ(problemsOf(teacher + "  cache:\n    path: /x\n    max_bytes: 1KiB\n"),
            (std::vector<std::string>{"teacher.cache.max_bytes: must be >= 1048576, found 1KiB"}));
}

} // namespace

// Issue 43: teacher.answer picks the answer kind (auto: the old rule), hidden
// takes the head's keys; the combinations that cannot be are ConfigErrors
// naming the keys.
TEST(Config, TheAnswerKindAndTheHiddenStateHead) {
  using distill::AnswerKind;
  const std::string teacher = "teacher:\n  kind: self\n";
  EXPECT_EQ(distill::answerKindOf(parseConfig(teacher).teacher), AnswerKind::kLogits);
  EXPECT_EQ(distill::answerKindOf(parseConfig(teacher + "  topk: 8\n").teacher), AnswerKind::kTopk);
  EXPECT_EQ(distill::answerKindOf(parseConfig(teacher + "  answer: topk\n  topk: 8\n").teacher), AnswerKind::kTopk);
  EXPECT_EQ(distill::answerKindOf(parseConfig(teacher + "  answer: logits\n").teacher), AnswerKind::kLogits);
  const Config c = parseConfig(teacher +
                               "  answer: hidden\n  hidden_size: 32\n  head:\n    weight: fc.weight\n    bias: fc.bias\n"
                               "    softcap: 30\n    scale: 0.5\n    on_change: adopt\n");
  EXPECT_EQ(distill::answerKindOf(c.teacher), AnswerKind::kHidden);
  EXPECT_EQ(c.teacher.head.weight, "fc.weight");
  EXPECT_EQ(c.teacher.head.bias, "fc.bias");
  EXPECT_EQ(c.teacher.head.softcap, 30);
  EXPECT_EQ(c.teacher.head.scale, 0.5);
  EXPECT_EQ(c.teacher.head.on_change, distill::HeadOnChange::kAdopt);
  EXPECT_EQ(Config().teacher.head.weight, "lm_head.weight");
  EXPECT_EQ(Config().teacher.head.on_change, distill::HeadOnChange::kRefuse);
  EXPECT_EQ(dumpConfig(parseConfig(dumpConfig(c))), dumpConfig(c));
  EXPECT_NE(configHash(c), configHash(parseConfig(teacher))) << "the answer kind is what is trained on";
  Config refuse = c;
  refuse.teacher.head.on_change = distill::HeadOnChange::kRefuse;
  EXPECT_EQ(configHash(refuse), configHash(c)) << "teacher.head.on_change is runtime";
  // Bytes per token: d_t payload values; the slots are sized by teacher.hidden_size.
  Config sized = c;
  sized.teacher.payload_dtype = distill::PayloadDtype::kBFloat16;
  EXPECT_EQ(distill::answerBytesPerToken(sized.teacher), 64.0);
  sized.teacher.hidden_size = 0;
  EXPECT_EQ(distill::answerBytesPerToken(sized.teacher), 0.0);
  EXPECT_EQ(distill::describeAnswer(c.teacher), "hidden states of d=32");

  EXPECT_EQ(problemsOf(teacher + "  answer: topk\n"),
            (std::vector<std::string>{"teacher.answer: topk needs teacher.topk > 0 (the k answered), found 0"}));
  EXPECT_EQ(problemsOf(teacher + "  answer: hidden\n  topk: 8\n"),
            (std::vector<std::string>{"teacher.answer: hidden answers no top-k: set teacher.topk: 0 (found 8) or "
                                      "teacher.answer: topk"}));
  EXPECT_EQ(problemsOf(teacher + "  answer: hidden\n  hidden_states: [h]\n"),
            (std::vector<std::string>{"teacher.hidden_states: cannot be returned with teacher.answer: hidden (the "
                                      "output teacher.output is the hidden states); set teacher.hidden_states: []"}));
  EXPECT_EQ(problemsOf(teacher + "  answer: states\n"),
            (std::vector<std::string>{"teacher.answer: must be one of auto, logits, topk, hidden; found \"states\""}));
  EXPECT_EQ(problemsOf(teacher + "  head:\n    weight: \"\"\n    scale: 0\n    softcap: -1\n    on_change: keep\n"),
            (std::vector<std::string>{"teacher.head.weight: must not be empty", "teacher.head.softcap: must be >= 0, found -1",
                                      "teacher.head.scale: must be > 0, found 0",
                                      "teacher.head.on_change: must be one of refuse, adopt; found \"keep\""}));
}

// Issue 44: teacher.samples answers sampled draws, which the teacher cache
// stores like any answer (row or prefix keys); what they cannot serve is
// refused naming teacher.samples.
TEST(Config, SampledAnswersAreCachedAndRefuseWhatTheyCannotServe) {
  using distill::AnswerKind;
  const std::string teacher = "teacher:\n  kind: self\n  samples: 8\n";
  EXPECT_EQ(distill::answerKindOf(parseConfig(teacher).teacher), AnswerKind::kSampled);
  for (const char* keys : {"row", "prefix"}) {
    const Config c = parseConfig(teacher + "  cache:\n    path: /tmp/c\n    mode: readwrite\n    keys: " + keys + "\n");
    EXPECT_EQ(c.teacher.cache.mode, distill::CacheMode::kReadWrite) << keys;
    EXPECT_EQ(distill::answerKindOf(c.teacher), AnswerKind::kSampled) << keys;
  }
  EXPECT_EQ(
      problemsOf(teacher + "  topk: 8\n"),
      (std::vector<std::string>{"teacher.samples (8): one answer kind: set teacher.topk: 0 or teacher.samples: 0"}));
  EXPECT_EQ(problemsOf(teacher + "  on_nonfinite: mask\n"),
            (std::vector<std::string>{"teacher.samples (8): a sampled answer cannot mark a masked token (integer "
                                      "counts): set teacher.on_nonfinite: error"}));
}
