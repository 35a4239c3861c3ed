#pragma once

// The shared-memory segment of one node and job (docs/design.md, "The segment (ipc/)").
// distill-run creates it before spawning the local ranks and removes it on
// every exit path; the local ranks attach to it. The layout is in wire.h.
//
// Thread safety: a Segment is an immutable handle (shared mapping); copies are
// cheap and may be used from any thread. The mapping lives as long as the last
// copy or endpoint that holds it.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/core/options.h"
#include "distill/core/status.h"

namespace distill::ipc {

struct SegmentImpl; // internal (src/segment_impl.h)

// Sizes that fix the segment layout; creator and attachers must agree.
struct SegmentLayout {
  int numStudents = 1; // local students (local ranks 0 .. numStudents-1)
  int slots = 4; // slots per ring (transport.slots)
  int64_t maxRequestBytes = 4 << 20; // payload bytes per request slot (transport.max_request_bytes)
  int64_t maxResponseBytes = 64 << 20; // payload bytes per response slot (transport.max_response_bytes)
  int heartbeatMs = 100; // heartbeat period (transport.heartbeat_ms)
  int numTeachers = 1; // local teachers (teacher.procs): local ranks numStudents .. numStudents+numTeachers-1
  int64_t stallTimeoutMs = 60000; // a live peer without heartbeats is lost after this long (transport.stall_timeout_s)

  // transport.* of `c`, with max_*_bytes auto resolved (core/payload.h: slotBytes);
  // ConfigError when an explicit size is below what the config needs (checkSlotBytes).
  static SegmentLayout fromConfig(const Config& c, int numStudents, int numTeachers = 1);
  // What a rank attaching to the segment distill-run made expects: fromConfig,
  // with the slot sizes left auto as 0 (any: the creator's computation holds,
  // and admission compares the configs, naming a key that differs).
  static SegmentLayout expectedFromConfig(const Config& c, int numStudents, int numTeachers = 1);
  // Equal, a 0 slot size of `expected` matching any.
  bool matches(const SegmentLayout& expected) const;
  bool operator==(const SegmentLayout& o) const;
  bool operator!=(const SegmentLayout& o) const { return !(*this == o); }
  // "students=3 teachers=1 slots=4 request_bytes=4194304 response_bytes=67108864 heartbeat_ms=100 stall_timeout_ms=60000"
  std::string describe() const;
};

// A snapshot of one process-table entry (for hang tables and tests).
struct ProcessSnapshot {
  int localIndex = -1; // the local rank: 0 .. numStudents-1 students, then the teachers
  int pid = 0; // 0 = never attached
  int rank = -1; // global rank
  std::string role; // "student" | "teacher"
  std::string state; // wire::stateName
  uint64_t incarnation = 0; // attaches of this local rank so far
  int64_t heartbeatAgeMs = -1;
  int64_t heartbeatNs = 0; // its last heartbeat (CLOCK_MONOTONIC, as monotonicNs()); 0 = never attached
  int64_t endedNs = 0; // when it detached (finished or dead), 0 = still attached or never
  std::string waitWhat; // wire::waitName
  int waitPeer = -1;
  int64_t waitStep = 0, waitAccStep = 0;
  uint64_t waitSeq = 0;
  int64_t waitForMs = 0; // how long the current wait has lasted
};

// A teacher's teacher.cache counters (Segment::teacherCache).
struct TeacherCacheGauge {
  enum class Full : uint32_t { kNo = 0, kMaxBytes = 1, kWriteFailed = 2 }; // why it stores no more rows
  Full full = Full::kNo;
  int64_t lookups = 0; // rows looked up in the store
  int64_t hits = 0; // of which answered from it
  int64_t storedTokens = 0; // tokens of the rows stored
  int64_t storedBytes = 0; // what the store spends on them
  // hits / lookups, nullopt before any lookup (mode write looks nothing up).
  std::optional<double> hitShare() const {
    return lookups > 0 ? std::optional<double>(double(hits) / double(lookups)) : std::nullopt;
  }
  // Bytes the store spends per stored token, 0 before any row is stored.
  double bytesPerToken() const { return storedTokens > 0 ? double(storedBytes) / double(storedTokens) : 0.0; }
};

class Segment {
 public:
  // Launcher only. Creates the segment `name` (mode 0600, zero-filled) and
  // initialises the control block. Every page is reserved at creation
  // (posix_fallocate), so no later write into the segment can die of SIGBUS
  // on a full /dev/shm; too little room is an IpcError naming the bytes
  // needed, the bytes free and the transport.* keys that set the size, and
  // leaves nothing in /dev/shm. An existing segment whose creator pid is
  // alive is an IpcError naming the segment and pid; one whose creator is dead
  // is removed and recreated (logged as a warning).
  static Segment create(const std::string& name, const SegmentLayout& layout, const std::string& jobId);

