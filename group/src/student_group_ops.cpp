// StudentGroup's collectives: barrier, all-reduce (blocking and asynchronous)
// and broadcast, each bounded by run.collective_timeout_s and diagnosed on a
// failure (student_group_impl.h).
#include <algorithm>

#include "distill/core/logging.h"
#include "student_group_impl.h"

namespace distill {
namespace {

c10d::ReduceOp toC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kAvg:
      return c10d::ReduceOp::AVG;
  }
  return c10d::ReduceOp::SUM;
}

} // namespace

void StudentGroup::barrier(const std::string& what) {
  impl_->run(what, [&] {
    c10d::BarrierOptions o;
    o.timeout = impl_->timeout;
    return impl_->gloo->barrier(o);
  });
}

void StudentGroup::allReduce(std::vector<at::Tensor>& tensors, ReduceOp op, const std::string& what) {
  auto& backend = impl_->backendFor(tensors);
  impl_->run(what, [&] {
    c10d::AllreduceOptions o;
    o.reduceOp = toC10d(op);
    o.timeout = impl_->timeout;
    return backend.allreduce(tensors, o);
  });
}

void StudentGroup::allReduce(at::Tensor& tensor, ReduceOp op, const std::string& what) {
  std::vector<at::Tensor> v{tensor};
  allReduce(v, op, what);
}

void StudentGroup::broadcast(std::vector<at::Tensor>& tensors, int root, const std::string& what) {
  DISTILL_CHECK_T(ConfigError, root >= 0 && root < impl_->size, "broadcast root ", root, " is not a student rank (0..",
                  impl_->size - 1, ")");
  auto& backend = impl_->backendFor(tensors);
  impl_->run(what, [&] {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = impl_->timeout;
    return backend.broadcast(tensors, o);
  });
}

void StudentGroup::broadcast(at::Tensor& tensor, int root, const std::string& what) {
  std::vector<at::Tensor> v{tensor};
  broadcast(v, root, what);
}

// ---- asynchronous all-reduce ----

struct PendingReduce::Impl {
  StudentGroup::Impl* group = nullptr;
  int64_t seq = 0;
  std::string what, how; // how: a failure at the start
  trace::Event event;
  Deadline deadline = Deadline::after(Millis(0));
  at::Tensor tensor; // kept alive while the transfer runs
  c10::intrusive_ptr<c10d::Work> work;
  bool waited = false;
};

PendingReduce::PendingReduce() : impl_(std::make_unique<Impl>()) {}

PendingReduce::~PendingReduce() {
  if (impl_->waited) return;
  try {
    wait();
  } catch (const std::exception& e) {
    DISTILL_LOG(kWarning) << "an unwaited " << impl_->what << " ended with: " << firstLineOf(e.what());
  }
}

void PendingReduce::wait() {
  Impl& p = *impl_;
  if (p.waited) return;
  p.waited = true;
  trace::Scope recorded(p.event); // the hang table shows the wait, labelled with the collective
  if (p.work) p.group->await(*p.work, p.deadline, p.how);
  if (!p.how.empty()) p.group->failed(p.what, p.seq, StudentGroup::Impl::awaitedName(p.what, p.seq), p.how);
}

std::unique_ptr<PendingReduce> StudentGroup::allReduceAsync(at::Tensor tensor, ReduceOp op, const std::string& what) {
  std::unique_ptr<PendingReduce> pending(new PendingReduce());
  PendingReduce::Impl& p = *pending->impl_;
  p.group = impl_.get();
  p.seq = ++impl_->seq;
  p.what = what;
  p.event = Impl::eventFor(what, p.seq);
  p.deadline = Deadline::after(impl_->timeout);
  p.tensor = tensor;
  std::vector<at::Tensor> tensors{tensor};
  auto& backend = impl_->backendFor(tensors);
  p.work = impl_->launch(
      [&] {
        c10d::AllreduceOptions o;
        o.reduceOp = toC10d(op);
        o.timeout = impl_->timeout;
        return backend.allreduce(tensors, o);
      },
      p.deadline, p.how);
  return pending;
}

} // namespace distill
