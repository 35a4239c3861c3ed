#include "distill/ckpt/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "distill/core/errors.h"
#include "distill/core/sys.h"

namespace distill {
namespace {

[[noreturn]] void fail(const char* verb, const std::string& path, int err) {
  throw FileSystemError(err, std::string("cannot ") + verb + " " + path + ": " + errnoString(err), __FILE__, __LINE__);
}

// Sorted entry names of `dir` (no "." or ".."); false with errno set on failure.
bool listNames(const std::string& dir, std::vector<std::string>* out) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return false;
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out->push_back(e->d_name);
  }
  int err = errno;
  ::closedir(d);
  errno = err;
  std::sort(out->begin(), out->end());
  return err == 0;
}

} // namespace

bool FileSystemError::noSpace() const noexcept { return err_ == ENOSPC || err_ == EDQUOT; }

const char* fsOpName(FsOp op) {
  switch (op) {
    case FsOp::kMkdir:
      return "mkdir";
    case FsOp::kOpen:
      return "open";
    case FsOp::kWrite:
      return "write";
    case FsOp::kFsync:
      return "fsync";
    case FsOp::kClose:
      return "close";
    case FsOp::kRead:
      return "read";
    case FsOp::kRename:
      return "rename";
    case FsOp::kRemove:
      return "remove";
    case FsOp::kList:
      return "list";
  }
  return "?";
}

void PosixFileSystem::createDirs(const std::string& path) {
  std::string at;
  const int e = makeDirs(path, &at, [&](const std::string& dir) { return fault(FsOp::kMkdir, dir); }, dirMode_);
  if (e != 0) fail("create directory", at, e);
}

void PosixFileSystem::writeFile(const std::string& path, const std::string& bytes) {
  if (int e = fault(FsOp::kOpen, path)) fail("open for writing", path, e);
  Fd fd(retryEintr([&] { return ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, fileMode_); }));
  if (fd.get() < 0) fail("open for writing", path, errno);
  // A file left by an earlier run (latest.tmp after a crash) keeps its mode
  // through O_TRUNC: take away what fileMode_ does not give.
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail("stat", path, errno);
  if ((st.st_mode & 07777 & ~fileMode_) != 0 && ::fchmod(fd.get(), st.st_mode & 07777 & fileMode_) != 0)
    fail("chmod", path, errno);
  size_t done = 0;
  while (done < bytes.size()) {
    if (int e = fault(FsOp::kWrite, path)) fail("write", path, e);
    size_t n = std::min(kWriteChunk, bytes.size() - done);
    ssize_t w = retryEintr([&] { return ::write(fd.get(), bytes.data() + done, n); });
    if (w < 0) fail("write", path, errno);
    done += static_cast<size_t>(w);
  }
  if (int e = fault(FsOp::kFsync, path)) fail("fsync", path, e);
  if (retryEintr([&] { return ::fsync(fd.get()); }) != 0) fail("fsync", path, errno);
  if (int e = fault(FsOp::kClose, path)) fail("close", path, e);
  if (fd.close() != 0 && errno != EINTR) fail("close", path, errno);
}

std::string PosixFileSystem::readFile(const std::string& path) {
  if (int e = fault(FsOp::kOpen, path)) fail("open", path, e);
  // O_NONBLOCK: opening a FIFO planted in a checkpoint returns at once
  // (refused below) instead of waiting for a writer; regular files ignore it.
  Fd fd(retryEintr([&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK); }));
  if (fd.get() < 0) fail("open", path, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail("stat", path, errno);
  if (!S_ISREG(st.st_mode)) {
    throw FileSystemError(EINVAL, "cannot read " + path + ": it is " + fileTypeName(st.st_mode) + ", not a regular file",
                          __FILE__, __LINE__);
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  for (;;) {
    if (int e = fault(FsOp::kRead, path)) fail("read", path, e);
    if (done == out.size()) out.resize(out.size() + 4096); // the file grew: read to EOF
    ssize_t r = retryEintr([&] { return ::read(fd.get(), &out[done], out.size() - done); });
    if (r < 0) fail("read", path, errno);
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  out.resize(done);
  return out;
}

bool PosixFileSystem::exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::vector<std::string> PosixFileSystem::list(const std::string& dir) {
  if (int e = fault(FsOp::kList, dir)) fail("list", dir, e);
  std::vector<std::string> out;
  if (!listNames(dir, &out)) fail("list", dir, errno);
  return out;
}

void PosixFileSystem::rename(const std::string& from, const std::string& to) {
  if (int e = fault(FsOp::kRename, from)) fail("rename", from + " -> " + to, e);
  if (::rename(from.c_str(), to.c_str()) != 0) fail("rename", from + " -> " + to, errno);
}

void PosixFileSystem::syncDir(const std::string& dir) {
  if (int e = fault(FsOp::kOpen, dir)) fail("open directory", dir, e);
  Fd fd(retryEintr([&] { return ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }));
  if (fd.get() < 0) fail("open directory", dir, errno);
  if (int e = fault(FsOp::kFsync, dir)) fail("fsync directory", dir, e);
  if (retryEintr([&] { return ::fsync(fd.get()); }) != 0) fail("fsync directory", dir, errno);
}

void PosixFileSystem::removeAll(const std::string& path) {
  if (int e = fault(FsOp::kRemove, path)) fail("remove", path, e);
  // No std::filesystem: libtorch.so exports its own copy of it, which the
  // dynamic linker may bind our calls to (a crash here, measured).
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail("remove", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    std::vector<std::string> names;
    if (!listNames(path, &names)) fail("list", path, errno);
    for (const auto& n : names) removeAll(path + "/" + n);
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) fail("remove", path, errno);
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    fail("remove", path, errno);
  }
}

int FaultyFileSystem::fault(FsOp op, const std::string& path) {
  if (op != op_ || path.find(pathContains_) == std::string::npos) return 0;
  return calls_.fetch_add(1) + 1 == nth_ ? err_ : 0;
}

std::shared_ptr<FileSystem> posixFileSystem(unsigned fileMode, unsigned dirMode) {
  return std::make_shared<PosixFileSystem>(fileMode, dirMode);
}

} // namespace distill
