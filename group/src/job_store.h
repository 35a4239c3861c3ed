#pragma once

// The student group's rendezvous store (internal to core): a key-value server
// in student rank 0's process, and a c10d::Store client in every student,
// over TCP, for the student group's own keys and gloo's and NCCL's rendezvous.
//
// Written here rather than taken from c10d::TCPStore (the well-kept default)
// because TCPStore authenticates nobody: any process that reaches its port
// reads every key (LIST_KEYS lists them, so even an unguessable key prefix is
// visible), writes keys the job reads and can join the group; and a client
// that loses it says only "Did the remote server shutdown or crash?". This
// store speaks the c10d::Store calls gloo and NCCL use (set, get, add, check,
// wait, deleteKey, compareSet, getNumKeys) over a small protocol of its own:
//
//   * Every connection first proves the job secret (rendezvous.h): the server
//     sends a random nonce, the client answers HMAC-SHA256(secret, both
//     nonces, its rank) (OpenSSL), the server answers with its own HMAC so the
//     client knows it talks to the job's store, not to a squatter on the port.
//     A peer that does not prove it is closed before it can ask anything.
//   * A client says goodbye when its store is destroyed normally. The server
//     records, in order, the ranks whose connection closed without one (their
//     process died, or unwound on an error) under kLostKeyPrefix<n> (n = 1,
//     2, ...): after a failure, the survivors name the rank lost first.
//
// Frames: u32 length (of what follows), u8 op or status, u64 request id,
// payload; strings as u32 length + bytes. A reply carries its request's id,
// so the late answer to a wait that timed out is recognised and dropped.
//
// Threads: the server runs one thread (a poll loop). A JobStore is thread safe
// (one request at a time, like TCPStore); clone() opens a new connection.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>
#include <vector>

#include "distill/core/clock.h"
#include "job_store_server.h"

namespace distill {

class JobStore : public c10d::Store {
 public:
  // Connects to `host`:`port` (retrying while nobody listens yet, until
  // `connectBy`: TimeoutError) and proves the secret as student rank `rank`.
  // `server` names the store's host in errors ("student rank 0 on node 0").
  // A store that refuses the proof, or cannot prove the secret itself, is a
  // ConfigError; a store that goes away during a call is a PeerLostError
  // naming `server`; a wait past its timeout is a TimeoutError.
  JobStore(std::string host, int port, std::string secret, int rank, std::string server, Deadline connectBy);
  ~JobStore() override; // says goodbye, unless an exception is unwinding (that counts as lost)

  c10::intrusive_ptr<c10d::Store> clone() override;
  // A new connection proving the secret as `rank`; -1: one whose closing
  // without a goodbye does not count as a rank lost (another store user of a
  // rank whose own connection speaks for it).
  c10::intrusive_ptr<JobStore> cloneAs(int rank);
  using c10d::Store::set;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using c10d::Store::compareSet;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override; // waits (getTimeout()) until the key exists
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // The ranks whose connection to the store closed without a goodbye, the
  // first lost first. Waits up to `grace` for a first one (a peer's death and
  // the error it causes here race by a few milliseconds).
  std::vector<int> lostRanks(Millis grace);

  // Waits up to `timeout` for every key of `keys` to exist: false when the
  // time ran out (an expected outcome, not an error); failures still throw.
  bool tryWait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout);

  // "127.0.0.1:29500 (served by student rank 0 on node 0)"
  std::string describe() const;

 private:
  struct Conn;
  // One request and its answer. At the deadline: TimeoutError, or, with
  // `timedOut`, *timedOut = true and an empty answer.
  std::vector<uint8_t> call(uint8_t op, const std::string& payload, Deadline deadline, const std::string& what,
                            uint8_t* status = nullptr, bool* timedOut = nullptr);

  std::string host_;
  int port_;
  std::string secret_;
  int rank_;
  std::string server_;
  std::unique_ptr<Conn> conn_;
};

} // namespace distill
