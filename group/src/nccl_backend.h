#pragma once

// Internal: the NCCL backend of the student group, in its own translation unit
// so that NCCL and CUDA headers stay out of everything else.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace distill {

// The CUDA devices this process sees (0 when distill was built without CUDA).
int visibleCudaDevices();

// Throws ConfigError when distill was built without CUDA.
c10::intrusive_ptr<c10d::Backend> makeNcclBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                                  std::chrono::milliseconds timeout, const std::string& device);

} // namespace distill
