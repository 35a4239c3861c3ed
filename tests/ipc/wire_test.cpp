// validateHeader: targeted cases and 100000 random corruptions. Pure C++ +
// gtest: built twice, normally and with -fsanitize=address,undefined (no torch).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "wire.h"

namespace w = distill::ipc::wire;

namespace {

constexpr size_t kCap = 1 << 16;

// A valid header with 4 tensors of different dtypes.
w::SlotHeader validHeader() {
  w::SlotHeader h{};
  h.seq = 42;
  h.step = 7;
  h.accStep = 1;
  h.kind = uint32_t(w::Kind::kRequest);
  h.senderRank = 3;
  h.ntensors = 4;
  const w::DType types[] = {w::DType::kInt64, w::DType::kFloat32, w::DType::kBFloat16, w::DType::kBool};
  uint64_t off = 0;
  for (int i = 0; i < 4; ++i) {
    auto& t = h.tensors[i];
    std::snprintf(t.name, sizeof t.name, "t%d", i);
    t.dtype = uint32_t(types[i]);
    t.ndim = 2;
    t.shape[0] = 3 + i;
    t.shape[1] = 5;
    t.nbytes = uint64_t(t.shape[0] * t.shape[1] * w::itemSize(types[i]));
    t.offset = off;
    off = w::alignUp(off + t.nbytes, w::kPayloadAlign);
  }
  w::sealHeader(h);
  return h;
}

bool rejected(const w::SlotHeader& h, std::string* why = nullptr) {
  std::string tmp;
  return !w::validateHeader(h, kCap, why ? why : &tmp);
}

} // namespace

TEST(IpcWire, ValidHeaderPasses) {
  std::string why;
  auto h = validHeader();
  EXPECT_TRUE(w::validateHeader(h, kCap, &why)) << why;
  h.ntensors = 0;
  w::sealHeader(h);
  EXPECT_TRUE(w::validateHeader(h, 0, &why)) << why;
}

TEST(IpcWire, MessagesNameFieldAndValues) {
  std::string why;
  auto h = validHeader();
  h.tensors[1].nbytes += 4;
  w::sealHeader(h);
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("tensor[1] 't1': nbytes 84 != 20 elements x 4 bytes = 80"), std::string::npos) << why;

  h = validHeader();
  h.tensors[2].dtype = 77;
  w::sealHeader(h);
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("unknown dtype 77"), std::string::npos) << why;

  h = validHeader();
  h.tensors[0].ndim = 9;
  w::sealHeader(h);
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("ndim 9 > 8"), std::string::npos) << why;

  h = validHeader();
  h.tensors[3].offset = kCap;
  w::sealHeader(h);
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("exceeds the slot capacity 65536"), std::string::npos) << why;

  h = validHeader();
  h.tensors[1].offset = h.tensors[0].offset;
  w::sealHeader(h);
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("overlaps"), std::string::npos) << why;

  h = validHeader();
  h.tensors[0].shape[0] = int64_t(1) << 40;
  h.tensors[0].shape[1] = int64_t(1) << 40;
  w::sealHeader(h);
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("overflows"), std::string::npos) << why;

  h = validHeader();
  h.step = 8; // not resealed
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
}

