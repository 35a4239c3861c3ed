#include "job_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/core/rendezvous.h"

namespace distill {
namespace {

// ---- Protocol ------------------------------------------------------------------------------------

constexpr size_t kMagic = 8, kNonce = 32, kMac = 32;
constexpr char kGreeting[kMagic + 1] = "DSTORE01";  // server -> client, then its nonce
constexpr char kHello[kMagic + 1] = "DSTHELLO";     // client -> server: rank (i32 LE), its nonce, its MAC
constexpr char kWelcome[kMagic + 1] = "DSTWELCM";   // server -> client: the server's MAC
constexpr char kRefused[kMagic + 1] = "DSTNOPE!";   // server -> client, then the server closes
constexpr size_t kHelloBytes = kMagic + 4 + kNonce + kMac;
constexpr uint32_t kMaxFrame = 256u << 20;  // gloo's and NCCL's values are small; bounds a broken peer
constexpr auto kHandshakeTime = std::chrono::seconds(10);
constexpr int kRefusalsLogged = 5;

enum Op : uint8_t { kSet = 1, kGet, kAdd, kCheck, kWait, kDelete, kNumKeys, kCompareSet, kBye };
enum Status : uint8_t { kOk = 0, kMissing = 1, kBad = 2 };

using Nonce = std::array<uint8_t, kNonce>;
using Mac = std::array<uint8_t, kMac>;

void randomBytes(uint8_t* p, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    DISTILL_CHECK_T(IpcError, r > 0, "getrandom: ", errnoString(errno));
    got += size_t(r);
  }
}

// HMAC-SHA256(secret, label | a | b | rank): binds the proof to both nonces
// (no replay), to the direction (the label) and to the rank.
Mac proof(const std::string& secret, const char* label, const Nonce& a, const Nonce& b, int32_t rank) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(a.data()), a.size());
  msg.append(reinterpret_cast<const char*>(b.data()), b.size());
  const uint32_t r = uint32_t(rank);
  for (int i = 0; i < 4; ++i) msg += char((r >> (8 * i)) & 0xff);
  Mac out{};
  unsigned len = 0;
  ::HMAC(EVP_sha256(), secret.data(), int(secret.size()), reinterpret_cast<const unsigned char*>(msg.data()),
         msg.size(), out.data(), &len);
  return out;
}

bool sameMac(const Mac& a, const uint8_t* b) { return CRYPTO_memcmp(a.data(), b, kMac) == 0; }

struct Writer {
  std::string b;
  void u8(uint8_t v) { b += char(v); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) b += char((v >> (8 * i)) & 0xff);
  }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) b += char((v >> (8 * i)) & 0xff);
  }
  void str(const std::string& s) {
    u32(uint32_t(s.size()));
    b += s;
  }
  void bytes(const std::vector<uint8_t>& v) {
    u32(uint32_t(v.size()));
    b.append(reinterpret_cast<const char*>(v.data()), v.size());
  }
};

struct Reader {
  const char* p;
  size_t n;
  bool ok = true;
  bool take(size_t k) {
    if (!ok || n < k) return ok = false;
    return true;
  }
  uint8_t u8() {
    if (!take(1)) return 0;
    uint8_t v = uint8_t(*p);
    ++p, --n;
    return v;
  }
  uint64_t uN(int bytes) {
    if (!take(size_t(bytes))) return 0;
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(p[i])) << (8 * i);
    p += bytes, n -= size_t(bytes);
    return v;
  }
  uint32_t u32() { return uint32_t(uN(4)); }
  uint64_t u64() { return uN(8); }
  std::string str() {
    const uint32_t len = u32();
    if (!take(len)) return {};
    std::string s(p, len);
    p += len, n -= len;
    return s;
  }
};

std::string frame(uint8_t opOrStatus, uint64_t id, const std::string& payload) {
  Writer w;
  w.u32(uint32_t(1 + 8 + payload.size()));
  w.u8(opOrStatus);
  w.u64(id);
  w.b += payload;
  return w.b;
}

