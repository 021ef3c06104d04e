#include "meshtrain/base/output_path.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what, const std::string& path,
                       const std::string& reason) {
  throw FileError(fmt::format("{} {}: cannot write there: {}", what, path, reason));
}

// access(2) checks the real user's permissions and a read-only file system;
// it creates nothing, so probing leaves no trace.
bool can(const fs::path& p, int mode) {
  return ::access(p.c_str(), mode) == 0;
}

}  // namespace

void check_output_path(const std::string& path, OutputKind kind, const std::string& what) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path target = fs::absolute(path, ec);
  if (ec) fail(what, path, ec.message());
  const fs::file_status st = fs::status(target, ec);  // follows symlinks
  if (fs::exists(st)) {
    const bool is_dir = fs::is_directory(st);
    if (kind == OutputKind::directory) {
      if (!is_dir) fail(what, path, "it exists and is not a directory");
      if (!can(target, W_OK | X_OK)) {
        fail(what, path, fmt::format("the directory is not writable ({})", std::strerror(errno)));
      }
      return;
    }
    if (is_dir) fail(what, path, "it is a directory; give a file name");
    if (!can(target, W_OK)) {
      fail(what, path, fmt::format("the file is not writable ({})", std::strerror(errno)));
    }
    // Written in place: the directory itself is not touched.
    if (kind == OutputKind::file) return;
  }
  // The nearest ancestor that exists must be a directory in which the
  // missing ones (or, for a replaced file, its temporary) can be created.
  fs::path dir = target.parent_path();
  while (!fs::exists(fs::status(dir, ec))) {
    const fs::path up = dir.parent_path();
    if (up == dir) break;
    dir = up;
  }
  if (!fs::is_directory(fs::status(dir, ec))) {
    fail(what, path, fmt::format("{} is not a directory", dir.string()));
  }
  if (!can(dir, W_OK | X_OK)) {
    fail(what, path,
         fmt::format("directory {} is not writable ({})", dir.string(), std::strerror(errno)));
  }
}

void create_output_parents(const std::string& path, const std::string& what) {
  if (path.empty()) return;
  std::error_code ec;
  const fs::path parent = fs::absolute(path, ec).parent_path();
  if (!ec) fs::create_directories(parent, ec);
  if (ec) {
    throw FileError(fmt::format("{} {}: cannot create directory {}: {}", what, path,
                                parent.string(), ec.message()));
  }
}

}  // namespace mt
