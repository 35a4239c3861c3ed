#include "gpt.h"

#include <cmath>

#include "demo_support.h"

namespace distill::examples {
namespace {

const char* kHparams = "gpt_hparams"; // [vocab, context, layers, heads, dim]

} // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptOptions& o) : heads_(o.heads), dropout_(o.dropout) {
  TORCH_CHECK(o.dim % o.heads == 0, "gpt: heads (", o.heads, ") must divide dim (", o.dim, ")");
  qkv = register_module("qkv", torch::nn::Linear(o.dim, 3 * o.dim));
  proj = register_module("proj", torch::nn::Linear(o.dim, o.dim));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
  // [B, T, 3C] -> 3 x [B, H, T, C/H]
  auto parts = qkv(x).view({b, t, 3, heads_, c / heads_}).permute({2, 0, 3, 1, 4}).unbind(0);
  auto y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, is_training() ? dropout_ : 0.0,
                                            /*is_causal=*/true);
  return proj(y.transpose(1, 2).reshape({b, t, c}));
}

BlockImpl::BlockImpl(const GptOptions& o) : dropout_(o.dropout) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  attn = register_module("attn", CausalSelfAttention(o));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  fc = register_module("fc", torch::nn::Linear(o.dim, 4 * o.dim));
  proj = register_module("proj", torch::nn::Linear(4 * o.dim, o.dim));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  namespace F = torch::nn::functional;
  const bool drop = is_training() && dropout_ > 0;
  auto a = attn(ln1(x));
  x = x + (drop ? F::dropout(a, F::DropoutFuncOptions().p(dropout_).training(true)) : a);
  auto m = proj(torch::gelu(fc(ln2(x))));
  return x + (drop ? F::dropout(m, F::DropoutFuncOptions().p(dropout_).training(true)) : m);
}

GptImpl::GptImpl(const GptOptions& o) : opts_(o) {
  tok = register_module("tok", torch::nn::Embedding(o.vocab, o.dim));
  pos = register_module("pos", torch::nn::Embedding(o.context, o.dim));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.layers; ++i) blocks->push_back(Block(o));
  lnF = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})));
  head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(o.dim, o.vocab).bias(false)));

  // GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 layers).
  torch::NoGradGuard noGrad;
  for (auto& p : named_parameters()) {
    const std::string& name = p.key();
    torch::Tensor& w = p.value();
    if (name.find("ln") != std::string::npos) continue; // LayerNorm: ones and zeros already
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      w.zero_();
    } else if (name.find(".proj.weight") != std::string::npos) {
      w.normal_(0.0, 0.02 / std::sqrt(2.0 * o.layers));
    } else {
      w.normal_(0.0, 0.02);
    }
  }
}

torch::Tensor GptImpl::hidden(const torch::Tensor& ids) {
  const int64_t t = ids.size(1);
  TORCH_CHECK(t <= opts_.context, "gpt: sequence of ", t, " exceeds the context of ", opts_.context);
  auto x = tok(ids) + pos(torch::arange(t, ids.options().dtype(torch::kLong)));
  for (auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
  return lnF(x);
}

torch::Tensor GptImpl::forward(const torch::Tensor& ids) { return head(hidden(ids)); }

void saveGpt(Gpt& model, const std::string& path) {
  const GptOptions& o = model->options();
  torch::serialize::OutputArchive archive;
  model->save(archive);
  archive.write(kHparams, torch::tensor({o.vocab, o.context, o.layers, o.heads, o.dim}, torch::kLong),
                /*is_buffer=*/true);
  archive.save_to(path + ".tmp");
  publishFile(path + ".tmp", path);
}

GptOptions readGptOptions(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  torch::Tensor h;
  TORCH_CHECK(archive.try_read(kHparams, h, /*is_buffer=*/true), path, " holds no ", kHparams,
              ": not a weights file written by saveGpt");
  TORCH_CHECK(h.numel() == 5, path, ": ", kHparams, " has ", h.numel(), " values, expected 5");
  auto v = h.to(torch::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  GptOptions o;
  o.vocab = p[0];
  o.context = p[1];
  o.layers = p[2];
  o.heads = p[3];
  o.dim = p[4];
  return o;
}

Gpt loadGpt(const std::string& path) {
  Gpt model(readGptOptions(path));
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  model->load(archive);
  model->eval();
  return model;
}

double evaluate(Gpt& model, const torch::Tensor& ids, const torch::Tensor& labels, int64_t rows) {
  const bool wasTraining = model->is_training();
  model->eval();
  double sum = 0;
  int64_t count = 0;
  {
    c10::InferenceMode guard;
    for (int64_t i = 0; i < ids.size(0); i += rows) {
      const int64_t n = std::min(rows, ids.size(0) - i);
      auto logits = model->forward(ids.narrow(0, i, n));
      auto y = labels.narrow(0, i, n);
      sum +=
          torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}),
                                               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
              .item<double>();
      count += y.numel();
    }
  }
  model->train(wasTraining);
  return count > 0 ? sum / count : 0.0;
}

} // namespace distill::examples