std::string toStr(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> toBytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string peerAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return std::string(host) + ":" + port;
}

}  // namespace

// ---- Server ------------------------------------------------------------------------------------

struct JobStoreServer::Impl {
  struct Connection {
    int fd = -1;
    std::string peer;
    std::string in, out;
    Nonce nonce{};
    bool authed = false;
    bool bye = false;
    bool closing = false;  // close once `out` is flushed (a refusal)
    int rank = -1;
    Clock::time_point handshakeBy;
  };
  struct Waiter {
    int conn;  // connection id
    uint64_t id;
    std::vector<std::string> keys;
    bool get;  // answer with the value of keys[0]
  };

  int listenFd = -1;
  int wakeFd = -1;
  std::string secret, where;
  std::thread thread;
  std::atomic<int> refused{0};
  // Owned by the thread:
  std::map<int, Connection> conns;  // by id
  int nextConn = 0;
  std::map<std::string, std::string> data;
  std::vector<Waiter> waiters;
  std::set<int> lost;
  int lostCount = 0;
  std::map<std::string, int> refusedFor;  // refusals by reason, for the log

  void run() {
    for (;;) {
      std::vector<pollfd> fds{{wakeFd, POLLIN, 0}, {listenFd, POLLIN, 0}};
      std::vector<int> ids;
      auto now = Clock::now();
      auto next = now + std::chrono::seconds(1);
      for (auto& [id, c] : conns) {
        fds.push_back({c.fd, short(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        ids.push_back(id);
        if (!c.authed) next = std::min(next, c.handshakeBy);
      }
      const int timeoutMs = int(std::max<int64_t>(0, toMs(next - now) + 1));
      if (::poll(fds.data(), fds.size(), timeoutMs) < 0 && errno != EINTR) {
        DISTILL_LOG(kError) << "rendezvous store " << where << ": poll: " << errnoString(errno) << "; stopping";
        return;
      }
      if (fds[0].revents) return;  // destructor
      if (fds[1].revents & POLLIN) acceptAll();
      for (size_t i = 2; i < fds.size(); ++i) {
        const int id = ids[i - 2];
        if (!conns.count(id)) continue;
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) readFrom(id);
        if (conns.count(id) && (fds[i].revents & POLLOUT)) flush(id);
      }
      now = Clock::now();
      std::vector<int> expired;
      for (auto& [id, c] : conns)
        if (!c.authed && now >= c.handshakeBy) expired.push_back(id);
      for (int id : expired) {
        if (conns.at(id).closing) closeConn(id);  // refused, and not reading our refusal
        else refuse(id, "it did not complete the handshake within 10 s");
      }
    }
  }

  void acceptAll() {
    for (;;) {
      const int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: all taken; anything else: the next poll tells
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Connection c;
      c.fd = fd;
      c.peer = peerAddress(fd);
      c.handshakeBy = Clock::now() + kHandshakeTime;
      randomBytes(c.nonce.data(), c.nonce.size());
      c.out.append(kGreeting, kMagic);
      c.out.append(reinterpret_cast<const char*>(c.nonce.data()), c.nonce.size());
      const int id = nextConn++;
      conns.emplace(id, std::move(c));
      flush(id);
    }
  }

  void closeConn(int id) {
    auto it = conns.find(id);
    if (it == conns.end()) return;
    Connection& c = it->second;
    ::close(c.fd);
    const bool wasLost = c.authed && c.rank >= 0 && !c.bye;
    const int rank = c.rank;
    conns.erase(it);
    waiters.erase(std::remove_if(waiters.begin(), waiters.end(), [&](const Waiter& w) { return w.conn == id; }),
                  waiters.end());
    if (wasLost && lost.insert(rank).second) {
      data[std::string(kLostKeyPrefix) + std::to_string(++lostCount)] = std::to_string(rank);
      DISTILL_LOG(kWarning) << "rendezvous store " << where << ": lost student rank " << rank
                            << " (its connection closed without a goodbye)";
      wake();
    }
  }

  void refuse(int id, const std::string& why) {
    Connection& c = conns.at(id);
    refused.fetch_add(1);
    if (++refusedFor[why] <= kRefusalsLogged) {  // a client that retries, or a scanner, is not a flood
      DISTILL_LOG(kWarning) << "rendezvous store " << where << ": refused a connection from " << c.peer << ": " << why
                            << (refusedFor[why] == kRefusalsLogged ? " (more like this are not logged)" : "");
    }
    c.out.append(kRefused, kMagic);
    c.closing = true;
    c.in.clear();
    flush(id);
  }

  void flush(int id) {
    Connection& c = conns.at(id);
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      closeConn(id);  // the peer went away
      return;
    }
    if (c.closing) closeConn(id);
  }

  void readFrom(int id) {
    char buf[65536];
    for (;;) {
      Connection& c = conns.at(id);
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n > 0) {
        if (!c.closing) c.in.append(buf, size_t(n));
        if (!process(id)) return;  // closed
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      closeConn(id);  // EOF or error
      return;
    }
  }

  // Handles what `in` holds; false if the connection was closed.
  bool process(int id) {
    Connection* c = &conns.at(id);
    if (!c->authed) {
      // Refuse at the first byte that is not our protocol (a TCPStore client,
      // a scanner), without waiting for the rest.
      const size_t k = std::min(c->in.size(), kMagic);
      if (c->in.compare(0, k, kHello, k) != 0) {
        refuse(id, "it does not speak the distill store protocol (a c10d TCPStore client, or a stranger)");
        return conns.count(id) > 0;
      }
      if (c->in.size() < kHelloBytes) return true;
      Reader r{c->in.data() + kMagic, kHelloBytes - kMagic};
      const int32_t rank = int32_t(r.u32());
      Nonce theirs{};
      std::memcpy(theirs.data(), r.p, kNonce);
      const auto* mac = reinterpret_cast<const uint8_t*>(r.p + kNonce);
      if (!sameMac(proof(secret, "distill-store-hello", c->nonce, theirs, rank), mac)) {
        refuse(id, "it did not prove the job secret (not a process of this job)");
        return conns.count(id) > 0;
      }
      c->authed = true;
      c->rank = rank;
      c->in.erase(0, kHelloBytes);
      const Mac ours = proof(secret, "distill-store-welcome", theirs, c->nonce, rank);
      c->out.append(kWelcome, kMagic);
      c->out.append(reinterpret_cast<const char*>(ours.data()), ours.size());
      flush(id);
      if (!conns.count(id)) return false;
      c = &conns.at(id);
    }
    while (c->in.size() >= 4) {
      Reader len{c->in.data(), 4};
      const uint32_t n = len.u32();
      if (n < 9 || n > kMaxFrame) {
        DISTILL_LOG(kWarning) << "rendezvous store " << where << ": student rank " << c->rank
                              << " sent a frame of " << n << " bytes; closing its connection";
        closeConn(id);
        return false;
      }
      if (c->in.size() < 4 + size_t(n)) break;
      const std::string body = c->in.substr(4, n);
      c->in.erase(0, 4 + size_t(n));
      if (!handle(id, body)) return false;
      if (!conns.count(id)) return false;
      c = &conns.at(id);
    }
    return true;
  }

  void reply(int id, uint64_t req, uint8_t status, const std::string& payload) {
    conns.at(id).out += frame(status, req, payload);
  }

  bool has(const std::vector<std::string>& keys) const {
    for (auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }

  // After a key appeared: answers the waits it completes.
  void wake() {
    std::set<int> touched;
    for (auto it = waiters.begin(); it != waiters.end();) {
      if (!has(it->keys)) {
        ++it;
        continue;
      }
      Writer w;
      if (it->get) w.str(data[it->keys[0]]);
      reply(it->conn, it->id, kOk, w.b);
      touched.insert(it->conn);
      it = waiters.erase(it);
    }
    for (int id : touched)
      if (conns.count(id)) flush(id);
  }

  // One request; false if the connection was closed.
  bool handle(int id, const std::string& body) {
    Reader r{body.data(), body.size()};
    const uint8_t op = r.u8();
    const uint64_t req = r.u64();
    Writer w;
    bool changed = false;
    auto keysFrom = [&] {
      const uint32_t n = r.u32();
      std::vector<std::string> keys;
      if (n > r.n / 4) {  // each key takes at least its 4-byte length: a count that cannot be
        r.ok = false;
        return keys;
      }
      keys.resize(n);
      for (auto& k : keys) k = r.str();
      return keys;
    };
    switch (op) {
      case kSet: {
        std::string key = r.str(), value = r.str();
        if (!r.ok) break;
        data[key] = std::move(value);
        changed = true;
        reply(id, req, kOk, "");
        break;
      }
      case kGet:
      case kWait: {
        auto keys = op == kGet ? std::vector<std::string>{r.str()} : keysFrom();
        if (!r.ok) break;
        if (has(keys)) {
          if (op == kGet) w.str(data[keys[0]]);
          reply(id, req, kOk, w.b);
        } else {
          waiters.push_back({id, req, std::move(keys), op == kGet});
        }
        break;
      }
      case kAdd: {
        std::string key = r.str();
        const int64_t delta = int64_t(r.u64());
        if (!r.ok) break;
        int64_t value = 0;
        auto it = data.find(key);
        if (it != data.end()) {
          char* end = nullptr;
          value = std::strtoll(it->second.c_str(), &end, 10);
          if (it->second.empty() || *end != '\0') {
            reply(id, req, kBad, "key '" + key + "' does not hold an integer");
            break;
          }
        }
        value += delta;
        data[key] = std::to_string(value);
        changed = true;
        w.u64(uint64_t(value));
        reply(id, req, kOk, w.b);
        break;
      }
      case kCheck: {
        auto keys = keysFrom();
        if (!r.ok) break;
        w.u8(has(keys) ? 1 : 0);
        reply(id, req, kOk, w.b);
        break;
      }
      case kDelete: {
        std::string key = r.str();
        if (!r.ok) break;
        w.u8(data.erase(key) ? 1 : 0);
        reply(id, req, kOk, w.b);
        break;
      }
      case kNumKeys:
        w.u64(uint64_t(data.size()));
        reply(id, req, kOk, w.b);
        break;
      case kCompareSet: {
        // c10d::TCPStore's semantics: set `desired` if the key holds
        // `expected` (or is missing and `expected` is empty); answer the value now held.
        std::string key = r.str(), expected = r.str(), desired = r.str();
        if (!r.ok) break;
        auto it = data.find(key);
        if ((it == data.end() && expected.empty()) || (it != data.end() && it->second == expected)) {
          data[key] = desired;
          changed = true;
          w.str(desired);
        } else {
          w.str(it == data.end() ? expected : it->second);
        }
        reply(id, req, kOk, w.b);
        break;
      }
      case kBye:
        conns.at(id).bye = true;
        closeConn(id);
        return false;
      default:
        r.ok = false;
    }
    if (!r.ok) {
      DISTILL_LOG(kWarning) << "rendezvous store " << where << ": malformed request (op " << int(op)
                            << ") from student rank " << conns.at(id).rank << "; closing its connection";
      closeConn(id);
      return false;
    }
    if (changed) wake();
    if (conns.count(id)) flush(id);
    return conns.count(id) > 0;
  }
};

JobStoreServer::JobStoreServer(int listenFd, std::string secret, std::string where) : impl_(std::make_unique<Impl>()) {
  impl_->listenFd = listenFd;
  impl_->secret = std::move(secret);
  impl_->where = std::move(where);
  ::fcntl(listenFd, F_SETFL, ::fcntl(listenFd, F_GETFL) | O_NONBLOCK);
  ::fcntl(listenFd, F_SETFD, FD_CLOEXEC);
  impl_->wakeFd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  DISTILL_CHECK_T(IpcError, impl_->wakeFd >= 0, "rendezvous store: eventfd: ", errnoString(errno));
  impl_->thread = std::thread([this] {
    try {
      impl_->run();
    } catch (const std::exception& e) {  // the store stops; its clients see it gone and say so
      DISTILL_LOG(kError) << "rendezvous store " << impl_->where << " stopped: " << e.what();
    }
  });
}

JobStoreServer::~JobStoreServer() {
  const uint64_t one = 1;
  (void)!::write(impl_->wakeFd, &one, sizeof one);
  if (impl_->thread.joinable()) impl_->thread.join();
  for (auto& [id, c] : impl_->conns) ::close(c.fd);
  ::close(impl_->wakeFd);
  ::close(impl_->listenFd);
}

int JobStoreServer::refused() const { return impl_->refused.load(); }

// ---- Client ------------------------------------------------------------------------------------

struct JobStore::Conn {
  int fd = -1;
  std::mutex mutex;
  uint64_t nextId = 1;
  bool broken = false;  // lost: every later call fails at once
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
    const int n = ::poll(&p, 1, deadline.when() == Clock::time_point::max() ? -1 : int(std::min<int64_t>(left, 1 << 30)));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return true;  // let the read or write report it
  }
}

}  // namespace

