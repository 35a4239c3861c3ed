// The manifest of a checkpoint and verification (CRC32C from core/checksum.h). No torch here.
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include <algorithm>

#include <map>

#include "distill/ckpt/checkpoint.h"
#include "distill/core/checksum.h"
#include "distill/core/config.h"
#include "distill/core/errors.h"
#include "layout.h"

namespace distill {
namespace {

std::string hex(uint64_t v, int digits) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%0*" PRIx64, digits, v);
  return buf;
}

// The manifest's last line but one holds the CRC32C of every byte before it:
//   ...\n  "manifest_crc32c": "1a2b3c4d"\n}\n
// so a manifest is checked byte for byte before anything parses it. (The same
// layout as every manifest written so far: older checkpoints read unchanged.)
constexpr const char kSelfKey[] = "\n  \"manifest_crc32c\": \"";
constexpr const char kSelfEnd[] = "\"\n}\n";

// The manifest is 3 levels deep (object, files array, file object). nlohmann's
// parser keeps its own stack (3.11 is not recursive), but no DOM of unbounded
// depth is built from a file either: this scan refuses deeper text first, and
// it is a plain loop, so 10^6 nested '[' cost 1 MB of reading, not the stack.
constexpr int kMaxDepth = 8;

[[noreturn]] void corrupt(const std::string& path, const std::string& why) {
  DISTILL_THROW(CheckpointError, "corrupt manifest ", path, ": ", why);
}

void checkDepth(const std::string& text, const std::string& path) {
  int depth = 0;
  bool inString = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (inString) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        inString = false;
      }
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxDepth) {
        corrupt(path,
                "JSON nested deeper than " + std::to_string(kMaxDepth) + " levels (too deeply nested at byte " +
                    std::to_string(i) + ")");
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

bool isHex(const std::string& s, size_t maxDigits) {
  return !s.empty() && s.size() <= maxDigits && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

using Json = nlohmann::json;

const Json& field(const Json& obj, const char* key, bool (Json::*is)() const noexcept, const char* kind,
                  const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end()) corrupt(path, std::string("field \"") + key + "\" missing");
  if (!((*it).*is)()) corrupt(path, std::string("field \"") + key + "\" is not " + kind + ": " + it->dump());
  return *it;
}

std::string stringField(const Json& obj, const char* key, const std::string& path) {
  return field(obj, key, &Json::is_string, "a string", path).get<std::string>();
}

int64_t intField(const Json& obj, const char* key, const std::string& path) {
  const Json& v = field(obj, key, &Json::is_number_integer, "an integer", path);
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    corrupt(path, std::string("field \"") + key + "\" is out of range: " + v.dump());
  }
  return v.get<int64_t>();
}

uint64_t hexField(const Json& obj, const char* key, size_t digits, const std::string& path) {
  const std::string s = stringField(obj, key, path);
  if (!isHex(s, digits)) corrupt(path, std::string("field \"") + key + "\" is not hex: \"" + s + "\"");
  return std::stoull(s, nullptr, 16);
}

} // namespace

