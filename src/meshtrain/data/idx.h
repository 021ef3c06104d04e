// Reader for the IDX format of (Fashion-)MNIST, optionally gzip-compressed
// (zlib reads plain files transparently). An IDX file is a big-endian header
// -- magic 0x000008TT with TT the element type and the low byte the number of
// dimensions, then one u32 per dimension -- followed by the elements. Only
// unsigned-byte files (type 0x08) exist for MNIST, so only those are read.
// Blocking file I/O; every malformed input throws mt::FileError naming the path,
// what was expected and what was found.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mt {

inline constexpr uint32_t kIdxImagesMagic = 0x00000803;  // u8, 3 dims: count, rows, cols
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;  // u8, 1 dim: count

struct IdxArray {
  std::vector<int64_t> dims;  // as declared by the header; dims[0] is the record count
  std::vector<uint8_t> data;  // min(limit, dims[0]) records, row-major
  int64_t records = 0;        // records actually read (== dims[0] unless limited)
};

// Reads `path`, checking that its magic equals `expected_magic` (which also
// fixes the number of dimensions). With limit >= 0 only the first `limit`
// records are read; otherwise all of them, and the file must end exactly where
// the header says (a shorter file is "truncated", a longer one has "trailing
// data"). `missing_hint` is appended to the message when the file is missing
// (e.g. which package provides it).
IdxArray read_idx(const std::string& path, uint32_t expected_magic, int64_t limit = -1,
                  const std::string& missing_hint = "");

}  // namespace mt
