// bench_loss --signals: what each teacher signal costs and how far its
// gradient is from the exact one (issue 44). Per signal and size, on one torch
// thread:
//   bytes_per_token   the answer on the ring (values bfloat16, ids int32,
//                     counts int16, statistics float32); request_bytes: ids
//                     the request carries (student top-k, sampled token)
//   cpu_ms_p50        distillLoss forward + backward, this thread's CPU time
//   error             ||mean g - g*|| / ||g*|| over all tokens, g the gradient
//                     w.r.t. the student logits, g* the exact full-vocabulary
//                     gradient of the same loss kind (forward KL for full,
//                     hidden, top-k and sampled; reverse KL for student top-k and the
//                     sampled token), the mean over `draws` independent draws
//                     for the sampled signals (one answer for the others)
//   noise             the part of that error the draws' variance explains:
//                     sqrt(sum_m ||g_m - mean g||^2 / (M (M - 1))) / ||g*||
//                     (the expected error of an unbiased estimator's mean)
//   bias              sqrt(max(0, error^2 - noise^2)): the relative error of
//                     the estimator's expectation (error itself where noise 0)
// The teacher by default is synthetic, not uniform noise: per token, Zipf
// logits -a log(rank) with a in [1.0, 1.8] over shuffled ranks (entropy
// printed), and a student equal to it plus N(0, 1) noise on every logit (its
// tail has another shape). --teacher-logits FILE reads a trained model's
// instead: a file written by Python's torch.save, either the teacher's [N, V]
// logits alone (the student is then the teacher plus N(0, 1) noise, the labels
// drawn from the teacher) or a dict {"teacher": [N, V], "student": [N, V],
// "labels": [N]} (bench/signals_logits.py writes one from a trained Llama
// teacher and a less-trained student on held-out text); N and V are the file's.
//
//   build/bin/bench_loss --signals [--n 128] [--v 32000] [--draws 100] [--reps 5] [--teacher-logits FILE]
#include <distill/distill.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

double cpuMs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

struct Setup {
  int64_t n = 128, v = 32000, draws = 100;
  int reps = 5;
  std::string logitsFile; // --teacher-logits (empty: the synthetic Zipf teacher)
  std::string teacher = "zipf", student = "teacher+noise"; // what the rows say they measured
};

struct Data {
  at::Tensor t, z, labels; // [N, V] teacher and student logits (float32), labels
  at::Tensor q, p; // softmaxes, float64
};

Data makeData(const Setup& s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(44);
  Data d;
  at::Tensor rank = at::empty({s.n, s.v}, at::kDouble);
  for (int64_t r = 0; r < s.n; ++r) rank[r].copy_(at::randperm(s.v, gen, at::kLong).add_(1));
  at::Tensor a = at::rand({s.n, 1}, gen, at::kDouble).mul_(0.8).add_(1.0);
  d.t = rank.log_().mul_(a).neg_().to(at::kFloat);
  d.z = d.t + at::randn({s.n, s.v}, gen, at::kFloat);
  d.labels = at::multinomial(at::softmax(d.t, 1), 1, false, gen).squeeze(1);
  d.q = at::softmax(d.t.to(at::kDouble), 1);
  d.p = at::softmax(d.z.to(at::kDouble), 1);
  return d;
}

// --teacher-logits: the file torch.save wrote (top of file), its N and V into s.
Data loadData(Setup& s) {
  std::ifstream f(s.logitsFile, std::ios::binary);
  if (!f) throw std::runtime_error("--teacher-logits " + s.logitsFile + ": cannot open it");
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const c10::IValue v = torch::pickle_load(bytes);
  Data d;
  if (v.isTensor()) {
    d.t = v.toTensor();
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      const std::string key = e.key().isString() ? e.key().toStringRef() : "";
      at::Tensor* slot = key == "teacher" ? &d.t : key == "student" ? &d.z : key == "labels" ? &d.labels : nullptr;
      if (slot && e.value().isTensor()) *slot = e.value().toTensor();
    }
  }
  if (!d.t.defined() || d.t.dim() < 2) {
    throw std::runtime_error("--teacher-logits " + s.logitsFile + ": expected a tensor [..., V] or a dict with "
                             "\"teacher\" [N, V] (torch.save of either)");
  }
  d.t = d.t.to(at::kFloat).reshape({-1, d.t.size(-1)}).contiguous();
  s.n = d.t.size(0), s.v = d.t.size(1);
  s.teacher = "file";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(44);
  if (d.z.defined()) {
    d.z = d.z.to(at::kFloat).reshape({s.n, s.v}).contiguous();
    s.student = "file";
  } else {
    d.z = d.t + at::randn({s.n, s.v}, gen, at::kFloat);
  }
  if (d.labels.defined()) {
    d.labels = d.labels.to(at::kLong).reshape({s.n}).contiguous();
  } else {
    d.labels = at::multinomial(at::softmax(d.t, 1), 1, false, gen).squeeze(1);
  }
  d.q = at::softmax(d.t.to(at::kDouble), 1);
  d.p = at::softmax(d.z.to(at::kDouble), 1);
  return d;
}

