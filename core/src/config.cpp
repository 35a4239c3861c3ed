#include "distill/core/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <type_traits>
#include <variant>

#include "distill/core/checksum.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"

namespace distill {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// An option enum's field (options.h): its spellings, and its value as an index into them.
struct EnumField {
  const char* const* names;
  size_t count;
  std::function<size_t()> get;
  std::function<void(size_t)> set;
};

// Where a key's value lives in a Config; the alternative held is also its type.
using Field = std::variant<std::string*, int*, int64_t*, double*, bool*,
                           std::vector<std::string>*, EnumField>;

template <class T>
Field fieldOf(T* p) {
  if constexpr (std::is_enum_v<T>) {
    return EnumField{EnumNames<T>::names, EnumNames<T>::count,
                     [p] { return static_cast<size_t>(*p); },
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
  KeySpec& min(double v) { range.lo = v; return *this; }
  KeySpec& above(double v) { range.lo = v; range.loOpen = true; return *this; }
  KeySpec& max(double v) { range.hi = v; return *this; }
  KeySpec& below(double v) { range.hi = v; range.hiOpen = true; return *this; }
  KeySpec& oneOf(std::vector<std::string> c) { choices = std::move(c); return *this; }
  KeySpec& byteSize() { bytes = true; return *this; }
  KeySpec& mandatory() { required = true; return *this; }
  KeySpec& nonEmpty() { notEmpty = true; return *this; }
  KeySpec& runtime() { runtimeOnly = true; return *this; }

  std::string section() const { return path.substr(0, path.find('.')); }
  std::string name() const { return path.substr(path.find('.') + 1); }

  std::string path;                  // "section.key"
  Field (*field)(Config&);           // the field in a Config
  Range range;                       // numbers only
  std::vector<std::string> choices;  // strings of a fixed form ("cuda:N" stands for cuda:<index>);
                                     // enum fields take their choices from options.h
  bool bytes = false;                // an int64 that also takes "64MiB"
  bool required = false;             // no default: the file must set it
  bool notEmpty = false;             // strings and lists
  bool runtimeOnly = false;          // cannot change what is trained (paths, ports, timeouts,
                                     // transport sizes): left out of configHash
};

// The path and the field come from one spelling, so they cannot drift apart.
#define DISTILL_KEY(sec, key) \
  KeySpec(#sec "." #key, [](Config& c) -> Field { return fieldOf(&c.sec.key); })

// The schema, in the order of options.h; ranges are its comments.
const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> keys = {
      DISTILL_KEY(run, name).nonEmpty().runtime(),
      DISTILL_KEY(run, nproc_per_node).min(2).max(kMaxProcsPerNode),
      DISTILL_KEY(run, nnodes).min(1),  // and nnodes x nproc_per_node fits an int, checked across fields
      // Each node's distill-run passes its own --node-rank: it differs between
      // nodes, so it cannot be part of the hash every rank compares on resume.
      DISTILL_KEY(run, node_rank).min(0).runtime(),  // and < run.nnodes, checked across fields
      DISTILL_KEY(run, master_addr).nonEmpty().runtime(),
      DISTILL_KEY(run, master_port).min(0).max(65535).runtime(),  // 0: a free port (single node, distill-run)
      DISTILL_KEY(run, log_dir).nonEmpty().runtime(),
      DISTILL_KEY(run, startup_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, collective_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, hang_timeout_s).min(kMinTimeoutS).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, on_hang).runtime(),
      DISTILL_KEY(run, stop_grace_s).min(0).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, status_every_s).min(1).max(kMaxTimeoutS).runtime(),
      DISTILL_KEY(run, seed),
      DISTILL_KEY(run, steps).min(0),

      DISTILL_KEY(teacher, kind).mandatory(),
      DISTILL_KEY(teacher, path),     // required by kind, checked across fields
      DISTILL_KEY(teacher, library),  // idem
      DISTILL_KEY(teacher, module),   // idem
      DISTILL_KEY(teacher, weights),
      DISTILL_KEY(teacher, method).nonEmpty(),
      DISTILL_KEY(teacher, inputs).nonEmpty(),
      DISTILL_KEY(teacher, output).nonEmpty(),
      DISTILL_KEY(teacher, hidden_states),
      DISTILL_KEY(teacher, device).oneOf({"cpu", "cuda", "cuda:N"}),
      DISTILL_KEY(teacher, autocast),
      DISTILL_KEY(teacher, max_batch_tokens).min(1).runtime(),
      DISTILL_KEY(teacher, topk).min(0),
      DISTILL_KEY(teacher, max_restarts).min(0).runtime(),
      DISTILL_KEY(teacher, threads).min(0).runtime(),
      // Runtime: a hit is bit-equal to the answer it replaces, so the cache
      // changes how fast a job runs, never what it trains.
      DISTILL_KEY(teacher, cache.path).runtime(),  // required unless mode is off, checked across fields
      DISTILL_KEY(teacher, cache.mode).oneOf({"off", "read", "write", "readwrite"}).runtime(),
      DISTILL_KEY(teacher, cache.max_bytes).byteSize().min(1 << 20).runtime(),

      DISTILL_KEY(student, grad_acc_steps).min(1),
      DISTILL_KEY(student, in_flight).min(1).runtime(),  // and <= transport.slots, checked across fields
      DISTILL_KEY(student, device).oneOf({"cpu", "cuda", "cuda:N"}),
      DISTILL_KEY(student, backend),
      DISTILL_KEY(student, bucket_mb).above(0).runtime(),

      DISTILL_KEY(transport, slots).min(1).runtime(),
      DISTILL_KEY(transport, max_request_bytes).byteSize().min(1).runtime(),
      DISTILL_KEY(transport, max_response_bytes).byteSize().min(1).runtime(),
      DISTILL_KEY(transport, heartbeat_ms).min(1).max(60000).runtime(),
      DISTILL_KEY(transport, spin_us).min(0).max(1000000).runtime(),
      DISTILL_KEY(transport, cuda_ipc).runtime(),

      DISTILL_KEY(loss, kind),
      DISTILL_KEY(loss, temperature).above(0),
      DISTILL_KEY(loss, alpha).min(0).max(1),
      DISTILL_KEY(loss, jsd_beta).above(0).below(1),
      DISTILL_KEY(loss, ignore_index),
      DISTILL_KEY(loss, chunk_tokens).min(1),

      DISTILL_KEY(checkpoint, dir).runtime(),
      DISTILL_KEY(checkpoint, every_steps).min(0).runtime(),
      DISTILL_KEY(checkpoint, keep_last).min(1).runtime(),
      DISTILL_KEY(checkpoint, async).runtime(),
      DISTILL_KEY(checkpoint, resume).runtime(),
      DISTILL_KEY(checkpoint, on_error).runtime(),
      DISTILL_KEY(checkpoint, on_corrupt).runtime(),
  };
  return keys;
}

#undef DISTILL_KEY

int keyIndex(const std::string& path) {
  const auto& keys = schema();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].path == path) return static_cast<int>(i);
  }
  return -1;
}

