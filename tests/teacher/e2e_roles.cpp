// The child roles of the teacher end-to-end and fault tests: students that
// train through the real client, a teacher.kind self teacher (this binary in
// teacher role), and misbehaving students. Each role reads its job from the
// environment (topologyEnv + DISTILL_CONFIG) through distill::init.
#include <ATen/autocast_mode.h>
#include <signal.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <functional>

#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"
#include "distill/student/grad.h"
#include "distill/student/init.h"
#include "distill/student/losses.h"
#include "distill/teacher/server.h"
#include "e2e_common.h"
#include "support/roles.h"
#include "tiny_mlp.h"

using namespace distill::testing::e2e;
using Ms = std::chrono::milliseconds;

namespace {

distill::Session initSession(const char* name) {
  int argc = 1;
  char arg0[32];
  std::snprintf(arg0, sizeof arg0, "%s", name);
  char* argv[] = {arg0, nullptr};
  return distill::init(argc, argv);
}

int64_t msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<Ms>(std::chrono::steady_clock::now() - t0).count();
}

// The teacher the job serves, run in this process: "script" (teacher.path),
// "mlp" (TinyMlp with teacher.weights) or "self" (selfTeacherLogits).
std::function<at::Tensor(const at::Tensor&)> inProcessTeacher(const std::string& kind, const distill::Config& cfg) {
  if (kind == "script") {
    auto m = std::make_shared<torch::jit::Module>(torch::jit::load(cfg.teacher.path));
    m->eval();
    return [m](const at::Tensor& ids) { return m->forward({ids}).toTensor(); };
  }
  if (kind == "mlp") {
    auto m = std::make_shared<distill::testing::TinyMlp>();
    std::shared_ptr<torch::nn::Module> base = m;
    torch::load(base, cfg.teacher.weights);
    m->eval();
    return [m](const at::Tensor& ids) { return m->forward(ids); };
  }
  return selfTeacherLogits;
}

// teacher.autocast on this thread's CPU ops, as the server's forward runs (restored on exit).
class CpuAutocast {
 public:
  explicit CpuAutocast(distill::Autocast a) : on_(a != distill::Autocast::kNone) {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, a == distill::Autocast::kFloat16 ? at::kHalf : at::kBFloat16);
  }
  ~CpuAutocast() {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }

 private:
  bool on_;
};

// What the server sends for these logits: full, or its top-k output (values,
// indices, logsumexp and log tail at the loss temperature), in teacher.payload_dtype.
distill::TeacherOutput shapeLikeServer(const at::Tensor& logits, const distill::Config& cfg) {
  distill::TeacherOutput o;
  const at::ScalarType dtype = distill::payloadDtype(cfg.teacher, logits.scalar_type());
  if (cfg.teacher.topk == 0) {
    // teacher.cache stores float32 full logits as float16 and answers every row from the store.
    const bool cached = cfg.teacher.cache.mode != distill::CacheMode::kOff && dtype == at::kFloat;
    o.makeLogits().logits = cached ? logits.to(at::kHalf).to(at::kFloat) : logits.to(dtype);
    return o;
  }
  auto out = distill::topkOutput(logits, cfg.teacher.topk, cfg.loss.temperature, dtype);
  o.makeTopk().values = out.at(distill::protocol::kTopkValues);
  o.makeTopk().indices = out.at(distill::protocol::kTopkIndices);
  o.makeTopk().logsumexp = out.at(distill::protocol::kLogsumexp);
  o.makeTopk().logTail = out.at(distill::protocol::kLogTail);
  return o;
}

} // namespace

