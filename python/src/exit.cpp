// distill._C._drain_gloo: the exit hazard's fix (docs/python.md, "Ending a job").
//
// A torch.distributed gloo backend runs its collectives on worker threads. A worker drops its
// reference to a finished work (and to the work's tensors) a moment after the caller's wait()
// returned; a tensor that Python also holds needs the GIL for that. If the interpreter is
// finalising by then, CPython ends the thread inside the GIL's acquisition (pthread_exit), the
// unwind meets a noexcept destructor and the process aborts ("terminate called without an
// active exception"). distill.init() registers an atexit hook that calls this for every gloo
// backend of the trainer's torch.distributed groups: with the GIL released, it waits until no
// work is queued or held by a worker, so every release is done before finalisation starts.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <thread>

#include "bindings.h"

namespace distill::py {

namespace {

// ProcessGroupGloo keeps its queue and each worker's current work as protected members (in
// torch 2.11: runLoop resets workInProgress_[i], dropping its reference, under workMutex_). A
// pointer to member named through a derived class reads them on any ProcessGroupGloo.
struct GlooWorkers : c10d::ProcessGroupGloo {
  GlooWorkers() = delete;
  // Works queued or held by a worker thread; 0 once every one of them was released.
  static int64_t busy(c10d::ProcessGroupGloo& pg) {
    constexpr auto mutex = &GlooWorkers::workMutex_;
    constexpr auto queue = &GlooWorkers::workQueue_;
    constexpr auto running = &GlooWorkers::workInProgress_;
    std::lock_guard<std::mutex> lock(pg.*mutex);
    auto n = static_cast<int64_t>((pg.*queue).size());
    for (const auto& w : pg.*running) n += w ? 1 : 0;
    return n;
  }
};

// Waits (polling each millisecond) until the backend's workers hold no work, or timeout_s
// passes; returns the works still queued or running (0: drained).
int64_t drainGloo(c10d::ProcessGroupGloo& pg, double timeoutS) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeoutS);
  for (;;) {
    const int64_t busy = GlooWorkers::busy(pg);
    if (busy == 0 || std::chrono::steady_clock::now() >= deadline) return busy;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

} // namespace

void bindExit(pyb::module_& m) {
  m.def(
      "_drain_gloo",
      [](const pyb::object& backend, double timeoutS) {
        auto* pg = backend.cast<c10d::ProcessGroupGloo*>(); // torch's object, through pybind11's conduit
        pyb::gil_scoped_release nogil;
        return drainGloo(*pg, timeoutS);
      },
      pyb::arg("backend"), pyb::arg("timeout_s"),
      "Waits, without the GIL, until the torch.distributed gloo backend's worker threads hold no work "
      "(queued or running), at most timeout_s seconds; returns the works left (0: drained).");
}

} // namespace distill::py