JobStore::JobStore(std::string host, int port, std::string secret, int rank, std::string server, Deadline connectBy)
    : host_(std::move(host)),
      port_(port),
      secret_(std::move(secret)),
      rank_(rank),
      server_(std::move(server)),
      conn_(std::make_unique<Conn>()) {
  const auto start = Clock::now();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  std::string lastError = "nobody listens there yet";
  // Nothing tells a client when the store begins to listen: try to connect,
  // backing off from 10 to 500 ms, until the deadline (as TCPStore does).
  for (auto pause = Millis(10);; pause = std::min(pause * 2, Millis(500))) {
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &found);
    if (rc != 0) {
      lastError = std::string("cannot resolve it: ") + ::gai_strerror(rc);
    } else {
      for (addrinfo* a = found; a && conn_->fd < 0; a = a->ai_next) {
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
          conn_->fd = fd;
        } else {
          lastError = errnoString(err);
          ::close(fd);
        }
      }
      ::freeaddrinfo(found);
    }
    if (conn_->fd >= 0) break;
    if (connectBy.expired())
      DISTILL_THROW(TimeoutError, awaiting("rendezvous store at " + describe()), "cannot reach the rendezvous store at ",
                    describe(), " within ", toMs(Clock::now() - start), " ms: ", lastError);
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, connectBy.remaining()));
  }
  const int one = 1;
  ::setsockopt(conn_->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  // Handshake: read the greeting, prove the secret, check the server's proof.
  auto recvExact = [&](size_t n, const char* what) {
    std::string b;
    while (b.size() < n) {
      if (!waitFd(conn_->fd, POLLIN, connectBy))
        DISTILL_THROW(TimeoutError, awaiting("rendezvous store at " + describe()), "the rendezvous store at ",
                      describe(), " did not send its ", what, " within ", toMs(Clock::now() - start),
                      " ms (is another program listening on run.master_port?)");
      char buf[256];
      const ssize_t got = ::recv(conn_->fd, buf, std::min(sizeof buf, n - b.size()), 0);
      if (got > 0) b.append(buf, size_t(got));
      else if (got < 0 && errno == EINTR) continue;
      else
        DISTILL_THROW(PeerLostError, awaiting("rendezvous store at " + describe()), "the rendezvous store at ",
                      describe(), " closed the connection before its ", what,
                      got == 0 ? std::string() : ": " + errnoString(errno));
    }
    return b;
  };
  const std::string greeting = recvExact(kMagic + kNonce, "greeting");
  DISTILL_CHECK_T(ConfigError, greeting.compare(0, kMagic, kGreeting) == 0, "the process listening at ", describe(),
                  " is not a distill rendezvous store (another program on run.master_port?)");
  Nonce serverNonce{}, ours{};
  std::memcpy(serverNonce.data(), greeting.data() + kMagic, kNonce);
  randomBytes(ours.data(), ours.size());
  Writer hello;
  hello.b.append(kHello, kMagic);
  hello.u32(uint32_t(rank_));
  hello.b.append(reinterpret_cast<const char*>(ours.data()), ours.size());
  const Mac mine = proof(secret_, "distill-store-hello", serverNonce, ours, rank_);
  hello.b.append(reinterpret_cast<const char*>(mine.data()), mine.size());
  if (::send(conn_->fd, hello.b.data(), hello.b.size(), MSG_NOSIGNAL) != ssize_t(hello.b.size()))
    DISTILL_THROW(PeerLostError, awaiting("rendezvous store at " + describe()), "the rendezvous store at ", describe(),
                  " went away during the handshake: ", errnoString(errno));
  const std::string answer = recvExact(kMagic, "answer");
  if (answer == std::string(kRefused, kMagic))
    DISTILL_THROW(ConfigError, "the rendezvous store at ", describe(),
                  " refused this process: it does not hold the job's secret (", kJobSecretEnv,
                  " differs: a process of another job, or a multi-node job whose nodes were given different "
                  "secrets)");
  DISTILL_CHECK_T(ConfigError, answer == std::string(kWelcome, kMagic), "the process listening at ", describe(),
                  " is not a distill rendezvous store (another program on run.master_port?)");
  const std::string theirs = recvExact(kMac, "proof");
  DISTILL_CHECK_T(ConfigError,
                  sameMac(proof(secret_, "distill-store-welcome", ours, serverNonce, rank_),
                          reinterpret_cast<const uint8_t*>(theirs.data())),
                  "the process listening at ", describe(),
                  " could not prove the job's secret: it is not this job's rendezvous store (another job's, or a "
                  "process squatting on run.master_port)");
}

