#pragma once

// What the teacher server accepts of a request (server.cpp's take()): its
// inputs named by teacher.inputs, the same dtypes and ranks as every request
// before it, within teacher.max_batch_tokens, and the ids it may carry
// (protocol::kRequestIds, up to teacher.request_ids per position: an ids answer).

#include <ATen/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "distill/core/config.h"
#include "distill/ipc/channel.h"
#include "pending.h"

namespace distill {

// The dtype and rank of each input, fixed by the first request of the job.
struct InputSignature {
  bool known = false;
  std::vector<at::ScalarType> dtypes;
  std::vector<int64_t> dims;
};

// "" when `m` is a request this teacher answers, with its inputs, ids and
// tokens filled into `p`; else why not (the teacher answers it with that
// error). The first accepted request fixes `signature`. `prefixKeys`:
// teacher.cache.keys prefix, whose inputs must be [B, T] token ids.
std::string checkRequest(const ipc::ReceivedMessage& m, const Config& cfg, bool prefixKeys, InputSignature& signature,
                         Pending* p);

} // namespace distill
