#include "distill/group/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "distill/core/errors.h"

namespace distill {
namespace {

bool isWildcard(const sockaddr* a) {
  if (a->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (a->sa_family == AF_INET6) return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  return false;
}

std::string numericHost(const sockaddr* a, socklen_t len) {
  char host[NI_MAXHOST] = {};
  if (::getnameinfo(a, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return host;
}

[[noreturn]] void wildcard(const std::string& address) {
  DISTILL_THROW(ConfigError, "run.master_addr '", address,
                "' is every interface of this host; the student group's rendezvous store binds to the address "
                "the students connect to, and to that one only: give this host's address (127.0.0.1 for a "
                "single-node job)");
}

} // namespace

StoreListener listenForStore(const std::string& address, int port) {
  if (address.empty() || address == "*" || address == "0.0.0.0" || address == "::") wildcard(address);
  DISTILL_CHECK_T(ConfigError, port >= 0 && port <= 65535, "run.master_port ", port, " is not a port (0..65535)");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found); rc != 0)
    DISTILL_THROW(ConfigError, "run.master_addr '", address, "' does not resolve: ", ::gai_strerror(rc));
  int inUse = 0, lastErr = 0;
  std::string tried;
  for (addrinfo* a = found; a; a = a->ai_next) {
    if (isWildcard(a->ai_addr)) {
      ::freeaddrinfo(found);
      wildcard(address);
    }
    tried = numericHost(a->ai_addr, a->ai_addrlen);
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      lastErr = errno;
      continue;
    }
    const int one = 1;
    // TIME_WAIT connections of a previous job on this port do not block it;
    // a listener does (EADDRINUSE below).
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 1024) != 0) {
      lastErr = errno;
      if (lastErr == EADDRINUSE) inUse = 1;
      ::close(fd);
      continue;
    }
    StoreListener l;
    l.fd = fd;
    l.address = tried;
    l.port = listeningPort(fd);
    ::freeaddrinfo(found);
    return l;
  }
  ::freeaddrinfo(found);
  if (inUse)
    DISTILL_THROW(ConfigError, "port ", port, " on ", address,
                  " is in use (run.master_port): another job's "
                  "rendezvous store or another program listens there; choose another run.master_port "
                  "(--master-port), or 0 for a free one (single-node jobs)");
  if (lastErr == EADDRNOTAVAIL)
    DISTILL_THROW(ConfigError, "run.master_addr '", address, "' (", tried,
                  ") is not an address of this host: the rendezvous store runs on the node of student rank 0 "
                  "(node 0) and binds to run.master_addr");
  DISTILL_THROW(ConfigError, "cannot listen on ", address, ":", port,
                " (run.master_addr, run.master_port): ", errnoString(lastErr));
}

int listeningPort(int fd) {
  int accepting = 0;
  socklen_t optLen = sizeof accepting;
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &optLen) != 0 || !accepting) return -1;
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return -1;
}

std::string makeJobSecret() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    DISTILL_CHECK_T(ConfigError, n > 0, "getrandom: ", errnoString(errno));
    got += size_t(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (unsigned char b : bytes) {
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

} // namespace distill