JobStore::~JobStore() {
  // A goodbye tells the server this rank left on purpose. While an exception
  // unwinds the rank failed: leaving without one makes it "lost", which is
  // what its peers should hear.
  if (!conn_ || conn_->fd < 0 || conn_->broken || std::uncaught_exceptions() > 0) return;
  const std::string bye = frame(kBye, 0, "");
  (void)!::send(conn_->fd, bye.data(), bye.size(), MSG_NOSIGNAL);
}

std::string JobStore::describe() const {
  return host_ + ":" + std::to_string(port_) + " (served by " + server_ + ")";
}

c10::intrusive_ptr<c10d::Store> JobStore::clone() {
  auto s = c10::make_intrusive<JobStore>(host_, port_, secret_, rank_, server_, Deadline::after(timeout_));
  s->setTimeout(timeout_);
  return s;
}

std::vector<uint8_t> JobStore::call(uint8_t op, const std::string& payload, Deadline deadline, const std::string& what,
                                    uint8_t* status) {
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
    if (!waitFd(conn_->fd, POLLIN, deadline))
      DISTILL_THROW(TimeoutError, awaiting("rendezvous store at " + describe()), "rendezvous store at ", describe(),
                    ": ", what, " timed out after ", toMs(Clock::now() - start), " ms");
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
}  // namespace

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

std::vector<int> JobStore::lostRanks(Millis grace) {
  std::vector<int> out;
  const std::string first = std::string(kLostKeyPrefix) + "1";
  if (grace > Millis(0)) {
    try {
      wait({first}, grace);
    } catch (const TimeoutError&) {
      return out;  // nobody was lost
    }
  }
  for (int n = 1;; ++n) {
    const std::string key = std::string(kLostKeyPrefix) + std::to_string(n);
    if (!check({key})) break;
    out.push_back(std::stoi(toStr(get(key))));
  }
  return out;
}

}  // namespace distill
