#include "distill/student/grad.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <functional>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/trace.h"
#include "distill/student/losses.h"

namespace distill {

double stepTokenCount(StudentGroup& group, const std::vector<at::Tensor>& microBatchLabels, int64_t ignoreIndex) {
  trace::noteStepOpens(static_cast<int64_t>(microBatchLabels.size())); // labels this collective with its own step
  int64_t local = 0;
  for (auto& l : microBatchLabels) local += countTokens(l, ignoreIndex);
  at::Tensor t = at::full({1}, static_cast<double>(local), at::kDouble);
  group.allReduce(t, ReduceOp::kSum, "step token count");
  return t.item<double>();
}

namespace {

// Runs `op(flat, index)` on `tensors` flattened into buckets (one dtype and
// device each, about `bucketMb` MiB) and copies each bucket's result back.
void inBuckets(const std::vector<at::Tensor>& tensors, double bucketMb,
               const std::function<void(at::Tensor&, int)>& op) {
  const int64_t bucketBytes = std::max<int64_t>(1, static_cast<int64_t>(bucketMb * (1 << 20)));
  std::vector<at::Tensor> bucket;
  int64_t bytes = 0;
  int index = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    std::vector<at::Tensor> flat;
    for (auto& t : bucket) flat.push_back(t.reshape(-1));
    at::Tensor buf = at::cat(flat);
    op(buf, index++);
    int64_t off = 0;
    for (auto& t : bucket) {
      t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
    bucket.clear();
    bytes = 0;
  };
  for (const auto& t : tensors) {
    if (!bucket.empty() &&
        (t.scalar_type() != bucket[0].scalar_type() || t.device() != bucket[0].device() || bytes >= bucketBytes)) {
      flush();
    }
    bucket.push_back(t);
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  flush();
}

} // namespace

void allReduceGradients(StudentGroup& group, const std::vector<at::Tensor>& params, double bucketMb, ReduceOp op) {
  std::vector<at::Tensor> grads;
  for (auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  inBuckets(grads, bucketMb,
            [&](at::Tensor& buf, int index) { group.allReduce(buf, op, "gradient bucket " + std::to_string(index)); });
}

namespace {

// Every student's count of tensors and of elements must be rank 0's: one
// all-reduce of (count, elements, -count, -elements) with MAX gives the
// largest and smallest of each.
void checkSameShapes(StudentGroup& group, const std::vector<at::Tensor>& all) {
  int64_t numel = 0;
  for (const auto& t : all) numel += t.numel();
  const int64_t count = static_cast<int64_t>(all.size());
  at::Tensor v = at::tensor({count, numel, -count, -numel}, at::kLong);
  group.allReduce(v, ReduceOp::kMax, "broadcastParameters: tensor counts");
  const int64_t* p = v.data_ptr<int64_t>();
  DISTILL_CHECK_T(ConfigError, p[0] == -p[2] && p[1] == -p[3], "broadcastParameters: student rank ", group.rank(),
                  " passes ", count, " tensors of ", numel, " elements, but the students range over ", -p[2], "..",
                  p[0], " tensors and ", -p[3], "..", p[1],
                  " elements: every student must build the same model (the same options)");
}

} // namespace

void broadcastParameters(StudentGroup& group, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& buffers, double bucketMb) {
  std::vector<at::Tensor> all = params;
  all.insert(all.end(), buffers.begin(), buffers.end());
  checkSameShapes(group, all);
  at::NoGradGuard noGrad; // parameters are leaves that require grad: copy_ into them outside autograd
  inBuckets(all, bucketMb, [&](at::Tensor& buf, int index) {
    group.broadcast(buf, 0, "parameter broadcast bucket " + std::to_string(index));
  });
}

std::vector<double> evaluateOnRank0(StudentGroup& group, const std::function<std::vector<double>()>& fn, size_t count) {
  at::Tensor t = at::zeros({static_cast<int64_t>(count)}, at::kDouble);
  if (group.rank() == 0) {
    auto v = fn();
    DISTILL_CHECK_EQ_T(ProtocolError, v.size(), count, "evaluateOnRank0: fn returned the wrong count");
    for (size_t i = 0; i < count; ++i) t[static_cast<int64_t>(i)] = v[i];
  }
  group.broadcast(t, 0, "evaluation broadcast");
  std::vector<double> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = t[static_cast<int64_t>(i)].item<double>();
  return out;
}

} // namespace distill
