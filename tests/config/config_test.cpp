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

using distill::Config;
using distill::ConfigError;
using distill::configHash;
using distill::configKeys;
using distill::dumpConfig;
using distill::parseConfig;

namespace {

// Smallest valid file: the one required key.
const std::string kSelf = "teacher:\n  kind: self\n";

std::vector<std::string> splitLines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The problem lines of the ConfigError parsing `yaml` throws (the header checked).
std::vector<std::string> problemsOf(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    parseConfig(yaml, overrides);
  } catch (const ConfigError& e) {
    std::vector<std::string> lines = splitLines(e.message());
    if (lines.empty()) {
      ADD_FAILURE() << "empty message";
      return {};
    }
    EXPECT_EQ(lines[0], "config <string>: " + std::to_string(lines.size() - 1) + " problem(s):");
    return {lines.begin() + 1, lines.end()};
  }
  ADD_FAILURE() << "no ConfigError for:\n" << yaml;
  return {};
}

Config selfDefaults() {
  Config c;
  c.teacher.kind = distill::TeacherKind::kSelf;
  return c;
}

struct BadCase {
  std::string yaml;
  std::string problem;
};

const std::vector<BadCase>& badCases() {
  static const std::vector<BadCase> cases = {
      // unknown names
      {kSelf + "loss:\n  temprature: 2\n", "loss.temprature: unknown key; did you mean loss.temperature?"},
      {kSelf + "transport:\n  slot: 2\n", "transport.slot: unknown key; did you mean transport.slots?"},
      {kSelf + "loss:\n  xyz: 1\n",
       "loss.xyz: unknown key; valid keys in loss: kind, temperature, alpha, jsd_beta, "
       "ignore_index, chunk_tokens, vocab, max_truncated_mass, on_nonfinite"},
      {kSelf + "student:\n  temperature: 2\n",
       "student.temperature: unknown key; valid keys in student: grad_acc_steps, in_flight, "
       "device, backend, bucket_mb"},
      {kSelf + "lose:\n  alpha: 0.5\n", "lose: unknown section; did you mean loss?"},
      {kSelf + "xyz: 1\n",
       "xyz: unknown section; valid sections: run, teacher, student, transport, loss, checkpoint, trainer"},
      {kSelf + "trainr:\n  data: x\n", "trainr: unknown section; did you mean trainer?"},
      // wrong types
      {kSelf + "loss:\n  temperature: hot\n", "loss.temperature: expected a number, found string \"hot\""},
      {kSelf + "loss:\n  alpha: \"0.5\"\n", "loss.alpha: expected a number, found string \"0.5\""},
      {kSelf + "loss:\n  alpha: {a: 1}\n", "loss.alpha: expected a number, found a map"},
      {kSelf + "loss:\n  alpha:\n", "loss.alpha: expected a number, found null"},
      {kSelf + "transport:\n  heartbeat_ms: 2.5\n", "transport.heartbeat_ms: expected an integer, found number 2.5"},
      {kSelf + "run:\n  steps: .inf\n", "run.steps: expected an integer, found string \".inf\""},
      {kSelf + "checkpoint:\n  async: yes\n", "checkpoint.async: expected a boolean, found string \"yes\""},
      {kSelf + "checkpoint:\n  resume: 1\n", "checkpoint.resume: expected a boolean, found number 1"},
      {kSelf + "run:\n  name: [a]\n", "run.name: expected a string, found a list"},
      {"teacher:\n  kind: self\n  inputs: input_ids\n",
       "teacher.inputs: expected a list of strings, found string \"input_ids\""},
      {"teacher:\n  kind: self\n  hidden_states: [a, [b]]\n",
       "teacher.hidden_states: expected a list of strings, found a list with a list at index 1"},
      {kSelf + "transport:\n  max_request_bytes: 64MB\n",
       "transport.max_request_bytes: expected a byte size or auto, found string \"64MB\""},
      {kSelf + "transport:\n  max_response_bytes: true\n",
       "transport.max_response_bytes: expected a byte size or auto, found boolean true"},
      {"teacher:\n  kind: self\n  payload_dtype: bf16\n",
       "teacher.payload_dtype: must be one of auto, float32, bfloat16, float16; found \"bf16\""},
      // ranges
      {kSelf + "loss:\n  alpha: 1.5\n", "loss.alpha: must be in [0, 1], found 1.5"},
      {kSelf + "transport:\n  slots: 0\n", "transport.slots: must be >= 1, found 0"},
      {kSelf + "loss:\n  temperature: 0\n", "loss.temperature: must be > 0, found 0"},
      {kSelf + "loss:\n  temperature: 1e999\n", "loss.temperature: must be a finite number, found 1e999"},
      {kSelf + "loss:\n  jsd_beta: 1\n", "loss.jsd_beta: must be in (0, 1), found 1"},
      {kSelf + "loss:\n  chunk_tokens: 0\n", "loss.chunk_tokens: must be >= 1, found 0"},
      {kSelf + "loss:\n  max_truncated_mass: 2\n", "loss.max_truncated_mass: must be in [0, 1], found 2"},
      {kSelf + "run:\n  nproc_per_node: 1\n", "run.nproc_per_node: must be in [2, 256], found 1"},
      {kSelf + "run:\n  nproc_per_node: 2000000000\n", "run.nproc_per_node: must be in [2, 256], found 2000000000"},
      {kSelf + "run:\n  nnodes: 2147483647\n",
       "run.nnodes: run.nnodes x run.nproc_per_node must be <= 2147483647 (every rank of the job is an int), "
       "found 2147483647 x 3"},
      {kSelf + "run:\n  master_port: 70000\n", "run.master_port: must be in [0, 65535], found 70000"},
      // the teacher pool
      {"teacher:\n  kind: self\n  procs: 0\n", "teacher.procs: must be in [1, 16], found 0"},
      {"teacher:\n  kind: self\n  procs: 3\n",
       "teacher.procs: must leave a student on each node: below run.nproc_per_node (3), found 3"},
      {"run:\n  nproc_per_node: 5\nteacher:\n  kind: self\n  procs: 2\n  devices: [cpu, cpu, cpu]\n",
       "teacher.devices: names 3 devices; give one per teacher (teacher.procs 2), one for all, or none "
       "(teacher.device)"},
      {"teacher:\n  kind: self\n  devices: [gpu]\n",
       "teacher.devices: device \"gpu\": must be one of cpu, cuda, cuda:N"},
      {kSelf + "run:\n  startup_timeout_s: -1\n", "run.startup_timeout_s: must be in [0.001, 2592000], found -1"},
      // every duration has a range: none overflows a deadline, none is a denormal
      {kSelf + "run:\n  hang_timeout_s: 1e300\n", "run.hang_timeout_s: must be in [0.001, 2592000], found 1e300"},
      {kSelf + "run:\n  hang_timeout_s: 5e9\n", "run.hang_timeout_s: must be in [0.001, 2592000], found 5e9"},
      {kSelf + "run:\n  startup_timeout_s: 1e10\n", "run.startup_timeout_s: must be in [0.001, 2592000], found 1e10"},
      {kSelf + "run:\n  collective_timeout_s: 1e10\n",
       "run.collective_timeout_s: must be in [0.001, 2592000], found 1e10"},
      {kSelf + "run:\n  collective_timeout_s: 1e-320\n",
       "run.collective_timeout_s: must be in [0.001, 2592000], found 1e-320"},
      {kSelf + "run:\n  stop_grace_s: -0.5\n", "run.stop_grace_s: must be in [0, 2592000], found -0.5"},
      {kSelf + "run:\n  status_every_s: 0\n", "run.status_every_s: must be in [1, 2592000], found 0"},
      {kSelf + "transport:\n  heartbeat_ms: 60001\n", "transport.heartbeat_ms: must be in [1, 60000], found 60001"},
      {kSelf + "transport:\n  spin_us: 1000001\n", "transport.spin_us: must be in [0, 1000000], found 1000001"},
      {kSelf + "run:\n  nnodes: 3000000000\n", "run.nnodes: must be in [1, 2147483647], found 3000000000"},
      {kSelf + "run:\n  seed: 99999999999999999999\n",
       "run.seed: must be in [-9223372036854775808, 9223372036854775807], found 99999999999999999999"},
      {kSelf + "transport:\n  heartbeat_ms: 0\n", "transport.heartbeat_ms: must be in [1, 60000], found 0"},
      {kSelf + "transport:\n  max_response_bytes: -1\n", "transport.max_response_bytes: must be >= 0, found -1"},
      {"teacher:\n  kind: self\n  vocab_size: -1\n", "teacher.vocab_size: must be >= 0, found -1"},
      {kSelf + "checkpoint:\n  keep_last: 0\n", "checkpoint.keep_last: must be >= 1, found 0"},
      {kSelf + "student:\n  bucket_mb: 0\n", "student.bucket_mb: must be > 0, found 0"},
      {kSelf + "run:\n  name: \"\"\n", "run.name: must not be empty"},
      {"teacher:\n  kind: self\n  inputs: []\n", "teacher.inputs: must not be empty"},
      // enumerations
      {kSelf + "loss:\n  kind: kl\n", "loss.kind: must be one of forward_kl, reverse_kl, jsd; found \"kl\""},
      {kSelf + "loss:\n  vocab: pad\n", "loss.vocab: must be one of error, truncate; found \"pad\""},
      {kSelf + "loss:\n  on_nonfinite: skip\n", "loss.on_nonfinite: must be one of error, skip_step; found \"skip\""},
      {"teacher:\n  kind: self\n  on_nonfinite: drop\n",
       "teacher.on_nonfinite: must be one of error, mask; found \"drop\""},
      {kSelf + "run:\n  on_hang: kill\n", "run.on_hang: must be one of teardown, wait; found \"kill\""},
      {"teacher:\n  kind: onnx\n", "teacher.kind: must be one of torchscript, registered, self; found \"onnx\""},
      {"teacher:\n  kind: self\n  autocast: fp16\n",
       "teacher.autocast: must be one of none, float16, bfloat16; found \"fp16\""},
      {"teacher:\n  kind: self\n  device: gpu\n", "teacher.device: must be one of cpu, cuda, cuda:N; found \"gpu\""},
      {kSelf + "student:\n  device: cuda:x\n", "student.device: must be one of cpu, cuda, cuda:N; found \"cuda:x\""},
      {kSelf + "student:\n  backend: mpi\n", "student.backend: must be one of auto, gloo, nccl; found \"mpi\""},
      {kSelf + "transport:\n  cuda_ipc: maybe\n", "transport.cuda_ipc: must be one of auto, on, off; found \"maybe\""},
      {kSelf + "checkpoint:\n  on_error: retry\n",
       "checkpoint.on_error: must be one of stop, continue; found \"retry\""},
      {kSelf + "checkpoint:\n  on_corrupt: skip\n",
       "checkpoint.on_corrupt: must be one of error, restart; found \"skip\""},
      // required
      {"run:\n  name: x\n", "teacher.kind: required key is missing"},
      {"", "teacher.kind: required key is missing"},
      {"teacher:\n  kind: torchscript\n", "teacher.path: required when teacher.kind is torchscript"},
      {"teacher:\n  kind: registered\n  library: libx.so\n",
       "teacher.module: required when teacher.kind is registered"},
      // across fields
      {kSelf + "student:\n  in_flight: 5\n", "student.in_flight: must be <= transport.slots (4), found 5"},
      {kSelf + "run:\n  node_rank: 1\n", "run.node_rank: must be < run.nnodes (1), found 1"},
      // Issue 27: what the reference says cannot be is refused at validation (and so by --dry-run).
      {"teacher:\n  kind: self\n  topk: 8\n  hidden_states: [h]\n",
       "teacher.hidden_states: cannot be returned with teacher.topk (8): the top-k output's four tensors fill a "
       "response; set teacher.topk: 0 or teacher.hidden_states: []"},
      {"teacher:\n  kind: self\n  hidden_states: [a, b, c, d]\n",
       "teacher.hidden_states: at most 3 fit in a response next to the logits, found 4"},
      // shape of the document
      {kSelf + "run: 3\n", "run: expected a map, found number 3"},
      {"- a\n- b\n", "(document): expected a map of sections, found a list"},
      {kSelf + "loss:\n  alpha: 0.1\n  alpha: 0.2\n", "loss.alpha: duplicate key"},
      {kSelf + "loss:\n  alpha: 0.1\nloss:\n  kind: jsd\n", "loss: duplicate section"},
      // the trainer's section: any key, scalar values
      {kSelf + "trainer: 3\n", "trainer: expected a map, found number 3"},
      {kSelf + "trainer:\n  sizes: [1, 2]\n",
       "trainer.sizes: expected a scalar (the trainer's keys take strings, numbers or booleans), found a list"},
      {kSelf + "trainer:\n  model: {dim: 3}\n",
       "trainer.model: expected a scalar (the trainer's keys take strings, numbers or booleans), found a map"},
      {kSelf + "trainer:\n  data:\n",
       "trainer.data: expected a scalar (the trainer's keys take strings, numbers or booleans), found null"},
      {kSelf + "trainer:\n  lr: 1\n  lr: 2\n", "trainer.lr: duplicate key"},
  };
  return cases;
}

