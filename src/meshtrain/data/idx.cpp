#include "meshtrain/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// Far above any real IDX data set (MNIST's largest file is 47 MB), far below
// where byte counts could overflow.
constexpr int64_t kMaxIdxBytes = int64_t{1} << 40;

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose_r(f); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

// Reads up to n bytes into dst; returns how many were read. Throws on a zlib
// error other than a plain early end of input, because a CRC mismatch or bad
// deflate data means the bytes we did get cannot be trusted either.
int64_t read_some(gzFile f, const std::string& path, uint8_t* dst, int64_t n) {
  int64_t got = 0;
  while (got < n) {
    const auto chunk = static_cast<unsigned>(std::min<int64_t>(n - got, INT_MAX / 2));
    const int r = gzread(f, dst + got, chunk);
    if (r < 0) {
      int errnum = 0;
      const char* msg = gzerror(f, &errnum);
      throw FileError(fmt::format("{}: corrupt or unreadable gzip data: {}", path,
                                  errnum == Z_ERRNO ? std::strerror(errno) : msg));
    }
    if (r == 0) break;
    got += r;
  }
  return got;
}

uint32_t big_endian_u32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

GzHandle open_checked(const std::string& path, const std::string& missing_hint) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    throw FileError(fmt::format("{}: file not found{}{}", path, missing_hint.empty() ? "" : "; ",
                                missing_hint));
  }
  if (std::filesystem::is_directory(status)) {
    throw FileError(fmt::format("{}: expected an IDX file, found a directory", path));
  }
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw FileError(fmt::format("{}: cannot open: {}", path,
                                errno != 0 ? std::strerror(errno) : "out of memory"));
  }
  return GzHandle(f);
}

}  // namespace

IdxArray read_idx(const std::string& path, uint32_t expected_magic, int64_t limit,
                  const std::string& missing_hint) {
  GzHandle file = open_checked(path, missing_hint);
  gzFile f = file.get();

  uint8_t word[4];
  const int64_t got_magic = read_some(f, path, word, 4);
  if (got_magic < 4) {
    throw FileError(fmt::format("{}: truncated: expected a 4-byte IDX magic number, found {} bytes",
                                path, got_magic));
  }
  const uint32_t magic = big_endian_u32(word);
  if (magic != expected_magic) {
    throw FileError(fmt::format(
        "{}: not an IDX file of the expected kind: expected magic 0x{:08x} (unsigned bytes, {} "
        "dimensions), found 0x{:08x}",
        path, expected_magic, expected_magic & 0xff, magic));
  }

  IdxArray out;
  const int ndims = static_cast<int>(magic & 0xff);
  for (int d = 0; d < ndims; ++d) {
    if (read_some(f, path, word, 4) < 4) {
      throw FileError(fmt::format(
          "{}: truncated header: expected {} dimension sizes after the magic, found only {}", path,
          ndims, d));
    }
    out.dims.push_back(big_endian_u32(word));
  }

  // Each dimension is below 2^32, so products of three can overflow int64:
  // a corrupt header must be reported, not computed with.
  int64_t record_bytes = 1;
  int64_t total_bytes = 1;
  bool overflow = false;
  for (int d = 0; d < ndims; ++d) {
    const int64_t dim = out.dims[static_cast<size_t>(d)];
    if (d > 0) overflow |= __builtin_mul_overflow(record_bytes, dim, &record_bytes);
    overflow |= __builtin_mul_overflow(total_bytes, dim, &total_bytes);
  }
  if (overflow || total_bytes > kMaxIdxBytes) {
    throw FileError(fmt::format("{}: implausible IDX header: dimensions [{}] exceed {} bytes", path,
                                fmt::join(out.dims, ", "), kMaxIdxBytes));
  }
  const int64_t declared = out.dims.empty() ? 0 : out.dims[0];
  out.records = limit >= 0 ? std::min(limit, declared) : declared;
  const int64_t want = out.records * record_bytes;

  // Grow the buffer as data arrives instead of trusting the header's size up
  // front: a corrupt count must give "truncated", not a multi-gigabyte allocation.
  constexpr int64_t kBlock = int64_t{16} << 20;
  int64_t have = 0;
  while (have < want) {
    const int64_t n = std::min(kBlock, want - have);
    out.data.resize(static_cast<size_t>(have + n));
    const int64_t got = read_some(f, path, out.data.data() + have, n);
    have += got;
    if (got < n) {
      throw FileError(fmt::format(
          "{}: truncated: header declares {} records of {} bytes ({} bytes of data), file has "
          "only {} bytes of data",
          path, declared, record_bytes, declared * record_bytes, have));
    }
  }

  if (limit < 0 || limit >= declared) {
    uint8_t extra[4096];
    int64_t trailing = 0;
    for (int64_t got; (got = read_some(f, path, extra, sizeof(extra))) > 0;) trailing += got;
    if (trailing > 0) {
      throw FileError(fmt::format(
          "{}: {} bytes of trailing data after the {} records of {} bytes the header declares",
          path, trailing, declared, record_bytes));
    }
  }
  return out;
}

}  // namespace mt
