#pragma once

// The teacher's head as a CPU student holds it (issue 43): a TeacherHead
// (loss/hidden_head.h) whose tensors are views over the node's one read-only
// mapping of the head object (ipc/shared_head.h), never a copy, and the check
// of its fingerprint after a teacher restart.
//
// Lifetime: each tensor's deleter holds the mapping (SharedHead::keepAlive), so
// the memory stays valid for as long as any tensor made from the head lives,
// even after the teacher republished or the segment was removed. The tensors
// are read-only memory (PROT_READ): writing into them is a SIGSEGV, so never
// hand them to an in-place op (the losses only read a TeacherHead).
//
// Thread safety: MappedTeacherHead is not thread-safe; one owner (the student's
// step loop) calls it. The TeacherHead it hands out may be read from any thread.

#include <cstdint>
#include <string>

#include "distill/core/clock.h"
#include "distill/ipc/device_head.h"
#include "distill/ipc/shared_head.h"
#include "distill/loss/hidden_head.h"

namespace distill {

// The TeacherHead over `shared`'s mapping: weight [V_t, d_t] and bias [V_t]
// (undefined without one) of its dtype on the CPU, softcap and scale as
// published. No copy.
TeacherHead teacherHeadView(const ipc::SharedHead& shared);

// The head on `device` for a student there (issue 43: one copy per node and
// device). On a CUDA device, the node's students of that device share one copy
// (ipc/device_head.h: the first copies the mapping there and exports it by CUDA
// IPC, the others import it; `deadline` bounds the wait for the first); the
// tensors hold the device memory. Where that fails (a build without CUDA, CUDA
// IPC refused, a copy that failed) it logs why and copies the head to the
// device for this student alone, as it does for any other device type; never
// an error for the trainer. The CPU: the mapping's own view.
TeacherHead teacherHeadOn(const ipc::SharedHead& shared, const TeacherHead& mapped, const at::Device& device,
                          const std::string& segmentName, const ipc::HeadReader& reader, Deadline deadline);

// What a student does when a restarted teacher publishes a head with another
// fingerprint than the one it holds.
enum class HeadChange {
  kRefuse, // IpcError naming the reader and both fingerprints; the held head stays
  kAdopt, // map the new head, drop the old one, log both fingerprints
};

class MappedTeacherHead {
 public:
  // Waits until `deadline` for the head published beside `segmentName` and
  // maps it (SharedHead::open's errors).
  static MappedTeacherHead open(const std::string& segmentName, const ipc::HeadReader& reader, Deadline deadline,
                                HeadChange onChange = HeadChange::kRefuse);

  const TeacherHead& head() const { return head_; }
  const ipc::SharedHead& shared() const { return shared_; }
  const std::string& fingerprint() const { return shared_.fingerprint(); }

  // After a teacher restart: waits until `deadline` for the restarted teacher's
  // head (a newer generation than the one held; TimeoutError naming the
  // reader), then compares fingerprints. The same: maps the new object (so the
  // old one, unlinked, is freed once no tensor holds it) and returns false.
  // Another: kAdopt maps it and returns true; kRefuse throws IpcError naming the
  // reader, the object and both fingerprints.
  bool awaitRepublished(Deadline deadline);

  // The same without waiting: false at once when the head held is still the
  // one published (one stat(2)).
  bool checkForChange();

 private:
  MappedTeacherHead(std::string segmentName, ipc::HeadReader reader, HeadChange onChange, ipc::SharedHead shared);
  bool adopt(ipc::SharedHead next);

  std::string segmentName_;
  ipc::HeadReader reader_;
  HeadChange onChange_;
  ipc::SharedHead shared_;
  TeacherHead head_;
};

} // namespace distill
