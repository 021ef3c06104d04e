// The catalogue of config keys for `meshtrain config --list` and
// `--print-config`: what read_run_config() reads (key, type, default and
// allowed values, recorded by Config's getters) joined with one line of
// meaning per key from a table in config_keys.cpp. A key read without a
// meaning, or a meaning for a key nobody reads, is a test failure, so the
// table stays in step with run_config.cpp.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/cli/config.h"

namespace mt {

struct KeyMeaning {
  std::string_view key;
  std::string_view meaning;
};

// The table of meanings, in the order `config --list` prints sections.
const std::vector<KeyMeaning>& key_meanings();
// The meaning of `key`, or "" when the table has none.
std::string_view key_meaning(std::string_view key);

// Every key read_run_config() knows, as its getters describe it when every
// key takes its default (read from an empty Config).
std::vector<KeyInfo> known_keys();

// `meshtrain config --list`: one line per key, KEY TYPE DEFAULT ALLOWED
// MEANING in aligned columns, grouped by section.
std::string format_key_list();

// The same as a Markdown table (key, type, default, allowed, meaning), for
// README.md's key list (`meshtrain config --list --markdown`; a test checks
// that the README holds exactly this text).
std::string format_key_markdown();

// The same as a Markdown table (key, type, default, allowed, meaning), for
// README.md's key list (`meshtrain config --list --markdown`; a test checks
// that the README holds exactly this text).
std::string format_key_markdown();

// `--print-config`: the effective configuration after reading `config`
// through read_run_config() (call that first), as TOML that loads back to
// the same run: every key the reader asked for, its value from the file or
// --set, or its default marked "# default".
std::string format_effective_config(const Config& config);

}  // namespace mt
