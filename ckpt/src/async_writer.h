#pragma once

// The async checkpoint manager's background writer (internal to ckpt/src,
// checkpoint_impl.h): one thread, one task at a time. The caller's thread
// queues a task and waits (bounded) for the writer to be idle; the task sets
// an AsyncResult before the writer goes idle, so the writer's mutex orders the
// result before waitIdle returns.

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "distill/core/clock.h"

namespace distill::ckpt_impl {

// The single background writer of an async manager. Its state is shared with
// the thread, so that a thread stuck in I/O past every deadline can be detached.
// It runs file I/O and notes (GroupNotes), never a collective.
struct Writer {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> task; // set by the caller thread, cleared by the writer
  bool busy = false; // a task is queued or running
  bool stop = false;

  static void loop(std::shared_ptr<Writer> w) {
    std::unique_lock<std::mutex> lock(w->mu);
    for (;;) {
      w->cv.wait(lock, [&] { return w->stop || w->task; });
      if (!w->task) return;
      auto task = std::move(w->task);
      w->task = nullptr;
      lock.unlock();
      task(); // catches everything itself
      lock.lock();
      w->busy = false;
      w->cv.notify_all();
    }
  }
  // Waits until no task is queued or running; false if the deadline passed first.
  bool waitIdle(Deadline d) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_until(lock, d.when(), [&] { return !busy; });
  }
};

// What an async save leaves for the caller's thread: set by the writer before
// it goes idle (the writer's mutex orders it before waitIdle returns).
struct AsyncResult {
  bool ok = false;
  std::string error; // the reason, as failSave words it after "not saved: "
};

} // namespace distill::ckpt_impl
