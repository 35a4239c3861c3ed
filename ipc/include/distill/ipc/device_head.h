#pragma once

// The teacher's head on a GPU, one copy per node and device (issue 43;
// docs/teacher.md, "The hidden-state answer"): the host mapping
// (shared_head.h) copied once into the memory of each device its students
// use, and shared by the students of that device through CUDA IPC instead of
// one device copy per student. Raw bytes only (no torch): student/
// teacher_head.h makes the tensors.
//
// Record: "<segment>.head.cuda-<device UUID, hex>-g<generation of the host
// head>" in /dev/shm, one page (removeHeadObjects takes it with the segment:
// every "<segment>.head.*"). A republished head (a teacher restart) has
// another generation, so another record and another device copy.
//
// Election: the first student of a device to need the head creates the record
// (O_CREAT | O_EXCL: the owner). It allocates the head's bytes on its device,
// copies the host mapping's weight (and bias) there, synchronises, exports the
// allocation's cudaIpcMemHandle, writes the host head's fingerprint and byte
// count, then `complete` = 1 (release; futex wake). The others of the device
// wait on `complete` (futex, bounded by the deadline, the owner's liveness
// checked from the kernel at each wake: a dead owner is an IpcError at once)
// and import the handle. An owner that fails sets `complete` = 2 with its
// reason, which the waiters report.
//
// Lifetime: an importer counts itself in `readers` while it holds the memory
// and wakes the owner when it lets go. The owner frees the memory when its
// last holder lets go and `readers` is 0, waiting at most `releaseTimeout` for
// importers still counted (one killed never lets go: the owner logs it and
// frees); it then unlinks the record. The memory belongs to the owner's
// process: an importer must not outlive its owner. The students of one job end
// together, and the death of one ends the job.
//
// Checks: an importer compares the record's fingerprint and byte count with
// the host head it mapped (IpcError naming both).
//
// Without CUDA compiled in, available() is false and share() throws UsageError.
// The memory is ipc/src/device_memory.h's: CUDA's, or in tests POSIX shared
// memory (tests/ipc/device_head_test.cpp runs all of the above without a GPU).
// Thread safety: a DeviceHead is an immutable handle; copies share one state.

#include <chrono>
#include <memory>
#include <string>

#include "distill/core/clock.h"
#include "distill/ipc/shared_head.h"

namespace distill::ipc {

class DeviceHead {
 public:
  struct State; // internal

  // Whether CUDA is compiled in (the device may still be unusable: share() says).
  static bool available();

  // The head `host` on CUDA device `device` (an ordinal of this process), made
  // or imported as described above; `deadline` bounds the wait for the
  // device's owner, `releaseTimeout` the owner's wait for its importers at
  // release. IpcError naming the record and the reader when it cannot.
  static DeviceHead share(const std::string& segmentName, const SharedHead& host, int device,
                          const HeadReader& reader, Deadline deadline,
                          std::chrono::milliseconds releaseTimeout = std::chrono::seconds(30));

  // "<segment>.head.cuda-<uuid>-g<generation>"
  static std::string recordName(const std::string& segmentName, const std::string& uuidHex, uint64_t generation);

  void* weight() const; // device memory, vocab * dim elements of the host head's dtype, read only by contract
  void* bias() const; // nullptr without bias
  int device() const;
  bool owner() const; // this process made the copy
  const std::string& recordName() const;
  // Holds the device memory (for tensors made over weight() and bias()).
  std::shared_ptr<const void> keepAlive() const;

 private:
  explicit DeviceHead(std::shared_ptr<State> s) : s_(std::move(s)) {}
  std::shared_ptr<State> s_;
};

} // namespace distill::ipc
