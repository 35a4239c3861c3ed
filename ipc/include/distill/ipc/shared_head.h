#pragma once

// The teacher's output layer, published once per node (issue 43; docs/design.md,
// "The teacher's head"): one read-only shared-memory object beside the job's
// segment that every CPU student of the node maps, not one copy per student.
// Raw bytes and shapes only (no torch): student/teacher_head.h makes the
// TeacherHead tensors over the mapping.
//
// Naming and removal: the object is "<segment>.head" in /dev/shm
// (headObjectName). Segment::remove and Segment::removeStale remove it with the
// segment (and any temporary a publisher left), so distill-run's cleanup and
// the next job's stale-segment sweep take it too.
//
// Publishing (the generation flip). publish() writes a new object under a
// temporary name "<segment>.head.tmp-<pid>-<n>" (pages reserved with
// posix_fallocate, so no SIGBUS on a full /dev/shm): header, weight, bias, the
// SHA-256 fingerprint, the checksum, then `complete` = 1 (release); makes it
// read-only (mode 0400) and rename(2)s it onto "<segment>.head". The rename is
// atomic: a reader opens either the old object or the new one, each whole; no
// reader can see a half-written head. The replaced object is unlinked by the
// rename and lives on, unchanged, for as long as someone still maps it, so a
// student holding the old head keeps valid memory until it drops it. The
// header's generation is the replaced object's + 1 (1 for the first), so a
// reader can wait for "a newer head than mine" after a teacher restart. One
// publisher per segment at a time (the node's first teacher); two concurrent
// publishers would each publish a whole head, the last rename winning.
//
// Fingerprint: SHA-256 over a domain tag, the dtype, V_t, d_t, has-bias, softcap
// and scale (their IEEE bytes), then the weight's and the bias's bytes
// (headFingerprint). Computed once by the publisher; readers compare it, and
// verify() recomputes it from the mapped bytes.
//
// Validation before use: a reader maps the object read-only (PROT_READ), checks
// the file holds at least the header, then magic, layout version, `complete`,
// checksum, dtype, shapes, byte counts and offsets against the file's size,
// before touching any data byte: a corrupt, truncated or incomplete object is an
// IpcError naming the object, the field and the reader, never a SIGBUS. The
// object is immutable once visible (mode 0400, never written again).
//
// Thread safety: a SharedHead is an immutable handle over one mapping; copies
// share it and may be used from any thread. The mapping lives as long as the
// last copy or keepAlive() holder.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distill/core/clock.h"

namespace distill::ipc {

// The dtypes a head may have (values as the wire format's).
enum class HeadDType : uint32_t { kFloat32 = 3, kFloat16 = 4, kBFloat16 = 5 };
int64_t headItemSize(HeadDType d); // 4 or 2
const char* headDTypeName(HeadDType d); // "float32", "float16", "bfloat16"

// What a teacher publishes: its output layer's bytes, row-major and contiguous.
struct HeadBytes {
  HeadDType dtype = HeadDType::kFloat32; // of weight and bias
  int64_t vocab = 0; // V_t: weight's rows
  int64_t dim = 0; // d_t: weight's columns
  const void* weight = nullptr; // vocab * dim elements
  const void* bias = nullptr; // vocab elements, or nullptr: no bias
  double softcap = 0; // > 0: logits = softcap * tanh(logits / softcap); 0: none
  double scale = 1; // logits *= scale before the softcap; 1: none
};

// Who waits for the head, for messages: "student rank 3 (local 1)".
struct HeadReader {
  int rank = -1; // global rank
  std::string role = "student";
};

// "<segment>.head"
std::string headObjectName(const std::string& segmentName);

// Lowercase hex SHA-256 of `head` as published (the same as SharedHead::fingerprint()).
std::string headFingerprint(const HeadBytes& head);

class SharedHead {
 public:
  struct Mapping; // internal

  // Teacher. Publishes `head` beside segment `segmentName` as described above
  // and returns it mapped read-only. IpcError (naming the object, the bytes and
  // /dev/shm's free room or errno) if it cannot; a bad `head` (dtype, shapes,
  // null data, softcap, scale) is a UsageError naming the field.
  static SharedHead publish(const std::string& segmentName, const HeadBytes& head);

  // Student. Waits until `deadline` for a head of generation > afterGeneration
  // to be published beside `segmentName` and maps it read-only. TimeoutError
  // naming the reader, the object and what it saw (nothing, or the generation
  // still published); IpcError for a corrupt, truncated or incomplete object.
  static SharedHead open(const std::string& segmentName, const HeadReader& reader, Deadline deadline,
                         uint64_t afterGeneration = 0);

  // True when the object at headObjectName() is no longer this one (a teacher
  // republished, or it was removed). One stat(2); no mapping.
  bool replaced() const;

  const std::string& objectName() const;
  uint64_t generation() const;
  const std::string& fingerprint() const; // lowercase hex SHA-256
  int publisherPid() const;
  HeadDType dtype() const;
  int64_t vocab() const;
  int64_t dim() const;
  bool hasBias() const;
  double softcap() const;
  double scale() const;
  const void* weight() const; // vocab * dim elements, read-only
  const void* bias() const; // nullptr without bias
  uint64_t objectBytes() const; // the whole object (header and data)

  // Recomputes the fingerprint from the mapped bytes; IpcError naming both if it differs.
  void verify() const;

  // Holds the mapping alive (for tensors made over weight() and bias()).
  std::shared_ptr<const void> keepAlive() const;

 private:
  explicit SharedHead(std::shared_ptr<const Mapping> m) : m_(std::move(m)) {}
  std::shared_ptr<const Mapping> m_;
};

// Removes "<segment>.head" and any temporary "<segment>.head.*" a publisher
// left; returns how many it removed. Segment::remove calls it.
int removeHeadObjects(const std::string& segmentName);
// Segment::removeStale: removes every head object (or temporary) in /dev/shm
// whose name starts with `prefix` and whose segment no longer exists; returns
// their names.
std::vector<std::string> removeOrphanHeads(const std::string& prefix);

} // namespace distill::ipc
