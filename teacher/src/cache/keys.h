#pragma once

// The teacher-output cache's keys (cache.h): what a stored answer is found by.
// Internal to teacher/ (the cache, the server, tests and benches).
//
// Key: SHA-256 (OpenSSL's libcrypto, which core already links for the
// rendezvous store) of the answer context's digest and, for every input named
// by teacher.inputs, its name, dtype, trailing shape and the row's bytes. A
// cryptographic hash because a collision would silently serve another row's
// answer; it costs about 2 ns per byte here, small next to any forward.
//
// Answer context (every key holds it, so two teachers never share an entry):
// the cache format version, the teacher's fingerprint (a SHA-256 over every
// parameter's and buffer's name, dtype, shape and bytes, plus kind, method and
// output names), the output kind (full logits, or top-k k and the loss
// temperature, on which logsumexp and log_tail depend, or sampled K, the loss
// temperature and run.seed, on which the draws depend), the hidden states,
// autocast and the device type.
//
// Prefix keys (teacher.cache.keys: prefix): one key per position, a chain over
// the row's positions, k_0 = SHA-256(context, "prefix", every input's name,
// dtype and shape after dim 1, position 0's bytes), k_t = SHA-256(k_{t-1},
// position t's bytes).
//
// Pure functions of their arguments: any thread.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "distill/core/options.h"
#include "distill/teacher/model.h"

namespace distill {

constexpr uint32_t kCacheFormatVersion = 2; // 2: a CRC32C per record, float16 full logits

using CacheKey = std::array<uint8_t, 32>;

// The digest of everything about the teacher that shapes an answer besides the
// row's inputs (see above). ConfigError if the model exposes neither its
// tensors nor a fingerprint: two such teachers could not be kept apart.
// teacher.answer hidden: `headFingerprint` (ipc::headFingerprint of the head
// published) is in it, so that rows of another head never read as this one's.
// Sampled answers (teacher.samples > 0): K, `temperature` and `seed` (run.seed)
// are in it, so that a store of other draws is refused at open (cache.h, "Signal").
std::string answerContext(const TeacherOptions& teacher, double temperature, const TeacherModel& model,
                          const std::string& headFingerprint = "", int64_t seed = 0);

// SHA-256 over the model's named parameters and buffers (name, dtype, shape,
// bytes), hex; "" if it exposes none.
std::string modelDigest(const TeacherModel& model);

// The key of row `row` of the inputs (teacher.inputs order, dim 0 = rows).
CacheKey rowKey(const std::string& context, const std::vector<std::string>& names,
                const std::vector<at::Tensor>& inputs, int64_t row);

// teacher.cache.keys prefix: the key of every position of row `row` (inputs
// [B, T, ...] in teacher.inputs order, contiguous, CPU), the chain above.
// ProtocolError naming teacher.cache.keys when an input has no sequence
// dimension (dim 1) or the inputs' sequence lengths differ.
// Why `inputs` cannot be keyed per position (no sequence dimension, or
// sequence lengths that differ), naming teacher.cache.keys; "" if they can.
std::string prefixInputsProblem(const std::vector<std::string>& names, const std::vector<at::Tensor>& inputs);
std::vector<CacheKey> positionKeys(const std::string& context, const std::vector<std::string>& names,
                                   const std::vector<at::Tensor>& inputs, int64_t row);

// A key as 64 hex digits (log lines).
std::string keyHex(const CacheKey& key);

} // namespace distill
