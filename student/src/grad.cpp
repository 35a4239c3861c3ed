#include "distill/student/grad.h"

#include <ATen/ATen.h>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/student/losses.h"

namespace distill {

double stepTokenCount(StudentGroup& group, const std::vector<at::Tensor>& microBatchLabels, int64_t ignoreIndex) {
  noteStepOpens(static_cast<int64_t>(microBatchLabels.size())); // labels this collective with its own step
  int64_t local = 0;
  for (auto& l : microBatchLabels) local += countTokens(l, ignoreIndex);
  at::Tensor t = at::full({1}, static_cast<double>(local), at::kDouble);
  group.allReduce(t, ReduceOp::kSum, "step token count");
  return t.item<double>();
}

void allReduceGradients(StudentGroup& group, const std::vector<at::Tensor>& params, double bucketMb, ReduceOp op) {
  const int64_t bucketBytes = std::max<int64_t>(1, static_cast<int64_t>(bucketMb * (1 << 20)));
  std::vector<at::Tensor> bucket;
  int64_t bytes = 0;
  int index = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    std::vector<at::Tensor> flat;
    for (auto& g : bucket) flat.push_back(g.reshape(-1));
    at::Tensor buf = at::cat(flat);
    group.allReduce(buf, op, "gradient bucket " + std::to_string(index++));
    int64_t off = 0;
    for (auto& g : bucket) {
      g.copy_(buf.narrow(0, off, g.numel()).view(g.sizes()));
      off += g.numel();
    }
    bucket.clear();
    bytes = 0;
  };
  for (auto& p : params) {
    at::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (!bucket.empty() &&
        (g.scalar_type() != bucket[0].scalar_type() || g.device() != bucket[0].device() || bytes >= bucketBytes)) {
      flush();
    }
    bucket.push_back(g);
    bytes += g.numel() * static_cast<int64_t>(g.element_size());
  }
  flush();
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
