#pragma once

// A small GPT (byte-level, causal self-attention) in the LibTorch C++ frontend:
// the demo's student and, larger, its teacher. examples/gpt/export_teacher.py
// defines the same family in Python with the same parameter names, so weights
// saved here load there.
//
//   GptOptions o;
//   o.layers = 2;
//   Gpt model(o);
//   at::Tensor logits = model->forward(ids);   // ids [B, T] int64 -> [B, T, vocab]
//
// Weight files (saveGpt/loadGpt) carry the architecture beside the parameters
// ("gpt_hparams"), so a teacher server builds the right model from the file
// alone (teacher_module.cpp).

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "gpt_options.h"

namespace distill::examples {

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptOptions& o);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear qkv{nullptr}, proj{nullptr};

 private:
  int64_t heads_;
  double dropout_;
};
TORCH_MODULE(CausalSelfAttention);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GptOptions& o);
  torch::Tensor forward(torch::Tensor x);

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, proj{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(Block);

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const GptOptions& o = {});
  // ids [B, T] int64 with T <= context -> logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& ids);
  // The input of `head`: the final layer norm's output [B, T, dim] (forward = head(hidden(ids))).
  torch::Tensor hidden(const torch::Tensor& ids);
  const GptOptions& options() const { return opts_; }

  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm lnF{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  GptOptions opts_;
};
TORCH_MODULE(Gpt);

// Writes the model's parameters and its GptOptions to `path` atomically (a
// temporary file, fsync, rename). Throws std::runtime_error naming the path.
void saveGpt(Gpt& model, const std::string& path);
// The architecture recorded in a file written by saveGpt.
GptOptions readGptOptions(const std::string& path);
// A model built from the file's architecture with its parameters, in eval mode.
Gpt loadGpt(const std::string& path);

// Mean cross-entropy (nats per byte) of `model` on every window of `ids`
// ([N, T]) predicting `labels` ([N, T]), in chunks of `rows`, in eval mode
// (training mode is restored after).
double evaluate(Gpt& model, const torch::Tensor& ids, const torch::Tensor& labels, int64_t rows = 64);

} // namespace distill::examples
