// The teacher's response must fit in one message (ipc::wire::kMaxTensors
// tensors): the top-k output takes four (values, indices, logsumexp, log tail),
// so hidden states next to it are refused at start-up, naming the keys, rather
// than failing every reply.
#include <gtest/gtest.h>

#include "distill/core/config.h"
#include "distill/core/context.h"
#include "distill/core/errors.h"
#include "distill/core/topology.h"
#include "distill/teacher/server.h"

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

} // namespace
