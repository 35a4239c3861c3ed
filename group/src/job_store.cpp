// The rendezvous store's client, a c10d::Store (job_store.h).
#include "job_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/group/rendezvous.h"
#include "job_store_wire.h"

namespace distill {

using namespace job_store_wire;

struct JobStore::Conn {
  int fd = -1;
  std::mutex mutex;
  uint64_t nextId = 1;
  bool broken = false; // lost: every later call fails at once
  std::string brokenWhy;
  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

// Waits for `events` on `fd` until `deadline`; false at the deadline.
bool waitFd(int fd, short events, Deadline deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<Millis>(deadline.remaining()).count();
    pollfd p{fd, events, 0};
    const int n =
        ::poll(&p, 1, deadline.when() == Clock::time_point::max() ? -1 : int(std::min<int64_t>(left, 1 << 30)));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return true; // let the read or write report it
  }
}

} // namespace

namespace {

// A connected, blocking TCP socket to host:port. Nothing tells a client when
// the store begins to listen: try to connect, backing off from 10 to 500 ms,
// until the deadline (as TCPStore does).
int connectTo(const std::string& host, int port, Deadline connectBy, const std::string& where,
              Clock::time_point start) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  std::string lastError = "nobody listens there yet";
  for (auto pause = Millis(10);; pause = std::min(pause * 2, Millis(500))) {
    int connected = -1;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (rc != 0) {
      lastError = std::string("cannot resolve it: ") + ::gai_strerror(rc);
    } else {
      for (addrinfo* a = found; a && connected < 0; a = a->ai_next) {
        // Non-blocking, so that an unreachable host (SYNs dropped) ends at the
        // deadline, not after the kernel's two minutes of retries.
        const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
        if (err == EINPROGRESS) {
          err = ETIMEDOUT;
          if (waitFd(fd, POLLOUT, connectBy)) {
            socklen_t len = sizeof err;
            if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          }
        }
        if (err == 0) {
          ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
          connected = fd;
        } else {
          lastError = errnoString(err);
          ::close(fd);
        }
      }
      ::freeaddrinfo(found);
    }
    if (connected >= 0) return connected;
    if (connectBy.expired())
      DISTILL_THROW(TimeoutError, awaiting("rendezvous store at " + where), "cannot reach the rendezvous store at ",
                    where, " within ", toMs(Clock::now() - start), " ms: ", lastError);
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, connectBy.remaining()));
  }
}

// Exactly `n` bytes of the handshake from `fd` (`what` names them in errors).
std::string recvExact(int fd, size_t n, const char* what, Deadline connectBy, const std::string& where,
                      Clock::time_point start) {
  std::string b;
  while (b.size() < n) {
    if (!waitFd(fd, POLLIN, connectBy))
      DISTILL_THROW(TimeoutError, awaiting("rendezvous store at " + where), "the rendezvous store at ", where,
                    " did not send its ", what, " within ", toMs(Clock::now() - start),
                    " ms (is another program listening on run.master_port?)");
    char buf[256];
    const ssize_t got = ::recv(fd, buf, std::min(sizeof buf, n - b.size()), 0);
    if (got > 0)
      b.append(buf, size_t(got));
    else if (got < 0 && errno == EINTR)
      continue;
    else
      DISTILL_THROW(PeerLostError, awaiting("rendezvous store at " + where), "the rendezvous store at ", where,
                    " closed the connection before its ", what, got == 0 ? std::string() : ": " + errnoString(errno));
  }
  return b;
}

