// The rendezvous store's server: one thread, a poll loop (job_store.h).
#include "job_store_server.h"

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

#include "distill/core/clock.h"
#include "distill/core/errors.h"
#include "distill/core/logging.h"
#include "distill/group/rendezvous.h"
#include "job_store_wire.h"

namespace distill {

using namespace job_store_wire;

namespace {

// A list of keys: u32 count, then each key.
std::vector<std::string> readKeys(Reader& r) {
  const uint32_t n = r.u32();
  std::vector<std::string> keys;
  if (n > r.n / 4) { // each key takes at least its 4-byte length: a count that cannot be
    r.ok = false;
    return keys;
  }
  keys.resize(n);
  for (auto& k : keys) k = r.str();
  return keys;
}

} // namespace

struct JobStoreServer::Impl {
  struct Connection {
    int fd = -1;
    std::string peer;
    std::string in, out;
    Nonce nonce{};
    bool authed = false;
    bool bye = false;
    bool closing = false; // close once `out` is flushed (a refusal)
    int rank = -1;
    Clock::time_point handshakeBy;
  };
  struct Waiter {
    int conn; // connection id
    uint64_t id;
    std::vector<std::string> keys;
    bool get; // answer with the value of keys[0]
  };

  int listenFd = -1;
  int wakeFd = -1;
  std::string secret, where;
  std::thread thread;
  std::atomic<int> refused{0};
  // Owned by the thread:
  std::map<int, Connection> conns; // by id
  int nextConn = 0;
  std::map<std::string, std::string> data;
  std::vector<Waiter> waiters;
  std::set<int> lost;
  int lostCount = 0;
  std::map<std::string, int> refusedFor; // refusals by reason, for the log

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
      if (fds[0].revents) return; // destructor
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
        if (conns.at(id).closing)
          closeConn(id); // refused, and not reading our refusal
        else
          refuse(id, "it did not complete the handshake within 10 s");
      }
    }
  }

  void acceptAll() {
    for (;;) {
      const int fd = ::accept4(listenFd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return; // EAGAIN: all taken; anything else: the next poll tells
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
    if (++refusedFor[why] <= kRefusalsLogged) { // a client that retries, or a scanner, is not a flood
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
      closeConn(id); // the peer went away
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
        if (!process(id)) return; // closed
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      closeConn(id); // EOF or error
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
        DISTILL_LOG(kWarning) << "rendezvous store " << where << ": student rank " << c->rank << " sent a frame of "
                              << n << " bytes; closing its connection";
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

  // kAdd: adds to the integer a key holds (0 when missing); true if it changed the data.
  bool add(int id, uint64_t req, Reader& r) {
    std::string key = r.str();
    const int64_t delta = int64_t(r.u64());
    if (!r.ok) return false;
    int64_t value = 0;
    auto it = data.find(key);
    if (it != data.end()) {
      char* end = nullptr;
      value = std::strtoll(it->second.c_str(), &end, 10);
      if (it->second.empty() || *end != '\0') {
        reply(id, req, kBad, "key '" + key + "' does not hold an integer");
        return false;
      }
    }
    value += delta;
    data[key] = std::to_string(value);
    Writer w;
    w.u64(uint64_t(value));
    reply(id, req, kOk, w.b);
    return true;
  }

  // kCompareSet, c10d::TCPStore's semantics: set `desired` if the key holds
  // `expected` (or is missing and `expected` is empty); answer the value now held.
  bool compareSet(int id, uint64_t req, Reader& r) {
    std::string key = r.str(), expected = r.str(), desired = r.str();
    if (!r.ok) return false;
    auto it = data.find(key);
    Writer w;
    bool changed = false;
    if ((it == data.end() && expected.empty()) || (it != data.end() && it->second == expected)) {
      data[key] = desired;
      changed = true;
      w.str(desired);
    } else {
      w.str(it == data.end() ? expected : it->second);
    }
    reply(id, req, kOk, w.b);
    return changed;
  }

  // One request; false if the connection was closed.
  bool handle(int id, const std::string& body) {
    Reader r{body.data(), body.size()};
    const uint8_t op = r.u8();
    const uint64_t req = r.u64();
    Writer w;
    bool changed = false;
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
        auto keys = op == kGet ? std::vector<std::string>{r.str()} : readKeys(r);
        if (!r.ok) break;
        if (has(keys)) {
          if (op == kGet) w.str(data[keys[0]]);
          reply(id, req, kOk, w.b);
        } else {
          waiters.push_back({id, req, std::move(keys), op == kGet});
        }
        break;
      }
      case kAdd:
        changed = add(id, req, r);
        break;
      case kCheck: {
        auto keys = readKeys(r);
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
      case kCompareSet:
        changed = compareSet(id, req, r);
        break;
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
    } catch (const std::exception& e) { // the store stops; its clients see it gone and say so
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

} // namespace distill
