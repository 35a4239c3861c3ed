// The teacher's response must fit in one message (ipc::wire::kMaxTensors
// tensors): the top-k output takes four (values, indices, logsumexp, log tail),
// so hidden states next to it are refused at start-up, naming the keys, rather
// than failing every reply.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <csignal>

#include "distill/core/config.h"
#include "distill/core/context.h"
#include "distill/core/errors.h"
#include "distill/core/topology.h"
#include "distill/teacher/model.h"
#include "distill/teacher/server.h"
#include "support/process.h"

namespace {

// serve()'s start-up error for this teacher section (the topology has no
// segment, so a config that fits stops at "no segment" instead).
std::string startupError(int64_t topk, std::vector<std::string> hidden) {
  distill::Config cfg;
  cfg.teacher.topk = topk;
  cfg.teacher.hidden_states = std::move(hidden);
  distill::TeacherContext ctx(distill::Topology::forLocalRank(0, 1, 1, 2), cfg);
  auto model = distill::teacherFromFunction([](const std::vector<at::Tensor>& in) { return in.at(0); });
  try {
    distill::serve(ctx, model);
  } catch (const distill::ConfigError& e) {
    return e.message();
  }
  return "no error";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(TeacherResponse, TopkLeavesNoRoomForHiddenStates) {
  std::string m = startupError(8, {"h3"});
  EXPECT_TRUE(has(m, "teacher.hidden_states: 1 hidden state(s) do not fit")) << m;
  EXPECT_TRUE(has(m, "teacher.topk=8")) << m;
  EXPECT_TRUE(has(m, "log_tail")) << m;
  EXPECT_TRUE(has(m, "at most 4 tensors")) << m;
  m = startupError(0, {"a", "b", "c", "d"});
  EXPECT_TRUE(has(m, "4 hidden state(s) do not fit in a response next to the logits")) << m;
  // What fits goes on to the next start-up step.
  EXPECT_TRUE(has(startupError(8, {}), "no segment")) << startupError(8, {});
  EXPECT_TRUE(has(startupError(0, {"a", "b", "c"}), "no segment"));
}

// Issue 27 (4.10): a FIFO in place of the model file blocked the teacher in
// torch::jit::load until the watchdog fired; only a regular file is opened,
// anything else is a ConfigError naming the path and what it is. In a child,
// so that a load that blocks fails the test instead of hanging it.
TEST(TeacherModelFile, OnlyARegularFileIsLoadedAFifoIsRefusedAtOnce) {
  const std::string dir = "/tmp/" + distill::testing::uniqueName("distill-model-file");
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  const std::string fifo = dir + "/model.pt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto refusal = [](const std::string& path) {
    distill::TeacherOptions o;
    o.kind = distill::TeacherKind::kTorchscript;
    o.path = path;
    try {
      distill::loadTeacherModel(o);
    } catch (const distill::ConfigError& e) {
      return e.message();
    }
    return std::string("loaded");
  };
  const std::string wantFifo = "teacher.path: '" + fifo + "': a FIFO (named pipe), not a regular file";
  const std::string wantDir = "teacher.path: '" + dir + "': a directory, not a regular file";
  auto child = distill::testing::forkChild([&] { return refusal(fifo) == wantFifo && refusal(dir) == wantDir ? 0 : 1; });
  auto st = child.waitFor(std::chrono::seconds(30));
  if (!st) child.kill(SIGKILL);
  ASSERT_TRUE(st) << "loading " << fifo << " blocked for 30 s";
  EXPECT_TRUE(st->exited && st->code == 0) << st->describe() << "; " << refusal(dir);
  ::unlink(fifo.c_str());
  ::rmdir(dir.c_str());
}

} // namespace
