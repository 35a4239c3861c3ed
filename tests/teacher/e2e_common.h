#pragma once
// Shared by the end-to-end tests and their roles (e2e_roles.cpp): the job's
// YAML, the students' deterministic micro-batches, the self teacher's model.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <string>

namespace distill::testing::e2e {

constexpr int64_t kVocab = 64, kBatch = 2, kSeq = 16, kIgnore = -100;

// A job config: `teacher` holds the indented lines of the teacher section.
inline std::string jobYaml(const std::string& teacher, int gradAccSteps = 4, int inFlight = 2,
                           double hangTimeoutS = 30) {
  return "run:\n  startup_timeout_s: 30\n  collective_timeout_s: 30\n  hang_timeout_s: " +
      std::to_string(hangTimeoutS) + "\nteacher:\n" + teacher +
      // Requests of kBatch x kSeq = 32 tokens: slots sized for 1024 fit the sizes set below.
      "  max_batch_tokens: 1024\nstudent:\n  grad_acc_steps: " + std::to_string(gradAccSteps) +
      "\n  in_flight: " + std::to_string(inFlight) +
      "\ntransport:\n  slots: 4\n  max_request_bytes: 65536\n  max_response_bytes: 262144\n"
      "  heartbeat_ms: 100\nloss:\n  kind: forward_kl\n  temperature: 2.0\n  alpha: 0.5\n"
      "  ignore_index: " +
      std::to_string(kIgnore) + "\n  chunk_tokens: 7\n";
}

struct MicroBatch {
  at::Tensor ids, labels; // int64 [kBatch, kSeq]; labels: next token, ~30% ignored
};

// The same for a (rank, step, acc_step) in every process.
inline MicroBatch microBatch(int rank, int64_t step, int64_t acc) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000003ull * uint64_t(rank + 1) + 131ull * uint64_t(step) +
                                                    uint64_t(acc));
  at::Tensor ids = at::randint(0, kVocab, {kBatch, kSeq}, g, at::kLong);
  at::Tensor labels = at::full({kBatch, kSeq}, kIgnore, at::kLong);
  labels.narrow(1, 0, kSeq - 1).copy_(ids.narrow(1, 1, kSeq - 1));
  labels.masked_fill_(at::rand({kBatch, kSeq}, g) < 0.3, kIgnore);
  return {ids, labels};
}

// The model of the teacher.kind self tests: a fixed random logit table.
inline at::Tensor selfTeacherLogits(const at::Tensor& ids) {
  static const at::Tensor table = [] {
    auto g = at::make_generator<at::CPUGeneratorImpl>(4242);
    return at::randn({kVocab, kVocab}, g, at::kFloat) * 2;
  }();
  return table.index_select(0, ids.reshape(-1)).view({ids.size(0), ids.size(1), kVocab});
}

} // namespace distill::testing::e2e