// Index of a key this file names itself: a miss is a typo here, not bad input.
size_t knownKey(const char* path) {
  const int i = keyIndex(path);
  DISTILL_INTERNAL_ASSERT(i >= 0, "no config key ", path);
  return static_cast<size_t>(i);
}

// The trainer's own section: any key, scalar values, passed through untouched.
const std::string kTrainerSection = "trainer";

std::vector<std::string> sectionNames() {
  std::vector<std::string> out;
  for (const KeySpec& k : schema()) {
    if (out.empty() || out.back() != k.section()) out.push_back(k.section());
  }
  out.push_back(kTrainerSection);
  return out;
}

bool isSection(const std::string& name) {
  const auto s = sectionNames();
  return std::find(s.begin(), s.end(), name) != s.end();
}

size_t levenshtein(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// Is `a` a subsequence of `b` (every character of a, in order, in b)?
bool isSubsequence(const std::string& a, const std::string& b) {
  size_t i = 0;
  for (size_t j = 0; i < a.size() && j < b.size(); ++j) i += a[i] == b[j] ? 1 : 0;
  return i == a.size();
}

// How near a mistyped name is to a known one: (tier, edit distance), lower is
// nearer; nullopt when they are unrelated. One name extending the other
// ("lrate" for "lr", "slot" for "slots") comes first, then one spelled inside
// the other ("temprature" for "temperature"), then any name within 3 edits.
// Plain edit distance alone ranks "lrate" as near "data" as "lr" (3 edits
// each): what a user who abbreviates means is the name they started to write.
// Both of the first two need the shorter name to have 2+ characters and the
// longer at most 4 times as many, so that "d" or "lr" do not match everything.
std::optional<std::pair<int, size_t>> nearness(const std::string& typo, const std::string& known) {
  const size_t d = levenshtein(typo, known);
  const std::string& shorter = typo.size() <= known.size() ? typo : known;
  const std::string& longer = typo.size() <= known.size() ? known : typo;
  if (shorter.size() >= 2 && longer.size() <= 4 * shorter.size()) {
    if (longer.compare(0, shorter.size(), shorter) == 0) return std::make_pair(0, d);
    if (isSubsequence(shorter, longer)) return std::make_pair(1, d);
  }
  if (d < 4) return std::make_pair(2, d);
  return std::nullopt;
}

// The nearest of `known` to `typo` (the first of equals), "" if none is near.
std::string nearest(const std::string& typo, const std::vector<std::string>& known) {
  std::string best;
  std::optional<std::pair<int, size_t>> bestScore;
  for (const std::string& k : known) {
    const auto score = nearness(typo, k);
    if (score && (!bestScore || *score < *bestScore)) {
      bestScore = score;
      best = k;
    }
  }
  return best;
}

// Is `path` a group of keys ("teacher.cache" of teacher.cache.mode, ...), written
// in a file as a nested map? Returns the group's key names, empty if it is none.
std::vector<std::string> groupKeys(const std::string& path) {
  std::vector<std::string> out;
  const std::string prefix = path + ".";
  for (const KeySpec& k : schema()) {
    if (k.path.compare(0, prefix.size(), prefix) == 0) out.push_back(k.path.substr(prefix.size()));
  }
  return out;
}

std::string unknownKey(const std::string& path) {
  const std::string section = path.substr(0, path.find('.'));
  const std::string name = path.substr(std::min(path.size(), section.size() + 1));
  // A key of the same section first: a typo rarely changes the section.
  std::vector<std::string> names;
  for (const KeySpec& k : schema()) {
    if (k.section() == section) names.push_back(k.name());
  }
  const std::string same = nearest(name, names);
  if (!same.empty()) return path + ": unknown key; did you mean " + section + "." + same + "?";
  // Another section's key only when the whole path is a few edits away: the same
  // name in another section ("student.temperature") is no typo of it.
  std::string best;
  size_t bestDist = 4;
  for (const KeySpec& k : schema()) {
    const size_t d = levenshtein(path, k.path);
    if (d < bestDist) {
      bestDist = d;
      best = k.path;
    }
  }
  if (!best.empty()) return path + ": unknown key; did you mean " + best + "?";
  if (!isSection(section)) return path + ": unknown key; valid sections: " + join(sectionNames());
  return path + ": unknown key; valid keys in " + section + ": " + join(names);
}

std::string unknownSection(const std::string& name) {
  // Section names are short: allow fewer edits, or "xyz" would suggest "run".
  const size_t limit = std::min<size_t>(3, name.size() / 2);
  for (const std::string& s : sectionNames()) {
    if (levenshtein(name, s) <= limit) return name + ": unknown section; did you mean " + s + "?";
  }
  return name + ": unknown section; valid sections: " + join(sectionNames());
}

// A YAML double-quoted string: readable in messages and parsed back by yaml-cpp.
std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (ch < 0x20 || ch == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\x%02x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

enum class Number { kNone, kInt, kFloat };

// Syntax of a decimal number (no hex, inf or nan): what a plain scalar means as a number.
Number numberKind(const std::string& s) {
  size_t i = 0;
  const size_t n = s.size();
  auto digits = [&] {
    const size_t start = i;
    while (i < n && s[i] >= '0' && s[i] <= '9') ++i;
    return i - start;
  };
  if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
  size_t mantissa = digits();
  bool isFloat = false;
  if (i < n && s[i] == '.') {
    ++i;
    isFloat = true;
    mantissa += digits();
  }
  if (mantissa == 0) return Number::kNone;
  if (i < n && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    isFloat = true;
    if (i < n && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) return Number::kNone;
  }
  if (i != n) return Number::kNone;
  return isFloat ? Number::kFloat : Number::kInt;
}

// from_chars: locale-independent (a trainer may have set a locale), but rejects '+'.
template <typename T>
bool parseNumber(const std::string& s, T& out) {
  const char* begin = s.data() + (!s.empty() && s[0] == '+');
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(begin, end, out);
  return ec == std::errc() && ptr == end;
}

bool isBoolText(const std::string& s) {
  static const std::set<std::string> words = {"true", "True", "TRUE", "false", "False", "FALSE"};
  return words.count(s) > 0;
}

bool isPlain(const YAML::Node& n) { return n.IsScalar() && n.Tag() == "?"; }

// How a value reads to a user: `string "hot"`, `number 3.5`, `a list`, ...
std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null: return "null";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Scalar: break;
    default: return "nothing";
  }
  const std::string& s = n.Scalar();
  if (isPlain(n) && isBoolText(s)) return "boolean " + s;
  if (isPlain(n) && numberKind(s) != Number::kNone) return "number " + s;
  return "string " + quote(s);
}