TEST(Config, EachBadConfigGivesItsExactProblem) {
  ASSERT_GE(badCases().size(), 25u);
  for (const BadCase& c : badCases()) {
    SCOPED_TRACE(c.yaml);
    EXPECT_EQ(problemsOf(c.yaml), std::vector<std::string>{c.problem});
  }
}

TEST(Config, CollectsEveryProblem) {
  const auto problems = problemsOf(
      "loss:\n  temprature: 2\n  alpha: 1.5\n"
      "transport:\n  slots: 0\n");
  EXPECT_EQ(problems,
            (std::vector<std::string>{
                "loss.temprature: unknown key; did you mean loss.temperature?",
                "teacher.kind: required key is missing",
                "transport.slots: must be >= 1, found 0",
                "loss.alpha: must be in [0, 1], found 1.5",
            }));
  EXPECT_EQ(problemsOf(kSelf + "run:\n  nnodes: 0\n  name: [x]\nloss:\n  kind: kl\n").size(), 3u);
}

TEST(Config, DefaultsAreThoseOfOptions) {
  const Config c = parseConfig(kSelf);
  EXPECT_EQ(dumpConfig(c), dumpConfig(selfDefaults()));
  EXPECT_EQ(c.source, "");
  EXPECT_EQ(c.run.name, "distill");
  EXPECT_EQ(c.loss.temperature, 1.0);
  EXPECT_EQ(c.transport.max_response_bytes, 0); // auto
  EXPECT_EQ(c.transport.max_request_bytes, 0); // auto
  EXPECT_EQ(c.teacher.payload_dtype, distill::PayloadDtype::kAuto);
  EXPECT_EQ(c.teacher.vocab_size, 0);
  EXPECT_EQ(c.teacher.inputs, std::vector<std::string>{"input_ids"});
  EXPECT_TRUE(c.checkpoint.resume);
  // A section left empty (every key commented out) is allowed.
  EXPECT_EQ(dumpConfig(parseConfig(kSelf + "loss:\n  # kind: jsd\n")), dumpConfig(c));
}