  // For processes that start together with no launcher to make the segment
  // (torchrun): each calls it with the same arguments; exactly one creates the
  // segment (an exclusive create) and initialises it, recording `creatorPid`
  // (their common parent: the segment is stale once it is gone); the others
  // attach as attach() does, waiting until `deadline` for it to be ready.
  static Segment createOrAttach(const std::string& name, const SegmentLayout& layout, const std::string& jobId,
                                int creatorPid, Deadline deadline);

  // Any local rank. Waits until `deadline` for the segment to exist and be
  // initialised (TimeoutError), then checks magic, layout version, control
  // checksum, job id and, if given, the layout (IpcError naming both values).
  static Segment attach(const std::string& name, const std::string& jobId, const std::optional<SegmentLayout>& expected,
                        Deadline deadline);

  // Launcher only. Removes the name (mappings stay valid) and the teacher's
  // head object beside it (shared_head.h); false if the segment did not exist.
  static bool remove(const std::string& name);
  static bool exists(const std::string& name);
  // Launcher only, before it creates its own: removes every segment in
  // /dev/shm whose name starts with `prefix` and whose creator pid is gone
  // (left by a distill-run that was SIGKILLed). Segments not yet initialised,
  // not ours to open, or whose creator lives are left alone. The head objects
  // of the segments it removes go too, and any head whose segment is gone.
  // Returns what it removed, with the dead creator's pid: "distill-ab12-n0
  // (creator pid 4242)", "distill-ab12-n0.head (a teacher head whose segment is gone)".
  static std::vector<std::string> removeStale(const std::string& prefix);

  const std::string& name() const;
  SegmentLayout layout() const;
  std::string jobId() const;
  uint64_t incarnation() const; // random per creation
  int creatorPid() const;
  size_t sizeBytes() const;
  bool admitted() const; // every teacher has admitted its students
  int numTeachers() const; // teacher.procs of the node

  // Any process: makes every wait on the segment fail with IpcError("aborted"),
  // now and later. Used by the launcher on teardown.
  void abort() const;
  bool aborted() const;

  // Launcher: asks the job to stop (SIGINT/SIGTERM received); students see it
  // through Client::stopRequested() and may checkpoint and leave cleanly.
  // Unlike abort(), no wait fails. Release store / acquire load.
  void requestStop() const;
  bool stopRequested() const;

  // Teacher `teacher` (0 .. numTeachers()-1): publishes the share (0..1) of the
  // last second it spent in forward; anyone (launcher status line, hang table)
  // reads it. Relaxed: a gauge. teacherBusy() without an index: the mean over
  // the teachers.
  void setTeacherBusy(int teacher, double share) const;
  double teacherBusy(int teacher) const;
  double teacherBusy() const;
  // Teacher `teacher`'s teacher.cache counters since its start (the teacher
  // stores them after each batch; relaxed); without an index: summed over the
  // teachers (full if any is). teacherCacheHits: the hit share, hits / rows
  // looked up (TeacherCacheGauge::hitShare, 0 before any lookup) — the one
  // definition the teacher's summary, the status line and the verdict use.
  void setTeacherCache(int teacher, const TeacherCacheGauge& gauge) const;
  TeacherCacheGauge teacherCache(int teacher) const;
  TeacherCacheGauge teacherCache() const;
  double teacherCacheHits(int teacher) const;
  double teacherCacheHits() const;

  // Student `localIndex` (its owner only): publishes its training status in
  // its status area (a seqlock: a few relaxed stores, no system call). Anyone
  // (distill-run's status line) reads the last one whole; nullopt before the
  // first, or while a writer stopped mid-write.
  void publishStatus(int localIndex, const StudentStatus& status) const;
  std::optional<StudentStatus> status(int localIndex) const;

  // Elastic teachers, each on its own. Launcher: setTeacherMaxRestarts(
  // teacher.max_restarts) before spawning, noteTeacherRestart(teacher, pid of
  // the dead one) before each respawn of that teacher (returns its new count).
  // Its students and their waits treat it, dead, as one being restarted, not
  // as lost, while teacherRestarts(teacher) < teacherMaxRestarts() or while it
  // is the one being replaced. teacherRestarts() without an index: the sum.
  void setTeacherMaxRestarts(int n) const;
  int teacherMaxRestarts() const;
  int noteTeacherRestart(int teacher, int deadPid) const;
  int teacherRestarts(int teacher) const;
  int teacherRestarts() const;
  // A teacher that failed again on a request an earlier incarnation failed on
  // (a deterministic failure: its model or that input) gives up: it is not
  // restarted, and its students stop waiting for it. `why` (which request of
  // which student, and the exception) is kept once per segment, the first
  // teacher's, for distill-run's summary. Release store / acquire load.
  void noteTeacherGaveUp(int teacher, const std::string& why) const;
  bool teacherGaveUp(int teacher) const;
  std::string teacherGaveUpReason() const; // "" if no teacher gave up

  std::vector<ProcessSnapshot> processes() const;

  const std::shared_ptr<SegmentImpl>& impl() const { return impl_; }

 private:
  explicit Segment(std::shared_ptr<SegmentImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<SegmentImpl> impl_;
};

} // namespace distill::ipc