// A trainer: steps x grad_acc_steps micro-batches through the ring with
// micro-batch k+1 in flight while k is computed; the loss of each with the
// ring's answer and with the in-process teacher's; SGD on a logit table.
// args: teacher kind (script | mlp | self), steps.
DISTILL_TEST_ROLE(distill_student) {
  const std::string kind = args.at(0);
  const int steps = std::stoi(args.at(1));
  distill::Session s = initSession("student");
  const distill::Config& cfg = s.config;
  const int G = cfg.student.grad_acc_steps, rank = s.topology.studentRank, total = steps * G;
  auto teacher = inProcessTeacher(kind, cfg);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
  at::Tensor table = at::randn({kVocab, kVocab}, gen, at::kDouble).requires_grad_();
  torch::optim::SGD opt({table}, torch::optim::SGDOptions(0.5));

  std::vector<distill::Handle> handles(total);
  auto submit = [&](int k) { handles[k] = s.client->submit(microBatch(rank, k / G, k % G).ids, k / G, k % G); };
  double normalizer = 0, maxDiff = 0, lossSum = 0;
  int gets = 0;
  std::string payload = "none";
  submit(0);
  for (int k = 0; k < total; ++k) {
    const int step = k / G, acc = k % G;
    MicroBatch mb = microBatch(rank, step, acc);
    if (acc == 0) {
      std::vector<at::Tensor> labels;
      for (int a = 0; a < G; ++a) labels.push_back(microBatch(rank, step, a).labels);
      normalizer = distill::stepTokenCount(s.student->group(), labels, cfg.loss.ignore_index);
    }
    if (k + 1 < total) submit(k + 1); // the teacher works on k+1 while this student computes k
    distill::TeacherReply reply = s.client->get(handles[k]);
    const auto& h = reply.handle();
    if (h.seq != handles[k].seq || h.step != step || h.accStep != acc) {
      std::fprintf(stderr, "reply %d has the wrong handle\n", k);
      return 1;
    }
    ++gets;
    const distill::TeacherOutput sent = reply.output();
    const distill::HiddenAnswer* hidden = sent.hidden(); // teacher.answer hidden: the reference is the full logits
    payload = c10::toString(
        (sent.logits() ? sent.logits()->logits : hidden ? hidden->hidden : sent.topk()->values).scalar_type());
    if (cfg.teacher.topk > 0 && !(sent.topk()->logsumexp.defined() && sent.topk()->logTail.defined())) {
      std::fprintf(stderr, "reply %d: top-k answer without %s\n", k,
                   sent.topk()->logsumexp.defined() ? "log_tail" : "logsumexp"); // the exact tail (losses.h)
      return 1;
    }
    at::Tensor logits = table.index_select(0, mb.ids.reshape(-1)).view({kBatch, kSeq, kVocab});
    auto ring = distill::distillLoss(logits, mb.labels, sent, cfg.loss, normalizer);
    at::Tensor local;
    {
      c10::InferenceMode guard;
      CpuAutocast autocast(cfg.teacher.autocast);
      local = teacher(mb.ids);
    }
    auto ref = distill::distillLoss(logits.detach(), mb.labels, shapeLikeServer(local, cfg), cfg.loss, normalizer);
    maxDiff = std::max(maxDiff, std::abs(ring.loss.item<double>() - ref.loss.item<double>()));
    lossSum += ring.loss.item<double>();
    ring.loss.backward();
    if (acc == G - 1) {
      distill::allReduceGradients(s.student->group(), {table}, cfg.student.bucket_mb);
      opt.step();
      opt.zero_grad();
    }
  }
  s.client->finish();
  std::fprintf(stderr, "RESULT gets=%d max_loss_diff=%.3e mean_step_loss=%.6f payload=%s\n", gets, maxDiff,
               lossSum / steps, payload.c_str());
  return 0;
}

// teacher.kind self: this binary in teacher role serves its own model.
// args: [N]: raise(SIGKILL) on the N-th forward call.
DISTILL_TEST_ROLE(self_teacher) {
  const int dieAt = args.empty() ? 0 : std::stoi(args[0]);
  distill::Session s = initSession("teacher");
  if (!s.isTeacher()) return 2;
  int calls = 0;
  distill::serve(*s.teacher, distill::teacherFromFunction([&](const std::vector<at::Tensor>& in) {
    if (++calls == dieAt) ::raise(SIGKILL);
    if (calls == 1) {
      // What teacher.autocast turned on around the forward (the e2e tests read it).
      std::fprintf(stderr, "FORWARD autocast cpu=%d dtype=%s\n", int(at::autocast::is_autocast_enabled(at::kCPU)),
                   c10::toString(at::autocast::get_autocast_dtype(at::kCPU)));
    }
    return selfTeacherLogits(in.at(0));
  }));
  return 0;
}

// A student whose request breaks the protocol after valid ones; prints the
// teacher's refusal and how long it took. args: skip | dtype | name.
DISTILL_TEST_ROLE(bad_student) {
  const std::string mode = args.at(0);
  distill::Session s = initSession("student");
  auto& c = *s.client;
  at::Tensor ids = microBatch(s.topology.studentRank, 0, 0).ids;
  c.get(c.submit(ids, 0, 0));
  auto t0 = std::chrono::steady_clock::now();
  try {
    if (mode == "skip") {
      c.get(c.submit(ids, 0, 1));
      t0 = std::chrono::steady_clock::now();
      c.get(c.submit(ids, 0, 3)); // acc_step 2 never sent: the step drift of docs/design.md's second hang
    } else if (mode == "dtype") {
      c.get(c.submit(ids.to(at::kFloat), 0, 1));
    } else {
      c.get(c.submit({{"tokens", ids}}, 0, 1));
    }
  } catch (const distill::ProtocolError& e) {
    std::fprintf(stderr, "REJECTED after %lld ms: ProtocolError: %s\n", static_cast<long long>(msSince(t0)), e.what());
    if (mode == "skip") return 0;
    // A bad input breaks no order: the next micro-batch is served.
    c.get(c.submit(ids, 0, 2));
    std::fprintf(stderr, "SERVED after the refusal\n");
    return 0;
  }
  std::fprintf(stderr, "NOT REJECTED\n");
  return 1;
}

// Trains until the teacher dies; prints how long the get() that noticed it
// waited. Exit 4: PeerLostError in get (expected), 5: elsewhere, 1: no error.
DISTILL_TEST_ROLE(orphan_student) {
  distill::Session s = initSession("student");
  const int G = s.config.student.grad_acc_steps, rank = s.topology.studentRank;
  try {
    for (int k = 0; k < 4000; ++k) {
      auto h = s.client->submit(microBatch(rank, k / G, k % G).ids, k / G, k % G);
      auto t0 = std::chrono::steady_clock::now();
      try {
        s.client->get(h);
      } catch (const distill::PeerLostError& e) {
        std::fprintf(stderr, "PEERLOST in get after %lld ms: PeerLostError: %s\n", static_cast<long long>(msSince(t0)),
                     e.what());
        return 4;
      }
    }
  } catch (const distill::PeerLostError& e) {
    std::fprintf(stderr, "PEERLOST outside get: %s\n", e.what());
    return 5;
  }
  std::fprintf(stderr, "the teacher never died\n");
  return 1;
}
