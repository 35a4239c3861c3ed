// core/checksum.h: the one checksum (CRC32C) of checkpoints and the config hash.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "distill/core/checksum.h"
#include "distill/core/config.h"

namespace distill {
namespace {

TEST(Checksum, Crc32cKnownValues) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u); // the CRC-32C check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu); // RFC 3720 B.4
  EXPECT_EQ(crc32cPortable("123456789", 9), 0xE3069283u);
}

// The instruction path and the table agree at every length and alignment, and
// a CRC continues across pieces.
TEST(Checksum, HardwareAndPortableAgreeAndContinue) {
  std::mt19937 rng(7);
  std::vector<unsigned char> buf(4096 + 16);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(9), size_t(176), size_t(1024), size_t(4095)}) {
      const unsigned char* p = buf.data() + start;
      ASSERT_EQ(crc32c(p, n), crc32cPortable(p, n)) << start << " " << n;
      for (size_t cut : {size_t(0), n / 3, n}) {
        ASSERT_EQ(crc32c(p + cut, n - cut, crc32c(p, cut)), crc32c(p, n)) << start << " " << n << " " << cut;
      }
    }
  }
}

// The config hash is CRC32C now: it still tells training keys apart and ignores runtime ones.
TEST(Checksum, ConfigHashIsCrc32cOfTheTrainingKeys) {
  const Config a = parseConfig("teacher:\n  kind: self\n");
  const Config b = parseConfig("teacher:\n  kind: self\nloss:\n  temperature: 2\n");
  const Config c = parseConfig("teacher:\n  kind: self\nrun:\n  log_dir: elsewhere\n");
  EXPECT_LE(configHash(a), 0xFFFFFFFFull);
  EXPECT_NE(configHash(a), configHash(b));
  EXPECT_EQ(configHash(a), configHash(c));
}

} // namespace
} // namespace distill
