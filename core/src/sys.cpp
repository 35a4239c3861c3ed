#include "distill/core/sys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "distill/core/errors.h"

namespace distill {

void Fd::reset(int fd) {
  if (fd_ >= 0 && fd_ != fd) ::close(fd_);
  fd_ = fd;
}

int Fd::close() {
  if (fd_ < 0) return 0;
  return ::close(release());
}

int makeDirs(const std::string& dir, std::string* failedAt, const std::function<int(const std::string&)>& before,
             unsigned mode) {
  for (size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    const std::string prefix = dir.substr(0, end);
    if (!prefix.empty() && prefix != "/" && prefix.back() != '/') { // "a//b": one mkdir for "a"
      int err = before ? before(prefix) : 0;
      struct stat st;
      if (err == 0 && ::mkdir(prefix.c_str(), static_cast<mode_t>(mode)) != 0) {
        err = errno;
        if (err == EEXIST) err = ::stat(prefix.c_str(), &st) == 0 && S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
      }
      if (err != 0) {
        if (failedAt) *failedAt = prefix;
        return err;
      }
    }
    if (end == std::string::npos) return 0;
  }
}

const char* fileTypeName(unsigned stMode) {
  switch (stMode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO (named pipe)";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFLNK:
      return "a symbolic link";
  }
  return "an unknown kind of file";
}

std::string regularFileProblem(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errnoString(errno);
  if (S_ISREG(st.st_mode)) return "";
  return std::string(fileTypeName(st.st_mode)) + ", not a regular file";
}

int createWithMode(const std::string& path, unsigned mode) {
  Fd fd(retryEintr([&] { return ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, static_cast<mode_t>(mode)); }));
  if (!fd.valid()) return errno;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno;
  const mode_t extra = st.st_mode & 07777 & ~static_cast<mode_t>(mode);
  if (extra != 0 && ::fchmod(fd.get(), st.st_mode & 07777 & static_cast<mode_t>(mode)) != 0) return errno;
  return fd.close() == 0 ? 0 : errno;
}

} // namespace distill
