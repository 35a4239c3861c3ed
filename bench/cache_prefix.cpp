// The teacher-output cache with prefix keys (teacher.cache.keys: prefix,
// docs/teacher.md "Prefix keys (on-policy groups)") against row keys, in one
// run: on-policy groups of G rows sharing a P-token prompt, R-token responses;
// epoch 1 fills each store, epoch 2 sends every prompt again with new
// responses. Per epoch-2 group: positions stored, positions shaped, bytes
// stored, and the teacher's time (cache lookups, forward, shaping, encoding,
// storing, decoding), with ratios prefix / row. The teacher is a causal model
// (embedding, cumulative mean, linear to the vocabulary), top-k answers, float32
// on the CPU (--topk 0: full logits). Prints one JSON line.
//
//   build/bin/bench_cache_prefix [--prompt 256 --response 64 --group 8 --prompts 4 --vocab 8192 --dim 128 --topk 8]
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>

#include "cache/cache.h"
#include "distill/core/answer_kinds.h"
#include "distill/teacher/server.h"

using distill::TeacherCache;

namespace {

struct Args {
  int64_t prompt = 256, response = 64, group = 8, prompts = 4, vocab = 8192, dim = 128, topk = 8, threads = 1, reps = 3;
};

Args parse(int argc, char** argv) {
  Args a;
  const std::map<std::string, int64_t*> flags = {
      {"--prompt", &a.prompt},   {"--response", &a.response}, {"--group", &a.group},
      {"--prompts", &a.prompts}, {"--vocab", &a.vocab},       {"--dim", &a.dim},
      {"--topk", &a.topk},       {"--threads", &a.threads},   {"--reps", &a.reps}};
  for (int i = 1; i + 1 < argc; i += 2) {
    auto it = flags.find(argv[i]);
    if (it == flags.end()) {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      std::exit(2);
    }
    *it->second = std::atoll(argv[i + 1]);
  }
  return a;
}

// The causal teacher, shaping only the positions asked for (as distill-teacher does).
struct Teacher {
  at::Tensor emb, w;
  int64_t topk = 8, shaped = 0;
  TeacherCache::Computed operator()(const std::vector<at::Tensor>& in, const at::Tensor& positions) {
    const at::Tensor& ids = in.at(0);
    at::Tensor x = emb.index_select(0, ids.reshape(-1)).view({ids.size(0), ids.size(1), emb.size(1)});
    at::Tensor n = at::arange(1, ids.size(1) + 1, at::kFloat).view({1, -1, 1});
    std::map<std::string, at::Tensor> raw{{distill::protocol::kLogits, at::matmul(x.cumsum(1) / n, w)}};
    if (positions.defined()) raw = distill::gatherPositions(raw, {}, positions, ids.size(1));
    const at::Tensor& logits = raw.at(distill::protocol::kLogits);
    shaped += logits.size(0) * logits.size(1);
    if (topk == 0) return {{{distill::protocol::kLogits, logits.contiguous()}}, w.size(1)};
    return {distill::topkOutput(logits, topk, 1.0), w.size(1)};
  }
};

at::Tensor groupRows(const Args& a, int64_t prompt, int64_t epoch) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + uint64_t(prompt));
  at::Tensor p = at::randint(0, a.vocab, {1, a.prompt}, g, at::kLong);
  auto r = at::make_generator<at::CPUGeneratorImpl>(5000 + 100 * uint64_t(epoch) + uint64_t(prompt));
  at::Tensor responses = at::randint(0, a.vocab, {a.group, a.response}, r, at::kLong);
  return at::cat({p.expand({a.group, a.prompt}), responses}, 1).contiguous();
}

struct Result {
  double msPerGroup = 0;
  int64_t stored = 0, shaped = 0, bytes = 0;
};

