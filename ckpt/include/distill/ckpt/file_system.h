#pragma once

// The one seam through which checkpoint code touches the file system, so that
// tests can fail any call of it. Every failure is a FileSystemError (a CheckpointError
// carrying the errno) whose message names the operation, the path and
// strerror(errno), e.g.
//   "cannot write /ckpt/step_20.tmp/rank_1.pt: No space left on device (errno 28)".
//
// Thread safety: PosixFileSystem keeps no state and may be used from several
// threads; the CheckpointManager calls its FileSystem from one thread at a time
// (its own background writer or the caller's thread, never both at once).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distill/core/errors.h"

namespace distill {

// The CheckpointError a FileSystem throws, with the errno of the failed call
// (so that a caller can tell "no space left" from other failures).
class FileSystemError : public CheckpointError {
 public:
  FileSystemError(int err, std::string msg, const char* file, int line)
      : CheckpointError(std::move(msg), ErrorWhere{}, file, line), err_(err) {}
  int errorNumber() const noexcept { return err_; }
  // ENOSPC or EDQUOT: the device or the quota is full.
  bool noSpace() const noexcept;

 private:
  int err_;
};

// The system calls behind FileSystem, as seen by the fault hook.
enum class FsOp { kMkdir, kOpen, kWrite, kFsync, kClose, kRead, kRename, kRemove, kList };
const char* fsOpName(FsOp op);

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // mkdir -p; an existing directory is fine.
  virtual void createDirs(const std::string& path) = 0;
  // Creates or truncates `path`, writes all of `bytes`, fsyncs and closes it.
  // On failure the file may be partial; the caller never publishes it.
  virtual void writeFile(const std::string& path, const std::string& bytes) = 0;
  // The whole file; a missing file is an error (ENOENT), and so is anything
  // but a regular file (a FIFO is refused, never waited on).
  virtual std::string readFile(const std::string& path) = 0;
  virtual bool exists(const std::string& path) = 0;
  // Names (not paths) of the entries of `dir`, sorted.
  virtual std::vector<std::string> list(const std::string& dir) = 0;
  // rename(2): atomic replace of `to` (a file, or an empty directory).
  virtual void rename(const std::string& from, const std::string& to) = 0;
  // fsync of a directory, making the entries created or renamed in it durable.
  virtual void syncDir(const std::string& dir) = 0;
  // rm -rf; a missing path is fine.
  virtual void removeAll(const std::string& path) = 0;
};

class PosixFileSystem : public FileSystem {
 public:
  // Files it writes get `fileMode`, directories it makes `dirMode` (less the
  // umask): run.file_mode's (core/options.h fileModeBits, dirModeBits);
  // owner-only by default. Existing directories keep theirs.
  explicit PosixFileSystem(unsigned fileMode = 0600, unsigned dirMode = 0700)
      : fileMode_(fileMode), dirMode_(dirMode) {}

  void createDirs(const std::string& path) override;
  void writeFile(const std::string& path, const std::string& bytes) override;
  std::string readFile(const std::string& path) override;
  bool exists(const std::string& path) override;
  std::vector<std::string> list(const std::string& dir) override;
  void rename(const std::string& from, const std::string& to) override;
  void syncDir(const std::string& dir) override;
  void removeAll(const std::string& path) override;

  // Bytes per write(2) call (so that "the Nth write" can fail mid-file).
  static constexpr size_t kWriteChunk = 1 << 20;

 protected:
  // Fault hook, called before every system call (each write(2) chunk is one
  // kWrite). Return 0 to go on, or an errno value to make that call fail with it
  // without doing it. Called on the thread doing the I/O. Default: 0.
  virtual int fault(FsOp op, const std::string& path) { return 0; }

 private:
  unsigned fileMode_, dirMode_;
};

// For tests and failure drills: fails the `nth` (1-based) call of `op` whose
// path contains `pathContains` with `err` (then behaves normally again).
class FaultyFileSystem : public PosixFileSystem {
 public:
  FaultyFileSystem(FsOp op, int64_t nth, int err, std::string pathContains = "")
      : op_(op), nth_(nth), err_(err), pathContains_(std::move(pathContains)) {}
  // Matching calls seen so far, and whether the fault was injected.
  int64_t calls() const { return calls_.load(); }
  bool fired() const { return calls_.load() >= nth_; }

 protected:
  int fault(FsOp op, const std::string& path) override;

 private:
  FsOp op_;
  int64_t nth_;
  int err_;
  std::string pathContains_;
  std::atomic<int64_t> calls_{0};
};

// A PosixFileSystem with the given modes (owner-only by default).
std::shared_ptr<FileSystem> posixFileSystem(unsigned fileMode = 0600, unsigned dirMode = 0700);

} // namespace distill
