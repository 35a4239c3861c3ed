#pragma once

// The one checksum of distill: CRC32C (Castagnoli), for checkpoint files and
// manifests and the config hash. No torch here.
//
// Written by hand: Debian packages no C++ CRC32C library (crc32c, Google's, is
// not in Debian; zlib's crc32 is another polynomial). It uses the SSE4.2
// instruction where the CPU has it and a table otherwise; both give the same
// values (tests/core/checksum_test.cpp).

#include <cstddef>
#include <cstdint>

namespace distill {

// CRC32C of `n` bytes at `data`, continuing from `crc` (0 to start):
// crc32c(ab) == crc32c(b, crc32c(a)).
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// The same with the portable table only (tests compare the two).
uint32_t crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

} // namespace distill