std::string expected(const char* what, const YAML::Node& n) {
  return std::string("expected ") + what + ", found " + describe(n);
}

std::string formatNumber(double v) {
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest exact form
  return std::string(buf, res.ptr);
}

// A bound as a reader writes it: 1000000, not 1e+06.
std::string formatBound(double v) {
  if (v > -1e15 && v < 1e15 && v == static_cast<double>(static_cast<int64_t>(v))) {
    return std::to_string(static_cast<int64_t>(v));
  }
  return formatNumber(v);
}

std::optional<std::string> checkRange(const Range& r, double v, const std::string& text) {
  // Written so that NaN fails.
  const bool ok = (r.loOpen ? v > r.lo : v >= r.lo) && (r.hiOpen ? v < r.hi : v <= r.hi);
  if (ok) return std::nullopt;
  std::string bound;
  if (r.lo > -kInf && r.hi < kInf) {
    bound = std::string("in ") + (r.loOpen ? "(" : "[") + formatBound(r.lo) + ", " +
            formatBound(r.hi) + (r.hiOpen ? ")" : "]");
  } else if (r.lo > -kInf) {
    bound = (r.loOpen ? "> " : ">= ") + formatBound(r.lo);
  } else {
    bound = (r.hiOpen ? "< " : "<= ") + formatBound(r.hi);
  }
  return "must be " + bound + ", found " + text;
}

