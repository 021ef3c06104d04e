#include "meshtrain/train/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

[[noreturn]] void fail(const std::string& path, std::string_view stage, int err) {
  throw FileError(fmt::format("saving {}: {} failed: {}", path, stage, std::strerror(err)));
}

// Closes the descriptor and removes the temporary unless released, so every
// early exit (exception from the producer included) cleans up.
class TempFile {
 public:
  TempFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // Closes now, reporting the error that a deferred write may surface here.
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }
  void mark_renamed() { renamed_ = true; }

 private:
  std::string path_;
  int fd_;
  bool renamed_ = false;
};

}  // namespace

void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink& sink)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  if (!target.has_filename()) {
    throw FileError(fmt::format("saving {}: the path names a directory, not a file", path));
  }
  // pid plus a counter keeps concurrent savers (threads or processes) apart.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = (dir / fmt::format(".{}.tmp-{}-{}", target.filename().string(),
                                             ::getpid(), counter.fetch_add(1)))
                              .string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, fmt::format("creating temporary file {}", tmp), errno);
  TempFile file(tmp, fd);

  const ByteSink sink = [&](const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(file.fd(), p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(path, fmt::format("writing temporary file {}", tmp), errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  };
  produce(sink);

  if (::fsync(file.fd()) != 0) fail(path, fmt::format("fsync of {}", tmp), errno);
  if (file.close() != 0) fail(path, fmt::format("closing {}", tmp), errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    fail(path, fmt::format("renaming {} over it", tmp), errno);
  }
  file.mark_renamed();
  // Without this the rename may be lost in a crash even though the data is
  // on disk.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) fail(path, fmt::format("opening directory {} to fsync it", dir.string()), errno);
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0) fail(path, fmt::format("fsync of directory {}", dir.string()), err);
}

}  // namespace mt
