#include "meshtrain/cli/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "meshtrain/base/error.h"

namespace mt {

template <class T>
bool Bounds<T>::contains(T v) const {
  // Written with negations so that NaN fails every bound.
  if (min && !(min_exclusive ? v > *min : v >= *min)) return false;
  if (max && !(max_exclusive ? v < *max : v <= *max)) return false;
  return true;
}

template <class T>
std::string Bounds<T>::describe() const {
  if (min && max) {
    return fmt::format("in {}{}, {}{}", min_exclusive ? '(' : '[', *min, *max,
                       max_exclusive ? ')' : ']');
  }
  if (min) return fmt::format("{} {}", min_exclusive ? ">" : ">=", *min);
  if (max) return fmt::format("{} {}", max_exclusive ? "<" : "<=", *max);
  return "any value";
}

template struct Bounds<int64_t>;
template struct Bounds<double>;

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

namespace {

constexpr const char* kOverrideSource = "--set";

std::vector<std::string> split_key(std::string_view key) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.emplace_back(key.substr(start, dot == std::string_view::npos ? dot : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return parts;
}

bool is_bare_key(std::string_view part) {
  return !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

// Whether `prefix` names `key` or a table containing it ("train" of "train.lr").
bool covers(std::string_view prefix, std::string_view key) {
  return key == prefix ||
         (key.size() > prefix.size() && key.starts_with(prefix) && key[prefix.size()] == '.');
}

std::string trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return "";
  const auto e = s.find_last_not_of(" \t");
  return std::string(s.substr(b, e - b + 1));
}

// A float in its shortest form that still reads back as a TOML float
// (1.0, not 1).
std::string float_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// A value as the user would write it: "fast" in double quotes, 0.1 in its
// shortest form (toml++'s printer uses 'fast' and 0.10000000000000001).
std::string render(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: {
      std::string out = "\"";
      for (char c : n.as_string()->get()) {
        if (c == '"' || c == '\\') out += '\\';
        out += c;
      }
      return out + "\"";
    }
    case toml::node_type::integer:
      return fmt::format("{}", n.as_integer()->get());
    case toml::node_type::floating_point:
      return float_text(n.as_floating_point()->get());
    case toml::node_type::boolean:
      return n.as_boolean()->get() ? "true" : "false";
    case toml::node_type::array: {
      std::vector<std::string> parts;
      for (const toml::node& e : *n.as_array()) parts.push_back(render(e));
      return fmt::format("[{}]", fmt::join(parts, ", "));
    }
    case toml::node_type::table:
      return "{...}";
    default: {
      std::ostringstream os;
      n.visit([&](auto&& v) { os << v; });
      return os.str();
    }
  }
}

// "string \"fast\"", "integer 5", "array [1, 2]": what a user wrote, by type.
std::string describe(const toml::node& n) {
  if (n.is_table()) return "a table";
  std::string text = render(n);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  const char* type = "value";
  switch (n.type()) {
    case toml::node_type::string:
      type = "string";
      break;
    case toml::node_type::integer:
      type = "integer";
      break;
    case toml::node_type::floating_point:
      type = "float";
      break;
    case toml::node_type::boolean:
      type = "boolean";
      break;
    case toml::node_type::array:
      type = "array";
      break;
    case toml::node_type::date:
      type = "date";
      break;
    case toml::node_type::time:
      type = "time";
      break;
    case toml::node_type::date_time:
      type = "date-time";
      break;
    default:
      break;
  }
  return fmt::format("{} {}", type, text);
}

// The candidate closest to `word` if it is close enough to be a likely typo.
std::optional<std::string> closest(std::string_view word, const std::vector<std::string>& cands) {
  std::optional<std::string> best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& c : cands) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string last_part(std::string_view key) {
  const size_t dot = key.rfind('.');
  return std::string(dot == std::string_view::npos ? key : key.substr(dot + 1));
}

// Whether a table holds any value other than (empty) tables.
bool has_value(const toml::table& t) {
  for (auto&& [k, v] : t) {
    const toml::table* sub = v.as_table();
    if (sub == nullptr || has_value(*sub)) return true;
  }
  return false;
}

// A default as the user would write it in TOML.
std::string toml_literal(int64_t v) {
  return fmt::format("{}", v);
}
std::string toml_literal(double v) {
  return float_text(v);
}
std::string toml_literal(std::string_view v) {
  std::string out = "\"";
  for (char c : v) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}
template <class T>
std::string toml_literal(const std::vector<T>& v) {
  std::vector<std::string> parts;
  for (const T& e : v) {
    if constexpr (std::is_same_v<T, std::string>) {
      parts.push_back(toml_literal(std::string_view(e)));
    } else {
      parts.push_back(toml_literal(e));
    }
  }
  return fmt::format("[{}]", fmt::join(parts, ", "));
}

template <class T>
std::string allowed_text(const Bounds<T>& b) {
  return b.min || b.max ? b.describe() : "";
}

}  // namespace

struct Config::Impl {
  toml::table root;
  std::string source;
  std::vector<std::string> overridden;              // keys set by --set, in order
  mutable std::set<std::string, std::less<>> read;  // keys the program asked for
  mutable std::vector<KeyInfo> catalogue;           // what the getters said of each key
  mutable std::set<std::string, std::less<>> catalogued;
  bool source_empty = true;  // the file or text had no keys

