#include "distill/student/grad_sync.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <string>

#include "distill/core/errors.h"
#include "distill/core/logging.h"

namespace distill {

struct GradientSync::Impl {
  struct Bucket {
    std::vector<size_t> params; // indices into `params`
    size_t waiting = 0; // parameters whose gradient has not landed in this backward
    std::vector<size_t> sent; // those with a gradient when it started: the layout of `flat`
    at::Tensor flat;
    std::unique_ptr<PendingReduce> pending;
  };

  StudentGroup& group;
  ReduceOp op;
  std::vector<at::Tensor> params;
  std::vector<int> bucketOf;
  std::vector<char> landed;
  std::vector<Bucket> buckets;
  size_t next = 0; // the next bucket to start: they start in order on every rank
  bool syncing = true;
  int startedByHooks = 0, lastStartedByHooks = 0;

  Impl(StudentGroup& g, ReduceOp o) : group(g), op(o) {}

  // Autograd calls it once the gradient of parameter `index` is accumulated.
  struct LandedHook : torch::autograd::PostAccumulateGradHook {
    LandedHook(Impl* s, size_t i) : sync(s), index(i) {}
    void operator()(const torch::autograd::Variable&) override { sync->landedOne(index); }
    Impl* sync;
    size_t index;
  };

  void reset() {
    for (auto& b : buckets) {
      b.waiting = b.params.size();
      b.sent.clear();
      b.flat = at::Tensor();
      b.pending.reset();
    }
    std::fill(landed.begin(), landed.end(), 0);
    next = 0;
    lastStartedByHooks = startedByHooks;
    startedByHooks = 0;
  }

  void start(size_t index) {
    Bucket& b = buckets[index];
    std::vector<at::Tensor> flat;
    for (size_t i : b.params) {
      const at::Tensor g = params[i].grad();
      if (!g.defined()) continue;
      b.sent.push_back(i);
      flat.push_back(g.reshape(-1));
    }
    if (flat.empty()) return; // no gradient in it on any rank (the same parameters on each)
    b.flat = at::cat(flat);
    b.pending = group.allReduceAsync(b.flat, op, "gradient bucket " + std::to_string(index));
  }

  // A parameter's gradient was accumulated: start every bucket that is
  // complete and whose predecessors have started.
  void landedOne(size_t param) {
    if (!syncing || landed[param]) return;
    landed[param] = 1;
    Bucket& b = buckets[size_t(bucketOf[param])];
    DISTILL_CHECK_T(UsageError, b.waiting > 0 && next <= size_t(bucketOf[param]),
                    "GradientSync: a gradient landed in gradient bucket ", bucketOf[param],
                    " after it started: call wait() after each syncing backward");
    --b.waiting;
    while (next < buckets.size() && buckets[next].waiting == 0) {
      start(next++);
      ++startedByHooks;
    }
  }
};

GradientSync::GradientSync(StudentGroup& group, const std::vector<at::Tensor>& params, double bucketMb, ReduceOp op)
    : impl_(std::make_unique<Impl>(group, op)) {
  Impl& s = *impl_;
  for (const auto& p : params) {
    if (p.requires_grad()) s.params.push_back(p);
  }
  const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(bucketMb * (1 << 20)));
  s.bucketOf.assign(s.params.size(), -1);
  s.landed.assign(s.params.size(), 0);
  int64_t bytes = 0;
  // Reverse order: backward produces the last layers' gradients first.
  for (size_t k = s.params.size(); k-- > 0;) {
    const at::Tensor& p = s.params[k];
    const bool fresh = s.buckets.empty() || bytes >= limit ||
        p.scalar_type() != s.params[s.buckets.back().params[0]].scalar_type() ||
        p.device() != s.params[s.buckets.back().params[0]].device();
    if (fresh) s.buckets.emplace_back(), bytes = 0;
    s.buckets.back().params.push_back(k);
    s.bucketOf[k] = static_cast<int>(s.buckets.size() - 1);
    bytes += p.numel() * static_cast<int64_t>(p.element_size());
  }
  s.reset();
  for (size_t k = 0; k < s.params.size(); ++k) {
    DISTILL_CHECK_T(UsageError, s.params[k].is_leaf(), "GradientSync: parameter ", k,
                    " is not a leaf tensor (no gradient accumulates into it)");
    auto& hooks = torch::autograd::impl::post_acc_grad_hooks(s.params[k]);
    DISTILL_CHECK_T(UsageError, hooks == nullptr, "GradientSync: parameter ", k,
                    " already has a post-accumulate-grad hook (another GradientSync on the same model?)");
    torch::autograd::impl::set_post_acc_grad_hooks(s.params[k], std::make_unique<Impl::LandedHook>(impl_.get(), k));
  }
}

GradientSync::~GradientSync() {
  for (auto& p : impl_->params) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
  for (auto& b : impl_->buckets) b.pending.reset(); // waits, without throwing
}

void GradientSync::setSyncing(bool on) { impl_->syncing = on; }
bool GradientSync::syncing() const { return impl_->syncing; }
int GradientSync::buckets() const { return static_cast<int>(impl_->buckets.size()); }
int GradientSync::startedDuringBackward() const { return impl_->lastStartedByHooks; }

void GradientSync::wait() {
  Impl& s = *impl_;
  while (s.next < s.buckets.size()) s.start(s.next++);
  for (auto& b : s.buckets) {
    if (!b.pending) continue;
    b.pending->wait();
    int64_t off = 0;
    for (size_t i : b.sent) {
      at::Tensor g = s.params[i].grad();
      g.copy_(b.flat.narrow(0, off, g.numel()).view(g.sizes()));
      off += g.numel();
    }
  }
  s.reset();
}

} // namespace distill
