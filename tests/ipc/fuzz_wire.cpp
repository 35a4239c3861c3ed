// libFuzzer target for wire::validateHeader (DISTILL_BUILD_FUZZ, clang++ -fsanitize=fuzzer).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace w = distill::ipc::wire;
  w::SlotHeader h{};
  const size_t n = size < sizeof h ? size : sizeof h;
  std::memcpy(&h, data, n);
  size_t capacity = 1 << 20;
  if (size > sizeof h + 8) std::memcpy(&capacity, data + sizeof h, 8);
  std::string why;
  w::validateHeader(h, capacity, &why);
  // Also exercise the field checks behind a correct checksum.
  if (size & 1) {
    h.magic = w::kSlotMagic;
    w::sealHeader(h);
    w::validateHeader(h, capacity, &why);
  }
  return 0;
}
