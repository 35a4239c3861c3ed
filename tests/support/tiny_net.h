#pragma once

// A language model small enough for multi-process tests: embedding, tanh,
// linear. Its forward gives [.., vocab] logits that depend on every weight.

#include <torch/torch.h>

namespace distill::testing {

struct TinyNet : torch::nn::Module {
  TinyNet(int64_t vocab, int64_t dim)
      : emb(register_module("emb", torch::nn::Embedding(vocab, dim))),
        fc(register_module("fc", torch::nn::Linear(dim, vocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) { return fc(torch::tanh(emb(ids))); }
  torch::nn::Embedding emb;
  torch::nn::Linear fc;
};

} // namespace distill::testing