TEST(Config, GoodConfigRoundTrips) {
  const std::string yaml =
      "run: {name: 'we \"said\" \\ hi', nproc_per_node: 5, nnodes: 2, node_rank: 1, seed: -7}\n"
      "teacher:\n"
      "  kind: registered\n"
      "  library: /opt/lib/libm.so\n"
      "  module: tiny_lm\n"
      "  inputs: [input_ids, attention_mask]\n"
      "  device: cuda:1\n"
      "  autocast: bfloat16\n"
      "  topk: 64\n"
      "student: {in_flight: 8, device: cuda, backend: nccl, bucket_mb: 12.5}\n"
      "transport: {slots: 8, max_request_bytes: 1GiB, max_response_bytes: 12345, cuda_ipc: off}\n"
      "loss: {kind: jsd, temperature: 2.5e-1, alpha: 1, jsd_beta: 0.1, ignore_index: 0}\n"
      "checkpoint: {dir: /ckpt, every_steps: 100, keep_last: 1, async: true, resume: false}\n";
  const Config c = parseConfig(yaml);
  EXPECT_EQ(c.run.name, "we \"said\" \\ hi");
  EXPECT_EQ(c.run.seed, -7);
  EXPECT_EQ(c.teacher.inputs, (std::vector<std::string>{"input_ids", "attention_mask"}));
  EXPECT_EQ(c.teacher.device, "cuda:1");
  EXPECT_EQ(c.student.bucket_mb, 12.5);
  EXPECT_EQ(c.transport.max_request_bytes, int64_t{1} << 30);
  EXPECT_EQ(c.transport.cuda_ipc, distill::CudaIpc::kOff);
  EXPECT_EQ(c.loss.temperature, 0.25);
  EXPECT_TRUE(c.checkpoint.async);
  EXPECT_FALSE(c.checkpoint.resume);

  const std::string dumped = dumpConfig(c);
  const Config again = parseConfig(dumped);
  EXPECT_EQ(dumpConfig(again), dumped);
  EXPECT_EQ(configHash(again), configHash(c));
  // hidden_states go with full logits only (teacher.topk: 0).
  const Config h = parseConfig("teacher:\n  kind: self\n  hidden_states: [h3, h4]\n");
  EXPECT_EQ(parseConfig(dumpConfig(h)).teacher.hidden_states, (std::vector<std::string>{"h3", "h4"}));
}