  void note(std::string_view key, std::string type, std::string def, std::string allowed,
            bool required = false) const {
    if (!catalogued.emplace(key).second) return;
    catalogue.push_back(
        KeyInfo{std::string(key), std::move(type), std::move(def), std::move(allowed), required});
  }

  std::string origin(std::string_view key) const {
    for (const std::string& o : overridden) {
      if (covers(o, key)) return kOverrideSource;
    }
    return source;
  }

  [[noreturn]] void fail(std::string_view key, std::string_view shown_key, const toml::node* n,
                         const std::string& what) const {
    const std::string from = origin(key);
    std::string where;
    if (n != nullptr && from != kOverrideSource && n->source().begin.line > 0) {
      where = fmt::format(" (line {})", n->source().begin.line);
    }
    throw ConfigError(
        fmt::format("config{}{}: {}: {}{}", from.empty() ? "" : " ", from, shown_key, what, where));
  }

  // The node at `key`, or nullptr; records the key as read.
  const toml::node* find(std::string_view key) const {
    const std::vector<std::string> parts = split_key(key);
    for (const std::string& p : parts) {
      MT_CHECK(!p.empty(), "config key \"{}\" has an empty component", key);
    }
    read.emplace(key);
    const toml::table* t = &root;
    std::string path;
    for (size_t i = 0; i < parts.size(); ++i) {
      const toml::node* n = t->get(parts[i]);
      if (n == nullptr) return nullptr;
      if (i + 1 == parts.size()) return n;
      path += (i == 0 ? "" : ".") + parts[i];
      t = n->as_table();
      if (t == nullptr)
        fail(path, key, n, fmt::format("{} is {}, not a table", path, describe(*n)));
    }
    return nullptr;
  }

  int64_t as_int(std::string_view key, std::string_view shown, const toml::node& n,
                 const Bounds<int64_t>& b) const {
    if (!n.is_integer()) fail(key, shown, &n, "expected an integer, got " + describe(n));
    const int64_t v = n.as_integer()->get();
    if (!b.contains(v)) fail(key, shown, &n, fmt::format("must be {}, got {}", b.describe(), v));
    return v;
  }

  double as_double(std::string_view key, std::string_view shown, const toml::node& n,
                   const Bounds<double>& b) const {
    double v = 0;
    if (n.is_floating_point()) {
      v = n.as_floating_point()->get();
    } else if (n.is_integer()) {
      v = static_cast<double>(n.as_integer()->get());
    } else {
      fail(key, shown, &n, "expected a number, got " + describe(n));
    }
    if (!b.contains(v)) fail(key, shown, &n, fmt::format("must be {}, got {}", b.describe(), v));
    return v;
  }

