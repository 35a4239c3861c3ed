#pragma once

// Torch archives as the checkpoint manager uses them (internal to ckpt/src,
// checkpoint_impl.h): an archive to bytes, bytes to and from a uint8 tensor,
// reading an int or a tensor by key, a module's deep copy to CPU. Free
// functions of their arguments: any thread.

#include <torch/nn/module.h>
#include <torch/serialize.h>

#include <cstring>
#include <optional>
#include <string>

namespace distill::ckpt_impl {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

inline std::string toBytes(OutputArchive& a) {
  std::string out;
  a.save_to([&](const void* p, size_t n) {
    out.append(static_cast<const char*>(p), n);
    return n;
  });
  return out;
}

inline at::Tensor bytesTensor(const std::string& s) {
  auto t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

inline std::string tensorBytes(const at::Tensor& t) {
  auto c = t.to(torch::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel()));
}

inline int64_t readInt(InputArchive& a, const std::string& key) {
  c10::IValue v;
  a.read(key, v);
  return v.toInt();
}

inline at::Tensor readTensor(InputArchive& a, const std::string& key) {
  at::Tensor t;
  a.read(key, t, /*is_buffer=*/true);
  return t;
}

// Deep copy of a module's parameters and buffers to CPU, laid out as
// Module::save lays them out, so that Module::load reads it back.
inline void snapshotModule(const torch::nn::Module& m, OutputArchive& a) {
  torch::NoGradGuard noGrad;
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    a.write(p.key(), p.value().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  }
  for (const auto& b : m.named_buffers(/*recurse=*/false)) {
    a.write(b.key(), b.value().detach().to(torch::kCPU, false, true), /*is_buffer=*/true);
  }
  for (const auto& c : m.named_children()) {
    if (!c.value()->is_serializable()) continue;
    OutputArchive child(a.compilation_unit());
    snapshotModule(*c.value(), child);
    a.write(c.key(), child);
  }
}

inline std::optional<torch::Device> deviceOf(const torch::nn::Module& m) {
  auto params = m.parameters();
  if (params.empty()) return std::nullopt;
  return params.front().device();
}

inline at::Generator cpuGenerator() { return at::detail::getDefaultCPUGenerator(); }

} // namespace distill::ckpt_impl
