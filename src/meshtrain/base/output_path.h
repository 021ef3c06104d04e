// Checks, before a run starts, that a path it will write later can be
// written, so a bad output path fails in seconds instead of after hours of
// training. Probing leaves nothing behind: it inspects the path and its
// nearest existing ancestor (stat and access(2) for write permission) and
// creates nothing; create_output_parents() then makes the missing parent
// directories once every check has passed. Blocks on file-system metadata
// calls only. Free functions, thread-safe.
#pragma once

#include <string>

namespace mt {

// How the writer will use the path.
enum class OutputKind {
  file,           // opened and overwritten in place (metrics JSON lines)
  replaced_file,  // written to a temporary beside it, then renamed over it
  directory,      // a directory the writer fills (created if missing)
};

// Throws FileError "{what} {path}: cannot write ...: {reason}" when the path
// cannot be written as `kind`: an existing directory where a file is meant
// (or the reverse), an existing file without write permission, or a nearest
// existing ancestor that is not a directory or not writable. Missing parent
// directories are fine when they can be created. `what` names the setting,
// e.g. "train.checkpoint" or "--metrics". An empty path passes.
void check_output_path(const std::string& path, OutputKind kind, const std::string& what);

// Creates the missing parent directories of `path` (not `path` itself).
// Throws FileError naming `what`, the path and the system error.
void create_output_parents(const std::string& path, const std::string& what);

}  // namespace mt
