#pragma once

// What the files of the config reader share (internal to core/src):
//   config_schema.cpp  the keys distill knows (one table), names, "did you mean"
//   config_values.cpp  a YAML value into a field: numbers, booleans, byte sizes, ranges
//   config_read.cpp    a document and its overrides into a Config, checks across keys
//   config.cpp         the public calls of config.h: dump, diff, hash, jobConfig, ...

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "distill/core/config.h"

namespace distill::config_impl {

constexpr double kInf = std::numeric_limits<double>::infinity();

// An option enum's field (options.h): its spellings, and its value as an index into them.
struct EnumField {
  const char* const* names;
  size_t count;
  std::function<size_t()> get;
  std::function<void(size_t)> set;
};

// Where a key's value lives in a Config; the alternative held is also its type.
using Field = std::variant<std::string*, int*, int64_t*, double*, bool*, std::vector<std::string>*, EnumField>;

template <class T>
Field fieldOf(T* p) {
  if constexpr (std::is_enum_v<T>) {
    return EnumField{EnumNames<T>::names, EnumNames<T>::count, [p] { return static_cast<size_t>(*p); },
                     [p](size_t i) { *p = static_cast<T>(i); }};
  } else {
    return p;
  }
}

// Allowed numbers: lo..hi, either end open; an infinite end is no bound.
struct Range {
  double lo = -kInf;
  double hi = kInf;
  bool loOpen = false;
  bool hiOpen = false;
};

// One key of the schema. The setters chain so that the table reads one line per key.
struct KeySpec {
  KeySpec(const char* p, Field (*f)(Config&)) : path(p), field(f) {}
  KeySpec& min(double v) {
    range.lo = v;
    return *this;
  }
  KeySpec& above(double v) {
    range.lo = v;
    range.loOpen = true;
    return *this;
  }
  KeySpec& max(double v) {
    range.hi = v;
    return *this;
  }
  KeySpec& below(double v) {
    range.hi = v;
    range.hiOpen = true;
    return *this;
  }
  KeySpec& oneOf(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  KeySpec& byteSize() {
    bytes = true;
    return *this;
  }
  KeySpec& orAuto() {
    autoZero = true;
    return *this;
  }
  KeySpec& mandatory() {
    required = true;
    return *this;
  }
  KeySpec& nonEmpty() {
    notEmpty = true;
    return *this;
  }
  KeySpec& runtime() {
    runtimeOnly = true;
    return *this;
  }

  std::string section() const { return path.substr(0, path.find('.')); }
  std::string name() const { return path.substr(path.find('.') + 1); }

  std::string path; // "section.key"
  Field (*field)(Config&); // the field in a Config
  Range range; // numbers only
  std::vector<std::string> choices; // strings of a fixed form ("cuda:N" stands for cuda:<index>);
                                    // enum fields take their choices from options.h
  bool bytes = false; // an int64 that also takes "64MiB"
  bool autoZero = false; // an int64 that also takes "auto", stored as 0
  bool required = false; // no default: the file must set it
  bool notEmpty = false; // strings and lists
  bool runtimeOnly = false; // cannot change what is trained (paths, ports, timeouts,
                            // transport sizes): left out of configHash
};

// The schema, in the order of options.h; ranges are its comments.
const std::vector<KeySpec>& schema();
int keyIndex(const std::string& path);
// Index of a key this file names itself: a miss is a typo here, not bad input.
size_t knownKey(const char* path);

// The trainer's own section: any key, scalar values, passed through untouched.
extern const std::string kTrainerSection;

std::vector<std::string> sectionNames();
bool isSection(const std::string& name);
// The nearest of `known` to `typo` (the first of equals), "" if none is near.
std::string nearest(const std::string& typo, const std::vector<std::string>& known);
// Is `path` a group of keys ("teacher.cache" of teacher.cache.mode, ...), written
// in a file as a nested map? Returns the group's key names, empty if it is none.
std::vector<std::string> groupKeys(const std::string& path);
std::string unknownKey(const std::string& path);
std::string unknownSection(const std::string& name);

// A YAML double-quoted string: readable in messages and parsed back by yaml-cpp.
std::string quote(const std::string& s);

enum class Number { kNone, kInt, kFloat };

// Syntax of a decimal number (no hex, inf or nan): what a plain scalar means as a number.
Number numberKind(const std::string& s);

// from_chars: locale-independent (a trainer may have set a locale), but rejects '+'.
template <typename T>
bool parseNumber(const std::string& s, T& out) {
  const char* begin = s.data() + (!s.empty() && s[0] == '+');
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(begin, end, out);
  return ec == std::errc() && ptr == end;
}

bool isBoolText(const std::string& s);
bool isPlain(const YAML::Node& n);
// How a value reads to a user: `string "hot"`, `number 3.5`, `a list`, ...
std::string describe(const YAML::Node& n);
std::string expected(const char* what, const YAML::Node& n);
bool isCudaIndex(const std::string& value);

// Parses `n` into the field `k` names in `c`. Returns the problem (without the
// path) or nothing; on a problem the field keeps its value.
std::optional<std::string> assign(const KeySpec& k, const YAML::Node& n, Config& c);
std::string formatValue(const Field& field);
// A value of the trainer section: a scalar, kept as written. Returns the problem, if any.
std::optional<std::string> trainerValue(const YAML::Node& n, std::string& out);

} // namespace distill::config_impl