// Options with a fixed set of values are parsed once into enums (options.h),
// and dumpConfig writes them as it wrote the strings they were: the text of
// config.yaml in checkpoints and of the config descriptions compared at
// admission is unchanged.
TEST(Config, EnumOptionsParseIntoEnumsAndDumpTheirSpelling) {
  const Config c = parseConfig(
      "run: {on_hang: wait}\n"
      "teacher: {kind: registered, library: l, module: m, autocast: float16}\n"
      "student: {backend: gloo}\n"
      "transport: {cuda_ipc: on}\n"
      "loss: {kind: reverse_kl}\n"
      "checkpoint: {on_error: continue, on_corrupt: restart}\n");
  EXPECT_EQ(c.run.on_hang, distill::OnHang::kWait);
  EXPECT_EQ(c.teacher.kind, distill::TeacherKind::kRegistered);
  EXPECT_EQ(c.teacher.autocast, distill::Autocast::kFloat16);
  EXPECT_EQ(c.student.backend, distill::GroupBackend::kGloo);
  EXPECT_EQ(c.transport.cuda_ipc, distill::CudaIpc::kOn);
  EXPECT_EQ(c.loss.kind, distill::LossKind::kReverseKl);
  EXPECT_EQ(c.checkpoint.on_error, distill::OnSaveError::kContinue);
  EXPECT_EQ(c.checkpoint.on_corrupt, distill::OnCorrupt::kRestart);

  const std::vector<std::string> lines = splitLines(dumpConfig(c));
  for (const char* want :
       {"  on_hang: \"wait\"", "  kind: \"registered\"", "  autocast: \"float16\"", "  backend: \"gloo\"",
        "  cuda_ipc: \"on\"", "  kind: \"reverse_kl\"", "  on_error: \"continue\"", "  on_corrupt: \"restart\""}) {
    EXPECT_NE(std::find(lines.begin(), lines.end(), want), lines.end()) << want;
  }
  // The defaults, as before they were enums.
  const std::vector<std::string> defaults = splitLines(dumpConfig(selfDefaults()));
  for (const char* want :
       {"  on_hang: \"teardown\"", "  kind: \"self\"", "  autocast: \"none\"", "  backend: \"auto\"",
        "  cuda_ipc: \"auto\"", "  kind: \"forward_kl\"", "  on_error: \"stop\"", "  on_corrupt: \"error\""}) {
    EXPECT_NE(std::find(defaults.begin(), defaults.end(), want), defaults.end()) << want;
  }

  // Each spelling names its value and back; anything else names none.
  EXPECT_EQ(distill::parseEnum<distill::LossKind>("jsd"), distill::LossKind::kJsd);
  EXPECT_EQ(distill::parseEnum<distill::LossKind>("kl"), std::nullopt);
  EXPECT_STREQ(distill::toString(distill::Autocast::kBFloat16), "bfloat16");
  EXPECT_STREQ(distill::toString(static_cast<distill::OnHang>(9)), "(invalid)");
  std::ostringstream os;
  os << distill::TeacherKind::kTorchscript;
  EXPECT_EQ(os.str(), "torchscript");
}

