// bench_loss: forward + backward time of distillLoss against plain
// cross-entropy (the label-only trainer's loss) on the same logits, measured in
// the same run, one torch thread. Prints JSON lines:
//   {"bench":"loss","kind":"forward_kl","teacher":"full|top32","n":1024,"v":256,"ms_p50":…,"ce_ms_p50":…,"ratio_to_ce":…}
//
//   build/bin/bench_loss [--n 1024] [--v 256] [--reps 200] [--no-tail]
//
// top32 is what the teacher server sends (topkOutput: values, indices,
// logsumexp and log tail); --no-tail leaves the log tail out (an older
// teacher: the logsumexp-only path).
#include <distill/distill.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

double p50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double timeMs(int reps, F&& f) {
  std::vector<double> ms;
  for (int i = 0; i < reps + 10; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    auto t1 = std::chrono::steady_clock::now();
    if (i >= 10) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return p50(ms);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 1024, v = 256;
  int reps = 200;
  bool noTail = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--no-tail") noTail = true;
    else if (f == "--n" && i + 1 < argc) n = std::stoll(argv[++i]);
    else if (f == "--v" && i + 1 < argc) v = std::stoll(argv[++i]);
    else if (f == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_loss [--n N] [--v V] [--reps R] [--no-tail]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  torch::manual_seed(0);
  auto base = torch::randn({n, v});
  auto teacher = torch::randn({n, v}) * 2;
  auto labels = torch::randint(0, v, {n}, torch::kLong);
  const double ce = timeMs(reps, [&] {
    auto z = base.clone().requires_grad_(true);
    torch::nn::functional::cross_entropy(z, labels).backward();
  });
  for (const char* kind : {"forward_kl", "reverse_kl", "jsd"}) {
    for (bool topk : {false, true}) {
      if (topk && std::string(kind) == "reverse_kl") continue;
      distill::LossOptions o;
      o.kind = distill::parseEnum<distill::LossKind>(kind).value();
      o.temperature = 1.0;
      distill::TeacherOutput t;
      if (topk) {  // what the teacher server sends: values, indices, logsumexp, log tail
        auto out = distill::topkOutput(teacher, 32, o.temperature);
        t.topkValues = out.at(distill::protocol::kTopkValues);
        t.topkIndices = out.at(distill::protocol::kTopkIndices);
        t.logsumexp = out.at(distill::protocol::kLogsumexp);
        if (!noTail) t.logTail = out.at(distill::protocol::kLogTail);
      } else {
        t.logits = teacher;
      }
      const double ms = timeMs(reps, [&] {
        auto z = base.clone().requires_grad_(true);
        distill::distillLoss(z, labels, t, o, static_cast<double>(n)).loss.backward();
      });
      std::printf("{\"bench\":\"loss\",\"kind\":\"%s\",\"teacher\":\"%s\",\"n\":%lld,\"v\":%lld,\"ms_p50\":%.3f,"
                  "\"ce_ms_p50\":%.3f,\"ratio_to_ce\":%.2f}\n",
                  kind, topk ? "top32" : "full", static_cast<long long>(n), static_cast<long long>(v), ms, ce,
                  ms / ce);
    }
  }
  return 0;
}
