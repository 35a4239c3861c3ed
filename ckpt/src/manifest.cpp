// The manifest of a checkpoint, CRC32C, and verification. No torch here.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>

#include "distill/ckpt/checkpoint.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"

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

std::string hex(uint64_t v, int digits) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%0*" PRIx64, digits, v);
  return buf;
}

// A JSON value, enough for the manifest: objects, arrays, strings, integers.
struct Json {
  enum Kind { kObject, kArray, kString, kInt } kind = kInt;
  std::map<std::string, Json> object;
  std::vector<Json> array;
  std::string str;
  int64_t num = 0;
};

// Recursive descent over the whole text; any deviation throws CheckpointError.
class Parser {
 public:
  Parser(const std::string& text, const std::string& path) : s_(text), path_(path) {}

  Json document() {
    Json v = value();
    ws();
    if (i_ != s_.size()) bad("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void bad(const std::string& what) {
    DISTILL_THROW(CheckpointError, "corrupt manifest ", path_, ": ", what, " at byte ", i_);
  }
  void ws() {
    while (i_ < s_.size() && std::strchr(" \t\r\n", s_[i_])) ++i_;
  }
  void expect(char c) {
    ws();
    if (i_ >= s_.size() || s_[i_] != c) bad(std::string("expected '") + c + "'");
    ++i_;
  }
  bool peek(char c) {
    ws();
    return i_ < s_.size() && s_[i_] == c;
  }
  Json value() {
    ws();
    if (i_ >= s_.size()) bad("unexpected end");
    Json v;
    char c = s_[i_];
    if (c == '{') {
      v.kind = Json::kObject;
      ++i_;
      if (peek('}')) return ++i_, v;
      do {
        std::string key = string();
        expect(':');
        v.object[key] = value();
      } while (peek(',') && ++i_);
      expect('}');
    } else if (c == '[') {
      v.kind = Json::kArray;
      ++i_;
      if (peek(']')) return ++i_, v;
      do {
        v.array.push_back(value());
      } while (peek(',') && ++i_);
      expect(']');
    } else if (c == '"') {
      v.kind = Json::kString;
      v.str = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t start = i_++;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      try {
        v.num = std::stoll(s_.substr(start, i_ - start));
      } catch (const std::exception&) {
        bad("bad number");
      }
    } else {
      bad("unexpected character");
    }
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) bad("unexpected end");
      char e = s_[i_++];
      if (e == 'u') {
        if (i_ + 4 > s_.size()) bad("bad \\u escape");
        unsigned cp = std::stoul(s_.substr(i_, 4), nullptr, 16);
        i_ += 4;
        if (cp >= 0x80) bad("\\u escape above 0x7f");  // formatManifest never writes one
        out += static_cast<char>(cp);
      } else if (e == '"' || e == '\\' || e == '/') {
        out += e;
      } else if (e == 'n' || e == 't') {
        out += e == 'n' ? '\n' : '\t';
      } else {
        bad("bad escape");
      }
    }
    expect('"');
    return out;
  }

  const std::string& s_;
  const std::string& path_;
  size_t i_ = 0;
};

const Json& field(const Json& obj, const std::string& key, Json::Kind kind, const std::string& path) {
  auto it = obj.object.find(key);
  DISTILL_CHECK_T(CheckpointError, it != obj.object.end() && it->second.kind == kind,
                  "corrupt manifest ", path, ": field \"", key, "\" missing or of the wrong type");
  return it->second;
}

uint64_t parseHex(const std::string& s, const std::string& key, const std::string& path) {
  DISTILL_CHECK_T(CheckpointError, !s.empty() && s.size() <= 16 &&
                                       s.find_first_not_of("0123456789abcdef") == std::string::npos,
                  "corrupt manifest ", path, ": \"", key, "\" is not hex: ", s);
  return std::stoull(s, nullptr, 16);
}

constexpr const char* kSelfKey = "\n  \"manifest_crc32c\": \"";

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  auto p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (haveSse42()) return ~crcHw(crc, p, n);
#endif
  return ~crcSoft(crc, p, n);
}