  std::string as_string(std::string_view key, std::string_view shown, const toml::node& n) const {
    if (!n.is_string()) fail(key, shown, &n, "expected a string, got " + describe(n));
    return n.as_string()->get();
  }

  template <class T, class Convert>
  std::vector<T> list(std::string_view key, std::vector<T> def, const char* what,
                      Convert&& convert) const {
    const toml::node* n = find(key);
    if (n == nullptr) return def;
    const toml::array* arr = n->as_array();
    if (arr == nullptr)
      fail(key, key, n, fmt::format("expected an array of {}, got {}", what, describe(*n)));
    std::vector<T> out;
    for (size_t i = 0; i < arr->size(); ++i) {
      out.push_back(convert(fmt::format("{}[{}]", key, i), *arr->get(i)));
    }
    return out;
  }

  void collect_unused(const toml::table& t, const std::string& prefix,
                      std::vector<std::pair<std::string, const toml::node*>>& out) const {
    for (auto&& [k, v] : t) {
      const std::string key =
          prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
      const toml::table* sub = v.as_table();
      if (sub != nullptr && !sub->empty()) {
        collect_unused(*sub, key, out);
        continue;
      }
      // Used if it (or a table above it) was read, or, for an empty table,
      // if something below it was asked for.
      const bool used = std::any_of(read.begin(), read.end(), [&](const std::string& r) {
        return covers(r, key) || covers(key, r);
      });
      if (!used) out.emplace_back(key, &v);
    }
  }

  std::optional<std::string> suggest(const std::string& key) const {
    const std::vector<std::string> known(read.begin(), read.end());
    if (auto c = closest(key, known)) return c;
    // The right key in the wrong section ("model.lr" for "train.lr").
    const std::string leaf = last_part(key);
    for (const std::string& k : known) {
      if (last_part(k) == leaf && k != key) return k;
    }
    return std::nullopt;
  }
};

Config::Config() : impl_(std::make_unique<Impl>()) {}
Config::~Config() = default;
Config::Config(Config&&) noexcept = default;
Config& Config::operator=(Config&&) noexcept = default;

Config Config::load(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    throw FileError(fmt::format("config {}: file not found", path));
  }
  if (std::filesystem::is_directory(status)) {
    throw FileError(fmt::format("config {}: is a directory, expected a TOML file", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(fmt::format("config {}: cannot open: {}", path, std::strerror(errno)));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw FileError(fmt::format("config {}: read error", path));
  return parse(text, path);
}

Config Config::parse(std::string_view toml_text, const std::string& source) {
  Config c;
  c.impl_->source = source;
  try {
    c.impl_->root = toml::parse(toml_text, std::string_view(source));
    c.impl_->source_empty = !has_value(c.impl_->root);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("config {}: TOML parse error at line {}, column {}: {}", source,
                                  e.source().begin.line, e.source().begin.column, e.description()));
  }
  return c;
}

void Config::set(std::string_view assignment) {
  const std::string text(assignment);
  const size_t eq = text.find('=');
  if (eq == std::string::npos) {
    throw ConfigError(fmt::format("--set {}: expected section.key=value", text));
  }
  const std::string key = trim(text.substr(0, eq));
  const std::string value = trim(text.substr(eq + 1));
  const std::vector<std::string> parts = split_key(key);
  for (const std::string& p : parts) {
    if (!is_bare_key(p)) {
      throw ConfigError(
          fmt::format("--set {}: bad key \"{}\": expected dotted names of letters, digits, _ and -",
                      text, key));
    }
  }
  if (value.empty()) {
    throw ConfigError(fmt::format("--set {}: empty value (write \"\" for an empty string)", text));
  }

  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value, std::string_view(kOverrideSource));
  } catch (const toml::parse_error& e) {
    // Only an obvious attempt at structured TOML is an error; anything else
    // is a bare word the user did not want to quote on a shell line.
    if (std::string_view("[{\"'").find(value.front()) != std::string_view::npos) {
      throw ConfigError(fmt::format("--set {}: cannot parse {} as a TOML value: {}", text, value,
                                    e.description()));
    }
    parsed = toml::table{};
    parsed.insert("v", value);
  }
  if (parsed.size() != 1 || !parsed.contains("v")) {
    throw ConfigError(fmt::format("--set {}: expected a single value after '='", text));
  }

