// Config: the run configuration, read from a TOML file plus command-line
// overrides (`--set section.key=value`), with typed getters that name the
// source and key in every error, and a final check that no key in the file
// went unread (typos become errors with a "did you mean" suggestion).
//
// Owned by the CLI, which maps it to each component's Options struct in one
// place; components never see a Config. Loading blocks on file I/O; getters do
// not. Keys are dotted paths of bare TOML keys ("train.lr"). Getters record
// which keys were asked for (that is what check_all_used() compares against)
// and, for `meshtrain config --list`, each key's type, default and allowed
// values (catalogue()), so they are const but not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

// An allowed range for a number, checked by the getters: e.g.
// Bounds<double>::positive() accepts x > 0, Bounds<int64_t>::in(1, 8) 1..8.
template <class T>
struct Bounds {
  std::optional<T> min, max;
  bool min_exclusive = false;
  bool max_exclusive = false;

  static Bounds any() { return {}; }
  static Bounds positive() { return {T(0), std::nullopt, true, false}; }
  static Bounds non_negative() { return {T(0), std::nullopt, false, false}; }
  static Bounds at_least(T lo) { return {lo, std::nullopt, false, false}; }
  static Bounds in(T lo, T hi) { return {lo, hi, false, false}; }  // closed interval

  bool contains(T v) const;
  // "any value", "> 0", ">= 1", "in [0, 1]", "in (0, 1]", "<= 5".
  std::string describe() const;
};
extern template struct Bounds<int64_t>;
extern template struct Bounds<double>;

// One key a getter was asked for, as the getter described it: what
// `meshtrain config --list` prints next to the key's meaning.
struct KeyInfo {
  std::string key;      // "train.lr"
  std::string type;     // "integer", "number", "boolean", "string", "list of integers", ...
  std::string def;      // the default as TOML text ("0.01", "\"sgd\"", "[]"); "" if required
  std::string allowed;  // "> 0", "in [0, 1]", "sgd | adamw"; "" for any value
  bool required = false;
};

class Config {
 public:
  // An empty configuration: every getter returns its default.
  Config();
  ~Config();
  Config(Config&&) noexcept;
  Config& operator=(Config&&) noexcept;

  // Reads a TOML file. Missing/unreadable file: FileError naming the path.
  // Syntax error: ConfigError naming the path, line and column.
  static Config load(const std::string& path);
  // Parses TOML text; `source` names it in messages (e.g. "<defaults>").
  static Config parse(std::string_view toml, const std::string& source);

  // Applies one override "section.key=value". The value is read as a TOML
  // value (5, 0.1, true, "text", [2, 1]); anything that is not valid TOML and
  // does not start with [ { " or ' is taken as a bare string (adamw). Missing
  // tables are created. Throws ConfigError for a malformed assignment.
  void set(std::string_view assignment);
  void set_all(const std::vector<std::string>& assignments);

  // The file path or source name given to load()/parse(); "" when empty.
  const std::string& source() const;
  // Whether the key is present (does not count as reading it).
  bool has(std::string_view key) const;

  // Typed getters: the value at `key`, or `def` when absent. A present value
  // of the wrong type or outside `bounds` throws ConfigError, e.g.
  // `config configs/x.toml: train.lr: expected a number, got string "fast"`.
  // Integers are accepted where a float is expected, not the other way round.
  int64_t get_int(std::string_view key, int64_t def,
                  const Bounds<int64_t>& bounds = Bounds<int64_t>::any()) const;
  double get_double(std::string_view key, double def,
                    const Bounds<double>& bounds = Bounds<double>::any()) const;
  bool get_bool(std::string_view key, bool def) const;
  std::string get_string(std::string_view key, std::string_view def) const;
  // Enum-like: the value must be one of `allowed` (the error lists them and
  // suggests the closest). `def` is returned unchecked when the key is absent.
  std::string get_string(std::string_view key, std::string_view def,
                         const std::vector<std::string>& allowed) const;
  std::vector<int64_t> get_int_list(std::string_view key, std::vector<int64_t> def,
                                    const Bounds<int64_t>& bounds = Bounds<int64_t>::any()) const;
  std::vector<double> get_double_list(std::string_view key, std::vector<double> def,
                                      const Bounds<double>& bounds = Bounds<double>::any()) const;
  std::vector<std::string> get_string_list(std::string_view key,
                                           std::vector<std::string> def) const;

  // Required variants: a missing key throws ConfigError "required key is missing".
  int64_t require_int(std::string_view key,
                      const Bounds<int64_t>& bounds = Bounds<int64_t>::any()) const;
  double require_double(std::string_view key,
                        const Bounds<double>& bounds = Bounds<double>::any()) const;
  std::string require_string(std::string_view key) const;

  // Every key a getter has asked for, in the order first asked (a key asked
  // for twice keeps its first description). Reading an empty Config through
  // the program's reader lists every key it knows with its default.
  const std::vector<KeyInfo>& catalogue() const;

  // The value at `key` as TOML text ("0.05", "\"sgd\"", "[512, 512]"), or
  // nullopt when absent or a table; does not count as reading it.
  std::optional<std::string> value_text(std::string_view key) const;

  // Whether the loaded file or text holds no values at all (nothing, comments
  // only, or empty [section] headers), whatever --set adds.
  bool source_empty() const;

  // Counts `key` and everything under it as read, for sections that another
  // component consumes as a whole.
  void mark_used(std::string_view key) const;
  // Keys present (in the file or from --set) that no getter has asked for,
  // in document order; tables count through their leaves.
  std::vector<std::string> unused_keys() const;
  // Throws ConfigError listing every unused key with its source and, where a
  // key that was asked for is close, "did you mean ...". Call it after the
  // program has read everything it knows.
  void check_all_used() const;

  // The effective configuration (file plus overrides) as TOML text, for logs.
  std::string dump() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Levenshtein distance between two strings (insertions, deletions, substitutions).
size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace mt