// Handshake: read the greeting, prove the secret, check the server's proof.
void handshake(int fd, const std::string& secret, int rank, Deadline connectBy, const std::string& where,
               Clock::time_point start) {
  const std::string greeting = recvExact(fd, kMagic + kNonce, "greeting", connectBy, where, start);
  DISTILL_CHECK_T(ConfigError, greeting.compare(0, kMagic, kGreeting) == 0, "the process listening at ", where,
                  " is not a distill rendezvous store (another program on run.master_port?)");
  Nonce serverNonce{}, ours{};
  std::memcpy(serverNonce.data(), greeting.data() + kMagic, kNonce);
  randomBytes(ours.data(), ours.size());
  Writer hello;
  hello.b.append(kHello, kMagic);
  hello.u32(uint32_t(rank));
  hello.b.append(reinterpret_cast<const char*>(ours.data()), ours.size());
  const Mac mine = proof(secret, "distill-store-hello", serverNonce, ours, rank);
  hello.b.append(reinterpret_cast<const char*>(mine.data()), mine.size());
  if (::send(fd, hello.b.data(), hello.b.size(), MSG_NOSIGNAL) != ssize_t(hello.b.size()))
    DISTILL_THROW(PeerLostError, awaiting("rendezvous store at " + where), "the rendezvous store at ", where,
                  " went away during the handshake: ", errnoString(errno));
  const std::string answer = recvExact(fd, kMagic, "answer", connectBy, where, start);
  if (answer == std::string(kRefused, kMagic))
    DISTILL_THROW(ConfigError, "the rendezvous store at ", where,
                  " refused this process: it does not hold the job's secret (", kJobSecretEnv,
                  " differs: a process of another job, or a multi-node job whose nodes were given different "
                  "secrets)");
  DISTILL_CHECK_T(ConfigError, answer == std::string(kWelcome, kMagic), "the process listening at ", where,
                  " is not a distill rendezvous store (another program on run.master_port?)");
  const std::string theirs = recvExact(fd, kMac, "proof", connectBy, where, start);
  DISTILL_CHECK_T(ConfigError,
                  sameMac(proof(secret, "distill-store-welcome", ours, serverNonce, rank),
                          reinterpret_cast<const uint8_t*>(theirs.data())),
                  "the process listening at ", where,
                  " could not prove the job's secret: it is not this job's rendezvous store (another job's, or a "
                  "process squatting on run.master_port)");
}

} // namespace

