#pragma once

// The architecture of the demo's GPT (gpt.h), without torch: what configs,
// weight files and logs describe.

#include <cstdint>
#include <string>

namespace distill::examples {

struct GptOptions {
  int64_t vocab = 256; // bytes
  int64_t context = 64; // longest sequence (positions)
  int64_t layers = 2; // transformer blocks
  int64_t heads = 4; // attention heads; must divide dim
  int64_t dim = 64; // model width
  double dropout = 0.0; // residual and attention dropout in training mode

  // Parameters, for logs ("0.13M").
  int64_t parameterCount() const;
  std::string describe() const; // "2 layers x 64 dim, 4 heads, context 64 (0.13M parameters)"
};

} // namespace distill::examples
