#pragma once

// The demo's data: the bytes of one text file, split into a training part (the
// first 1 - val_fraction) and a held-out validation part (the rest).
//
// Batches are a pure function of (seed, step, rank, acc_step): random windows
// of the training part drawn by a generator seeded from those four numbers. So
// a resumed run sees exactly the batches it would have seen, with no data
// position to save, and a single process can rebuild the global batch of a
// step of N data-parallel students (the label-only baseline does, to train on
// the same tokens as the distilled students).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace distill::examples {

struct Batch {
  at::Tensor ids; // [rows, context] int64: bytes
  at::Tensor labels; // [rows, context] int64: the next byte of each position
};

class TextData {
 public:
  // Reads `path` (std::runtime_error naming it when unreadable or too short
  // for one window of `context` + 1 bytes in each part).
  TextData(const std::string& path, double valFraction, int64_t context);

  const std::string& path() const { return path_; }
  int64_t trainBytes() const { return split_; }
  int64_t valBytes() const { return static_cast<int64_t>(bytes_.size()) - split_; }
  // FNV-1a 64 of the file's bytes: identifies the data in a phase's key.
  uint64_t hash() const { return hash_; }

  // `rows` windows of the training part for (seed, step, rank, accStep).
  Batch sample(int64_t seed, int64_t step, int64_t rank, int64_t accStep, int64_t rows) const;
  // The validation part cut into consecutive windows, at most `maxTokens` tokens.
  Batch validation(int64_t maxTokens) const;

 private:
  std::string path_;
  std::string bytes_;
  int64_t split_ = 0;
  int64_t context_ = 0;
  uint64_t hash_ = 0;
};

} // namespace distill::examples
