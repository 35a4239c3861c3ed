// Incremental SHA-256 over libcrypto's EVP (sha256.h).
#include "distill/core/sha256.h"

#include <openssl/evp.h>

#include "distill/core/errors.h"

namespace distill {

namespace {
EVP_MD_CTX* ctx(void* p) { return static_cast<EVP_MD_CTX*>(p); }
} // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  DISTILL_CHECK_T(InternalError, ctx_ && EVP_DigestInit_ex(ctx(ctx_), EVP_sha256(), nullptr) == 1,
                  "SHA-256 init failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx(ctx_)); }

void Sha256::add(const void* p, size_t n) {
  DISTILL_INTERNAL_ASSERT(!done_, "Sha256::add after finish");
  DISTILL_CHECK_T(InternalError, EVP_DigestUpdate(ctx(ctx_), p, n) == 1, "SHA-256 update failed");
}

void Sha256::addString(const std::string& s) {
  addInt(static_cast<int64_t>(s.size()));
  add(s.data(), s.size());
}

Sha256::Digest Sha256::finish() {
  DISTILL_INTERNAL_ASSERT(!done_, "Sha256::finish twice");
  done_ = true;
  Digest out{};
  unsigned int n = 0;
  DISTILL_CHECK_T(InternalError, EVP_DigestFinal_ex(ctx(ctx_), out.data(), &n) == 1 && n == out.size(),
                  "SHA-256 final failed");
  return out;
}

std::string hexBytes(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[p[i] >> 4];
    s[2 * i + 1] = digits[p[i] & 15];
  }
  return s;
}

} // namespace distill