bool isCudaIndex(const std::string& value) {
  const std::string prefix = "cuda:";
  return value.size() > prefix.size() && value.compare(0, prefix.size(), prefix) == 0 &&
         std::all_of(value.begin() + prefix.size(), value.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

bool matchesChoice(const std::string& value, const std::string& choice) {
  if (choice == "cuda:N") return isCudaIndex(value);
  return value == choice;
}

// A plain integer of bytes, or digits with a binary unit: "64MiB", "1 GiB". Returns
// false if `n` is no byte size at all; sets `overflow` if it does not fit an int64.
bool parseByteSize(const YAML::Node& n, int64_t& out, bool& overflow) {
  const std::string& s = n.Scalar();
  if (isPlain(n) && numberKind(s) == Number::kInt) {
    overflow = !parseNumber(s, out);  // negative or zero: the range check reports it
    return true;
  }
  size_t digits = 0;
  while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
  std::string unit = s.substr(digits);
  if (!unit.empty() && unit[0] == ' ') unit.erase(0, 1);
  int shift = 0;
  if (unit == "KiB") shift = 10;
  else if (unit == "MiB") shift = 20;
  else if (unit == "GiB") shift = 30;
  if (digits == 0 || shift == 0) return false;
  int64_t amount = 0;
  overflow = !parseNumber(s.substr(0, digits), amount) ||
             amount > (std::numeric_limits<int64_t>::max() >> shift);
  out = overflow ? 0 : amount << shift;
  return true;
}

// Parses `n` into the field `k` names in `c`. Returns the problem (without the
// path) or nothing; on a problem the field keeps its value.
std::optional<std::string> assign(const KeySpec& k, const YAML::Node& n, Config& c) {
  const Field field = k.field(c);

  if (auto* list = std::get_if<std::vector<std::string>*>(&field)) {
    if (!n.IsSequence()) return expected("a list of strings", n);
    std::vector<std::string> items;
    for (size_t i = 0; i < n.size(); ++i) {
      if (!n[i].IsScalar()) {
        return expected("a list of strings", n) + " with " + describe(n[i]) + " at index " +
               std::to_string(i);
      }
      items.push_back(n[i].Scalar());
    }
    if (k.notEmpty && items.empty()) return "must not be empty";
    **list = std::move(items);
    return std::nullopt;
  }

  if (auto* str = std::get_if<std::string*>(&field)) {
    // Any scalar is a string here: `name: 2024` means "2024".
    if (!n.IsScalar()) return expected("a string", n);
    const std::string& s = n.Scalar();
    if (k.notEmpty && s.empty()) return "must not be empty";
    if (!k.choices.empty() &&
        std::none_of(k.choices.begin(), k.choices.end(),
                     [&](const std::string& ch) { return matchesChoice(s, ch); })) {
      return "must be one of " + join(k.choices) + "; found " + quote(s);
    }
    **str = s;
    return std::nullopt;
  }

  if (auto* e = std::get_if<EnumField>(&field)) {
    if (!n.IsScalar()) return expected("a string", n);
    const std::string& s = n.Scalar();
    const auto end = e->names + e->count;
    const auto it = std::find_if(e->names, end, [&](const char* name) { return s == name; });
    if (it == end) return "must be one of " + join(std::vector<std::string>(e->names, end)) + "; found " + quote(s);
    e->set(static_cast<size_t>(it - e->names));
    return std::nullopt;
  }

  if (auto* flag = std::get_if<bool*>(&field)) {
    if (!isPlain(n) || !isBoolText(n.Scalar())) return expected("a boolean", n);
    **flag = n.Scalar()[0] == 't' || n.Scalar()[0] == 'T';
    return std::nullopt;
  }

  if (auto* real = std::get_if<double*>(&field)) {
    if (!isPlain(n) || numberKind(n.Scalar()) == Number::kNone) return expected("a number", n);
    double v = 0;
    if (!parseNumber(n.Scalar(), v)) return "must be a finite number, found " + n.Scalar();
    if (auto problem = checkRange(k.range, v, n.Scalar())) return problem;
    **real = v;
    return std::nullopt;
  }

  // int or int64, possibly a byte size.
  int64_t v = 0;
  bool overflow = false;
  if (k.bytes) {
    if (!n.IsScalar() || !parseByteSize(n, v, overflow)) return expected("a byte size", n);
  } else {
    if (!isPlain(n) || numberKind(n.Scalar()) != Number::kInt) return expected("an integer", n);
    overflow = !parseNumber(n.Scalar(), v);
  }
  if (overflow) {
    return "must be in [" + std::to_string(std::numeric_limits<int64_t>::min()) + ", " +
           std::to_string(std::numeric_limits<int64_t>::max()) + "], found " + n.Scalar();
  }
  if (auto problem = checkRange(k.range, static_cast<double>(v), n.Scalar())) return problem;
  if (std::holds_alternative<int*>(field)) {
    // Past the key's own range only when it does not fit an int: name both bounds then.
    Range fits = k.range;
    fits.lo = std::max<double>(fits.lo, INT_MIN);
    fits.hi = std::min<double>(fits.hi, INT_MAX);
    if (auto problem = checkRange(fits, static_cast<double>(v), n.Scalar())) return problem;
  }
  if (auto* i32 = std::get_if<int*>(&field)) {
    **i32 = static_cast<int>(v);
  } else {
    *std::get<int64_t*>(field) = v;
  }
  return std::nullopt;
}

std::string formatValue(const Field& field) {
  struct {
    std::string operator()(const std::string* s) const { return quote(*s); }
    std::string operator()(const int* v) const { return std::to_string(*v); }
    std::string operator()(const int64_t* v) const { return std::to_string(*v); }
    std::string operator()(const double* v) const { return formatNumber(*v); }
    std::string operator()(const bool* v) const { return *v ? "true" : "false"; }
    std::string operator()(const EnumField& e) const {
      const size_t i = e.get();
      DISTILL_INTERNAL_ASSERT(i < e.count, "option enum value ", i, " out of range");
      return quote(e.names[i]);
    }
    std::string operator()(const std::vector<std::string>* v) const {
      std::vector<std::string> items;
      for (const std::string& s : *v) items.push_back(quote(s));
      return "[" + join(items) + "]";
    }
  } format;
  return std::visit(format, field);
}

// The value a key was given, and by which override ("" = the file).
struct Setting {
  YAML::Node node;
  std::string origin;
};

// " (from --set)" after a problem of an override; "" for the file's.
std::string fromText(const std::string& origin) { return origin.empty() ? "" : " (from " + origin + ")"; }

// A value of the trainer section: a scalar, kept as written. Returns the problem, if any.
std::optional<std::string> trainerValue(const YAML::Node& n, std::string& out) {
  if (!n.IsScalar()) {
    return "expected a scalar (the trainer's keys take strings, numbers or booleans), found " +
           describe(n);
  }
  out = n.Scalar();
  return std::nullopt;
}

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
  if (body.IsNull()) return;  // every key of the group commented out
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
  if (doc.IsNull()) return true;  // an empty file: only the required keys will be missing
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
    if (body.IsNull()) continue;  // "loss:" with every key commented out
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
          trainer[kv.first.Scalar()] = value;  // the later one wins, as for distill's keys
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

void readOverrides(const std::vector<ConfigOverride>& overrides,
                   std::vector<std::optional<Setting>>& values,
                   std::map<std::string, std::string>& trainer,
                   std::vector<std::string>& problems) {
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
        if (auto problem = trainerValue(YAML::Load(o.substr(eq + 1)), value)) {
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
      values[i] = Setting{YAML::Load(o.substr(eq + 1)), over.origin.empty() ? "--set" : over.origin};
    } catch (const YAML::Exception& e) {
      problems.push_back(path + ": not a YAML value: " + e.msg + from);
    }
  }
}

// "trainer.<key>: <what>" as a ConfigError, naming the file when known.
[[noreturn]] void trainerProblem(const TrainerOptions& t, const std::string& key, const std::string& what) {
  DISTILL_THROW(ConfigError, "config ", t.source.empty() ? "<string>" : t.source, ": 1 problem(s):\n",
                kTrainerSection, ".", key, ": ", what);
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
    trainerProblem(t, key, "must be in [" + std::to_string(std::numeric_limits<int64_t>::min()) + ", " +
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

}  // namespace

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
bool TrainerOptions::getBool(const std::string& key) const {
  return trainerBool(*this, key, requiredText(*this, key));
}

void TrainerOptions::expectOnly(const std::vector<std::string>& known) const {
  std::vector<std::string> problems;
  for (const auto& kv : values) {
    const std::string& key = kv.first;
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const std::string best = nearest(key, known);
    const std::string path = kTrainerSection + "." + key;
    problems.push_back(best.empty()
                           ? path + ": unknown key; valid keys in " + kTrainerSection + ": " + join(known)
                           : path + ": unknown key; did you mean " + kTrainerSection + "." + best + "?");
  }
  if (problems.empty()) return;
  std::string msg = "config " + (source.empty() ? std::string("<string>") : source) + ": " +
                    std::to_string(problems.size()) + " problem(s):";
  for (const std::string& p : problems) msg += "\n" + p;
  DISTILL_THROW(ConfigError, msg);
}

namespace {

Config parseWith(const std::string& yamlText, const std::vector<ConfigOverride>& overrides,
                 const std::string& sourceName) {
  YAML::Node doc;
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
    if (!docs.empty()) doc = docs[0];
  } catch (const YAML::Exception& e) {
    DISTILL_THROW(ConfigError, "config ", sourceName, ": YAML syntax error at line ",
                  e.mark.line + 1, ", column ", e.mark.column + 1, ": ", e.msg);
  }

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
  std::vector<bool> valid(keys.size(), true);  // false: the key's value had a problem
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

  // Across fields, only between values that are valid on their own.
  const auto ok = [&](const char* path) { return valid[knownKey(path)]; };
  const auto suffix = [&](const char* path) {
    const auto& v = values[knownKey(path)];
    return v ? fromText(v->origin) : std::string();
  };
  const auto needs = [&](const char* path, const std::string& value) {
    if (value.empty() && ok(path)) {
      problems.push_back(std::string(path) + ": required when teacher.kind is " +
                         toString(config.teacher.kind));
    }
  };
  if (values[knownKey("teacher.kind")] && ok("teacher.kind")) {
    if (config.teacher.kind == TeacherKind::kTorchscript) needs("teacher.path", config.teacher.path);
    if (config.teacher.kind == TeacherKind::kRegistered) {
      needs("teacher.library", config.teacher.library);
      needs("teacher.module", config.teacher.module);
    }
  }
  if (ok("teacher.cache.mode") && ok("teacher.cache.path") && config.teacher.cache.mode != "off" &&
      config.teacher.cache.path.empty()) {
    problems.push_back("teacher.cache.path: required when teacher.cache.mode is " + config.teacher.cache.mode +
                       suffix("teacher.cache.mode"));
  }
  if (ok("student.in_flight") && ok("transport.slots") &&
      config.student.in_flight > config.transport.slots) {
    problems.push_back("student.in_flight: must be <= transport.slots (" +
                       std::to_string(config.transport.slots) + "), found " +
                       std::to_string(config.student.in_flight) + suffix("student.in_flight"));
  }
  if (ok("run.nnodes") && ok("run.nproc_per_node") &&
      static_cast<int64_t>(config.run.nnodes) * config.run.nproc_per_node > INT_MAX) {
    // Ranks and world sizes are ints (RANK, WORLD_SIZE, c10d): a job must number its processes in one.
    problems.push_back("run.nnodes: run.nnodes x run.nproc_per_node must be <= " + std::to_string(INT_MAX) +
                       " (every rank of the job is an int), found " + std::to_string(config.run.nnodes) + " x " +
                       std::to_string(config.run.nproc_per_node) + suffix("run.nnodes"));
  }
  if (ok("run.node_rank") && ok("run.nnodes") && config.run.node_rank >= config.run.nnodes) {
    problems.push_back("run.node_rank: must be < run.nnodes (" +
                       std::to_string(config.run.nnodes) + "), found " +
                       std::to_string(config.run.node_rank) + suffix("run.node_rank"));
  }

  if (!problems.empty()) {
    std::string msg = "config " + sourceName + ": " + std::to_string(problems.size()) +
                      " problem(s):";
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

}  // namespace

Config parseConfig(const std::string& yamlText, const std::vector<std::string>& overrides,
                   const std::string& sourceName) {
  return parseWith(yamlText, fromSet(overrides), sourceName);
}

Config loadConfig(const std::string& path, const std::vector<ConfigOverride>& overrides) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                        &std::fclose);
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

std::string stringOverride(const std::string& key, const std::string& value) { return key + "=" + quote(value); }

std::vector<std::string> configKeys() {
  std::vector<std::string> out;
  for (const KeySpec& k : schema()) out.push_back(k.path);
  return out;
}

std::string dumpConfig(const Config& config) {
  Config copy = config;  // the schema's accessors take a mutable Config
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
  Config copy = config;  // the schema's accessors take a mutable Config
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
  for (const auto& [key, e] : left) {  // trainer keys only a has
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

}  // namespace

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

}  // namespace distill

namespace distill {

Config jobConfig(int& argc, char** argv) {
  std::string path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {  // the rest belongs to someone else
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

}  // namespace distill
