// Compiled with MT_VERSION (CMake's PROJECT_VERSION) and MT_GIT_DESCRIBE
// (`git describe` at configure time, empty outside a git checkout) as
// definitions of this file alone, so a new commit recompiles nothing else.
#include <fmt/format.h>

#include "meshtrain/cli/commands.h"

#ifndef MT_VERSION
#define MT_VERSION "unknown"
#endif
#ifndef MT_GIT_DESCRIBE
#define MT_GIT_DESCRIBE ""
#endif

namespace mt {

std::string version_string() {
  const std::string git = MT_GIT_DESCRIBE;
  return git.empty() ? fmt::format("meshtrain {}", MT_VERSION)
                     : fmt::format("meshtrain {} (git {})", MT_VERSION, git);
}

}  // namespace mt
