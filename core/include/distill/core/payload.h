#pragma once

// What the rings carry, in bytes, as the config says: a request of
// teacher.max_batch_tokens tokens and its answer. transport.max_request_bytes
// and max_response_bytes are these sizes when auto (0); a size set below them
// is a ConfigError before the segment is made (distill-run: before any rank
// starts), not a failure at the first large batch.
//
// A request holds teacher.inputs, each taken as one int64 per token (token
// ids [B, T], as teacher.max_batch_tokens counts them). An answer holds the
// tensors of the configured answer kind (answer_kinds.h, answerBytes). Each
// tensor starts at a 64-byte boundary of the slot.

#include <cstdint>
#include <string>

#include "distill/core/options.h"

namespace distill {

// Bytes per value of logits or top-k values: teacher.payload_dtype; auto: 2
// under teacher.autocast, else 4 (float32, the most an auto payload sends).
int64_t payloadValueBytes(const TeacherOptions& t);

struct SlotBytes {
  int64_t tokens = 0; // teacher.max_batch_tokens
  int64_t request = 0; // payload bytes of a request of `tokens` tokens
  int64_t response = 0; // of its answer; 0 when unknown
  double requestPerToken = 0; // request / tokens, before alignment
  double responsePerToken = 0; // idem, 0 when unknown
  std::string unknown; // why the response cannot be computed ("" when it can)
};

// What a request and a response of teacher.max_batch_tokens tokens need.
SlotBytes slotBytesNeeded(const Config& c);

// transport.max_request_bytes / max_response_bytes: as set, or (auto) the needed
// size; where that is unknown, 4 MiB / 64 MiB (at least what is known).
int64_t requestSlotBytes(const Config& c);
int64_t responseSlotBytes(const Config& c);

// ConfigError when transport.max_request_bytes or max_response_bytes is set
// below the needed size, naming it, the key and teacher.max_batch_tokens.
void checkSlotBytes(const Config& c);

// One line for the log: the slot sizes, what they hold per token, and whether
// each was computed (auto) or set.
std::string describeSlotBytes(const Config& c);

} // namespace distill
