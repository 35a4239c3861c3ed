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

} // namespace distill::testing
