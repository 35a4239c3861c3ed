#pragma once

// Where the student group meets: the rendezvous store's listening socket and
// the job secret every peer of the store must prove (student_group.h).
//
// The store binds to run.master_addr only, never to every interface. Its
// port is run.master_port; 0 picks a free one (single-node jobs: the launcher
// binds it and hands the socket to student rank 0, so the choice cannot be
// taken by anyone in between). A process that cannot prove the job secret is
// refused before it can read or write a key.
//
// distill-run generates the secret of a single-node job (32 random bytes) and
// hands it to the students in DISTILL_JOB_SECRET, the way it hands them the
// segment name (a process's environment is readable by its own user only). A
// job of several nodes needs the same secret on every node: the user sets
// DISTILL_JOB_SECRET in each distill-run's environment.
//
// No torch here: the launcher uses it.

#include <string>

namespace distill {

// Environment of the student ranks.
constexpr const char* kJobSecretEnv = "DISTILL_JOB_SECRET"; // the secret (distill-run, or the user)
constexpr const char* kStoreFdEnv = "DISTILL_STORE_FD"; // student rank 0: the listening socket to serve on

// A bound, listening TCP socket (close-on-exec) and what it is bound to.
struct StoreListener {
  int fd = -1;
  std::string address; // the numeric address bound, e.g. "127.0.0.1"
  int port = 0; // the port bound (the free one chosen when 0 was asked)
};

// Binds a listening socket to `address`:`port` (port 0: a free one). Errors
// name the key: ConfigError when `address` is a wildcard (0.0.0.0, ::: every
// interface) or does not resolve to an address of this host, when the port
// is in use ("port 29500 on 127.0.0.1 is in use (run.master_port)").
StoreListener listenForStore(const std::string& address, int port);

// The port a listening socket `fd` is bound to, or -1 if `fd` is not one.
int listeningPort(int fd);

// 64 hex digits from the kernel's random source (getrandom).
std::string makeJobSecret();

} // namespace distill
