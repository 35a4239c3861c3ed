#pragma once

// A fresh directory for a teacher-output cache store, removed at scope exit
// (an LMDB store is data.mdb and lock.mdb; no std::filesystem: libtorch.so
// exports a clashing copy).

#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "support/process.h"

namespace distill::testing {

struct CacheStoreDir {
  std::string path = ::testing::TempDir() + uniqueName("distill-cache");
  ~CacheStoreDir() {
    ::unlink((path + "/data.mdb").c_str());
    ::unlink((path + "/lock.mdb").c_str());
    ::rmdir(path.c_str());
  }
};

} // namespace distill::testing