  toml::table* t = &impl_->root;
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path += (i == 0 ? "" : ".") + parts[i];
    toml::node* n = t->get(parts[i]);
    if (n == nullptr) {
      t->insert(parts[i], toml::table{});
      n = t->get(parts[i]);
    }
    if (!n->is_table()) {
      throw ConfigError(fmt::format("--set {}: {} is {} (from {}), not a table", text, path,
                                    describe(*n), impl_->origin(path)));
    }
    t = n->as_table();
  }
  parsed.get("v")->visit([&](auto&& node) { t->insert_or_assign(parts.back(), std::move(node)); });
  impl_->overridden.push_back(key);
}

void Config::set_all(const std::vector<std::string>& assignments) {
  for (const std::string& a : assignments) set(a);
}

const std::string& Config::source() const {
  return impl_->source;
}

bool Config::has(std::string_view key) const {
  const std::vector<std::string> parts = split_key(key);
  const toml::table* t = &impl_->root;
  for (size_t i = 0; i < parts.size(); ++i) {
    const toml::node* n = t->get(parts[i]);
    if (n == nullptr) return false;
    if (i + 1 == parts.size()) return true;
    t = n->as_table();
    if (t == nullptr) return false;
  }
  return false;
}

int64_t Config::get_int(std::string_view key, int64_t def, const Bounds<int64_t>& bounds) const {
  impl_->note(key, "integer", toml_literal(def), allowed_text(bounds));
  const toml::node* n = impl_->find(key);
  return n == nullptr ? def : impl_->as_int(key, key, *n, bounds);
}

double Config::get_double(std::string_view key, double def, const Bounds<double>& bounds) const {
  impl_->note(key, "number", toml_literal(def), allowed_text(bounds));
  const toml::node* n = impl_->find(key);
  return n == nullptr ? def : impl_->as_double(key, key, *n, bounds);
}

bool Config::get_bool(std::string_view key, bool def) const {
  impl_->note(key, "boolean", def ? "true" : "false", "");
  const toml::node* n = impl_->find(key);
  if (n == nullptr) return def;
  if (!n->is_boolean()) {
    impl_->fail(key, key, n, "expected a boolean (true or false), got " + describe(*n));
  }
  return n->as_boolean()->get();
}

std::string Config::get_string(std::string_view key, std::string_view def) const {
  impl_->note(key, "string", toml_literal(def), "");
  const toml::node* n = impl_->find(key);
  return n == nullptr ? std::string(def) : impl_->as_string(key, key, *n);
}

std::string Config::get_string(std::string_view key, std::string_view def,
                               const std::vector<std::string>& allowed) const {
  impl_->note(key, "string", toml_literal(def), fmt::format("{}", fmt::join(allowed, " | ")));
  const toml::node* n = impl_->find(key);
  if (n == nullptr) return std::string(def);
  std::string v = impl_->as_string(key, key, *n);
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
    const auto guess = closest(v, allowed);
    impl_->fail(key, key, n,
                fmt::format("unknown value \"{}\"; allowed: {}{}", v, fmt::join(allowed, ", "),
                            guess ? fmt::format(" (did you mean \"{}\"?)", *guess) : ""));
  }
  return v;
}

std::vector<int64_t> Config::get_int_list(std::string_view key, std::vector<int64_t> def,
                                          const Bounds<int64_t>& bounds) const {
  impl_->note(key, "list of integers", toml_literal(def), allowed_text(bounds));
  return impl_->list(key, std::move(def), "integers",
                     [&](const std::string& shown, const toml::node& e) {
                       return impl_->as_int(key, shown, e, bounds);
                     });
}

