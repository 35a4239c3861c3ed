#pragma once

// Raw system calls of ipc/: every one goes through retryEintr, except
// futexWait, for which EINTR is a (harmless) spurious wake-up that callers,
// which loop and re-check their condition, already handle.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "distill/core/sys.h"

namespace distill::ipc::sys {

// The EINTR retry is core's (core/sys.h), reachable here as sys::retryEintr.
using distill::retryEintr;

// FUTEX_WAIT (shared: the word is in shared memory) while *word == expected,
// for at most `timeout`. Returns on wake-up, value change, signal or timeout.
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
// FUTEX_WAKE every waiter of `word` (shared).
void futexWakeAll(std::atomic<uint32_t>* word);

enum class PidState { kRunning, kStopped, kGone }; // kGone: no such process, or a zombie
PidState pidState(int pid);

// Creates /dev/shm/<name> (O_EXCL, mode 0600) of `bytes`, its pages reserved
// (posix_fallocate: no SIGBUS later on a full /dev/shm), mapped read-write.
// IpcError naming `who`, the object and why (removed again on failure).
std::pair<Fd, void*> createShmObject(const std::string& name, uint64_t bytes, const std::string& who);

// Reads a small file (e.g. /proc/<pid>/stat); "" on error.
std::string readSmallFile(const std::string& path);

} // namespace distill::ipc::sys
