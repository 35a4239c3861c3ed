#include "files.h"

#include <limits.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "distill/core/errors.h"
#include "distill/core/sys.h"

namespace distill::cache_files {
namespace {

std::string modeText(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0%03o", unsigned(mode & 07777));
  return buf;
}

std::string userText(uid_t uid) {
  struct passwd pw {};
  struct passwd* found = nullptr;
  char buf[1024];
  std::string out = "uid " + std::to_string(uid);
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &found) == 0 && found) out += " (" + std::string(found->pw_name) + ")";
  return out;
}

} // namespace

// A store another user can change could serve that user's answers (the CRC
// guards against accidents only): its folder and files must be this user's and
// writable by no one else. `p` need not exist unless `required`.
void checkPrivate(const std::string& p, bool required) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) {
    const int err = errno;
    DISTILL_CHECK_T(ConfigError, !required && err == ENOENT, "teacher.cache.path: cannot stat ", p, ": ",
                    errnoString(err));
    return;
  }
  DISTILL_CHECK_T(ConfigError, st.st_uid == ::geteuid(), "teacher.cache.path: ", p, " belongs to ", userText(st.st_uid),
                  ", not to this process's user (", userText(::geteuid()), "; mode ", modeText(st.st_mode),
                  "): a store another user can change could serve its answers; give a "
                  "cache path of your own");
  DISTILL_CHECK_T(ConfigError, (st.st_mode & (S_IWGRP | S_IWOTH)) == 0, "teacher.cache.path: ", p, " has mode ",
                  modeText(st.st_mode), ", writable by ", (st.st_mode & S_IWOTH) ? "others" : "its group",
                  ": a store another user can change could serve its answers; chmod go-w ", p);
}

// The store's folder: its parents as mkdir -p makes them, itself owner-only (0700).
void makeStoreDir(const std::string& path) {
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  std::string failedAt;
  if (slash != std::string::npos && slash > 0) {
    const int err = makeDirs(dir.substr(0, slash), &failedAt);
    DISTILL_CHECK_T(ConfigError, err == 0, "teacher.cache.path: cannot create the directory ", failedAt, ": ",
                    errnoString(err));
  }
  if (::mkdir(dir.c_str(), 0700) != 0) {
    const int err = errno;
    struct stat st {};
    DISTILL_CHECK_T(ConfigError, err == EEXIST && ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
                    "teacher.cache.path: cannot create the directory ", dir, ": ",
                    errnoString(err == EEXIST ? ENOTDIR : err));
  }
}

// Where data.mdb is mapped in this process: LMDB does not say (mdb_env_info's
// me_mapaddr is the fixed address asked for, none here), so /proc/self/maps is
// read: the mapping at offset 0 of data.mdb's path or inode. nullptr if not found.
const char* findMap(const std::string& file, int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return nullptr;
  char resolved[PATH_MAX];
  const std::string real = ::realpath(file.c_str(), resolved) ? resolved : file;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long start = 0, end = 0, offset = 0, inode = 0;
    char perms[8];
    int pathAt = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx %7s %lx %*x:%*x %lu %n", &start, &end, perms, &offset, &inode, &pathAt) <
            5 ||
        offset != 0) {
      continue;
    }
    const std::string mapped = pathAt > 0 ? line.substr(size_t(pathAt)) : "";
    const bool dataFile = mapped.size() >= 9 && mapped.compare(mapped.size() - 9, 9, "/data.mdb") == 0;
    if (mapped == real || (dataFile && inode == st.st_ino)) {
      return reinterpret_cast<const char*>(start);
    }
  }
  return nullptr;
}


} // namespace distill::cache_files
