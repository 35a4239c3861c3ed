// Bytes per token of the teacher's answer (issue 28 item 2): on the wire (the
// tensors the server sends, each starting at a 64-byte boundary of the slot,
// as teacher/src/server.cpp shapes them) and in the teacher-output cache (the
// records teacher/src/cache/records.cpp stores), for a vocabulary of --v entries
// (32 000) and --rows sequences of --seq tokens of random logits (a cache
// record holds one sequence): top-k for k = 32, 64, 128 and full logits, in
// float32 and bfloat16 values. The wire figures equal
// core/payload.h's slot arithmetic (what transport.max_response_bytes auto
// reserves per token); the bench checks that they do. One JSON line each:
//   {"bench":"payload","v":32000,"payload":"topk","k":64,"dtype":"bfloat16",
//    "wire_bytes_per_token":392.0,"slot_bytes_per_token":392.0,"cache_bytes_per_token":…,
//    "full_fp32_over_wire":…}
// And the cost of teacher.on_nonfinite's check (teacher/src/answer_check.h,
// issue 39 item 2: at most 2 % of an answer's time at V = 32k), as a ratio to
// a baseline timed in the same run: a lower bound of any teacher's answer, its
// output projection alone (hidden [tokens, --d] x [--d, V], --d 2048: a 1B-class
// model's head; every real forward costs more than its head) and the shaping
// (full logits in float32, or top-64), median of --reps. Measured here (2 shared
// cores, OMP_NUM_THREADS=1, V 32000, 256 tokens): d 2048 full 0.010, top-64
// 0.006; with the smallest head, d 512, full 0.04 (a head alone is not a teacher):
//   {"bench":"nonfinite_check","v":32000,"tokens":256,"d":2048,"payload":"full",
//    "check_ms":…,"answer_ms":…,"ratio":…}
// printf of literal keys and numbers only: trivially valid JSON.
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "answer_check.h" // internal: teacher/src (findNonfinite)
#include "cache/cache.h" // internal: teacher/src (encodeRow, roundForStorage)
#include "distill/core/options.h"
#include "distill/core/payload.h"
#include "distill/core/answer_kinds.h"
#include "distill/teacher/server.h"

namespace {

int64_t argOr(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

int64_t aligned(int64_t n) { return (n + 63) / 64 * 64; }

// One configuration: the answer as the server sends it, its wire bytes and
// its cache records, per token.
void measure(const at::Tensor& logits, int64_t k, distill::PayloadDtype dtype, const char* name) {
  distill::Config c;
  c.teacher.topk = k;
  c.teacher.payload_dtype = dtype;
  c.teacher.vocab_size = logits.size(-1);
  c.teacher.max_batch_tokens = logits.size(0) * logits.size(1);
  const at::ScalarType st = distill::payloadDtype(c.teacher, logits.scalar_type());
  const double temperature = 1.0;
  distill::Answer answer;
  if (k > 0) {
    answer = distill::topkOutput(logits, k, temperature, st);
  } else {
    answer[distill::protocol::kLogits] = logits.to(st).contiguous();
  }
  const int64_t rows = logits.size(0), n = rows * logits.size(1);
  int64_t wire = 0;
  for (const auto& [_, t] : answer) wire += aligned(int64_t(t.nbytes()));
  // The cache rounds float32 top-k values to float16 first, as the cache does (cache/records.h, roundForStorage).
  distill::Answer stored = answer;
  distill::roundForStorage(stored, temperature);
  int64_t cache = 0;
  for (int64_t r = 0; r < rows; ++r) {
    distill::Answer row;
    for (const auto& [key, t] : stored) row[key] = t.narrow(0, r, 1);
    cache += int64_t(distill::encodeRow(row, logits.size(-1)).size());
  }
  const distill::SlotBytes slot = distill::slotBytesNeeded(c);
  const double wirePer = double(wire) / double(n);
  const double fullFp32 = 4.0 * double(logits.size(-1));
  std::printf(
      "{\"bench\":\"payload\",\"v\":%lld,\"seq\":%lld,\"tokens\":%lld,\"payload\":\"%s\",\"k\":%lld,\"dtype\":\"%s\","
      "\"wire_bytes_per_token\":%.1f,\"slot_bytes_per_token\":%.1f,\"cache_bytes_per_token\":%.1f,"
      "\"full_fp32_over_wire\":%.1f,\"slot_matches_wire\":%s}\n",
      static_cast<long long>(logits.size(-1)), static_cast<long long>(logits.size(1)), static_cast<long long>(n),
      k > 0 ? "topk" : "full", static_cast<long long>(k), name, wirePer, double(slot.response) / double(n),
      double(cache) / double(n), fullFp32 / wirePer, slot.response == wire ? "true" : "false");
}

// Median milliseconds of `reps` calls of `f` (after one warm-up call).
double medianMs(int64_t reps, const std::function<void()>& f) {
  f();
  std::vector<double> ms;
  for (int64_t i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void measureCheck(int64_t v, int64_t tokens, int64_t d, int64_t k, int64_t reps) {
  const at::Tensor hidden = at::randn({tokens, d});
  const at::Tensor head = at::randn({v, d}) * (1.0 / 8);
  at::Tensor logits;
  const double answer = medianMs(reps, [&] {
    logits = at::mm(hidden, head.t());
    if (k > 0) {
      distill::topkOutput(logits, k, 1.0, at::kFloat);
    } else {
      logits.contiguous();
    }
  });
  bool finite = true;
  const double check = medianMs(reps, [&] { finite = !distill::findNonfinite(logits).has_value(); });
  std::printf(
      "{\"bench\":\"nonfinite_check\",\"v\":%lld,\"tokens\":%lld,\"d\":%lld,\"payload\":\"%s\",\"k\":%lld,"
      "\"check_ms\":%.4f,\"answer_ms\":%.4f,\"ratio\":%.4f,\"finite\":%s}\n",
      static_cast<long long>(v), static_cast<long long>(tokens), static_cast<long long>(d), k > 0 ? "topk" : "full",
      static_cast<long long>(k), check, answer, check / answer, finite ? "true" : "false");
}

} // namespace

int main(int argc, char** argv) {
  const int64_t v = argOr(argc, argv, "--v", 32000);
  const int64_t rows = argOr(argc, argv, "--rows", 2), seq = argOr(argc, argv, "--seq", 128);
  at::manual_seed(0);
  const at::Tensor logits = at::randn({rows, seq, v}) * 3;
  for (int64_t k : {32, 64, 128}) {
    measure(logits, k, distill::PayloadDtype::kFloat32, "float32");
    measure(logits, k, distill::PayloadDtype::kBFloat16, "bfloat16");
  }
  measure(logits, 0, distill::PayloadDtype::kFloat32, "float32");
  measure(logits, 0, distill::PayloadDtype::kBFloat16, "bfloat16");
  const int64_t d = argOr(argc, argv, "--d", 2048), reps = argOr(argc, argv, "--reps", 11);
  measureCheck(v, rows * seq, d, 0, reps);
  measureCheck(v, rows * seq, d, 64, reps);
  return 0;
}
