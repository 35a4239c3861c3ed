#pragma once

// Helpers of the shared-head tests (tests/ipc/shared_head_test.cpp,
// tests/student/teacher_head_test.cpp): a deterministic head to publish, a
// pipe to order real processes without sleeping, and the proportional set
// size of one mapping read from /proc/<pid>/smaps.

#include <dirent.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "distill/ipc/shared_head.h"

namespace distill::ipc::test {

// A float32 head whose element i is seed + i / 1024 (exact in float32 for these sizes).
struct TestHead {
  std::vector<float> weight, bias;
  HeadBytes bytes;
  TestHead(int64_t vocab, int64_t dim, float seed, bool withBias, double softcap = 0, double scale = 1) {
    weight.resize(size_t(vocab * dim));
    for (size_t i = 0; i < weight.size(); ++i) weight[i] = seed + float(i % 65536) / 1024.0f;
    if (withBias) bias.assign(size_t(vocab), seed - 1.0f);
    bytes.dtype = HeadDType::kFloat32;
    bytes.vocab = vocab;
    bytes.dim = dim;
    bytes.weight = weight.data();
    bytes.bias = withBias ? bias.data() : nullptr;
    bytes.softcap = softcap;
    bytes.scale = scale;
  }
};

// One-way signal between processes: signal() writes a byte; wait() polls with a deadline.
struct Signal {
  int fds[2] = {-1, -1};
  Signal() { (void)!::pipe(fds); }
  ~Signal() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
  void signal() const { (void)!::write(fds[1], "x", 1); }
  bool wait(Deadline deadline) const {
    pollfd p{fds[0], POLLIN, 0};
    const int ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count());
    if (::poll(&p, 1, ms) != 1) return false;
    char c;
    return ::read(fds[0], &c, 1) == 1;
  }
};

// Rss and Pss (bytes) of the mapping of `path` in process `pid`, summed over its VMAs; -1 if none.
struct MappingSize {
  int64_t rss = -1, pss = -1;
};
inline MappingSize mappingSize(int pid, const std::string& path) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  MappingSize out;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string first;
    ls >> first;
    if (first.find('-') != std::string::npos && first.find(':') == std::string::npos) { // a VMA's first line
      inside = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
      continue;
    }
    int64_t kb = 0;
    if (inside && (first == "Rss:" || first == "Pss:") && (ls >> kb)) {
      int64_t& v = first == "Rss:" ? out.rss : out.pss;
      v = (v < 0 ? 0 : v) + kb * 1024;
    }
  }
  return out;
}

// Names in /dev/shm that start with `prefix`, with their sizes.
inline std::vector<std::pair<std::string, int64_t>> shmObjects(const std::string& prefix) {
  std::vector<std::pair<std::string, int64_t>> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      struct stat st {};
      if (n.compare(0, prefix.size(), prefix) == 0 && ::stat(("/dev/shm/" + n).c_str(), &st) == 0)
        out.emplace_back(n, int64_t(st.st_size));
    }
    ::closedir(d);
  }
  return out;
}

} // namespace distill::ipc::test
