// Reading a config: the YAML document and its overrides (--set, DISTILL_SET)
// into a Config, every problem collected and reported at once.
#include <cerrno>
#include <climits>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config_impl.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"

namespace distill {

using namespace config_impl;

namespace {

// The value a key was given, and by which override ("" = the file).
struct Setting {
  YAML::Node node;
  std::string origin;
};

// " (from --set)" after a problem of an override; "" for the file's.
std::string fromText(const std::string& origin) { return origin.empty() ? "" : " (from " + origin + ")"; }

// Records the value of the key at `path` (an unknown key or a repeated one is a problem).
void readKey(const std::string& path, const YAML::Node& value, std::vector<std::optional<Setting>>& values,
             std::vector<std::string>& problems) {
  const int i = keyIndex(path);
  if (i < 0) {
    problems.push_back(unknownKey(path));
    return;
  }
  // yaml-cpp keeps both entries of a repeated key; the later one wins.
  if (values[i]) problems.push_back(path + ": duplicate key");
  values[i] = Setting{value, ""};
}

// A group of keys written as a nested map: "teacher:\n  cache:\n    mode: read"
// sets teacher.cache.mode (one level of nesting; --set spells the whole path).
void readGroup(const std::string& path, const std::vector<std::string>& keys, const YAML::Node& body,
               std::vector<std::optional<Setting>>& values, std::vector<std::string>& problems) {
  if (body.IsNull()) return; // every key of the group commented out
  if (!body.IsMap()) {
    problems.push_back(path + ": expected a map of " + join(keys) + ", found " + describe(body));
    return;
  }
  for (const auto& kv : body) {
    if (!kv.first.IsScalar()) {
      problems.push_back(path + ": expected a key name, found " + describe(kv.first));
      continue;
    }
    readKey(path + "." + kv.first.Scalar(), kv.second, values, problems);
  }
}

// Records each key's value from the document, and the problems of its shape
// (not a map, unknown names, duplicates). Values themselves are checked later,
// except the trainer's, which are only checked to be scalars.
// Returns false if the document is no map at all.
bool readDocument(const YAML::Node& doc, std::vector<std::optional<Setting>>& values,
                  std::map<std::string, std::string>& trainer, std::vector<std::string>& problems) {
  if (doc.IsNull()) return true; // an empty file: only the required keys will be missing
  if (!doc.IsMap()) {
    problems.push_back("(document): expected a map of sections, found " + describe(doc));
    return false;
  }
  std::set<std::string> seen;
  for (const auto& sec : doc) {
    if (!sec.first.IsScalar()) {
      problems.push_back("(document): expected a section name, found " + describe(sec.first));
      continue;
    }
    const std::string& name = sec.first.Scalar();
    if (!isSection(name)) {
      problems.push_back(unknownSection(name));
      continue;
    }
    if (!seen.insert(name).second) problems.push_back(name + ": duplicate section");
    const YAML::Node& body = sec.second;
    if (body.IsNull()) continue; // "loss:" with every key commented out
    if (!body.IsMap()) {
      problems.push_back(name + ": expected a map, found " + describe(body));
      continue;
    }
    for (const auto& kv : body) {
      if (!kv.first.IsScalar()) {
        problems.push_back(name + ": expected a key name, found " + describe(kv.first));
        continue;
      }
      const std::string path = name + "." + kv.first.Scalar();
      if (name == kTrainerSection) {
        std::string value;
        if (auto problem = trainerValue(kv.second, value)) {
          problems.push_back(path + ": " + *problem);
          continue;
        }
        if (!trainer.emplace(kv.first.Scalar(), value).second) {
          problems.push_back(path + ": duplicate key");
          trainer[kv.first.Scalar()] = value; // the later one wins, as for distill's keys
        }
        continue;
      }
      if (const auto group = groupKeys(path); !group.empty()) {
        readGroup(path, group, kv.second, values, problems);
        continue;
      }
      readKey(path, kv.second, values, problems);
    }
  }
  return true;
}

// `s` with its control characters as YAML escapes ("a\nb"), for messages.
std::string escaped(const std::string& s) {
  const std::string q = quote(s);
  return q.substr(1, q.size() - 2);
}

// The first control character of `s` as "\n at byte 5"; "" if there is none.
std::string controlCharacter(const std::string& s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>(s[i]);
    if (ch < 0x20 || ch == 0x7f) return escaped(s.substr(i, 1)) + " at byte " + std::to_string(i);
  }
  return "";
}

// An override's value: YAML, but an empty one (`--set checkpoint.dir=`) is the empty string,
// as `dir: ""` in a file, not YAML's null (which no key takes).
YAML::Node overrideValue(const std::string& text) {
  return text.find_first_not_of(" \t") == std::string::npos ? YAML::Load("\"\"") : YAML::Load(text);
}

void readOverrides(const std::vector<ConfigOverride>& overrides, std::vector<std::optional<Setting>>& values,
                   std::map<std::string, std::string>& trainer, std::vector<std::string>& problems) {
  const std::string trainerPrefix = kTrainerSection + ".";
  for (const ConfigOverride& over : overrides) {
    const std::string& o = over.setting;
    const std::string from = fromText(over.origin.empty() ? "--set" : over.origin);
    const size_t eq = o.find('=');
    const std::string path = o.substr(0, eq);
    // An override is one line of text: distill-run hands them to the ranks one
    // per line (DISTILL_SET), and a YAML scalar on one line carries no control
    // character; refused, not encoded, so that every process reads the same.
    if (const std::string bad = controlCharacter(o); !bad.empty()) {
      problems.push_back((path.empty() ? std::string("(empty)") : escaped(path)) +
                         ": an override must be one line of printable text, found the control character " + bad +
                         " (a double-quoted YAML value can carry it escaped)" + from);
      continue;
    }
    if (eq == std::string::npos || eq == 0) {
      problems.push_back((o.empty() ? "(empty)" : o) + ": expected key=value" + from);
      continue;
    }
    if (path == kTrainerSection || path.compare(0, trainerPrefix.size(), trainerPrefix) == 0) {
      const std::string key = path.substr(std::min(path.size(), trainerPrefix.size()));
      if (key.empty()) {
        problems.push_back(path + ": expected trainer.KEY=value" + from);
        continue;
      }
      try {
        std::string value;
        if (auto problem = trainerValue(overrideValue(o.substr(eq + 1)), value)) {
          problems.push_back(path + ": " + *problem + from);
        } else {
          trainer[key] = value;
        }
      } catch (const YAML::Exception& e) {
        problems.push_back(path + ": not a YAML value: " + e.msg + from);
      }
      continue;
    }
    const int i = keyIndex(path);
    if (i < 0) {
      problems.push_back(unknownKey(path) + from);
      continue;
    }
    try {
      values[i] = Setting{overrideValue(o.substr(eq + 1)), over.origin.empty() ? "--set" : over.origin};
    } catch (const YAML::Exception& e) {
      problems.push_back(path + ": not a YAML value: " + e.msg + from);
    }
  }
}

// The one YAML document of `yamlText` (null when empty).
YAML::Node loadDocument(const std::string& yamlText, const std::string& sourceName) {
  try {
    // All documents, to refuse a second one: YAML::Load would read the first
    // and silently drop the rest (two configs pasted into one file).
    std::vector<YAML::Node> docs = YAML::LoadAll(yamlText);
    if (docs.size() > 1) {
      const YAML::Mark mark = docs[1].Mark();
      DISTILL_THROW(ConfigError, "config ", sourceName, ": holds ", docs.size(), " YAML documents",
                    mark.is_null() ? std::string() : " (the second from line " + std::to_string(mark.line + 1) + ")",
                    "; a config is one document: remove the '---' line(s) or split the file");
    }
    return docs.empty() ? YAML::Node() : docs[0];
  } catch (const YAML::Exception& e) {
    DISTILL_THROW(ConfigError, "config ", sourceName, ": YAML syntax error at line ", e.mark.line + 1, ", column ",
                  e.mark.column + 1, ": ", e.msg);
  }
}

// teacher.procs against run.nproc_per_node, teacher.devices against teacher.procs.
template <typename Ok, typename Suffix>
void checkTeacherPool(const Config& config, const Ok& ok, const Suffix& suffix, std::vector<std::string>& problems) {
  const int k = config.teacher.procs;
  if (ok("teacher.procs") && ok("run.nproc_per_node") && k >= config.run.nproc_per_node) {
    problems.push_back("teacher.procs: must leave a student on each node: below run.nproc_per_node (" +
                       std::to_string(config.run.nproc_per_node) + "), found " + std::to_string(k) +
                       suffix("teacher.procs"));
  }
  if (!ok("teacher.devices")) return;
  const auto& devices = config.teacher.devices;
  if (ok("teacher.procs") && devices.size() > 1 && int(devices.size()) != k) {
    problems.push_back("teacher.devices: names " + std::to_string(devices.size()) +
                       " devices; give one per teacher (teacher.procs " + std::to_string(k) +
                       "), one for all, or none (teacher.device)" + suffix("teacher.devices"));
  }
  for (const std::string& d : devices) {
    try {
      parseDevice(d);
    } catch (const Error& e) {
      problems.push_back("teacher.devices: " + e.message() + suffix("teacher.devices"));
    }
  }
}

// teacher.answer against teacher.topk and teacher.hidden_states.
template <typename Ok, typename Suffix>
void checkTeacherAnswer(const Config& config, const Ok& ok, const Suffix& suffix, std::vector<std::string>& problems) {
  if (!ok("teacher.answer") || !ok("teacher.topk")) return;
  const TeacherOptions& t = config.teacher;
  if (t.answer == TeacherAnswer::kTopk && t.topk == 0) {
    problems.push_back("teacher.answer: topk needs teacher.topk > 0 (the k answered), found 0" +
                       suffix("teacher.answer"));
  }
  if ((t.answer == TeacherAnswer::kLogits || t.answer == TeacherAnswer::kHidden) && t.topk > 0) {
    problems.push_back("teacher.answer: " + std::string(toString(t.answer)) + " answers no top-k: set teacher.topk: 0 " +
                       "(found " + std::to_string(t.topk) + ") or teacher.answer: topk" + suffix("teacher.answer"));
  }
  // The hidden states are the answer itself: a response carries nothing beside them.
  if (t.answer == TeacherAnswer::kHidden && ok("teacher.hidden_states") && !t.hidden_states.empty()) {
    problems.push_back("teacher.hidden_states: cannot be returned with teacher.answer: hidden (the output " +
                       std::string("teacher.output is the hidden states); set teacher.hidden_states: []") +
                       suffix("teacher.hidden_states"));
  }
}

// teacher.samples (sampled answers, answer_kinds.h) against what cannot take them yet or ever.
template <typename Ok, typename Suffix>
void checkSamples(const Config& config, const Ok& ok, const Suffix& suffix, std::vector<std::string>& problems) {
  if (!ok("teacher.samples") || config.teacher.samples == 0) return;
  const std::string s = "teacher.samples (" + std::to_string(config.teacher.samples) + ")";
  const auto add = [&](const std::string& why) { problems.push_back(why + suffix("teacher.samples")); };
  if (ok("teacher.topk") && config.teacher.topk > 0) add(s + ": one answer kind: set teacher.topk: 0 or teacher.samples: 0");
  if (ok("teacher.answer") && config.teacher.answer != TeacherAnswer::kAuto) {
    add(s + ": one answer kind: teacher.answer " + toString(config.teacher.answer) +
        " answers no samples; set teacher.answer: auto or teacher.samples: 0");
  }
  if (ok("loss.kind") && config.loss.kind != LossKind::kForwardKl) {
    add(s + " with loss.kind " + toString(config.loss.kind) +
        ": sampled answers give an unbiased forward KL only (docs/losses.md, \"Sampled targets\"); use "
        "loss.kind: forward_kl");
  }
  if (ok("teacher.on_nonfinite") && config.teacher.on_nonfinite == TeacherOnNonfinite::kMask) {
    add(s + ": a sampled answer cannot mark a masked token (integer counts): set teacher.on_nonfinite: error");
  }
  if (ok("teacher.hidden_states") && !config.teacher.hidden_states.empty()) {
    add(s + ": sampled answers carry no hidden states: set teacher.hidden_states: []");
  }
}

// teacher.request_ids (ids answers) and loss.kind sampled_token, which needs them.
template <typename Ok, typename Suffix>
void checkRequestIds(const Config& config, const Ok& ok, const Suffix& suffix, std::vector<std::string>& problems) {
  if (ok("loss.kind") && ok("teacher.request_ids") && config.loss.kind == LossKind::kSampledToken &&
      config.teacher.request_ids == 0) {
    problems.push_back("loss.kind sampled_token: needs the teacher's log-probability of each sampled token, an ids "
                       "answer: set teacher.request_ids: 1 (or more) and hand Steps each micro-batch's sampled "
                       "tokens (docs/onpolicy.md, \"The sampled-token recipe\")" +
                       suffix("loss.kind"));
  }
  if (!ok("teacher.request_ids") || config.teacher.request_ids == 0) return;
  if (ok("teacher.answer") && config.teacher.answer == TeacherAnswer::kHidden) {
    problems.push_back("teacher.request_ids (" + std::to_string(config.teacher.request_ids) +
                       "): ids answers are the teacher's logits at the ids, and teacher.answer hidden sends no "
                       "logits; set teacher.request_ids: 0 or another teacher.answer" +
                       suffix("teacher.request_ids"));
  }
}

// The rules between keys, only between values that are valid on their own.
void checkAcrossFields(const Config& config, const std::vector<std::optional<Setting>>& values,
                       const std::vector<bool>& valid, std::vector<std::string>& problems) {
  const auto ok = [&](const char* path) { return valid[knownKey(path)]; };
  const auto suffix = [&](const char* path) {
    const auto& v = values[knownKey(path)];
    return v ? fromText(v->origin) : std::string();
  };
  const auto needs = [&](const char* path, const std::string& value) {
    if (value.empty() && ok(path)) {
      problems.push_back(std::string(path) + ": required when teacher.kind is " + toString(config.teacher.kind));
    }
  };
  if (values[knownKey("teacher.kind")] && ok("teacher.kind")) {
    if (config.teacher.kind == TeacherKind::kTorchscript) needs("teacher.path", config.teacher.path);
    if (config.teacher.kind == TeacherKind::kRegistered) {
      needs("teacher.library", config.teacher.library);
      needs("teacher.module", config.teacher.module);
    }
  }
  if (ok("teacher.cache.mode") && ok("teacher.cache.path") && config.teacher.cache.mode != CacheMode::kOff &&
      config.teacher.cache.path.empty()) {
    problems.push_back("teacher.cache.path: required when teacher.cache.mode is " +
                       std::string(toString(config.teacher.cache.mode)) + suffix("teacher.cache.mode"));
  }
  // A response holds four tensors (ipc kMaxTensors): the logits and up to
  // three hidden states, or the top-k output's four and none.
  if (ok("teacher.hidden_states") && ok("teacher.topk") && config.teacher.topk > 0 &&
      !config.teacher.hidden_states.empty()) {
    problems.push_back("teacher.hidden_states: cannot be returned with teacher.topk (" +
                       std::to_string(config.teacher.topk) +
                       "): the top-k output's four tensors fill a response; set teacher.topk: 0 or "
                       "teacher.hidden_states: []" +
                       suffix("teacher.hidden_states"));
  } else if (ok("teacher.hidden_states") && config.teacher.hidden_states.size() > size_t(kMaxHiddenStates)) {
    problems.push_back("teacher.hidden_states: at most " + std::to_string(kMaxHiddenStates) +
                       " fit in a response next to the logits, found " +
                       std::to_string(config.teacher.hidden_states.size()) + suffix("teacher.hidden_states"));
  }
  checkTeacherAnswer(config, ok, suffix, problems);
  if (ok("student.in_flight") && ok("transport.slots") && config.student.in_flight > config.transport.slots) {
    problems.push_back("student.in_flight: must be <= transport.slots (" + std::to_string(config.transport.slots) +
                       "), found " + std::to_string(config.student.in_flight) + suffix("student.in_flight"));
  }
  if (ok("run.nnodes") && ok("run.nproc_per_node") &&
      static_cast<int64_t>(config.run.nnodes) * config.run.nproc_per_node > INT_MAX) {
    // Ranks and world sizes are ints (RANK, WORLD_SIZE, c10d): a job must number its processes in one.
    problems.push_back("run.nnodes: run.nnodes x run.nproc_per_node must be <= " + std::to_string(INT_MAX) +
                       " (every rank of the job is an int), found " + std::to_string(config.run.nnodes) + " x " +
                       std::to_string(config.run.nproc_per_node) + suffix("run.nnodes"));
  }
  checkTeacherPool(config, ok, suffix, problems);
  checkSamples(config, ok, suffix, problems);
  checkRequestIds(config, ok, suffix, problems);
  if (ok("run.node_rank") && ok("run.nnodes") && config.run.node_rank >= config.run.nnodes) {
    problems.push_back("run.node_rank: must be < run.nnodes (" + std::to_string(config.run.nnodes) + "), found " +
                       std::to_string(config.run.node_rank) + suffix("run.node_rank"));
  }
}

Config parseWith(const std::string& yamlText, const std::vector<ConfigOverride>& overrides,
                 const std::string& sourceName) {
  const YAML::Node doc = loadDocument(yamlText, sourceName);
  const auto& keys = schema();
  std::vector<std::optional<Setting>> values(keys.size());
  std::vector<std::string> problems;
  // A document that is no map says nothing about required keys: don't pile on.
  std::map<std::string, std::string> trainer;
  const bool isMap = readDocument(doc, values, trainer, problems);
  readOverrides(overrides, values, trainer, problems);

  Config config;
  config.trainer.values = std::move(trainer);
  config.trainer.source = sourceName;
  std::vector<bool> valid(keys.size(), true); // false: the key's value had a problem
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!values[i]) {
      if (keys[i].required && isMap) problems.push_back(keys[i].path + ": required key is missing");
      continue;
    }
    if (auto problem = assign(keys[i], values[i]->node, config)) {
      problems.push_back(keys[i].path + ": " + *problem + fromText(values[i]->origin));
      valid[i] = false;
    }
  }

  checkAcrossFields(config, values, valid, problems);

  if (!problems.empty()) {
    std::string msg = "config " + sourceName + ": " + std::to_string(problems.size()) + " problem(s):";
    for (const std::string& p : problems) msg += "\n" + p;
    DISTILL_THROW(ConfigError, msg);
  }
  return config;
}

std::vector<ConfigOverride> fromSet(const std::vector<std::string>& overrides) {
  std::vector<ConfigOverride> out;
  for (const std::string& o : overrides) out.push_back({o, "--set"});
  return out;
}

} // namespace

Config parseConfig(const std::string& yamlText, const std::vector<std::string>& overrides,
                   const std::string& sourceName) {
  return parseWith(yamlText, fromSet(overrides), sourceName);
}

Config loadConfig(const std::string& path, const std::vector<ConfigOverride>& overrides) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) DISTILL_THROW(ConfigError, "config ", path, ": cannot open: ", errnoString(errno));
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, file.get())) > 0) text.append(buf, n);
  if (std::ferror(file.get())) {
    DISTILL_THROW(ConfigError, "config ", path, ": cannot read: ", errnoString(errno));
  }
  Config config = parseWith(text, overrides, path);
  config.source = path;
  return config;
}

Config loadConfig(const std::string& path, const std::vector<std::string>& overrides) {
  return loadConfig(path, fromSet(overrides));
}

} // namespace distill
