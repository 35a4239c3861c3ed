#pragma once

// System-call helpers shared by the modules and the launcher: the one EINTR
// retry, an owning file descriptor and mkdir -p. POSIX only, torch-free; no
// std::filesystem (libtorch.so exports its own copy of it, and a call bound to
// that copy crashed; docs/building.md, "Build notes").

#include <cerrno>
#include <functional>
#include <string>

namespace distill {

// Calls f() again while it returns -1 with errno == EINTR; returns its result
// (errno set on -1). Every raw read/write/waitpid/poll/open/fsync goes through it.
template <typename F>
auto retryEintr(F f) -> decltype(f()) {
  for (;;) {
    auto r = f();
    if (r == -1 && errno == EINTR) continue;
    return r;
  }
}

// Owns a file descriptor: closed on destruction; move-only. -1 = none.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }
  // Gives the descriptor up without closing it.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the current descriptor (if any) and owns `fd` instead.
  void reset(int fd = -1);
  // close(2) with its result: 0, or -1 with errno (a deferred write error may
  // only show here). Not retried on EINTR: on Linux the descriptor is gone anyway.
  int close();

 private:
  int fd_ = -1;
};

// mkdir -p `dir`: each directory it makes gets `mode` (less the umask); an
// existing directory is fine and keeps its mode. Returns 0, or the errno of
// the first directory that could not be made (ENOTDIR when a part is an
// existing non-directory), with its path in `*failedAt`. `before`, when given,
// is called with each directory before its mkdir; a non-zero return is taken
// as that mkdir's errno (checkpoint fault injection).
int makeDirs(const std::string& dir, std::string* failedAt = nullptr,
             const std::function<int(const std::string&)>& before = {}, unsigned mode = 0755);

// What a st_mode's file type is, for messages: "a regular file", "a
// directory", "a FIFO (named pipe)", "a socket", "a character device", "a
// block device", "a symbolic link", "an unknown kind of file".
const char* fileTypeName(unsigned stMode);

// "" when `path` is a regular file (links followed); otherwise what it is
// instead ("a FIFO (named pipe), not a regular file") or why stat failed
// (strerror). Opening a FIFO for reading blocks until a writer comes: check
// before handing a path to a loader that opens it.
std::string regularFileProblem(const std::string& path);

// Creates `path` if missing (O_CREAT, `mode` less the umask); an existing
// one loses the permissions `mode` does not give (a log of an earlier run,
// 0644, becomes 0600); the content is kept. Returns 0 or the errno.
int createWithMode(const std::string& path, unsigned mode);

} // namespace distill
