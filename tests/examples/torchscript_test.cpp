// The TorchScript teacher of configs/demo-torchscript.yaml at a tiny size: the
// C++-trained teacher exported by examples/gpt/export_teacher.py gives the same
// logits as the C++ module, and distill-teacher serves it to two students for
// a few steps. The Python-only path (a teacher trained in Python) exports too.
#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cmath>

#include "demo_common.h"
#include "gpt.h"

using namespace distill::testing;
using namespace distill::testing::demo;
namespace ex = distill::examples;

TEST(DemoTorchScript, ExportedTeacherMatchesAndServesAFewSteps) {
  TinyDemo base; // trains the C++ teacher the export starts from
  {
    Console teacher({binPath("distill-gpt"), "train-teacher", "--config", base.config});
    const ExitStatus st = teacher.finish(Ms(60000));
    ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << teacher.text();
  }
  const std::string script = base.dir + "/teacher.ts.pt";
  {
    Console exp(
        {DISTILL_PYTHON_EXE, sourcePath("examples/gpt/export_teacher.py"), "--weights", base.weights, "--out", script});
    const ExitStatus st = exp.finish(Ms(60000));
    ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << exp.text();
  }

  // The same logits from the C++ module and its TorchScript export.
  {
    ex::Gpt cpp = ex::loadGpt(base.weights);
    torch::jit::Module ts = torch::jit::load(script);
    ts.eval();
    torch::manual_seed(5);
    auto ids = torch::randint(0, 256, {3, 16}, torch::kLong);
    c10::InferenceMode guard;
    const double diff = (cpp->forward(ids) - ts.forward({ids}).toTensor()).abs().max().item<double>();
    EXPECT_LT(diff, 1e-5);
  }

  // A few distilled steps with distill-teacher serving the TorchScript file.
  TinyDemo job("teacher: {kind: torchscript, path: " + script + ", threads: 1}\n");
  Console run(
      {binPath("distill-run"), "--config", job.config, "--set", "run.steps=8", "--", binPath("distill-gpt"), "distill"},
      {{"OMP_NUM_THREADS", "1"}});
  const ExitStatus st = run.finish(Ms(60000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << run.text();
  int trained = 0;
  for (auto& rec : readMetrics(job.phaseFile("distilled", "metrics.jsonl"))) {
    if (rec.count("kd")) {
      ++trained;
      EXPECT_TRUE(std::isfinite(ex::jsonNumber(rec, "kd", NAN)));
    }
  }
  EXPECT_EQ(trained, 8);
  EXPECT_TRUE(ex::fileExists(job.phaseFile("distilled", "done.json")));
}

TEST(DemoTorchScript, TeacherMadeInPythonAlone) {
  const std::string out = "/tmp/" + uniqueName("distill-demo-test") + ".ts.pt";
  Console exp({DISTILL_PYTHON_EXE,
               sourcePath("examples/gpt/export_teacher.py"),
               "--train-steps",
               "5",
               "--data",
               sourcePath("README.md"),
               "--context",
               "16",
               "--layers",
               "1",
               "--heads",
               "2",
               "--dim",
               "16",
               "--batch",
               "4",
               "--threads",
               "1",
               "--out",
               out});
  const ExitStatus st = exp.finish(Ms(60000));
  ASSERT_TRUE(st.exited && st.code == 0) << st.describe() << "\n" << exp.text();
  torch::jit::Module ts = torch::jit::load(out);
  auto logits = ts.forward({torch::zeros({1, 16}, torch::kLong)}).toTensor();
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, 16, 256}));
  ex::removeTree(out);
}
