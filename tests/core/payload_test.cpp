// config_test: the slot sizes a config gives (core/src/payload.cpp).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "distill/core/payload.h"
#include "support/process.h"
#include "config_test_util.h"

using distill::Config;
using distill::ConfigError;
using distill::configHash;
using distill::configKeys;
using distill::dumpConfig;
using distill::parseConfig;
using namespace config_testing;

namespace {

// Issue 28 item 2: the slot sizes follow from the teacher's keys; an explicit
// size below them is a ConfigError naming the size needed, the key and
// teacher.max_batch_tokens, and auto (0) is the needed size.
TEST(Payload, SlotBytesFromTheTeacherKeys) {
  auto sizes = [](const std::string& teacher, const std::string& transport = "") {
    return parseConfig("teacher:\n  kind: self\n" + teacher + (transport.empty() ? "" : "transport:\n" + transport));
  };
  // top-64 in float32: 64 x 4 + 64 x 4 + 4 + 4 = 520 B per token.
  Config c = sizes("  topk: 64\n  max_batch_tokens: 4096\n");
  distill::SlotBytes s = distill::slotBytesNeeded(c);
  EXPECT_EQ(s.request, 4096 * 8);
  EXPECT_EQ(s.response, 4096 * 520);
  EXPECT_EQ(s.responsePerToken, 520);
  EXPECT_TRUE(s.unknown.empty());
  EXPECT_EQ(distill::requestSlotBytes(c), 4096 * 8);
  EXPECT_EQ(distill::responseSlotBytes(c), 4096 * 520);
  // bfloat16 values (set, or auto under teacher.autocast): 64 x 2 + 64 x 4 + 8 = 392 B.
  EXPECT_EQ(
      distill::slotBytesNeeded(sizes("  topk: 64\n  max_batch_tokens: 4096\n  payload_dtype: bfloat16\n")).response,
      4096 * 392);
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  topk: 64\n  max_batch_tokens: 4096\n  autocast: bfloat16\n")).response,
            4096 * 392);
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  topk: 64\n  max_batch_tokens: 4096\n  autocast: bfloat16\n"
                                           "  payload_dtype: float32\n"))
                .response,
            4096 * 520);
  // Two inputs: 16 B per token; each tensor starts at 64 bytes.
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  inputs: [input_ids, attention_mask]\n  max_batch_tokens: 3\n")).request,
            2 * 64);
  // Full logits: known with teacher.vocab_size only.
  EXPECT_EQ(distill::slotBytesNeeded(sizes("  vocab_size: 32000\n  max_batch_tokens: 8\n  payload_dtype: "
                                           "bfloat16\n"))
                .response,
            8 * 32000 * 2);
  Config unknown = sizes("  max_batch_tokens: 8\n");
  EXPECT_FALSE(distill::slotBytesNeeded(unknown).unknown.empty());
  EXPECT_EQ(distill::responseSlotBytes(unknown), int64_t{64} << 20); // today's default
  EXPECT_NO_THROW(distill::checkSlotBytes(sizes("  max_batch_tokens: 8\n", "  max_response_bytes: 1KiB\n")));
  // Set sizes are kept as set, and checked.
  Config big = sizes("  topk: 64\n  max_batch_tokens: 4096\n", "  max_response_bytes: 4MiB\n");
  EXPECT_EQ(distill::responseSlotBytes(big), int64_t{4} << 20);
  EXPECT_NO_THROW(distill::checkSlotBytes(big));

  try {
    distill::checkSlotBytes(sizes("  topk: 64\n", "  max_response_bytes: 1MiB\n"));
    ADD_FAILURE() << "a 1 MiB response slot for 16384 tokens of top-64 was accepted";
  } catch (const ConfigError& e) {
    const std::string w = e.what();
    for (const char* part : {"transport.max_response_bytes: 1048576 bytes is below the 8519680 bytes",
                             "teacher.max_batch_tokens=16384", "top-64 in 32-bit values", "520 bytes per token",
                             "at least 8519680 (or auto)", "lower teacher.max_batch_tokens to 2016 or fewer"})
      EXPECT_NE(w.find(part), std::string::npos) << part << "\n" << w;
  }
  try {
    distill::checkSlotBytes(sizes("  inputs: [a, b]\n", "  max_request_bytes: 64KiB\n"));
    ADD_FAILURE() << "a 64 KiB request slot for 16384 tokens of 2 inputs was accepted";
  } catch (const ConfigError& e) {
    const std::string w = e.what();
    for (const char* part : {"transport.max_request_bytes: 65536 bytes is below the 262144 bytes",
                             "2 input(s) of teacher.inputs", "lower teacher.max_batch_tokens to 4096 or fewer"})
      EXPECT_NE(w.find(part), std::string::npos) << part << "\n" << w;
  }
  // The log line distill-run prints.
  const std::string line = distill::describeSlotBytes(c);
  EXPECT_NE(line.find("slots: request 32768 B (auto; 8 B/token x teacher.max_batch_tokens=4096"), std::string::npos)
      << line;
  EXPECT_NE(line.find("response 2129920 B (auto; top-64 in 32-bit values, 520 B/token = 2.03 MiB needed)"),
            std::string::npos)
      << line;
}

} // namespace