// The gradient of alpha = 1, T = 1 loss w.r.t. the student logits, and its CPU time.
at::Tensor gradient(const Data& d, const distill::TeacherOutput& t, distill::LossKind kind, double* ms = nullptr) {
  distill::LossOptions o;
  o.kind = kind;
  o.alpha = 1;
  at::Tensor z = d.z.clone().requires_grad_(true);
  const double c0 = cpuMs();
  distill::distillLoss(z, d.labels, t, o, double(d.z.size(0))).loss.backward();
  if (ms) *ms = cpuMs() - c0;
  return z.grad().to(at::kDouble);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  std::string signal;
  int64_t size;
  const char* loss;
  double bytes, requestBytes, cpu, error, noise;
  int64_t draws;
};

void print(const Setup& s, double entropy, const Row& r) {
  std::printf("{\"bench\":\"signals\",\"signal\":\"%s\",\"size\":%lld,\"loss\":\"%s\",\"n\":%lld,\"v\":%lld,"
              "\"teacher\":\"%s\",\"student\":\"%s\",\"teacher_entropy_nats\":%.3f,\"bytes_per_token\":%.0f,\"request_bytes_per_"
              "token\":%.0f,\"cpu_ms_p50\":%.2f,\"error\":%.4g,\"noise\":%.4g,\"bias\":%.4g,\"draws\":%lld}\n",
              r.signal.c_str(), (long long)r.size, r.loss, (long long)s.n, (long long)s.v, s.teacher.c_str(),
              s.student.c_str(), entropy, r.bytes,
              r.requestBytes, r.cpu, r.error, r.noise,
              std::sqrt(std::max(0.0, r.error * r.error - r.noise * r.noise)), (long long)r.draws);
  std::fflush(stdout);
}

// A deterministic signal: its gradient once, its time over reps.
Row fixed(const Setup& s, const Data& d, const distill::TeacherOutput& t, distill::LossKind kind,
          const at::Tensor& exact) {
  std::vector<double> ms;
  at::Tensor g;
  for (int i = 0; i < s.reps; ++i) {
    double m = 0;
    g = gradient(d, t, kind, &m);
    ms.push_back(m);
  }
  Row r;
  r.cpu = median(ms);
  r.error = (g - exact).norm().item<double>() / exact.norm().item<double>();
  r.noise = 0;
  r.draws = 1;
  return r;
}

// A stochastic signal: the mean of `draws` gradients, its error and noise (top of file).
template <typename F>
Row drawn(const Setup& s, const at::Tensor& exact, F&& draw) {
  at::Tensor sum = at::zeros_like(exact);
  double sq = 0;
  std::vector<double> ms;
  for (int64_t m = 0; m < s.draws; ++m) {
    double t = 0;
    at::Tensor g = draw(&t);
    sum += g;
    sq += g.pow(2).sum().item<double>();
    ms.push_back(t);
  }
  const double m = double(s.draws), scale = exact.norm().item<double>();
  at::Tensor mean = sum / m;
  Row r;
  r.cpu = median(ms);
  r.error = (mean - exact).norm().item<double>() / scale;
  const double spread = (sq - m * mean.pow(2).sum().item<double>()) / (m - 1); // E ||g - mean||^2
  r.noise = std::sqrt(std::max(0.0, spread) / m) / scale;
  r.draws = s.draws;
  return r;
}

// The command line into s; false (after the usage line) when it does not parse.
bool parseArgs(int argc, char** argv, Setup& s) {
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    const bool more = i + 1 < argc;
    if (f == "--signals") continue;
    if (f == "--n" && more) {
      s.n = std::stoll(argv[++i]);
    } else if (f == "--v" && more) {
      s.v = std::stoll(argv[++i]);
    } else if (f == "--draws" && more) {
      s.draws = std::stoll(argv[++i]);
    } else if (f == "--reps" && more) {
      s.reps = std::stoi(argv[++i]);
    } else if (f == "--teacher-logits" && more) {
      s.logitsFile = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_loss --signals [--n N] [--v V] [--draws M] [--reps R] [--teacher-logits FILE]\n");
      return false;
    }
  }
  return true;
}

} // namespace

