// The demo's C++ teacher module answering with its hidden states
// (teacher.answer: hidden; examples/gpt/teacher_module.cpp declares its head):
// a real distill-run job at a tiny size trains the students exactly as the same
// job with full logits does (the same held-out loss to the last digit), with
// the head published once per node. examples/gpt/signals.sh runs every signal.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "demo_common.h"
#include "demo_support.h"

using namespace distill::testing;
using namespace distill::testing::demo;
namespace ex = distill::examples;

namespace {

// One distilled run of `demo` in log folder `name` with `sets`; its done.json's val_loss as written.
std::string distilled(const TinyDemo& demo, const std::string& name, const std::vector<std::string>& sets,
                      std::string* console) {
  std::vector<std::string> argv{binPath("distill-run"), "--config", demo.config, "--set", "teacher.cache.mode=off",
                                "--set", "checkpoint.dir=\"\"", "--set", "run.log_dir=" + demo.dir + "/" + name};
  for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
  argv.insert(argv.end(), {"--", binPath("distill-gpt"), "distill"});
  Console run(argv, {{"OMP_NUM_THREADS", "1"}});
  const ExitStatus st = run.finish(Ms(90000));
  *console = run.text();
  EXPECT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << run.text();
  return ex::parseJson(ex::readText(demo.dir + "/" + name + "/distilled/done.json"))["val_loss"];
}

} // namespace

TEST(DemoSignals, TheGptTeacherAnsweringHiddenStatesTrainsAsWithFullLogits) {
  TinyDemo demo;
  Console teacher({binPath("distill-gpt"), "train-teacher", "--config", demo.config});
  const ExitStatus st = teacher.finish(Ms(60000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << teacher.text();

  std::string fullConsole, hiddenConsole;
  const std::string full = distilled(demo, "full", {}, &fullConsole);
  const std::string hidden =
      distilled(demo, "hidden", {"teacher.answer=hidden", "teacher.hidden_size=32"}, &hiddenConsole);
  ASSERT_FALSE(full.empty()) << fullConsole;
  EXPECT_EQ(hidden, full) << hiddenConsole; // the same GEMM, chunked in the student: bit for bit
  EXPECT_NE(hiddenConsole.find("published its head"), std::string::npos) << hiddenConsole;
  EXPECT_NE(hiddenConsole.find("hidden states of d=32"), std::string::npos) << hiddenConsole;
  EXPECT_EQ(fullConsole.find("published its head"), std::string::npos) << fullConsole;
}
