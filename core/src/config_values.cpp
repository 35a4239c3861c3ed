// A YAML value into a Config field: the checks and messages of each kind of
// value (strings, enums, lists, booleans, numbers, byte sizes, ranges).
#include <algorithm>
#include <climits>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config_impl.h"
#include "distill/core/errors.h"
#include "distill/core/strings.h"

namespace distill::config_impl {

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
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

bool isBoolText(const std::string& s) {
  static const std::set<std::string> words = {"true", "True", "TRUE", "false", "False", "FALSE"};
  return words.count(s) > 0;
}

bool isPlain(const YAML::Node& n) { return n.IsScalar() && n.Tag() == "?"; }

std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Scalar:
      break;
    default:
      return "nothing";
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
  const auto res = std::to_chars(buf, buf + sizeof buf, v); // shortest exact form
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
    bound = std::string("in ") + (r.loOpen ? "(" : "[") + formatBound(r.lo) + ", " + formatBound(r.hi) +
        (r.hiOpen ? ")" : "]");
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
    overflow = !parseNumber(s, out); // negative or zero: the range check reports it
    return true;
  }
  size_t digits = 0;
  while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
  std::string unit = s.substr(digits);
  if (!unit.empty() && unit[0] == ' ') unit.erase(0, 1);
  int shift = 0;
  if (unit == "KiB")
    shift = 10;
  else if (unit == "MiB")
    shift = 20;
  else if (unit == "GiB")
    shift = 30;
  if (digits == 0 || shift == 0) return false;
  int64_t amount = 0;
  overflow = !parseNumber(s.substr(0, digits), amount) || amount > (std::numeric_limits<int64_t>::max() >> shift);
  out = overflow ? 0 : amount << shift;
  return true;
}

namespace {

std::optional<std::string> assignList(const KeySpec& k, const YAML::Node& n, std::vector<std::string>& out) {
  if (!n.IsSequence()) return expected("a list of strings", n);
  std::vector<std::string> items;
  for (size_t i = 0; i < n.size(); ++i) {
    if (!n[i].IsScalar()) {
      return expected("a list of strings", n) + " with " + describe(n[i]) + " at index " + std::to_string(i);
    }
    items.push_back(n[i].Scalar());
  }
  if (k.notEmpty && items.empty()) return "must not be empty";
  out = std::move(items);
  return std::nullopt;
}

std::optional<std::string> assignString(const KeySpec& k, const YAML::Node& n, std::string& out) {
  // Any scalar is a string here: `name: 2024` means "2024".
  if (!n.IsScalar()) return expected("a string", n);
  const std::string& s = n.Scalar();
  if (k.notEmpty && s.empty()) return "must not be empty";
  if (!k.choices.empty() &&
      std::none_of(k.choices.begin(), k.choices.end(), [&](const std::string& ch) { return matchesChoice(s, ch); })) {
    return "must be one of " + join(k.choices) + "; found " + quote(s);
  }
  out = s;
  return std::nullopt;
}

std::optional<std::string> assignEnum(const YAML::Node& n, const EnumField& e) {
  if (!n.IsScalar()) return expected("a string", n);
  const std::string& s = n.Scalar();
  const auto end = e.names + e.count;
  const auto it = std::find_if(e.names, end, [&](const char* name) { return s == name; });
  if (it == end) return "must be one of " + join(std::vector<std::string>(e.names, end)) + "; found " + quote(s);
  e.set(static_cast<size_t>(it - e.names));
  return std::nullopt;
}

std::optional<std::string> assignBool(const YAML::Node& n, bool& out) {
  if (!isPlain(n) || !isBoolText(n.Scalar())) return expected("a boolean", n);
  out = n.Scalar()[0] == 't' || n.Scalar()[0] == 'T';
  return std::nullopt;
}

std::optional<std::string> assignDouble(const KeySpec& k, const YAML::Node& n, double& out) {
  if (!isPlain(n) || numberKind(n.Scalar()) == Number::kNone) return expected("a number", n);
  double v = 0;
  if (!parseNumber(n.Scalar(), v)) return "must be a finite number, found " + n.Scalar();
  if (auto problem = checkRange(k.range, v, n.Scalar())) return problem;
  out = v;
  return std::nullopt;
}

// An int or int64 field, possibly a byte size.
std::optional<std::string> assignInteger(const KeySpec& k, const YAML::Node& n, const Field& field) {
  int64_t v = 0;
  bool overflow = false;
  if (k.autoZero && n.IsScalar() && n.Scalar() == "auto") {
    v = 0;
  } else if (k.bytes) {
    if (!n.IsScalar() || !parseByteSize(n, v, overflow))
      return expected(k.autoZero ? "a byte size or auto" : "a byte size", n);
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

} // namespace

std::optional<std::string> assign(const KeySpec& k, const YAML::Node& n, Config& c) {
  const Field field = k.field(c);
  if (auto* list = std::get_if<std::vector<std::string>*>(&field)) return assignList(k, n, **list);
  if (auto* str = std::get_if<std::string*>(&field)) return assignString(k, n, **str);
  if (auto* e = std::get_if<EnumField>(&field)) return assignEnum(n, *e);
  if (auto* flag = std::get_if<bool*>(&field)) return assignBool(n, **flag);
  if (auto* real = std::get_if<double*>(&field)) return assignDouble(k, n, **real);
  return assignInteger(k, n, field);
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

std::optional<std::string> trainerValue(const YAML::Node& n, std::string& out) {
  if (!n.IsScalar()) {
    return "expected a scalar (the trainer's keys take strings, numbers or booleans), found " + describe(n);
  }
  out = n.Scalar();
  return std::nullopt;
}

} // namespace distill::config_impl
