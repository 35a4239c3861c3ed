// The teacher-output cache's records (records.h): a row's answer encoded
// compactly for the store (float32 logits and top-k values in float16, indices
// in the narrowest integer that holds the vocabulary), sealed with a CRC32C
// over its key and bytes.
// With teacher.cache.dtype float32, float32 logits and values are stored as
// they are (4 bytes each), so an answer is the one the teacher computed.
// Logits and values that arrive in bfloat16 or float16 (teacher.payload_dtype,
// or its auto under teacher.autocast) are stored as they are, 2 bytes each, and
// come back bit-equal in their own dtype; teacher.payload_dtype is part of the
// answer context, so answers of one payload dtype never answer another's.
#include "records.h"

#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>

#include "distill/core/checksum.h"
#include "distill/core/errors.h"
#include "distill/core/answer_kinds.h"

namespace distill {
namespace {

// How a tensor of a row is stored.
enum class Encoding : uint8_t { kRaw = 0, kFloat16 = 1, kUInt8 = 2, kUInt16 = 3 };

void put(std::string& out, const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
template <typename T>
void putValue(std::string& out, T v) {
  put(out, &v, sizeof v);
}

// Reads a record with bounds checks: a short or odd record is an error, never a wild read.
class Reader {
 public:
  Reader(const void* data, size_t size) : p_(static_cast<const char*>(data)), left_(size) {}
  const char* take(size_t n) {
    DISTILL_CHECK_T(IpcError, n <= left_, "teacher cache: malformed record (", n, " bytes wanted, ", left_, " left)");
    const char* at = p_;
    p_ += n;
    left_ -= n;
    return at;
  }
  template <typename T>
  T value() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  size_t left() const { return left_; }

 private:
  const char* p_;
  size_t left_;
};

// A record: the magic, a CRC32C (of the key, then of every byte after the CRC), the tensors.
constexpr char kRecordMagic[4] = {'D', 'T', 'C', char(kCacheFormatVersion)};
constexpr char kPositionMagic[4] = {'D', 'T', 'P', char(kCacheFormatVersion)}; // prefix keys' records
constexpr size_t kCrcAt = sizeof kRecordMagic;
constexpr size_t kBodyAt = kCrcAt + sizeof(uint32_t);

uint32_t recordCrc(const CacheKey& key, const char* data, size_t size) {
  return crc32c(data + kBodyAt, size - kBodyAt, crc32c(key.data(), key.size()));
}

// float16 for a float32 tensor whose finite values float16 holds (|v| <= 65504): logits
// and top-k values span a small range, where float16's 11-bit significand keeps 8 times
// bfloat16's precision; a tensor float16 cannot hold stays float32 (nullopt).
std::optional<at::Tensor> asFloat16(const at::Tensor& t) {
  at::Tensor half = t.to(at::kHalf);
  if (!at::equal(at::isfinite(half), at::isfinite(t))) return std::nullopt;
  return half;
}

} // namespace

bool recordIntact(const CacheKey& key, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  if (size < kBodyAt ||
      (std::memcmp(p, kRecordMagic, sizeof kRecordMagic) != 0 &&
       std::memcmp(p, kPositionMagic, sizeof kPositionMagic) != 0)) {
    return false;
  }
  uint32_t stored;
  std::memcpy(&stored, p + kCrcAt, sizeof stored);
  return stored == recordCrc(key, p, size);
}

void roundForStorage(Answer& answer, double temperature) {
  auto values = answer.find(protocol::kTopkValues);
  auto lse = answer.find(protocol::kLogsumexp);
  auto tail = answer.find(protocol::kLogTail);
  if (values == answer.end() || lse == answer.end() || tail == answer.end() ||
      values->second.scalar_type() != at::kFloat) {
    return;
  }
  at::Tensor v = values->second;
  at::Tensor rounded = v.to(at::kHalf).to(at::kFloat);
  // Where float16 cannot hold a value it stays float32 (encodeRow then stores that row as float32).
  rounded = at::where(at::isfinite(rounded) | ~at::isfinite(v), rounded, v);
  values->second = rounded;
  // logsumexp = log(exp(logsumexp(values / T)) + exp(log_tail)), so that the
  // k + 1 buckets still sum to 1 (student/losses.h checks that they do).
  at::Tensor head = at::logsumexp(rounded.div(temperature), -1);
  lse->second = at::logaddexp(head, tail->second.to(at::kFloat)).contiguous();
}

namespace {

// The answer kinds table's tensors (answer_kinds.h), in its order: logits, then
// top-k's values, indices, logsumexp, log tail. A position record names each
// tensor by its index here + 1 (0: a name written out, e.g. a hidden state);
// the codes are stored, so a new kind's tensors only ever append to this list
// (tests/core/answer_kinds_test.cpp holds today's order).
const std::vector<const AnswerTensor*>& tableTensors() {
  static const std::vector<const AnswerTensor*> all = [] {
    std::vector<const AnswerTensor*> v;
    for (const AnswerKindSpec& k : answerKinds()) {
      for (const AnswerTensor& t : k.tensors) v.push_back(&t);
    }
    return v;
  }();
  return all;
}

const AnswerTensor* tableTensor(const std::string& name) {
  for (const AnswerTensor* t : tableTensors()) {
    if (name == t->name) return t;
  }
  return nullptr;
}

// The name of a position record's code; nullptr for a code no table tensor has.
const char* codeName(uint8_t code) {
  return code >= 1 && code <= tableTensors().size() ? tableTensors()[code - 1]->name : nullptr;
}

uint8_t nameCode(const std::string& name) {
  for (size_t c = 0; c < tableTensors().size(); ++c) {
    if (name == tableTensors()[c]->name) return static_cast<uint8_t>(c + 1);
  }
  return 0;
}

// How a tensor is stored, and the tensor to store, by what the kinds table says
// it is: values in the payload dtype (logits, top-k values) in float16 where it
// holds them, token ids (top-k indices, sampled ids) in the narrowest integer
// that holds the vocabulary; anything else (float32 statistics, hidden states,
// sampled counts in their int16) as it is.
std::pair<Encoding, at::Tensor> chooseEncoding(const std::string& name, const at::Tensor& t, int64_t vocab,
                                               CacheDtype dtype) {
  const AnswerTensor* spec = tableTensor(name);
  if (spec && spec->dtype == DtypeRule::kPayload && t.scalar_type() == at::kFloat) {
    if (dtype == CacheDtype::kFloat32) return {Encoding::kRaw, t};
    if (auto half = asFloat16(t)) return {Encoding::kFloat16, *half};
  } else if (spec && spec->dtype == DtypeRule::kInt32 &&
             (spec->shape == ShapeRule::kTopk || spec->shape == ShapeRule::kSamples) && t.scalar_type() == at::kInt &&
             vocab > 0 && vocab <= 65536) {
    return {vocab <= 256 ? Encoding::kUInt8 : Encoding::kUInt16, t};
  }
  return {Encoding::kRaw, t};
}

size_t elementBytes(Encoding enc, at::ScalarType dtype) {
  switch (enc) {
    case Encoding::kFloat16:
    case Encoding::kUInt16:
      return 2;
    case Encoding::kUInt8:
      return 1;
    default:
      return c10::elementSize(dtype);
  }
}

// The tensor's bytes as `enc` stores them.
void putPayload(std::string& out, Encoding enc, const at::Tensor& stored, int64_t vocab) {
  if (enc != Encoding::kUInt8 && enc != Encoding::kUInt16) return put(out, stored.data_ptr(), stored.nbytes());
  // By hand: torch has no uint16 arithmetic to convert with.
  const int32_t* idx = stored.data_ptr<int32_t>();
  for (int64_t i = 0; i < stored.numel(); ++i) {
    DISTILL_INTERNAL_ASSERT(idx[i] >= 0 && idx[i] < vocab, "token id ", idx[i], " outside vocab ", vocab);
    if (enc == Encoding::kUInt8) {
      putValue<uint8_t>(out, static_cast<uint8_t>(idx[i]));
    } else {
      putValue<uint16_t>(out, static_cast<uint16_t>(idx[i]));
    }
  }
}

// A tensor of `shape` and `dtype` from `nbytes` stored bytes at `bytes`.
at::Tensor readPayload(const char* bytes, uint64_t nbytes, Encoding enc, at::ScalarType dtype,
                       const std::vector<int64_t>& shape, const std::string& name) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  DISTILL_CHECK_T(IpcError, enc <= Encoding::kUInt16, "teacher cache: record with encoding ", int(enc));
  DISTILL_CHECK_T(IpcError, nbytes == uint64_t(numel) * elementBytes(enc, dtype), "teacher cache: record of '", name,
                  "' holds ", nbytes, " bytes for ", numel, " elements");
  if (enc == Encoding::kRaw || enc == Encoding::kFloat16) {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(enc == Encoding::kRaw ? dtype : at::kHalf));
    std::memcpy(t.data_ptr(), bytes, nbytes);
    return t.to(dtype);
  }
  at::Tensor t = at::empty(shape, at::kInt);
  int32_t* dst = t.data_ptr<int32_t>();
  for (int64_t k = 0; k < numel; ++k) {
    if (enc == Encoding::kUInt8) {
      dst[k] = static_cast<uint8_t>(bytes[k]);
    } else {
      uint16_t v;
      std::memcpy(&v, bytes + 2 * k, 2);
      dst[k] = v;
    }
  }
  return t.to(dtype);
}

// A position record (encodeRow's kPosition): per tensor its name's code (or
// 0, its length and the name), encoding, dtype, the number of dims after
// [1, 1] and each as uint32, then its bytes, whose length the shape gives.
void putPositionTensor(std::string& out, const std::string& name, const at::Tensor& t, int64_t vocab,
                       CacheDtype dtype) {
  DISTILL_INTERNAL_ASSERT(t.dim() >= 2 && t.size(0) == 1 && t.size(1) == 1, "a position record takes [1, 1, ...]");
  const auto [enc, stored] = chooseEncoding(name, t, vocab, dtype);
  const uint8_t code = nameCode(name);
  putValue<uint8_t>(out, code);
  if (code == 0) {
    putValue<uint8_t>(out, static_cast<uint8_t>(name.size()));
    put(out, name.data(), name.size());
  }
  putValue<uint8_t>(out, static_cast<uint8_t>(enc));
  putValue<int8_t>(out, static_cast<int8_t>(t.scalar_type()));
  putValue<uint8_t>(out, static_cast<uint8_t>(t.dim() - 2));
  for (int64_t d = 2; d < t.dim(); ++d) {
    DISTILL_INTERNAL_ASSERT(t.size(d) <= int64_t(UINT32_MAX), "dim ", t.size(d));
    putValue<uint32_t>(out, static_cast<uint32_t>(t.size(d)));
  }
  putPayload(out, enc, stored, vocab);
}

void putRowTensor(std::string& out, const std::string& name, const at::Tensor& t, int64_t vocab, CacheDtype dtype) {
  DISTILL_INTERNAL_ASSERT(t.dim() >= 1 && t.size(0) == 1, "encodeRow takes one row");
  const auto [enc, stored] = chooseEncoding(name, t, vocab, dtype);
  putValue<uint8_t>(out, static_cast<uint8_t>(name.size()));
  put(out, name.data(), name.size());
  putValue<uint8_t>(out, static_cast<uint8_t>(enc));
  putValue<int8_t>(out, static_cast<int8_t>(t.scalar_type()));
  putValue<uint8_t>(out, static_cast<uint8_t>(t.dim() - 1));
  for (int64_t d = 1; d < t.dim(); ++d) putValue<int64_t>(out, t.size(d));
  putValue<uint64_t>(out, uint64_t(stored.numel()) * elementBytes(enc, t.scalar_type()));
  putPayload(out, enc, stored, vocab);
}

at::ScalarType readDtype(Reader& r) {
  const int8_t code = r.value<int8_t>();
  DISTILL_CHECK_T(IpcError, code >= 0 && code < static_cast<int8_t>(at::ScalarType::NumOptions),
                  "teacher cache: record with dtype code ", int(code));
  return static_cast<at::ScalarType>(code);
}

// One tensor of a record of either kind.
std::pair<std::string, at::Tensor> readTensor(Reader& r, bool position) {
  std::string name;
  const uint8_t code = position ? r.value<uint8_t>() : 0;
  DISTILL_CHECK_T(IpcError, code == 0 || codeName(code), "teacher cache: record with name code ", int(code));
  if (code > 0) {
    name = codeName(code);
  } else {
    const size_t nameLen = r.value<uint8_t>();
    name.assign(r.take(nameLen), nameLen);
  }
  const auto enc = static_cast<Encoding>(r.value<uint8_t>());
  const at::ScalarType dtype = readDtype(r);
  const int ndim = r.value<uint8_t>();
  std::vector<int64_t> shape = position ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1};
  for (int d = 0; d < ndim; ++d) {
    shape.push_back(position ? int64_t(r.value<uint32_t>()) : r.value<int64_t>());
    DISTILL_CHECK_T(IpcError, shape.back() >= 0 && shape.back() < (int64_t(1) << 40), "teacher cache: record with dim ",
                    shape.back());
  }
  uint64_t nbytes = 0;
  if (position) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    DISTILL_CHECK_T(IpcError, enc <= Encoding::kUInt16, "teacher cache: record with encoding ", int(enc));
    nbytes = uint64_t(numel) * elementBytes(enc, dtype);
  } else {
    nbytes = r.value<uint64_t>();
  }
  return {name, readPayload(r.take(nbytes), nbytes, enc, dtype, shape, name)};
}

} // namespace