std::vector<double> Config::get_double_list(std::string_view key, std::vector<double> def,
                                            const Bounds<double>& bounds) const {
  impl_->note(key, "list of numbers", toml_literal(def), allowed_text(bounds));
  return impl_->list(key, std::move(def), "numbers",
                     [&](const std::string& shown, const toml::node& e) {
                       return impl_->as_double(key, shown, e, bounds);
                     });
}

std::vector<std::string> Config::get_string_list(std::string_view key,
                                                 std::vector<std::string> def) const {
  impl_->note(key, "list of strings", toml_literal(def), "");
  return impl_->list(key, std::move(def), "strings",
                     [&](const std::string& shown, const toml::node& e) {
                       return impl_->as_string(key, shown, e);
                     });
}

int64_t Config::require_int(std::string_view key, const Bounds<int64_t>& bounds) const {
  impl_->note(key, "integer", "", allowed_text(bounds), true);
  const toml::node* n = impl_->find(key);
  if (n == nullptr) impl_->fail(key, key, nullptr, "required key is missing");
  return impl_->as_int(key, key, *n, bounds);
}

double Config::require_double(std::string_view key, const Bounds<double>& bounds) const {
  impl_->note(key, "number", "", allowed_text(bounds), true);
  const toml::node* n = impl_->find(key);
  if (n == nullptr) impl_->fail(key, key, nullptr, "required key is missing");
  return impl_->as_double(key, key, *n, bounds);
}

std::string Config::require_string(std::string_view key) const {
  impl_->note(key, "string", "", "", true);
  const toml::node* n = impl_->find(key);
  if (n == nullptr) impl_->fail(key, key, nullptr, "required key is missing");
  return impl_->as_string(key, key, *n);
}

const std::vector<KeyInfo>& Config::catalogue() const {
  return impl_->catalogue;
}

std::optional<std::string> Config::value_text(std::string_view key) const {
  const std::vector<std::string> parts = split_key(key);
  const toml::table* t = &impl_->root;
  for (size_t i = 0; i < parts.size(); ++i) {
    const toml::node* n = t->get(parts[i]);
    if (n == nullptr) return std::nullopt;
    if (i + 1 == parts.size()) {
      if (n->is_table()) return std::nullopt;
      return render(*n);
    }
    t = n->as_table();
    if (t == nullptr) return std::nullopt;
  }
  return std::nullopt;
}

bool Config::source_empty() const {
  return impl_->source_empty;
}

void Config::mark_used(std::string_view key) const {
  impl_->read.emplace(key);
}

std::vector<std::string> Config::unused_keys() const {
  std::vector<std::pair<std::string, const toml::node*>> found;
  impl_->collect_unused(impl_->root, "", found);
  std::vector<std::string> keys;
  for (auto& [k, n] : found) keys.push_back(k);
  return keys;
}

void Config::check_all_used() const {
  std::vector<std::pair<std::string, const toml::node*>> found;
  impl_->collect_unused(impl_->root, "", found);
  if (found.empty()) return;
  std::string msg = fmt::format(
      "config{}{}: {} unknown key{} (present but never read):", impl_->source.empty() ? "" : " ",
      impl_->source, found.size(), found.size() == 1 ? "" : "s");
  for (const auto& [key, node] : found) {
    const std::string from = impl_->origin(key);
    std::vector<std::string> notes;
    if (from == kOverrideSource) {
      notes.push_back("from --set");
    } else if (node->source().begin.line > 0) {
      notes.push_back(fmt::format("line {}", node->source().begin.line));
    }
    if (auto s = impl_->suggest(key)) notes.push_back(fmt::format("did you mean \"{}\"?", *s));
    msg += fmt::format("\n  {}", key);
    if (!notes.empty()) msg += fmt::format(" ({})", fmt::join(notes, ", "));
  }
  throw ConfigError(msg);
}

std::string Config::dump() const {
  std::ostringstream os;
  os << impl_->root;
  return os.str();
}

}  // namespace mt
