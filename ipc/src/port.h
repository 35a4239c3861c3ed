#pragma once

// A process attached to the segment as one local rank: owns its process-table
// entry, its heartbeat thread, and the waits and ring operations of that rank.
// Internal to ipc/ (the channel, channel_core.h, builds on it; no torch here).
//
// Threads: the heartbeat thread only writes heartbeatNs. Every other method is
// called by the endpoint's thread (endpoints are not thread safe).
//
// ---- Waiting without lost wake-ups ----
// Each process sleeps only on its own ProcessEntry::doorbell (a 32-bit futex
// word in shared memory, FUTEX_WAIT without FUTEX_PRIVATE_FLAG), so one sleep
// covers every ring it consumes or produces into (the teacher's waitAny).
//   waiter:  seq = doorbell.load(acquire); sleepers.fetch_add(1, seq_cst);
//            fence(seq_cst); if (condition()) done; else FUTEX_WAIT(doorbell, seq, timeout)
//   waker:   <release store that makes condition() true (head/tail/admitted)>;
//            fence(seq_cst); if (sleepers.load(acquire)) { doorbell.fetch_add(1); FUTEX_WAKE }
// The two seq_cst fences guarantee that the waiter's condition load sees the
// store or the waker's sleepers load sees the increment. In the second case
// the increment (release) synchronises with that load (acquire), so the
// waiter's `seq` load happens-before the waker's doorbell bump and cannot have
// read it: FUTEX_WAIT then either finds a changed word (EAGAIN) or is woken.
// The waker skips the syscall when nobody sleeps (the common, spinning case).
//
// Every sleep is bounded by min(deadline, next liveness check) where liveness
// checks run every heartbeat_ms / 4; on each wake-up the waiter checks the
// abort flag, the peer(s) and the deadline.

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/core/tag.h"
#include "recorder.h"
#include "segment_impl.h"

namespace distill::ipc {

// What a wait is for; fills the process table and error messages.
struct WaitDesc {
  wire::WaitWhat what = wire::WaitWhat::kNone;
  int peerIndex = -1; // process index waited on, -1 = any student
  std::optional<Tag> tag; // the message waited for or on, when known
};

class Port {
 public:
  // Claims process-table entry `index` (IpcError if a live process holds it),
  // publishes `config` in its ConfigArea (ConfigError if it does not fit),
  // writes pid/rank/incarnation/heartbeat, state = attached, starts the
  // heartbeat thread and rings the teacher's doorbell (admission).
  Port(std::shared_ptr<SegmentImpl> seg, int index, int rank, int spinUs, const std::string& config = {});
  // What process `index` published of its config at attach ("" = nothing).
  // Call only after an acquire load that saw it attached.
  std::string publishedConfig(int index) const;
  // Stops the heartbeat; state = finished if markFinished() was called, else dead.
  ~Port();
  Port(const Port&) = delete;
  Port& operator=(const Port&) = delete;

  SegmentImpl& seg() const { return *seg_; }
  const std::shared_ptr<SegmentImpl>& segPtr() const { return seg_; }
  int index() const { return index_; }
  int rank() const { return rank_; }
  bool isTeacher() const { return seg_->isTeacher(index_); }
  const char* roleName() const { return isTeacher() ? "teacher" : "student"; }
  wire::ProcessEntry& self() const { return seg_->process(index_); }
  void setState(wire::ProcState s) { self().state.store(uint32_t(s), std::memory_order_release); }
  // This process's flight recorder (installed as the process's trace sink
  // while the port lives, so collectives and the teacher's forward land in it too).
  Recorder& recorder() { return recorder_; }
  void markFinished() { finished_ = true; }

  // Waits until cond() (which must load what it tests with acquire) is true.
  // Returns false at the deadline. Throws PeerLostError when a peer in
  // `peers` died, detached or stalled (for a peer that finished cleanly: only
  // if `finishedIsLost`), IpcError when the segment was aborted.
  bool waitUntil(const std::function<bool()>& cond, const WaitDesc& desc, const std::vector<int>& peers,
                 bool finishedIsLost, Deadline deadline);

  // True if the launcher will restart the teacher at process `index` (pid
  // `pid`) should it die, or is replacing it now (its restarts <
  // teacherMaxRestarts, or pid == its replacedPid).
  bool teacherMayRestart(int index, int pid) const;
  // Throws PeerLostError if process `index` is dead, detached abnormally or
  // stalled; a teacher that may restart (above) never is.
  void checkPeer(int index, const WaitDesc& desc, bool finishedIsLost) const;

  // "teacher rank 3 (local 2, pid 123)"
  std::string describeProcess(int index) const;
  // "student rank 0 (local 0)": this process
  std::string describeSelf() const;

 private:
  void heartbeatLoop();
  // Logs once when peer `index` begins to stall (no heartbeat for 2 periods,
  // alive) and once when it resumes.
  void noteStall(int index, bool stalled, int64_t ageNs, bool stopped, const ErrorWhere& where) const;
  // A wait that ends with its condition met checks no peer: a peer noted as
  // stalled whose heartbeat is fresh again (or that has finished) is noted as
  // resumed here, so the resume is logged also when it ended the wait at once.
  void noteResumed(const std::vector<int>& peers) const;

  std::shared_ptr<SegmentImpl> seg_;
  int index_;
  int rank_;
  Recorder recorder_;
  int spinUs_;
  bool finished_ = false;
  std::mutex hbMutex_;
  std::condition_variable hbCv_;
  bool hbStop_ = false;
  std::thread heartbeat_;
  mutable std::vector<int64_t> stalledSince_; // per process index: when its stall began, 0 = not stalled
};

} // namespace distill::ipc