// Only the used prefix is the message: 48 fixed bytes + one descriptor per
// tensor (+ the error text for errors). Bytes after it are neither checksummed
// nor read, so a producer writes (and a consumer copies) 3 cache lines, not 16.
TEST(IpcWire, ChecksumCoversTheUsedPrefixOnly) {
  w::SlotHeader h = validHeader();
  h.ntensors = 1;
  w::sealHeader(h);
  EXPECT_EQ(w::headerBytes(h), 56u + 128u);
  std::string why;
  std::memset(&h.tensors[2], 0xAB, sizeof h.tensors[2]); // beyond the prefix
  EXPECT_TRUE(w::validateHeader(h, kCap, &why)) << why;
  h.tensors[0].shape[1] ^= 1; // inside it
  ASSERT_TRUE(rejected(h, &why));
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
  // An error message: the whole header, error text included.
  w::SlotHeader e{};
  e.kind = uint32_t(w::Kind::kError);
  std::snprintf(e.errorText, sizeof e.errorText, "bad input");
  w::sealHeader(e);
  EXPECT_EQ(w::headerBytes(e), sizeof e);
  EXPECT_TRUE(w::validateHeader(e, kCap, &why)) << why;
  e.errorText[400] = 'x';
  ASSERT_TRUE(rejected(e, &why));
  EXPECT_NE(why.find("checksum"), std::string::npos) << why;
  // A text longer than the field: cut at a character boundary, saying so.
  EXPECT_EQ(w::fitErrorText("bad input"), "bad input");
  const std::string exact(w::kErrorTextBytes - 1, 'a');
  EXPECT_EQ(w::fitErrorText(exact), exact);
  std::string accents;
  while (accents.size() < 2000) accents += "\xC3\xA9"; // U+00E9, two bytes each
  for (const std::string& longText : {exact + "b", accents, "x" + accents}) {
    const std::string fitted = w::fitErrorText(longText);
    EXPECT_LE(fitted.size(), size_t(w::kErrorTextBytes - 1));
    EXPECT_GE(fitted.size(), size_t(w::kErrorTextBytes - 2)); // at most one byte of a character dropped
    const std::string cut = w::kErrorTextCut;
    ASSERT_EQ(fitted.substr(fitted.size() - cut.size()), cut);
    const std::string kept = fitted.substr(0, fitted.size() - cut.size());
    EXPECT_EQ(longText.compare(0, kept.size(), kept), 0);
    EXPECT_NE(static_cast<unsigned char>(longText[kept.size()]) & 0xC0, 0x80) << "cut inside a character";
  }
  // A corrupt ntensors cannot make the checksum read past the header.
  w::SlotHeader big = validHeader();
  big.ntensors = 1000000;
  EXPECT_EQ(w::headerBytes(big), 56u + 4u * 128u);
  w::sealHeader(big);
  ASSERT_TRUE(rejected(big, &why));
  EXPECT_NE(why.find("ntensors"), std::string::npos) << why;
}

// 100000 corrupted headers, each rejected; plus random garbage that must not crash.
TEST(IpcWire, RandomCorruptionsAreRejected) {
  std::mt19937_64 rng(12345);
  const w::SlotHeader good = validHeader();
  int accepted = 0;
  for (int iter = 0; iter < 100000; ++iter) {
    w::SlotHeader h = good;
    auto* bytes = reinterpret_cast<unsigned char*>(&h);
    const int mode = int(rng() % 3);
    if (mode == 0) {
      // Raw corruption (no reseal): 1..8 random bytes changed.
      // Distinct positions, so two flips never cancel out.
      const size_t n = 1 + rng() % 8;
      // Within the message's bytes (wire::headerBytes); leave magic/checksum alone here.
      const size_t used = w::headerBytes(good);
      size_t first = 8 + rng() % (used - 8 - n);
      const size_t gap = 1 + rng() % ((used - first) / n);
      for (size_t k = 0; k < n; ++k) bytes[first + k * gap] ^= uint8_t(1 + rng() % 255);
      ASSERT_TRUE(rejected(h)) << "iteration " << iter << " (raw)";
    } else if (mode == 1) {
      // A semantically invalid field, resealed so only the field checks can catch it.
      auto& t = h.tensors[rng() % 4];
      switch (rng() % 12) {
        case 0:
          h.kind = uint32_t(5 + rng() % 1000);
          break;
        case 1:
          h.ntensors = uint32_t(5 + rng() % 1000000);
          break;
        case 2:
          std::memset(t.name, 'x', sizeof t.name);
          break;
        case 3:
          t.dtype = uint32_t(7 + rng() % 1000);
          break;
        case 4:
          t.ndim = uint32_t(9 + rng() % 1000);
          break;
        case 5:
          t.shape[rng() % 2] = -int64_t(1 + rng() % 1000);
          break;
        case 6:
          t.nbytes += 1 + rng() % 4096;
          break;
        case 7:
          t.offset += 1 + rng() % 63;
          break;
        case 8:
          t.offset = kCap + 64 * (rng() % 4);
          break;
        case 9:
          t.offset = ~uint64_t(0) - 63;
          break;
        case 10:
          h.tensors[1].offset = h.tensors[2].offset;
          break;
        case 11:
          h.kind = uint32_t(w::Kind::kError);
          std::memset(h.errorText, 'e', sizeof h.errorText);
          break;
      }
      w::sealHeader(h);
      ASSERT_TRUE(rejected(h)) << "iteration " << iter << " (field)";
    } else {
      // Random garbage with a good magic and checksum: either verdict, no crash.
      for (size_t k = 8; k < sizeof h; ++k) bytes[k] = uint8_t(rng());
      if (rng() % 2) h.ntensors = uint32_t(rng() % 5);
      w::sealHeader(h);
      accepted += w::validateHeader(h, size_t(rng() % (kCap * 2)), nullptr) ? 1 : 0;
    }
  }
  RecordProperty("garbage_accepted", accepted);
}
