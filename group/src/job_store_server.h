#pragma once

// The rendezvous store's server (job_store.h describes the store and its
// protocol): a key-value server on one thread, in student rank 0's process.
// No torch: the client, a c10d::Store, is in job_store.h.

#include <memory>
#include <string>

namespace distill {

// "distill_store/lost/<n>" = the decimal rank of the n-th rank lost.
constexpr const char* kLostKeyPrefix = "distill_store/lost/";

class JobStoreServer {
 public:
  // Serves on the listening socket `listenFd` (taken over, closed on
  // destruction) until destroyed. `where` names it in log lines ("127.0.0.1:29500").
  JobStoreServer(int listenFd, std::string secret, std::string where);
  ~JobStoreServer();
  JobStoreServer(const JobStoreServer&) = delete;
  JobStoreServer& operator=(const JobStoreServer&) = delete;

  // Connections refused so far (they did not prove the secret).
  int refused() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace distill
