#pragma once

// The process group of the students, and only the students.
//
// Every barrier, all-reduce and broadcast of a distill job runs here: the
// teacher is in no collective at all (docs/design.md, "The four hangs this design rules out":
// the checkpoint set-up hang). A StudentGroup
// can only be made by a StudentContext (private constructor), and a
// TeacherContext has no way to reach one — that is checked at compile time by
// tests/group/context_test.cpp.
//
// Backends: c10d ProcessGroupGloo for CPU tensors (and every barrier);
// ProcessGroupNCCL for CUDA tensors when built with CUDA and student.backend
// allows it. Rendezvous: the job's own store at MASTER_ADDR:MASTER_PORT
// (group/src/job_store.h; student rank 0 serves it, bound to MASTER_ADDR only,
// on the socket distill-run hands it in DISTILL_STORE_FD or one it binds),
// under the prefix "distill/students/". Every peer of the store proves the job
// secret (DISTILL_JOB_SECRET, group/rendezvous.h) first; without one (a rank
// started by hand) it warns that the store takes anyone. Under torchrun
// (TORCHELASTIC_USE_AGENT_STORE) the agent's TCPStore is used instead.
//
// Deadlines: every collective is bounded by run.collective_timeout_s. Before a
// collective each rank bumps its own arrival counter in the store; on a timeout
// or a failure the error names the ranks whose counter shows they never
// entered that collective, the rank lost first (its connection to the store
// closed without a goodbye: died or failed) and the ones lost after it, or the
// store's host, student rank 0, when the store itself is gone.
//
// Thread safety: collectives must be issued from one thread per process, in
// the same order on every rank (as with any c10d group).

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class Store;
} // namespace c10d

namespace distill {

struct Topology;
struct RunOptions;
struct StudentOptions;
class StudentContext;

enum class ReduceOp { kSum, kMax, kMin, kAvg };

// Notes between the ranks of the group outside any collective: a key/value
// board on the group's rendezvous store (served by student rank 0's process).
// Made for a background thread of a rank that must hear from the other ranks
// while its main thread goes on issuing collectives: the async checkpoint
// writer of each rank posts that its files are durable, student rank 0's
// writer awaits every note, publishes, and posts the outcome.
//
// Each GroupNotes has a connection of its own to the store; use one from one
// thread at a time. Nothing here is matched across ranks like a collective.
// Every wait has a deadline; once student rank 0's process is gone every call
// throws PeerLostError.
class GroupNotes {
 public:
  ~GroupNotes();
  GroupNotes(const GroupNotes&) = delete;
  GroupNotes& operator=(const GroupNotes&) = delete;

  void post(const std::string& key, const std::string& value);
  // The values of `keys`, in order. Returns as soon as every key is posted,
  // or when `timeout` has passed; a key still not posted then is nullopt.
  std::vector<std::optional<std::string>> await(const std::vector<std::string>& keys,
                                                std::chrono::milliseconds timeout);
  // Removes `key`; a key never posted is fine.
  void erase(const std::string& key);

 private:
  friend class StudentGroup;
  GroupNotes();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// An all-reduce under way (StudentGroup::allReduceAsync). wait() returns once
// it is done, within the group's collective timeout from its start, with the
// same errors as allReduce (naming the ranks that never entered it). Wait for
// every pending reduce before the next blocking collective. Destroyed
// unwaited (an exception unwinding), it waits without throwing, so no
// transfer outlives its tensors.
class PendingReduce {
 public:
  ~PendingReduce();
  PendingReduce(const PendingReduce&) = delete;
  PendingReduce& operator=(const PendingReduce&) = delete;
  void wait();

 private:
  friend class StudentGroup;
  PendingReduce();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class StudentGroup {
 public:
  ~StudentGroup();
  StudentGroup(const StudentGroup&) = delete;
  StudentGroup& operator=(const StudentGroup&) = delete;

  int rank() const;
  int size() const;
  std::chrono::milliseconds timeout() const;
  // Collectives entered so far by this rank.
  int64_t sequence() const;

  // `what` names the collective in errors ("checkpoint barrier", "grad bucket 3").
  void barrier(const std::string& what = "barrier");
  // In place. CPU tensors go through gloo, CUDA tensors through NCCL.
  void allReduce(std::vector<at::Tensor>& tensors, ReduceOp op = ReduceOp::kSum,
                 const std::string& what = "all_reduce");
  void allReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum, const std::string& what = "all_reduce");
  // Starts an all-reduce of `tensor` in place and returns at once (gloo's or
  // NCCL's own threads carry it): what GradientSync overlaps with backward.
  // Issue them in the same order on every rank, as any collective.
  std::unique_ptr<PendingReduce> allReduceAsync(at::Tensor tensor, ReduceOp op = ReduceOp::kSum,
                                                const std::string& what = "all_reduce");
  void broadcast(std::vector<at::Tensor>& tensors, int root, const std::string& what = "broadcast");
  void broadcast(at::Tensor& tensor, int root, const std::string& what = "broadcast");

  // A note board whose keys live under `prefix` (store keys
  // "distill/students/notes/<prefix>/<key>"), with its own store connection.
  // Not a collective; callable from any thread.
  std::unique_ptr<GroupNotes> notes(const std::string& prefix);

  // A store for another process group of the same students (Python's
  // torch.distributed world): a new connection to the group's rendezvous
  // store, authenticated as the group's own (distill's store, job_store.h),
  // its keys under "distill/students/<prefix>/". Its closing is never taken
  // for this rank lost (the group's own connection speaks for the rank).
  // Under torchrun, torchrun's agent store under the same prefix.
  c10::intrusive_ptr<c10d::Store> store(const std::string& prefix);

 private:
  friend class StudentContext;
  friend class PendingReduce;
  StudentGroup(const Topology& topo, const RunOptions& run, const StudentOptions& student);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace distill
