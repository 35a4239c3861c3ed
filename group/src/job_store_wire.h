#pragma once

// The rendezvous store's wire format and handshake (job_store.h), shared by
// its server (job_store_server.cpp) and client (job_store.cpp). Internal to core.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/socket.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "distill/core/errors.h"

namespace distill::job_store_wire {

// ---- Protocol ------------------------------------------------------------------------------------

constexpr size_t kMagic = 8, kNonce = 32, kMac = 32;
constexpr char kGreeting[kMagic + 1] = "DSTORE01"; // server -> client, then its nonce
constexpr char kHello[kMagic + 1] = "DSTHELLO"; // client -> server: rank (i32 LE), its nonce, its MAC
constexpr char kWelcome[kMagic + 1] = "DSTWELCM"; // server -> client: the server's MAC
constexpr char kRefused[kMagic + 1] = "DSTNOPE!"; // server -> client, then the server closes
constexpr size_t kHelloBytes = kMagic + 4 + kNonce + kMac;
constexpr uint32_t kMaxFrame = 256u << 20; // gloo's and NCCL's values are small; bounds a broken peer
constexpr auto kHandshakeTime = std::chrono::seconds(10);
constexpr int kRefusalsLogged = 5;

enum Op : uint8_t { kSet = 1, kGet, kAdd, kCheck, kWait, kDelete, kNumKeys, kCompareSet, kBye };
enum Status : uint8_t { kOk = 0, kMissing = 1, kBad = 2 };

using Nonce = std::array<uint8_t, kNonce>;
using Mac = std::array<uint8_t, kMac>;

inline void randomBytes(uint8_t* p, size_t n) {
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
inline Mac proof(const std::string& secret, const char* label, const Nonce& a, const Nonce& b, int32_t rank) {
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

inline bool sameMac(const Mac& a, const uint8_t* b) { return CRYPTO_memcmp(a.data(), b, kMac) == 0; }

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

inline std::string frame(uint8_t opOrStatus, uint64_t id, const std::string& payload) {
  Writer w;
  w.u32(uint32_t(1 + 8 + payload.size()));
  w.u8(opOrStatus);
  w.u64(id);
  w.b += payload;
  return w.b;
}

inline std::string toStr(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
inline std::vector<uint8_t> toBytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

inline std::string peerAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[NI_MAXHOST] = {}, port[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "?";
  return std::string(host) + ":" + port;
}

} // namespace distill::job_store_wire
