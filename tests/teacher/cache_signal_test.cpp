// The teacher-output cache's signal record (teacher/src/cache/cache.h,
// "Signal"; issue 43, the signal contract): a store holds one teacher's
// answers of one kind, and a teacher of another context is refused at open,
// naming what the store holds and what this teacher answers. Part of
// teacher_cache_test.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache_test_util.h"
#include "distill/core/errors.h"
#include "distill/teacher/model.h"

using distill::TeacherCache;
using namespace cache_testing;

namespace {

struct Lin : torch::nn::Module {
  Lin() { fc = register_module("fc", torch::nn::Linear(4, 8)); }
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};

// The ConfigError opening `dir` with `context` gives ("" when it opens).
std::string refusal(const std::string& dir, const char* mode, const std::string& context) {
  try {
    TeacherCache c(options(dir, mode), context, kNames);
  } catch (const distill::ConfigError& e) {
    return e.what();
  }
  return "";
}

} // namespace

TEST(TeacherCacheSignal, AStoreOfAnotherSignalOrTeacherIsRefusedNamingBoth) {
  torch::manual_seed(3);
  auto lin = std::make_shared<Lin>();
  distill::ModuleTeacher<Lin> model(lin, "logits");
  distill::TeacherOptions full;
  full.kind = distill::TeacherKind::kRegistered;
  distill::TeacherOptions top8 = full;
  top8.topk = 8;
  distill::TeacherOptions bf16 = full;
  bf16.payload_dtype = distill::PayloadDtype::kBFloat16;
  const std::string fullContext = distill::answerContext(full, 1.0, model);

  TempDir dir;
  { TeacherCache writer(options(dir.path, "readwrite"), fullContext, kNames); }
  // The same teacher and signal opens it in every mode.
  for (const char* mode : {"read", "readwrite", "write"}) EXPECT_EQ(refusal(dir.path, mode, fullContext), "") << mode;

  // Another kind: top-8 answers at T = 1 where the store holds full logits.
  std::string m = refusal(dir.path, "readwrite", distill::answerContext(top8, 1.0, model));
  EXPECT_NE(m.find("it holds answers of [full logits] where this teacher answers [topk 8 temperature"),
            std::string::npos)
      << m;
  // Another payload dtype.
  m = refusal(dir.path, "read", distill::answerContext(bf16, 1.0, model));
  EXPECT_NE(m.find("[payload_dtype auto]"), std::string::npos) << m;
  EXPECT_NE(m.find("[payload_dtype bfloat16]"), std::string::npos) << m;
  // Other weights: the teacher's digest differs, nothing else.
  {
    torch::NoGradGuard g;
    lin->fc->weight.data()[0][0] += 1;
  }
  m = refusal(dir.path, "write", distill::answerContext(full, 1.0, model));
  EXPECT_NE(m.find("written by another teacher or for another signal: it holds answers of [weights "),
            std::string::npos)
      << m;
  EXPECT_NE(m.find(distill::modelDigest(model)), std::string::npos) << m;
  EXPECT_EQ(m.find("full logits"), std::string::npos) << "only what differs is named: " << m;
  EXPECT_NE(m.find("give this teacher another teacher.cache.path, or remove the store"), std::string::npos) << m;
}
