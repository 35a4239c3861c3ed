#pragma once

// The teacher cache's files: who may own its store, how its folder is made,
// where LMDB mapped data.mdb. Internal to teacher/ (the cache's store.cpp).

#include <string>

namespace distill::cache_files {

// A store another user can change could serve that user's answers (the CRC
// guards against accidents only): its folder and files must be this user's and
// writable by no one else. `p` need not exist unless `required`. ConfigError
// naming the path, the owner and the mode otherwise.
void checkPrivate(const std::string& p, bool required);
// The store's folder: its parents as mkdir -p makes them, itself owner-only (0700).
void makeStoreDir(const std::string& path);
// Where data.mdb (`file`, open as `fd`) is mapped in this process; nullptr if not found.
const char* findMap(const std::string& file, int fd);

} // namespace distill::cache_files
