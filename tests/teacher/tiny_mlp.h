#pragma once
// The C++ teacher of the registered-teacher test: embedding + linear. The test
// builds one with a fixed seed, torch::save's its weights for distill-teacher
// (which dlopens libdistill_test_teacher.so) and runs the same one in-process.
#include <torch/torch.h>

namespace distill::testing {

struct TinyMlp : torch::nn::Module {
  static constexpr int64_t kVocab = 64, kDim = 32;
  TinyMlp()
      : emb(register_module("emb", torch::nn::Embedding(kVocab, kDim))),
        fc(register_module("fc", torch::nn::Linear(kDim, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) { return 3.0 * fc(torch::tanh(emb(ids))); }
  torch::nn::Embedding emb;
  torch::nn::Linear fc;
};

// The causal teacher of the prefix-key tests (teacher.cache.keys: prefix):
// embedding, the cumulative mean over the positions, linear. Its answer at
// position t depends on ids[0..t] alone, bit for bit (a running sum along the
// positions, whatever follows them and whatever rows share the batch).
struct CausalMean : torch::nn::Module {
  static constexpr int64_t kVocab = 64, kDim = 32;
  CausalMean()
      : emb(register_module("emb", torch::nn::Embedding(kVocab, kDim))),
        fc(register_module("fc", torch::nn::Linear(kDim, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) {
    torch::Tensor x = emb(ids);
    torch::Tensor n = torch::arange(1, ids.size(1) + 1, x.options()).view({1, -1, 1});
    return 3.0 * fc(x.cumsum(1) / n);
  }
  torch::nn::Embedding emb;
  torch::nn::Linear fc;
};

} // namespace distill::testing
