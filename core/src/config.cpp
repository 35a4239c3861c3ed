#include "distill/core/config.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "config_impl.h"
#include "distill/core/checksum.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"

namespace distill {

using namespace config_impl;

namespace {

// "trainer.<key>: <what>" as a ConfigError, naming the file when known.
[[noreturn]] void trainerProblem(const TrainerOptions& t, const std::string& key, const std::string& what) {
  DISTILL_THROW(ConfigError, "config ", t.source.empty() ? "<string>" : t.source, ": 1 problem(s):\n", kTrainerSection,
                ".", key, ": ", what);
}

// The text of `key`, or nullptr when not set.
const std::string* trainerText(const TrainerOptions& t, const std::string& key) {
  auto it = t.values.find(key);
  return it == t.values.end() ? nullptr : &it->second;
}

const std::string& requiredText(const TrainerOptions& t, const std::string& key) {
  const std::string* text = trainerText(t, key);
  if (!text) trainerProblem(t, key, "required by the trainer, missing");
  return *text;
}

int64_t trainerInt(const TrainerOptions& t, const std::string& key, const std::string& text) {
  int64_t v = 0;
  if (numberKind(text) != Number::kInt) trainerProblem(t, key, "expected an integer, found " + quote(text));
  if (!parseNumber(text, v)) {
    trainerProblem(t, key,
                   "must be in [" + std::to_string(std::numeric_limits<int64_t>::min()) + ", " +
                       std::to_string(std::numeric_limits<int64_t>::max()) + "], found " + text);
  }
  return v;
}

double trainerDouble(const TrainerOptions& t, const std::string& key, const std::string& text) {
  double v = 0;
  if (numberKind(text) == Number::kNone) trainerProblem(t, key, "expected a number, found " + quote(text));
  if (!parseNumber(text, v)) trainerProblem(t, key, "must be a finite number, found " + text);
  return v;
}

bool trainerBool(const TrainerOptions& t, const std::string& key, const std::string& text) {
  if (!isBoolText(text)) trainerProblem(t, key, "expected a boolean, found " + quote(text));
  return text[0] == 't' || text[0] == 'T';
}

} // namespace

std::string TrainerOptions::getString(const std::string& key, const std::string& fallback) const {
  const std::string* text = trainerText(*this, key);
  return text ? *text : fallback;
}
int64_t TrainerOptions::getInt(const std::string& key, int64_t fallback) const {
  const std::string* text = trainerText(*this, key);
  return text ? trainerInt(*this, key, *text) : fallback;
}
double TrainerOptions::getDouble(const std::string& key, double fallback) const {
  const std::string* text = trainerText(*this, key);
  return text ? trainerDouble(*this, key, *text) : fallback;
}
bool TrainerOptions::getBool(const std::string& key, bool fallback) const {
  const std::string* text = trainerText(*this, key);
  return text ? trainerBool(*this, key, *text) : fallback;
}
std::string TrainerOptions::getString(const std::string& key) const { return requiredText(*this, key); }
int64_t TrainerOptions::getInt(const std::string& key) const {
  return trainerInt(*this, key, requiredText(*this, key));
}
double TrainerOptions::getDouble(const std::string& key) const {
  return trainerDouble(*this, key, requiredText(*this, key));
}
bool TrainerOptions::getBool(const std::string& key) const { return trainerBool(*this, key, requiredText(*this, key)); }

void TrainerOptions::expectOnly(const std::vector<std::string>& known) const {
  std::vector<std::string> problems;
  for (const auto& kv : values) {
    const std::string& key = kv.first;
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const std::string best = nearest(key, known);
    const std::string path = kTrainerSection + "." + key;
    problems.push_back(best.empty() ? path + ": unknown key; valid keys in " + kTrainerSection + ": " + join(known)
                                    : path + ": unknown key; did you mean " + kTrainerSection + "." + best + "?");
  }
  if (problems.empty()) return;
  std::string msg = "config " + (source.empty() ? std::string("<string>") : source) + ": " +
      std::to_string(problems.size()) + " problem(s):";
  for (const std::string& p : problems) msg += "\n" + p;
  DISTILL_THROW(ConfigError, msg);
}

DeviceSpec parseDevice(const std::string& device) {
  DeviceSpec d;
  if (device == "cpu") return d;
  d.cuda = true;
  if (device == "cuda") return d;
  DISTILL_CHECK_T(ConfigError, isCudaIndex(device) && device.size() <= 5 + 9, "device ", quote(device),
                  ": must be one of cpu, cuda, cuda:N");
  d.index = std::stoi(device.substr(5));
  return d;
}

std::string teacherDevice(const TeacherOptions& t, int teacher) {
  if (t.devices.empty()) return t.device;
  if (t.devices.size() == 1) return t.devices[0];
  DISTILL_CHECK_T(ConfigError, teacher >= 0 && size_t(teacher) < t.devices.size(),
                  "teacher.devices: no device for teacher ", teacher, " (", t.devices.size(), " given)");
  return t.devices[size_t(teacher)];
}

std::string stringOverride(const std::string& key, const std::string& value) { return key + "=" + quote(value); }

std::vector<std::string> configKeys() {
  std::vector<std::string> out;
  for (const KeySpec& k : schema()) out.push_back(k.path);
  return out;
}

std::string dumpConfig(const Config& config) {
  Config copy = config; // the schema's accessors take a mutable Config
  std::string out;
  std::string section, group;
  for (const KeySpec& k : schema()) {
    if (k.section() != section) {
      section = k.section();
      group.clear();
      out += section + ":\n";
    }
    // A key of a group ("cache.mode") is written nested, under its group's line.
    const size_t dot = k.name().find('.');
    if (dot == std::string::npos) {
      group.clear();
      out += "  " + k.name() + ": " + formatValue(k.field(copy)) + "\n";
      continue;
    }
    if (k.name().substr(0, dot) != group) {
      group = k.name().substr(0, dot);
      out += "  " + group + ":\n";
    }
    out += "    " + k.name().substr(dot + 1) + ": " + formatValue(k.field(copy)) + "\n";
  }
  // Only when set: configs without it keep the hash they had before the section existed.
  if (!config.trainer.values.empty()) {
    out += kTrainerSection + ":\n";
    for (const auto& [key, value] : config.trainer.values) out += "  " + quote(key) + ": " + quote(value) + "\n";
  }
  return out;
}

std::vector<ConfigEntry> configEntries(const Config& config) {
  Config copy = config; // the schema's accessors take a mutable Config
  std::vector<ConfigEntry> out;
  for (const KeySpec& k : schema()) out.push_back({k.path, formatValue(k.field(copy)), !k.runtimeOnly});
  for (const auto& [key, value] : config.trainer.values) {
    out.push_back({kTrainerSection + "." + key, quote(value), true});
  }
  return out;
}

std::vector<std::string> configDiff(const Config& a, const Config& b, bool trainingOnly) {
  std::map<std::string, ConfigEntry> left;
  for (ConfigEntry& e : configEntries(a)) left.emplace(e.key, std::move(e));
  std::vector<std::string> out;
  for (const ConfigEntry& e : configEntries(b)) {
    auto it = left.find(e.key);
    if (trainingOnly && !e.training) {
      if (it != left.end()) left.erase(it);
      continue;
    }
    if (it == left.end() || it->second.value != e.value) out.push_back(e.key);
    if (it != left.end()) left.erase(it);
  }
  for (const auto& [key, e] : left) { // trainer keys only a has
    if (!trainingOnly || e.training) out.push_back(key);
  }
  return out;
}

namespace {

// CRC32C (core/checksum.h) of `s` continuing from `h`, then a 0xff separator
// byte: ("ab","c") and ("a","bc") differ.
void crcMix(uint32_t& h, const std::string& s) {
  static const unsigned char kSeparator = 0xff;
  h = crc32c(s.data(), s.size(), h);
  h = crc32c(&kSeparator, 1, h);
}

// A value as a description carries it: as is, or its digest when long.
std::string describedValue(const std::string& value) {
  constexpr size_t kLongValue = 200;
  if (value.size() <= kLongValue) return value;
  uint32_t h = 0;
  crcMix(h, value);
  char buf[32];
  std::snprintf(buf, sizeof buf, "#crc32c:%08x", static_cast<unsigned>(h));
  return buf;
}

} // namespace

std::string configDescription(const Config& config) {
  std::string out;
  for (const ConfigEntry& e : configEntries(config)) out += quote(e.key) + ": " + quote(describedValue(e.value)) + "\n";
  return out;
}

std::vector<ConfigMismatch> compareConfig(const Config& config, const std::string& description) {
  // Theirs, in their order (yaml-cpp keeps a map's order).
  std::vector<std::pair<std::string, std::string>> theirs;
  try {
    const YAML::Node doc = YAML::Load(description);
    DISTILL_CHECK_T(ConfigError, doc.IsMap() || doc.IsNull(), "a config description must be a map, found ",
                    describe(doc));
    for (const auto& kv : doc) {
      DISTILL_CHECK_T(ConfigError, kv.first.IsScalar() && kv.second.IsScalar(),
                      "a config description maps keys to scalars");
      theirs.emplace_back(kv.first.Scalar(), kv.second.Scalar());
    }
  } catch (const YAML::Exception& e) {
    DISTILL_THROW(ConfigError, "not a config description: ", e.msg);
  }
  std::map<std::string, std::string> left(theirs.begin(), theirs.end());
  std::vector<ConfigMismatch> out;
  const std::string notSet = "(not set)";
  for (const ConfigEntry& e : configEntries(config)) {
    const std::string mine = describedValue(e.value);
    auto it = left.find(e.key);
    if (it == left.end()) {
      out.push_back({e.key, mine, notSet});
      continue;
    }
    if (it->second != mine) out.push_back({e.key, mine, it->second});
    left.erase(it);
  }
  for (const auto& [key, value] : theirs) {
    if (left.count(key)) out.push_back({key, notSet, value});
  }
  return out;
}

uint64_t configHash(const Config& config) {
  uint32_t h = 0;
  auto mix = [&h](const std::string& s) { crcMix(h, s); };
  for (const ConfigEntry& e : configEntries(config)) {
    if (!e.training) continue;
    mix(e.key);
    mix(e.value);
  }
  return h;
}

std::vector<std::string> extractSetOverrides(int& argc, char** argv) {
  std::vector<std::string> out;
  if (argc < 1) return out;
  int kept = 1;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg == "--set") {
      if (i + 1 >= argc || std::string(argv[i + 1]) == "--") {
        DISTILL_THROW(ConfigError, "--set needs a section.key=value argument after it");
      }
      out.push_back(argv[++i]);
    } else if (arg.compare(0, 6, "--set=") == 0) {
      out.push_back(arg.substr(6));
    } else {
      argv[kept++] = argv[i];
    }
  }
  for (; i < argc; ++i) argv[kept++] = argv[i];
  argc = kept;
  argv[argc] = nullptr;
  return out;
}

Config jobConfig(int& argc, char** argv) {
  std::string path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") { // the rest belongs to someone else
      for (; i < argc; ++i) argv[out++] = argv[i];
      break;
    }
    if (a == "--config") {
      DISTILL_CHECK_T(ConfigError, i + 1 < argc, "--config needs a file name");
      path = argv[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      path = a.substr(9);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
  if (path.empty()) {
    const char* env = std::getenv("DISTILL_CONFIG");
    if (env) path = env;
  }
  DISTILL_CHECK_T(ConfigError, !path.empty(),
                  "no config: pass --config FILE or set DISTILL_CONFIG (distill-run sets it)");
  std::vector<std::string> overrides;
  if (const char* env = std::getenv("DISTILL_SET")) {
    std::string all = env;
    size_t start = 0;
    while (start <= all.size()) {
      size_t nl = all.find('\n', start);
      std::string line = all.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
      if (!line.empty()) overrides.push_back(line);
      if (nl == std::string::npos) break;
      start = nl + 1;
    }
  }
  auto own = extractSetOverrides(argc, argv);
  overrides.insert(overrides.end(), own.begin(), own.end());
  return loadConfig(path, overrides);
}

} // namespace distill
