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
      {kSelf + "loss:\n  kind: kl\n", "loss.kind: must be one of forward_kl, reverse_kl, jsd, sampled_token; found \"kl\""},
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
      {kSelf + "transport:\n  cuda_mps: auto\n", "transport.cuda_mps: must be one of off, on; found \"auto\""},
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
      "transport: {cuda_ipc: on, cuda_mps: on}\n"
      "loss: {kind: reverse_kl}\n"
      "checkpoint: {on_error: continue, on_corrupt: restart}\n");
  EXPECT_EQ(c.run.on_hang, distill::OnHang::kWait);
  EXPECT_EQ(c.teacher.kind, distill::TeacherKind::kRegistered);
  EXPECT_EQ(c.teacher.autocast, distill::Autocast::kFloat16);
  EXPECT_EQ(c.student.backend, distill::GroupBackend::kGloo);
  EXPECT_EQ(c.transport.cuda_ipc, distill::CudaIpc::kOn);
  EXPECT_EQ(c.transport.cuda_mps, distill::CudaMps::kOn);
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

} // namespace