std::string encodeRow(const Answer& row, int64_t vocab, const CacheKey& key, RecordKind kind, CacheDtype dtype) {
  const bool position = kind == RecordKind::kPosition;
  std::string out(position ? kPositionMagic : kRecordMagic, sizeof kRecordMagic);
  putValue<uint32_t>(out, 0); // the CRC, filled in last
  putValue<uint8_t>(out, static_cast<uint8_t>(row.size()));
  for (const auto& [name, tensor] : row) {
    at::Tensor t = tensor.detach().contiguous().cpu();
    if (position) {
      putPositionTensor(out, name, t, vocab, dtype);
    } else {
      putRowTensor(out, name, t, vocab, dtype);
    }
  }
  const uint32_t crc = recordCrc(key, out.data(), out.size());
  std::memcpy(out.data() + kCrcAt, &crc, sizeof crc);
  return out;
}

Answer decodeRow(const void* data, size_t size) {
  Reader r(data, size);
  const char* magic = r.take(sizeof kRecordMagic);
  const bool position = std::memcmp(magic, kPositionMagic, sizeof kPositionMagic) == 0;
  DISTILL_CHECK_T(IpcError, position || std::memcmp(magic, kRecordMagic, sizeof kRecordMagic) == 0,
                  "teacher cache: record of another format");
  r.take(sizeof(uint32_t)); // the CRC: checked by the store's lookup (recordIntact), which has the key
  Answer out;
  const int count = r.value<uint8_t>();
  for (int i = 0; i < count; ++i) out.insert(readTensor(r, position));
  DISTILL_CHECK_T(IpcError, r.left() == 0, "teacher cache: ", r.left(), " bytes after the record's tensors");
  return out;
}

} // namespace distill
