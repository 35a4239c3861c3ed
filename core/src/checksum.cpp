#include "distill/core/checksum.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace distill {
namespace {

struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
  }
};

uint32_t crcSoft(uint32_t c, const uint8_t* p, size_t n) {
  static const Crc32cTable table;
  while (n--) c = table.t[(c ^ *p++) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crcHw(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
bool haveSse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

} // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  auto p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  if (haveSse42()) return ~crcHw(~crc, p, n);
#endif
  return ~crcSoft(~crc, p, n);
}

uint32_t crc32cPortable(const void* data, size_t n, uint32_t crc) {
  return ~crcSoft(~crc, static_cast<const uint8_t*>(data), n);
}

} // namespace distill
