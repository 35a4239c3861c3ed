#pragma once

// Incremental SHA-256 (OpenSSL's EVP, libcrypto, as the rendezvous HMAC uses):
// the one digest of distill's identities: the teacher-output cache's keys and
// model digest (teacher/src/cache/keys.cpp), the published head's fingerprint
// (ipc/shared_head.h) and the teacher fingerprint in every answer
// (teacher/model.h). Not thread-safe: one Sha256 per thread.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace distill {

class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void add(const void* p, size_t n);
  // A length first, so that ("ab","c") and ("a","bc") differ.
  void addString(const std::string& s);
  void addInt(int64_t v) { add(&v, sizeof v); }
  // The digest; the object is spent afterwards (add or finish again is an InternalError).
  Digest finish();

 private:
  void* ctx_; // EVP_MD_CTX*: libcrypto's header stays out of ours
  bool done_ = false;
};

// Lowercase hex of `n` bytes.
std::string hexBytes(const uint8_t* p, size_t n);

} // namespace distill
