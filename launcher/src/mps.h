#pragma once

// transport.cuda_mps: on (docs/gpu.md, "One GPU shared by students and teacher"). Processes on one GPU
// get a CUDA context each, which the GPU time-slices: every CUDA IPC message between them waits for a
// switch (about 155 us one way on an H200). An MPS server gives the node's ranks one context (18-24 us).
// distill-run starts one of its own before the ranks (nvidia-cuda-mps-control -d, with a pipe folder of
// its own under /tmp, which the ranks inherit in CUDA_MPS_PIPE_DIRECTORY) and stops it when the job ends
// (`quit` on the control program's stdin), on every path out of the supervisor. A server the user runs
// (CUDA_MPS_PIPE_DIRECTORY already set) is used as it is: nothing is started or stopped.

#include <string>

#include "distill/core/config.h"

namespace distill::launcher {

class MpsServer {
 public:
  // Starts the server when `cfg` asks for one (else does nothing). Throws ConfigError when the control
  // program is not on PATH or fails to start the server (its output in the message).
  explicit MpsServer(const Config& cfg, const std::string& jobId);
  ~MpsServer(); // stop()
  MpsServer(const MpsServer&) = delete;
  MpsServer& operator=(const MpsServer&) = delete;

  // Quits the server (bounded: the control program is killed after 15 s) and removes its folder. Idempotent.
  void stop();
  bool running() const { return !dir_.empty(); }

 private:
  std::string dir_; // /tmp/distill-mps-<job>: pipe/ and log/; "" when none was started here
  std::string program_; // the control program's path
};

} // namespace distill::launcher