Result run(const Args& a, distill::CacheKeys keys, const std::string& dir) {
  distill::TeacherOptions::CacheOptions o;
  o.path = dir;
  o.mode = distill::CacheMode::kReadWrite;
  o.max_bytes = int64_t(4) << 30;
  o.keys = keys;
  TeacherCache cache(o, "bench context", {"input_ids"}, 1.0);
  auto g = at::make_generator<at::CPUGeneratorImpl>(7);
  Teacher teacher{at::randn({a.vocab, a.dim}, g, at::kFloat), at::randn({a.dim, a.vocab}, g, at::kFloat), a.topk};
  for (int64_t p = 0; p < a.prompts; ++p) {
    cache.answer({{groupRows(a, p, 1)}}, TeacherCache::ComputePositions(std::ref(teacher)), at::kCPU);
  }
  const distill::CacheStats before = cache.stats();
  const int64_t shapedBefore = teacher.shaped;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t p = 0; p < a.prompts; ++p) {
    cache.answer({{groupRows(a, p, 2)}}, TeacherCache::ComputePositions(std::ref(teacher)), at::kCPU);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  Result r;
  r.msPerGroup = ms / double(a.prompts);
  r.stored = (cache.stats().insertedTokens - before.insertedTokens) / a.prompts;
  r.shaped = (teacher.shaped - shapedBefore) / a.prompts;
  r.bytes = (cache.stats().storedBytes - before.storedBytes) / a.prompts;
  return r;
}

void removeStore(const std::string& dir) {
  ::unlink((dir + "/data.mdb").c_str());
  ::unlink((dir + "/lock.mdb").c_str());
  ::rmdir(dir.c_str());
}

} // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  at::set_num_threads(int(a.threads));
  c10::InferenceMode guard;
  const std::string base = "/tmp/bench-cache-prefix-" + std::to_string(::getpid());
  // Each mode `reps` times (fresh stores, alternating): the median time.
  std::vector<Result> rows, prefixes;
  for (int64_t i = 0; i < a.reps; ++i) {
    rows.push_back(run(a, distill::CacheKeys::kRow, base + "-row"));
    prefixes.push_back(run(a, distill::CacheKeys::kPrefix, base + "-prefix"));
    removeStore(base + "-row");
    removeStore(base + "-prefix");
  }
  auto median = [](std::vector<Result> v) {
    std::sort(v.begin(), v.end(), [](const Result& x, const Result& y) { return x.msPerGroup < y.msPerGroup; });
    return v[v.size() / 2];
  };
  const Result row = median(rows), prefix = median(prefixes);
  double load[1] = {0};
  ::getloadavg(load, 1);
  auto ratio = [](double x, double y) { return y > 0 ? x / y : 0.0; };
  std::printf(
      "{\"bench\": \"cache_prefix\", \"prompt\": %lld, \"response\": %lld, \"group\": %lld, \"prompts\": %lld, "
      "\"vocab\": %lld, \"dim\": %lld, \"topk\": %lld, \"epoch\": 2, "
      "\"positions_stored_per_group\": {\"row\": %lld, \"prefix\": %lld}, \"stored_ratio\": %.4f, "
      "\"positions_shaped_per_group\": {\"row\": %lld, \"prefix\": %lld}, \"shaped_ratio\": %.4f, "
      "\"bytes_stored_per_group\": {\"row\": %lld, \"prefix\": %lld}, \"bytes_ratio\": %.4f, "
      "\"ms_per_group\": {\"row\": %.1f, \"prefix\": %.1f}, \"time_ratio\": %.4f, "
      "\"reps\": %lld, \"threads\": %lld, \"cores\": %u, \"load\": %.2f}\n",
      (long long)a.prompt, (long long)a.response, (long long)a.group, (long long)a.prompts, (long long)a.vocab,
      (long long)a.dim, (long long)a.topk, (long long)row.stored, (long long)prefix.stored,
      ratio(double(prefix.stored), double(row.stored)), (long long)row.shaped, (long long)prefix.shaped,
      ratio(double(prefix.shaped), double(row.shaped)), (long long)row.bytes, (long long)prefix.bytes,
      ratio(double(prefix.bytes), double(row.bytes)), row.msPerGroup, prefix.msPerGroup,
      ratio(prefix.msPerGroup, row.msPerGroup), (long long)a.reps, (long long)a.threads,
      std::thread::hardware_concurrency(), load[0]);
  return 0;
}
