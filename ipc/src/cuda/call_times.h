#pragma once

// Host-side times of a ring end's CUDA calls, per kind of call (issue 42: where one message's time goes).
// On only with DISTILL_CUDA_IPC_TIMES=1; the end logs summary() when it closes. Pure C++ (tested on CPUs in
// tests/ipc/flag_page_test.cpp); one instance per ring end, used by the thread that drives it.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

namespace distill::ipc::cuda {

class CallTimes {
 public:
  enum Call { kCopy, kWaitWritten, kWriteWritten, kWaitDone, kWriteDone, kEventRecord, kEventWait, kEventSync, kCount };
  explicit CallTimes(bool on) : on_(on) {}
  bool on() const { return on_; }
  void add(Call c, int64_t ns) {
    ++n_[c];
    ns_[c] += ns;
    max_[c] = std::max(max_[c], ns);
  }
  // "copy 2000 x 4.1 us (max 30.2), event-sync 2000 x 120.3 us (max 900.0)": the calls made, mean and max.
  std::string summary() const {
    static const char* const kNames[kCount] = {"copy",       "wait-written", "write-written", "wait-done",
                                               "write-done", "event-record", "event-wait",    "event-sync"};
    std::string out;
    for (int c = 0; c < kCount; ++c) {
      if (!n_[c]) continue;
      char buf[128];
      std::snprintf(buf, sizeof buf, "%s%s %lld x %.1f us (max %.1f)", out.empty() ? "" : ", ", kNames[c],
                    static_cast<long long>(n_[c]), double(ns_[c]) / double(n_[c]) / 1e3, double(max_[c]) / 1e3);
      out += buf;
    }
    return out.empty() ? "no CUDA calls" : out;
  }

 private:
  bool on_;
  int64_t n_[kCount] = {}, ns_[kCount] = {}, max_[kCount] = {};
};

} // namespace distill::ipc::cuda