const ManifestFile* Manifest::find(const std::string& name) const {
  for (const auto& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string formatManifest(const Manifest& m) {
  std::string s = "{\n  \"format\": \"distill-checkpoint\",\n  \"version\": 1,\n";
  s += "  \"step\": " + std::to_string(m.step) + ",\n";
  s += "  \"student_world_size\": " + std::to_string(m.studentWorldSize) + ",\n";
  s += "  \"config_hash\": \"" + hex(m.configHash, 16) + "\",\n";
  s += "  \"teacher_fingerprint\": " + jsonQuote(m.teacherFingerprint) + ",\n";
  s += "  \"checksum\": \"crc32c\",\n  \"files\": [";
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    s += std::string(i ? "," : "") + "\n    {\"name\": " + jsonQuote(f.name) +
         ", \"size\": " + std::to_string(f.size) + ", \"crc32c\": \"" + hex(f.crc32c, 8) + "\"}";
  }
  s += "\n  ],\n";
  // The manifest's own checksum covers every byte before its line.
  uint32_t self = crc32c(s.data(), s.size());
  return s + (kSelfKey + 1) + hex(self, 8) + "\"\n}\n";
}

Manifest parseManifest(const std::string& text, const std::string& path) {
  size_t at = text.rfind(kSelfKey);
  DISTILL_CHECK_T(CheckpointError, at != std::string::npos, "corrupt manifest ", path,
                  ": no manifest_crc32c line (truncated?)");
  uint32_t want = crc32c(text.data(), at + 1);
  Json doc = Parser(text, path).document();
  DISTILL_CHECK_T(CheckpointError, doc.kind == Json::kObject, "corrupt manifest ", path, ": not an object");
  uint32_t got = static_cast<uint32_t>(
      parseHex(field(doc, "manifest_crc32c", Json::kString, path).str, "manifest_crc32c", path));
  DISTILL_CHECK_T(CheckpointError, got == want, "corrupt manifest ", path, ": checksum ", hex(got, 8),
                  " recorded, ", hex(want, 8), " computed");
  DISTILL_CHECK_T(CheckpointError, field(doc, "format", Json::kString, path).str == "distill-checkpoint" &&
                                       field(doc, "version", Json::kInt, path).num == 1,
                  "manifest ", path, ": unknown format or version");
  Manifest m;
  m.step = field(doc, "step", Json::kInt, path).num;
  m.studentWorldSize = static_cast<int>(field(doc, "student_world_size", Json::kInt, path).num);
  m.configHash = parseHex(field(doc, "config_hash", Json::kString, path).str, "config_hash", path);
  m.teacherFingerprint = field(doc, "teacher_fingerprint", Json::kString, path).str;
  for (const Json& f : field(doc, "files", Json::kArray, path).array) {
    DISTILL_CHECK_T(CheckpointError, f.kind == Json::kObject, "corrupt manifest ", path, ": bad file entry");
    ManifestFile mf;
    mf.name = field(f, "name", Json::kString, path).str;
    mf.size = field(f, "size", Json::kInt, path).num;
    mf.crc32c = static_cast<uint32_t>(parseHex(field(f, "crc32c", Json::kString, path).str, "crc32c", path));
    DISTILL_CHECK_T(CheckpointError, !mf.name.empty() && mf.name.find('/') == std::string::npos &&
                                         mf.size >= 0,
                    "corrupt manifest ", path, ": bad file entry \"", mf.name, "\"");
    m.files.push_back(std::move(mf));
  }
  DISTILL_CHECK_T(CheckpointError, m.studentWorldSize >= 1, "corrupt manifest ", path,
                  ": student_world_size ", m.studentWorldSize);
  return m;
}

Manifest verifyCheckpoint(const std::string& stepDir, FileSystem& fs) {
  const std::string mpath = stepDir + "/manifest.json";
  Manifest m = parseManifest(fs.readFile(mpath), mpath);
  std::vector<std::string> required = {"model.pt", "optimizer.pt", "train_state.pt"};
  for (int r = 0; r < m.studentWorldSize; ++r) required.push_back("rank_" + std::to_string(r) + ".pt");
  for (const auto& name : required) {
    DISTILL_CHECK_T(CheckpointError, m.find(name), "manifest ", mpath, " does not list ", name);
  }
  for (const auto& f : m.files) {
    const std::string path = stepDir + "/" + f.name;
    std::string bytes = fs.readFile(path);
    DISTILL_CHECK_T(CheckpointError, static_cast<int64_t>(bytes.size()) == f.size, "corrupt file ", path,
                    ": ", bytes.size(), " bytes, the manifest says ", f.size);
    uint32_t crc = crc32c(bytes.data(), bytes.size());
    DISTILL_CHECK_T(CheckpointError, crc == f.crc32c, "corrupt file ", path, ": CRC32C ", hex(crc, 8),
                    ", the manifest says ", hex(f.crc32c, 8));
  }
  return m;
}

}  // namespace distill
