#include "request.h"

#include <ATen/ATen.h>

#include <sstream>

#include "answer_check.h"
#include "cache/keys.h"
#include "distill/core/answer_kinds.h"

namespace distill {
namespace {

// The request's ids beside its first input [B, T, ...]: integer [B, T, k], 1 <= k <= teacher.request_ids.
std::string checkIds(const ipc::ReceivedMessage& m, const Config& cfg, Pending* p) {
  if (!m.has(protocol::kRequestIds)) return "";
  const std::string key = std::string("'") + protocol::kRequestIds + "' ";
  if (cfg.teacher.request_ids <= 0) {
    return key + "(ids to answer at) in a request, and teacher.request_ids is 0: set it to the most ids per position "
                 "a request carries";
  }
  at::Tensor ids = m.view(protocol::kRequestIds);
  const at::Tensor& first = p->inputs.at(0);
  const bool shaped = ids.dim() == 3 && first.dim() >= 2 && ids.size(0) == first.size(0) &&
      ids.size(1) == first.size(1) && ids.size(2) >= 1;
  if (!shaped || at::isFloatingType(ids.scalar_type()) || ids.scalar_type() == at::kBool) {
    return key + "must be integer ids [B, T, k] with the [B, T] of input '" + cfg.teacher.inputs.at(0) + "' " +
        describe(first) + ", found " + describe(ids);
  }
  if (ids.size(2) > cfg.teacher.request_ids) {
    return key + "carries " + std::to_string(ids.size(2)) + " ids per position, more than teacher.request_ids=" +
        std::to_string(cfg.teacher.request_ids) + " (which sizes the slots)";
  }
  p->ids = ids;
  return "";
}

} // namespace

std::string checkRequest(const ipc::ReceivedMessage& m, const Config& cfg, bool prefixKeys, InputSignature& signature,
                         Pending* p) {
  const auto& names = cfg.teacher.inputs;
  std::ostringstream why;
  int64_t batch = -1;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!m.has(names[i])) {
      why << "missing input '" << names[i] << "' (teacher.inputs); found:";
      for (auto& n : m.names()) why << " " << n;
      return why.str();
    }
    at::Tensor t = m.view(names[i]);
    if (t.dim() < 1 || t.size(0) < 1) return "input '" + names[i] + "' has no batch dimension: " + describe(t);
    if (batch < 0) batch = t.size(0);
    if (t.size(0) != batch) {
      return "input '" + names[i] + "' has batch " + std::to_string(t.size(0)) + ", input '" + names[0] + "' has " +
          std::to_string(batch);
    }
    if (signature.known && (t.scalar_type() != signature.dtypes[i] || t.dim() != signature.dims[i])) {
      why << "input '" << names[i] << "': expected " << c10::toString(signature.dtypes[i]) << " with "
          << signature.dims[i] << " dims (as every request so far), found " << describe(t);
      return why.str();
    }
    p->inputs.push_back(t);
  }
  if (std::string problem = checkIds(m, cfg, p); !problem.empty()) return problem;
  if (!signature.known) {
    for (auto& t : p->inputs) {
      signature.dtypes.push_back(t.scalar_type());
      signature.dims.push_back(t.dim());
    }
    signature.known = true;
  }
  if (prefixKeys) {
    if (std::string problem = prefixInputsProblem(names, p->inputs); !problem.empty()) return problem;
  }
  at::Tensor first = p->inputs.at(0);
  p->tokens = first.dim() >= 2 ? first.size(0) * first.size(1) : first.size(0);
  if (p->tokens > cfg.teacher.max_batch_tokens) {
    return "request of " + std::to_string(p->tokens) +
        " tokens exceeds teacher.max_batch_tokens=" + std::to_string(cfg.teacher.max_batch_tokens);
  }
  return "";
}

} // namespace distill
