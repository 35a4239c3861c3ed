#include "distill/core/sys.h"

#include <sys/stat.h>
#include <unistd.h>

namespace distill {

void Fd::reset(int fd) {
  if (fd_ >= 0 && fd_ != fd) ::close(fd_);
  fd_ = fd;
}

int Fd::close() {
  if (fd_ < 0) return 0;
  return ::close(release());
}

int makeDirs(const std::string& dir, std::string* failedAt, const std::function<int(const std::string&)>& before) {
  for (size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    const std::string prefix = dir.substr(0, end);
    if (!prefix.empty() && prefix != "/" && prefix.back() != '/') { // "a//b": one mkdir for "a"
      int err = before ? before(prefix) : 0;
      struct stat st;
      if (err == 0 && ::mkdir(prefix.c_str(), 0755) != 0) {
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

} // namespace distill
