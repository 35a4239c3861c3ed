// teacher_cache_test: hidden-state answers in the cache (issue 43). Their rows
// are stored as any answer's (the table's tensor, in the payload dtype), and
// the key's context carries the head's fingerprint: rows answered for one head
// are never read for another.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cache/cache.h"
#include "distill/core/errors.h"
#include "cache/keys.h"
#include "distill/core/answer_kinds.h"
#include "distill/ipc/shared_head.h"
#include "distill/teacher/model.h"
#include "cache_test_util.h"

using namespace cache_testing;

namespace {

// The fingerprint a teacher publishes for a [16, 8] float32 head filled with `value`.
std::string headFingerprint(float value) {
  std::vector<float> w(16 * 8, value);
  distill::ipc::HeadBytes b;
  b.vocab = 16;
  b.dim = 8;
  b.weight = w.data();
  return distill::ipc::headFingerprint(b);
}

// hidden [rows, seq, 8] float32, a function of the ids.
TeacherCache::Computed hiddenRows(const at::Tensor& x) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(77);
  const at::Tensor table = at::randn({64, 8}, g, at::kFloat);
  return {{{distill::protocol::kHidden, table.index_select(0, x.reshape(-1)).view({x.size(0), x.size(1), 8})}}, 16};
}

} // namespace

TEST(TeacherCacheHidden, RowsOfAnotherHeadAreNeverRead) {
  struct Stated : distill::TeacherModel { // a model with a fingerprint (nothing else is asked here)
    std::map<std::string, at::Tensor> forward(const std::vector<at::Tensor>&) override { return {}; }
    std::string fingerprint() const override { return "weights v1"; }
  } teacher;
  distill::TeacherOptions t;
  t.answer = distill::TeacherAnswer::kHidden;
  t.hidden_size = 8;
  const std::string a = distill::answerContext(t, 1.0, teacher, headFingerprint(1));
  const std::string b = distill::answerContext(t, 1.0, teacher, headFingerprint(2));
  EXPECT_NE(a, b);
  EXPECT_NE(a.find("hidden states of head " + headFingerprint(1)), std::string::npos) << a;
  distill::TeacherOptions logits = t;
  logits.answer = distill::TeacherAnswer::kLogits;
  EXPECT_EQ(distill::answerContext(logits, 1.0, teacher, headFingerprint(1)).find("hidden states of head"),
            std::string::npos);

  TempDir dir;
  int computes = 0;
  auto compute = [&](const std::vector<at::Tensor>& in) {
    ++computes;
    return hiddenRows(in[0]);
  };
  const at::Tensor x = ids(6, 5, 3);
  auto f32 = options(dir.path, "readwrite");
  f32.dtype = distill::CacheDtype::kFloat32;
  {
    TeacherCache cache(f32, a, kNames, 1.0);
    const auto first = cache.answer({{x}}, compute, at::kCPU);
    EXPECT_EQ(cache.stats().inserted, 6);
    const auto again = cache.answer({{x}}, compute, at::kCPU);
    EXPECT_EQ(computes, 1);
    EXPECT_EQ(cache.stats().hits, 6);
    EXPECT_TRUE(bitEqual(again[0], first[0])) << "hidden rows read back as stored (float32)";
    EXPECT_TRUE(bitEqual(again[0].at(distill::protocol::kHidden), hiddenRows(x).answer.at(distill::protocol::kHidden)));
  }
  // The same store opened for another head: refused at open, naming both heads' fingerprints.
  try {
    TeacherCache other(f32, b, kNames, 1.0);
    ADD_FAILURE() << "a store of another head opened";
  } catch (const distill::ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("it holds answers of [hidden states of head " + headFingerprint(1)), std::string::npos) << m;
    EXPECT_NE(m.find("where this teacher answers [hidden states of head " + headFingerprint(2)), std::string::npos)
        << m;
  }
  EXPECT_EQ(computes, 1);
}