JobStore::JobStore(std::string host, int port, std::string secret, int rank, std::string server, Deadline connectBy)
    : host_(std::move(host)),
      port_(port),
      secret_(std::move(secret)),
      rank_(rank),
      server_(std::move(server)),
      conn_(std::make_unique<Conn>()) {
  const auto start = Clock::now();
  conn_->fd = connectTo(host_, port_, connectBy, describe(), start);
  const int one = 1;
  ::setsockopt(conn_->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  handshake(conn_->fd, secret_, rank_, connectBy, describe(), start);
}

JobStore::~JobStore() {
  // A goodbye tells the server this rank left on purpose. While an exception
  // unwinds the rank failed: leaving without one makes it "lost", which is
  // what its peers should hear.
  if (!conn_ || conn_->fd < 0 || conn_->broken || std::uncaught_exceptions() > 0) return;
  const std::string bye = frame(kBye, 0, "");
  (void)!::send(conn_->fd, bye.data(), bye.size(), MSG_NOSIGNAL);
}

std::string JobStore::describe() const { return host_ + ":" + std::to_string(port_) + " (served by " + server_ + ")"; }

c10::intrusive_ptr<c10d::Store> JobStore::clone() { return cloneAs(rank_); }

c10::intrusive_ptr<JobStore> JobStore::cloneAs(int rank) {
  auto s = c10::make_intrusive<JobStore>(host_, port_, secret_, rank, server_, Deadline::after(timeout_));
  s->setTimeout(timeout_);
  return s;
}

std::vector<uint8_t> JobStore::call(uint8_t op, const std::string& payload, Deadline deadline, const std::string& what,
                                    uint8_t* status, bool* timedOut) {
  std::lock_guard<std::mutex> lock(conn_->mutex);
  auto lostIt = [&](const std::string& why) {
    conn_->broken = true;
    conn_->brokenWhy = why;
    DISTILL_THROW(PeerLostError, awaiting("rendezvous store at " + describe()), "lost the rendezvous store at ",
                  describe(), " during ", what, ": ", why);
  };
  if (conn_->broken)
    DISTILL_THROW(PeerLostError, awaiting("rendezvous store at " + describe()), "lost the rendezvous store at ",
                  describe(), " earlier: ", conn_->brokenWhy);
  const uint64_t id = conn_->nextId++;
  const std::string out = frame(op, id, payload);
  for (size_t sent = 0; sent < out.size();) {
    const ssize_t n = ::send(conn_->fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += size_t(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      lostIt(errnoString(errno) + " (its process is gone?)");
    }
  }
  const auto start = Clock::now();
  std::string in;
  for (;;) {
    // A whole frame in `in`? (Answers to earlier requests that timed out are dropped.)
    while (in.size() >= 4) {
      Reader len{in.data(), 4};
      const uint32_t n = len.u32();
      if (n < 9 || n > kMaxFrame) lostIt("a malformed answer of " + std::to_string(n) + " bytes");
      if (in.size() < 4 + size_t(n)) break;
      Reader r{in.data() + 4, n};
      const uint8_t st = r.u8();
      const uint64_t rid = r.u64();
      std::string body(r.p, r.n);
      in.erase(0, 4 + size_t(n));
      if (rid != id) continue;
      if (st == kBad) DISTILL_THROW(IpcError, "rendezvous store at ", describe(), ": ", what, ": ", body);
      if (status) *status = st;
      return toBytes(body);
    }
    if (!waitFd(conn_->fd, POLLIN, deadline)) {
      if (timedOut) { // an answer the caller expects may not come: not a failure
        *timedOut = true;
        return {};
      }
      DISTILL_THROW(TimeoutError, awaiting("rendezvous store at " + describe()), "rendezvous store at ", describe(),
                    ": ", what, " timed out after ", toMs(Clock::now() - start), " ms");
    }
    char buf[65536];
    const ssize_t n = ::recv(conn_->fd, buf, sizeof buf, 0);
    if (n > 0) {
      in.append(buf, size_t(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      lostIt(n == 0 ? std::string("the connection was closed (its process is gone?)") : errnoString(errno));
    }
  }
}

namespace {
Deadline after(const std::chrono::milliseconds& t) {
  return t == c10d::Store::kNoTimeout ? Deadline::never() : Deadline::after(t);
}
std::string keyList(const std::vector<std::string>& keys) {
  std::string s;
  for (auto& k : keys) s += (s.empty() ? "'" : ", '") + k + "'";
  return s;
}
} // namespace

void JobStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  Writer w;
  w.str(key);
  w.bytes(value);
  call(kSet, w.b, after(timeout_), "set '" + key + "'");
}

std::vector<uint8_t> JobStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  Writer w;
  w.str(key);
  w.bytes(expected);
  w.bytes(desired);
  auto body = call(kCompareSet, w.b, after(timeout_), "compare-set '" + key + "'");
  Reader r{reinterpret_cast<const char*>(body.data()), body.size()};
  return toBytes(r.str());
}

std::vector<uint8_t> JobStore::get(const std::string& key) {
  Writer w;
  w.str(key);
  auto body = call(kGet, w.b, after(timeout_), "get '" + key + "' (waiting for it to be set)");
  Reader r{reinterpret_cast<const char*>(body.data()), body.size()};
  return toBytes(r.str());
}

int64_t JobStore::add(const std::string& key, int64_t value) {
  Writer w;
  w.str(key);
  w.u64(uint64_t(value));
  auto body = call(kAdd, w.b, after(timeout_), "add to '" + key + "'");
  Reader r{reinterpret_cast<const char*>(body.data()), body.size()};
  return int64_t(r.u64());
}

bool JobStore::deleteKey(const std::string& key) {
  Writer w;
  w.str(key);
  auto body = call(kDelete, w.b, after(timeout_), "delete '" + key + "'");
  return !body.empty() && body[0] != 0;
}

bool JobStore::check(const std::vector<std::string>& keys) {
  Writer w;
  w.u32(uint32_t(keys.size()));
  for (auto& k : keys) w.str(k);
  auto body = call(kCheck, w.b, after(timeout_), "check " + keyList(keys));
  return !body.empty() && body[0] != 0;
}

int64_t JobStore::getNumKeys() {
  auto body = call(kNumKeys, "", after(timeout_), "count keys");
  Reader r{reinterpret_cast<const char*>(body.data()), body.size()};
  return int64_t(r.u64());
}

void JobStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void JobStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  Writer w;
  w.u32(uint32_t(keys.size()));
  for (auto& k : keys) w.str(k);
  call(kWait, w.b, after(timeout), "wait for " + keyList(keys));
}

bool JobStore::tryWait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  Writer w;
  w.u32(uint32_t(keys.size()));
  for (auto& k : keys) w.str(k);
  bool timedOut = false;
  call(kWait, w.b, after(timeout), "wait for " + keyList(keys), nullptr, &timedOut);
  return !timedOut;
}

std::vector<int> JobStore::lostRanks(Millis grace) {
  std::vector<int> out;
  const std::string first = std::string(kLostKeyPrefix) + "1";
  if (grace > Millis(0) && !tryWait({first}, grace)) return out; // nobody was lost
  for (int n = 1;; ++n) {
    const std::string key = std::string(kLostKeyPrefix) + std::to_string(n);
    if (!check({key})) break;
    out.push_back(std::stoi(toStr(get(key))));
  }
  return out;
}

} // namespace distill
