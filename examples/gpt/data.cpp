#include "data.h"

#include <ATen/ATen.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace distill::examples {
namespace {

// splitmix64: one well-mixed word per input, for seeding.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

} // namespace

TextData::TextData(const std::string& path, double valFraction, int64_t context) : path_(path), context_(context) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw std::runtime_error("data " + path + ": cannot open: " + std::strerror(errno));
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) bytes_.append(buf, n);
  if (std::ferror(f.get())) throw std::runtime_error("data " + path + ": cannot read: " + std::strerror(errno));
  split_ = static_cast<int64_t>(static_cast<double>(bytes_.size()) * (1.0 - valFraction));
  if (split_ < context + 1 || valBytes() < context + 1) {
    throw std::runtime_error("data " + path + ": " + std::to_string(bytes_.size()) +
                             " bytes are too few for a window of " + std::to_string(context + 1) +
                             " bytes in both the training and the validation part (val_fraction " +
                             std::to_string(valFraction) + ")");
  }
  hash_ = 14695981039346656037ull;
  for (unsigned char ch : bytes_) {
    hash_ ^= ch;
    hash_ *= 1099511628211ull;
  }
}

Batch TextData::sample(int64_t seed, int64_t step, int64_t rank, int64_t accStep, int64_t rows) const {
  uint64_t state =
      mix(mix(mix(mix(static_cast<uint64_t>(seed)) ^ static_cast<uint64_t>(step)) ^ static_cast<uint64_t>(rank)) ^
          static_cast<uint64_t>(accStep));
  const uint64_t starts = static_cast<uint64_t>(split_ - context_); // window start in [0, starts)
  at::Tensor window = at::empty({rows, context_ + 1}, at::kLong);
  int64_t* out = window.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    state = mix(state);
    const int64_t start = static_cast<int64_t>(state % starts);
    for (int64_t j = 0; j <= context_; ++j) {
      out[r * (context_ + 1) + j] = static_cast<unsigned char>(bytes_[start + j]);
    }
  }
  return {window.narrow(1, 0, context_).contiguous(), window.narrow(1, 1, context_).contiguous()};
}

Batch TextData::validation(int64_t maxTokens) const {
  const int64_t windows = std::max<int64_t>(1, std::min((valBytes() - 1) / context_, maxTokens / context_));
  at::Tensor window = at::empty({windows, context_ + 1}, at::kLong);
  int64_t* out = window.data_ptr<int64_t>();
  for (int64_t w = 0; w < windows; ++w) {
    for (int64_t j = 0; j <= context_; ++j) {
      out[w * (context_ + 1) + j] = static_cast<unsigned char>(bytes_[split_ + w * context_ + j]);
    }
  }
  return {window.narrow(1, 0, context_).contiguous(), window.narrow(1, 1, context_).contiguous()};
}

} // namespace distill::examples