// The device options stay strings (torch::Device takes them as they are);
// parseDevice gives their parts to the modules that need them.
TEST(Config, DeviceOptionsParseIntoTheirParts) {
  EXPECT_FALSE(distill::parseDevice("cpu").cuda);
  EXPECT_TRUE(distill::parseDevice("cuda").cuda);
  EXPECT_EQ(distill::parseDevice("cuda").index, -1);
  EXPECT_TRUE(distill::parseDevice("cuda:3").cuda);
  EXPECT_EQ(distill::parseDevice("cuda:3").index, 3);
  EXPECT_THROW(distill::parseDevice("gpu"), ConfigError);
  EXPECT_THROW(distill::parseDevice("cuda:"), ConfigError);
  EXPECT_THROW(distill::parseDevice("cuda:99999999999"), ConfigError);
}

TEST(Config, OverridesAreValidatedLikeTheFile) {
  const Config c = parseConfig(kSelf + "loss:\n  alpha: 7\n",
                               {"loss.alpha=0.25", "teacher.inputs=[a, b]", "run.name=a=b", "transport.slots=1",
                                "student.in_flight=1", "run.seed=1", "run.seed=2"});
  EXPECT_EQ(c.loss.alpha, 0.25); // the override replaces the bad file value
  EXPECT_EQ(c.teacher.inputs, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.run.name, "a=b");
  EXPECT_EQ(c.run.seed, 2); // the later one wins
  EXPECT_EQ(parseConfig("", {"teacher.kind=self"}).teacher.kind, distill::TeacherKind::kSelf);

  EXPECT_EQ(problemsOf(kSelf, {"loss.temprature=2"}),
            std::vector<std::string>{"loss.temprature: unknown key; did you mean loss.temperature? (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"loss.alpha=2"}),
            std::vector<std::string>{"loss.alpha: must be in [0, 1], found 2 (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"loss.alpha=hot"}),
            std::vector<std::string>{"loss.alpha: expected a number, found string \"hot\" (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"loss.alpha"}), std::vector<std::string>{"loss.alpha: expected key=value (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"=3"}), std::vector<std::string>{"=3: expected key=value (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"student.in_flight=9"}),
            std::vector<std::string>{"student.in_flight: must be <= transport.slots (4), found 9 (from --set)"});
  EXPECT_EQ(problemsOf(kSelf, {"teacher.inputs=[a"}).size(), 1u);
}

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
  EXPECT_EQ(keys.size(), 70u); // 62 + loss.vocab, loss.max_truncated_mass, teacher.payload_dtype, teacher.vocab_size,
                               // teacher.cache.keys, teacher.cache.dtype, teacher.on_nonfinite, loss.on_nonfinite
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

} // namespace

namespace {

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

} // namespace

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

namespace {

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

// Issue 28 item 2: the slot sizes follow from the teacher's keys; an explicit
// size below them is a ConfigError naming the size needed, the key and
// teacher.max_batch_tokens, and auto (0) is the needed size.
TEST(Payload, SlotBytesFromTheTeacherKeys) {
  auto sizes = [](const std::string& teacher, const std::string& transport = "") {
    return parseConfig("teacher:\n  kind: self\n" + teacher + (transport.empty() ? "" : "transport:\n" + transport));
  };
  // top-64 in float32: 64 x 4 + 64 x 4 + 4 + 4 = 520 B per token.
  Config c = sizes("  topk: 64\n  max_batch_tokens: 4096\n");
  distill::SlotBytes s = distill::slotBytesNeeded(c);
  EXPECT_EQ(s.request, 4096 * 8);
  EXPECT_EQ(s.response, 4096 * 520);
  EXPECT_EQ(s.responsePerToken, 520);
  EXPECT_TRUE(s.unknown.empty());
  EXPECT_EQ(distill::requestSlotBytes(c), 4096 * 8);
  EXPECT_EQ(distill::responseSlotBytes(c), 4096 * 520);
  // bfloat16 values (set, or auto under teacher.autocast): 64 x 2 + 64 x 4 + 8 = 392 B.
  EXPECT_EQ(
      distill::slotBytesNeeded(sizes("  topk: 64\n  max_batch_tokens: 4096\n  payload_dtype: bfloat16\n")).response,
      4096 * 392);
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  topk: 64\n  max_batch_tokens: 4096\n  autocast: bfloat16\n")).response,
            4096 * 392);
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  topk: 64\n  max_batch_tokens: 4096\n  autocast: bfloat16\n"
                                           "  payload_dtype: float32\n"))
                .response,
            4096 * 520);
  // Two inputs: 16 B per token; each tensor starts at 64 bytes.
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  inputs: [input_ids, attention_mask]\n  max_batch_tokens: 3\n")).request,
            2 * 64);
  // Full logits: known with teacher.vocab_size only.
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  vocab_size: 32000\n  max_batch_tokens: 8\n  payload_dtype: "
                                           "bfloat16\n"))
                .response,
            8 * 32000 * 2);
  Config unknown = sizes("  max_batch_tokens: 8\n");
  EXPECT_FALSE(distill::slotBytesNeeded(unknown).unknown.empty());
  EXPECT_EQ(distill::responseSlotBytes(unknown), int64_t{64} << 20); // today's default
  EXPECT_NO_THROW(distill::checkSlotBytes(sizes("  max_batch_tokens: 8\n", "  max_response_bytes: 1KiB\n")));
  // Set sizes are kept as set, and checked.
  Config big = sizes("  topk: 64\n  max_batch_tokens: 4096\n", "  max_response_bytes: 4MiB\n");
  EXPECT_EQ(distill::responseSlotBytes(big), int64_t{4} << 20);
  EXPECT_NO_THROW(distill::checkSlotBytes(big));

  try {
    distill::checkSlotBytes(sizes("  topk: 64\n", "  max_response_bytes: 1MiB\n"));
    ADD_FAILURE() << "a 1 MiB response slot for 16384 tokens of top-64 was accepted";
  } catch (const ConfigError& e) {
    const std::string w = e.what();
    for (const char* part : {"transport.max_response_bytes: 1048576 bytes is below the 8519680 bytes",
                             "teacher.max_batch_tokens=16384", "top-64 in 32-bit values", "520 bytes per token",
                             "at least 8519680 (or auto)", "lower teacher.max_batch_tokens to 2016 or fewer"})
      EXPECT_NE(w.find(part), std::string::npos) << part << "\n" << w;
  }
  try {
    distill::checkSlotBytes(sizes("  inputs: [a, b]\n", "  max_request_bytes: 64KiB\n"));
    ADD_FAILURE() << "a 64 KiB request slot for 16384 tokens of 2 inputs was accepted";
  } catch (const ConfigError& e) {
    const std::string w = e.what();
    for (const char* part : {"transport.max_request_bytes: 65536 bytes is below the 262144 bytes",
                             "2 input(s) of teacher.inputs", "lower teacher.max_batch_tokens to 4096 or fewer"})
      EXPECT_NE(w.find(part), std::string::npos) << part << "\n" << w;
  }
  // The log line distill-run prints.
  const std::string line = distill::describeSlotBytes(c);
  EXPECT_NE(line.find("slots: request 32768 B (auto; 8 B/token x teacher.max_batch_tokens=4096"), std::string::npos)
      << line;
  EXPECT_NE(line.find("response 2129920 B (auto; top-64 in 32-bit values, 520 B/token = 2.03 MiB needed)"),
            std::string::npos)
      << line;
}