const ManifestFile* Manifest::find(const std::string& name) const {
  for (const auto& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

std::string formatManifest(const Manifest& m) {
  nlohmann::ordered_json j;
  j["format"] = "distill-checkpoint";
  j["version"] = 1;
  j["step"] = m.step;
  j["student_world_size"] = m.studentWorldSize;
  j["config_hash"] = hex(m.configHash, 16);
  j["teacher_fingerprint"] = m.teacherFingerprint;
  if (m.answerTeacher != 0) j["answer_teacher"] = hex(m.answerTeacher, 16);
  j["checksum"] = "crc32c";
  j["files"] = nlohmann::ordered_json::array();
  for (const auto& f : m.files) {
    j["files"].push_back({{"name", f.name}, {"size", f.size}, {"crc32c", hex(f.crc32c, 8)}});
  }
  // Bytes that are not UTF-8 (a fingerprint is the caller's string) become U+FFFD.
  std::string s = j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  s.resize(s.size() - 2); // the closing "\n}": the checksum line comes last
  s += ",\n";
  const uint32_t self = crc32c(s.data(), s.size()); // every byte before its line
  return s + (kSelfKey + 1) + hex(self, 8) + kSelfEnd;
}

Manifest parseManifest(const std::string& text, const std::string& path) {
  // 1. The bytes: the checksum line, then the checksum, before any parsing.
  const size_t at = text.rfind(kSelfKey);
  if (at == std::string::npos) corrupt(path, "no manifest_crc32c line (truncated?)");
  const size_t hexAt = at + std::strlen(kSelfKey);
  const std::string recordedHex = text.substr(hexAt, 8);
  if (!isHex(recordedHex, 8) || recordedHex.size() != 8 || text.compare(hexAt + 8, std::string::npos, kSelfEnd) != 0) {
    corrupt(path, "malformed manifest_crc32c line (truncated?)");
  }
  const uint32_t recorded = static_cast<uint32_t>(std::stoul(recordedHex, nullptr, 16));
  const uint32_t computed = crc32c(text.data(), at + 1);
  if (recorded != computed) {
    corrupt(path, "checksum " + hex(recorded, 8) + " recorded, " + hex(computed, 8) + " computed");
  }
  // 2. The JSON, bounded in depth.
  checkDepth(text, path);
  Json doc;
  try {
    doc = Json::parse(text);
  } catch (const Json::exception& e) {
    std::string why = e.what(); // "[json.exception.parse_error.101] parse error at line 3, ..."
    auto close = why.find("] ");
    corrupt(path, "invalid JSON: " + (close == std::string::npos ? why : why.substr(close + 2)));
  }
  // 3. The fields.
  if (!doc.is_object()) corrupt(path, "not a JSON object");
  if (stringField(doc, "format", path) != "distill-checkpoint" || intField(doc, "version", path) != 1) {
    DISTILL_THROW(CheckpointError, "manifest ", path, ": unknown format or version (", doc["format"].dump(),
                  ", version ", doc["version"].dump(), ")");
  }
  Manifest m;
  m.step = intField(doc, "step", path);
  const int64_t world = intField(doc, "student_world_size", path);
  if (world < 1 || world > (1 << 20)) corrupt(path, "student_world_size " + std::to_string(world));
  m.studentWorldSize = static_cast<int>(world);
  m.configHash = hexField(doc, "config_hash", 16, path);
  m.teacherFingerprint = stringField(doc, "teacher_fingerprint", path);
  if (doc.contains("answer_teacher")) m.answerTeacher = hexField(doc, "answer_teacher", 16, path);
  for (const Json& f : field(doc, "files", &Json::is_array, "an array", path)) {
    if (!f.is_object()) corrupt(path, "a files entry is not an object: " + f.dump());
    ManifestFile mf;
    mf.name = stringField(f, "name", path);
    mf.size = intField(f, "size", path);
    mf.crc32c = static_cast<uint32_t>(hexField(f, "crc32c", 8, path));
    if (mf.name.empty() || mf.name.find('/') != std::string::npos || mf.name == "." || mf.name == ".." || mf.size < 0) {
      corrupt(path, "bad files entry " + f.dump());
    }
    m.files.push_back(std::move(mf));
  }
  return m;
}

Manifest verifyCheckpoint(const std::string& stepDir, FileSystem& fs) {
  const std::string mpath = stepDir + "/" + ckpt_layout::kManifest;
  Manifest m = parseManifest(fs.readFile(mpath), mpath);
  std::vector<std::string> required = {ckpt_layout::kModel, ckpt_layout::kOptimizer, ckpt_layout::kTrain};
  for (int r = 0; r < m.studentWorldSize; ++r) required.push_back(ckpt_layout::rankFile(r));
  for (const auto& name : required) {
    DISTILL_CHECK_T(CheckpointError, m.find(name), "manifest ", mpath, " does not list ", name);
  }
  for (const auto& f : m.files) {
    const std::string path = stepDir + "/" + f.name;
    std::string bytes = fs.readFile(path);
    DISTILL_CHECK_T(CheckpointError, static_cast<int64_t>(bytes.size()) == f.size, "corrupt file ", path, ": ",
                    bytes.size(), " bytes, the manifest says ", f.size);
    uint32_t crc = crc32c(bytes.data(), bytes.size());
    DISTILL_CHECK_T(CheckpointError, crc == f.crc32c, "corrupt file ", path, ": CRC32C ", hex(crc, 8),
                    ", the manifest says ", hex(f.crc32c, 8));
  }
  return m;
}

CheckpointScan scanCheckpoints(const std::string& root, FileSystem& fs) {
  namespace L = ckpt_layout;
  CheckpointScan scan;
  std::vector<int64_t> complete;
  for (const auto& name : fs.list(root)) {
    bool tmp = false;
    const int64_t s = L::parseStepName(name, &tmp);
    if (s < 0) continue;
    if (tmp) {
      scan.skipped.push_back("skipping partial checkpoint " + root + "/" + name +
                             ": never published (a save did not finish)");
    } else {
      complete.push_back(s);
    }
  }
  std::sort(complete.rbegin(), complete.rend());
  const std::string latestPath = root + "/" + L::kLatest;
  if (fs.exists(latestPath)) {
    std::string text;
    try {
      text = fs.readFile(latestPath);
    } catch (const Error& e) {
      text = "(" + e.message() + ")";
    }
    bool tmp = false;
    const std::string name = text.size() > 1 && text.back() == '\n' ? text.substr(0, text.size() - 1) : text;
    const int64_t s = L::parseStepName(name, &tmp);
    if (s < 0 || tmp) {
      scan.skipped.push_back(latestPath + " is unreadable (\"" + text.substr(0, 40) +
                             "\"): every complete checkpoint is a candidate");
    } else if (std::find(complete.begin(), complete.end(), s) == complete.end()) {
      scan.skipped.push_back(latestPath + " names " + name +
                             ", which does not exist: every complete checkpoint is a candidate");
    } else {
      scan.latest = s;
    }
  }
  std::vector<int64_t> candidates;
  for (int64_t s : complete) {
    if (scan.latest >= 0 && s > scan.latest) {
      scan.skipped.push_back("skipping uncommitted checkpoint " + root + "/" + L::stepName(s) + ": " + latestPath +
                             " names " + L::stepName(scan.latest) +
                             " (a save was interrupted between renaming it and moving latest)");
    } else {
      candidates.push_back(s);
    }
  }
  for (int64_t s : candidates) {
    const std::string dir = root + "/" + L::stepName(s);
    try {
      Manifest m = verifyCheckpoint(dir, fs);
      DISTILL_CHECK_T(CheckpointError, m.step == s, "manifest ", dir, "/", L::kManifest, " says step ", m.step);
      scan.chosen = std::move(m);
      scan.chosenDir = dir;
      break;
    } catch (const Error& e) {
      scan.rejected.push_back(dir + ": " + e.message());
    } catch (const std::exception& e) {
      scan.rejected.push_back(dir + ": " + e.what());
    }
  }
  return scan;
}

namespace {

// The entries of a dumpConfig() text, "section.key" -> value as written. The
// dump is distill's own canonical format (section lines, then "  key: value";
// a group's keys nested under "  group:" as "    key: value", read as
// "section.group.key"; trainer keys quoted), so it is read line by line rather than re-validated
// with parseConfig: a config built in code (which no file check saw) or one
// from another version of the schema still compares key by key.
std::vector<std::pair<std::string, std::string>> dumpEntries(const std::string& yaml) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string section, group;
  size_t lineNo = 0;
  for (size_t at = 0; at < yaml.size();) {
    size_t end = yaml.find('\n', at);
    if (end == std::string::npos) end = yaml.size();
    const std::string line = yaml.substr(at, end - at);
    at = end + 1;
    ++lineNo;
    auto bad = [&] {
      DISTILL_THROW(ConfigError, "config.yaml line ", lineNo, " is not as dumpConfig writes it: ", line.substr(0, 80));
    };
    if (line.empty()) continue;
    if (line[0] != ' ') {
      if (line.back() != ':' || line.find(' ') != std::string::npos) bad();
      section = line.substr(0, line.size() - 1);
      group.clear();
      continue;
    }
    if (section.empty() || line.size() < 3 || line.compare(0, 2, "  ") != 0) bad();
    std::string prefix = section + ".";
    size_t i = 2;
    if (line[2] == ' ') { // "    key: value": a key of the group above
      if (group.empty() || line.size() < 5 || line.compare(0, 4, "    ") != 0 || line[4] == ' ') bad();
      prefix += group + ".";
      i = 4;
    } else if (line.back() == ':' && line.find(": ") == std::string::npos && line[2] != '"') { // "  group:"
      group = line.substr(2, line.size() - 3);
      if (group.find(' ') != std::string::npos) bad();
      continue;
    } else {
      group.clear();
    }
    std::string key;
    if (line[i] == '"') { // a quoted trainer key: undo core's quote()
      for (++i; i < line.size() && line[i] != '"'; ++i) {
        char c = line[i];
        if (c == '\\' && i + 1 < line.size()) {
          const char e = line[++i];
          if (e == 'n') {
            c = '\n';
          } else if (e == 't') {
            c = '\t';
          } else if (e == 'x' && i + 2 < line.size() && isHex(line.substr(i + 1, 2), 2)) {
            c = static_cast<char>(std::stoi(line.substr(i + 1, 2), nullptr, 16));
            i += 2;
          } else {
            c = e;
          }
        }
        key += c;
      }
      if (i >= line.size()) bad();
      ++i;
    } else {
      const size_t colon = line.find(": ", i);
      if (colon == std::string::npos) bad();
      key = line.substr(i, colon - i);
      i = colon;
    }
    if (line.compare(i, 2, ": ") != 0) bad();
    out.emplace_back(prefix + key, line.substr(i + 2));
  }
  return out;
}

} // namespace

std::vector<std::string> configChanges(const std::string& savedYaml, const Config& now) {
  std::map<std::string, std::string> saved;
  std::vector<std::string> savedOrder;
  for (auto& [key, value] : dumpEntries(savedYaml)) {
    savedOrder.push_back(key);
    saved[key] = std::move(value);
  }
  std::vector<std::string> out;
  std::map<std::string, bool> seen;
  for (const auto& e : configEntries(now)) {
    seen[e.key] = true;
    if (!e.training) continue;
    auto it = saved.find(e.key);
    const std::string before = it == saved.end() ? "(unset)" : it->second;
    if (before != e.value) out.push_back(e.key + ": " + before + " -> " + e.value);
  }
  // Trainer keys only the saved run had (a schema key this version lacks is not compared).
  for (const auto& key : savedOrder) {
    if (!seen.count(key) && key.rfind("trainer.", 0) == 0) out.push_back(key + ": " + saved[key] + " -> (unset)");
  }
  return out;
}

} // namespace distill