int signalsMain(int argc, char** argv) {
  Setup s;
  if (!parseArgs(argc, argv, s)) return 2;
  at::set_num_threads(1);
  using distill::LossKind;
  Data d;
  try {
    d = s.logitsFile.empty() ? makeData(s) : loadData(s);
  } catch (const c10::Error& e) { // not a file torch.save wrote
    std::fprintf(stderr, "bench_loss --signals: --teacher-logits %s: %s\n", s.logitsFile.c_str(),
                 e.what_without_backtrace());
    return 2;
  } catch (const std::exception& e) { // no such file, or not the tensors expected
    std::fprintf(stderr, "bench_loss --signals: %s\n", e.what());
    return 2;
  }
  const double entropy = -(d.q * d.q.log()).sum(1).mean().item<double>();
  // Exact gradients (alpha 1, T 1, normalizer N): (p - q) / N and p (log p/q - KL) / N.
  const at::Tensor fwd = (d.p - d.q) / double(s.n);
  const at::Tensor lr = d.p.log() - d.q.log();
  const at::Tensor rev = d.p * (lr - (d.p * lr).sum(1, true)) / double(s.n);
  const double v = double(s.v);

  Row full = fixed(s, d, distill::TeacherOutput{distill::LogitsAnswer{d.t}}, LossKind::kForwardKl, fwd);
  full.signal = "full", full.size = s.v, full.loss = "forward_kl", full.bytes = 2 * v, full.requestBytes = 0;
  print(s, entropy, full);
  Row fullRev = fixed(s, d, distill::TeacherOutput{distill::LogitsAnswer{d.t}}, LossKind::kReverseKl, rev);
  fullRev.signal = "full", fullRev.size = s.v, fullRev.loss = "reverse_kl", fullRev.bytes = 2 * v;
  fullRev.requestBytes = 0;
  print(s, entropy, fullRev);

  { // hidden states and the head: any [N, V] logits are h W^T with d = N (reduced QR of the logits'
    // transpose, in float64: W = Q [V, N] orthonormal, h = R^T [N, N]), so the signal is exact here
    // up to float32 rounding; bytes as the values of the other rows (2 d), the head once per node.
    auto [q, r] = at::linalg_qr(d.t.to(at::kDouble).t(), "reduced");
    auto head = std::make_shared<distill::TeacherHead>();
    head->weight = q.to(at::kFloat).contiguous();
    const at::Tensor h = r.t().to(at::kFloat).contiguous();
    Row hid = fixed(s, d, distill::TeacherOutput{distill::HiddenAnswer{h, head}}, LossKind::kForwardKl, fwd);
    hid.signal = "hidden", hid.size = h.size(1), hid.loss = "forward_kl", hid.bytes = 2.0 * double(h.size(1));
    hid.requestBytes = 0;
    print(s, entropy, hid);
  }
  for (int64_t k : {8, 64}) {
    auto out = distill::topkOutput(d.t, k, 1.0, at::kBFloat16);
    distill::TopkAnswer a{out.at(distill::protocol::kTopkValues), out.at(distill::protocol::kTopkIndices),
                          out.at(distill::protocol::kLogsumexp), out.at(distill::protocol::kLogTail)};
    Row r = fixed(s, d, distill::TeacherOutput{a}, LossKind::kForwardKl, fwd);
    r.signal = "topk", r.size = k, r.loss = "forward_kl", r.bytes = 6.0 * k + 8, r.requestBytes = 0;
    print(s, entropy, r);
  }
  for (int64_t k : {8, 64}) { // the student's own top-k: reverse KL with the tail bucket
    at::Tensor ids = std::get<1>(d.z.topk(k, 1));
    at::Tensor vals = d.t.gather(1, ids).to(at::kBFloat16);
    at::Tensor tail = at::logsumexp(d.t.scatter(1, ids, -INFINITY), 1);
    at::Tensor lse = at::logaddexp(at::logsumexp(vals.to(at::kFloat), 1), tail);
    distill::IdsAnswer a{vals, lse, tail, ids.to(at::kInt), {}};
    Row r = fixed(s, d, distill::TeacherOutput{a}, LossKind::kReverseKl, rev);
    r.signal = "student_topk", r.size = k, r.loss = "reverse_kl", r.bytes = 2.0 * k + 8, r.requestBytes = 4.0 * k;
    print(s, entropy, r);
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor qf = d.q.to(at::kFloat), pf = d.p.to(at::kFloat);
  for (int64_t k : {8, 64}) { // sampled targets: K draws from q per answer
    Row r = drawn(s, fwd, [&](double* ms) {
      at::Tensor draws = at::multinomial(qf, k, /*replacement=*/true, gen).to(at::kInt);
      distill::TeacherOutput t{distill::SampledAnswer{draws, at::ones({s.n, k}, at::kShort)}};
      return gradient(d, t, LossKind::kForwardKl, ms);
    });
    r.signal = "sampled", r.size = k, r.loss = "forward_kl", r.bytes = 6.0 * k, r.requestBytes = 0;
    print(s, entropy, r);
  }
  { // the sampled-token recipe: x ~ p_S, the teacher's logit at x (float32) and its logsumexp
    const at::Tensor lse = at::logsumexp(d.t, 1);
    Row r = drawn(s, rev, [&](double* ms) {
      at::Tensor x = at::multinomial(pf, 1, false, gen);
      distill::TeacherOutput t{distill::IdsAnswer{d.t.gather(1, x), lse, {}, x, {}}};
      return gradient(d, t, LossKind::kSampledToken, ms);
    });
    r.signal = "sampled_token", r.size = 1, r.loss = "reverse_kl", r.bytes = 8, r.requestBytes = 4;
    print(s, entropy, r);
  }
  return 0;
}
