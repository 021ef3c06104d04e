#include "meshtrain/train/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

namespace mt {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; a big-endian host needs byte swapping");

namespace {

using json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
// The reference implementation refuses headers above 100 MB; so do we, so
// that a corrupt length cannot make us allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

template <class... Args>
[[noreturn]] void bad(std::string_view path, fmt::format_string<Args...> f, Args&&... args) {
  throw CheckpointError(
      fmt::format("safetensors file {}: {}", path, fmt::format(f, std::forward<Args>(args)...)));
}

void pread_exact(int fd, const std::string& path, void* dst, uint64_t n, uint64_t offset,
                 std::string_view what) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, 1ull << 30));
    const ssize_t r = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw FileError(fmt::format("reading {} of {}: {}", what, path, std::strerror(errno)));
    }
    if (r == 0) {
      throw CheckpointError(
          fmt::format("safetensors file {}: truncated while reading {}: {} "
                      "bytes missing at offset {}",
                      path, what, n, offset));
    }
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

SafetensorsEntry parse_entry(std::string_view path, const std::string& name, const json& v) {
  if (!v.is_object()) bad(path, "tensor '{}': expected an object, got {}", name, v.type_name());
  for (const auto& [key, unused] : v.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      bad(path, "tensor '{}': unknown field '{}'", name, key);
    }
  }
  SafetensorsEntry e;
  e.name = name;
  const auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) bad(path, "tensor '{}': missing string 'dtype'", name);
  const auto parsed = parse_safetensors_dtype(dt->get_ref<const std::string&>());
  if (!parsed) {
    bad(path, "tensor '{}': unsupported dtype '{}' (expected F32, F64, BF16, F16, I32, I64, U8)",
        name, dt->get_ref<const std::string&>());
  }
  e.dtype = *parsed;

  const auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) bad(path, "tensor '{}': missing array 'shape'", name);
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  for (const json& d : *sh) {
    if (!d.is_number_unsigned()) {
      bad(path, "tensor '{}': shape {} has an entry that is not a non-negative integer", name,
          sh->dump());
    }
    const auto u = d.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(numel, u, &numel)) {
      bad(path, "tensor '{}': shape {} is too large", name, sh->dump());
    }
    dims.push_back(static_cast<int64_t>(u));
  }
  e.shape = Shape(std::move(dims));

  const auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned()) {
    bad(path, "tensor '{}': 'data_offsets' must be [begin, end] with non-negative integers", name);
  }
  e.begin = (*off)[0].get<uint64_t>();
  e.end = (*off)[1].get<uint64_t>();
  if (e.begin > e.end)
    bad(path, "tensor '{}': data_offsets [{}, {}] run backwards", name, e.begin, e.end);
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, dtype_size(e.dtype), &bytes) || bytes != e.end - e.begin) {
    bad(path, "tensor '{}': {} {} needs {} x {} bytes but data_offsets [{}, {}] span {}", name,
        dt->get_ref<const std::string&>(), e.shape.str(), numel, dtype_size(e.dtype), e.begin,
        e.end, e.end - e.begin);
  }
  return e;
}

}  // namespace

std::string_view safetensors_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (DType t :
       {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    if (safetensors_dtype(t) == name) return t;
  }
  return std::nullopt;
}

const SafetensorsEntry* SafetensorsHeader::find(std::string_view name) const {
  auto it =
      std::lower_bound(entries.begin(), entries.end(), name,
                       [](const SafetensorsEntry& e, std::string_view n) { return e.name < n; });
  return it != entries.end() && it->name == name ? &*it : nullptr;
}

void write_safetensors(const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata, const ByteSink& sink) {
  std::vector<const std::pair<const std::string, Tensor>*> order;
  for (const auto& kv : tensors) {
    if (kv.first.empty() || kv.first == kMetadataKey) {
      throw ConfigError(fmt::format("safetensors: invalid tensor name '{}'", kv.first));
    }
    if (!kv.second.defined()) {
      throw ShapeError(fmt::format("safetensors: tensor '{}' has no storage", kv.first));
    }
    order.push_back(&kv);
  }
  // Larger elements first keeps each tensor aligned to its element size,
  // since the data section itself starts 8-byte aligned.
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype());
  });

  json header = json::object();
  uint64_t offset = 0;
  for (const auto* kv : order) {
    const Tensor& t = kv->second;
    header[kv->first] = {{"dtype", safetensors_dtype(t.dtype())},
                         {"shape", t.shape().dims()},
                         {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    throw ConfigError(fmt::format("safetensors: cannot encode header: {}", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  const uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  sink(len, 8);
  sink(text.data(), text.size());
  for (const auto* kv : order) {
    if (kv->second.nbytes() > 0) sink(kv->second.raw(), kv->second.nbytes());
  }
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomically(path,
                        [&](const ByteSink& sink) { write_safetensors(tensors, metadata, sink); });
}

SafetensorsHeader parse_safetensors_header(std::string_view path, std::string_view text,
                                           uint64_t file_size) {
  if (file_size < 8 || text.size() > file_size - 8) {
    bad(path, "truncated: a {}-byte header does not fit in {} bytes", text.size(), file_size);
  }
  // nlohmann keeps the last of duplicate keys silently; count top-level keys
  // while parsing so a duplicated tensor name is reported instead.
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 &&
        !seen.insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), on_event);
  } catch (const json::exception& e) {
    bad(path, "header is not valid JSON: {}", e.what());
  }
  if (!root.is_object()) bad(path, "header must be a JSON object, got {}", root.type_name());
  if (!duplicate.empty()) bad(path, "header names tensor '{}' twice", duplicate);

  SafetensorsHeader h;
  h.data_start = 8 + text.size();
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) bad(path, "__metadata__ must be an object of strings");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) bad(path, "__metadata__ entry '{}' is not a string", mk);
        h.metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    h.entries.push_back(parse_entry(path, key, value));
  }

  const uint64_t data_size = file_size - h.data_start;
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : h.entries) {
    if (e.end > data_size) {
      bad(path,
          "truncated: tensor '{}' ends at data offset {} but the file has {} data bytes "
          "({} bytes in all)",
          e.name, e.end, data_size, file_size);
    }
    by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  std::string_view prev = "the start of the data";
  for (const SafetensorsEntry* e : by_offset) {
    if (e->begin < cursor) {
      bad(path, "tensor '{}' at [{}, {}] overlaps {}", e->name, e->begin, e->end, prev);
    }
    if (e->begin > cursor) {
      bad(path, "gap of {} bytes between {} and tensor '{}'", e->begin - cursor, prev, e->name);
    }
    cursor = e->end;
    prev = e->name;
  }
  if (cursor != data_size) {
    bad(path, "{} bytes after the last tensor are not described by the header", data_size - cursor);
  }
  return h;
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw FileError(fmt::format("cannot open {}: {}", path_, std::strerror(errno)));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      throw FileError(fmt::format("cannot stat {}: {}", path_, std::strerror(errno)));
    }
    file_size_ = static_cast<uint64_t>(st.st_size);
    if (file_size_ < 8) {
      bad(path_, "truncated: {} bytes, too short for the 8-byte header length", file_size_);
    }
    unsigned char len[8];
    pread_exact(fd_, path_, len, 8, 0, "the header length");
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
    if (n > file_size_ - 8) {
      bad(path_, "truncated: header length {} exceeds the {} bytes after the length field", n,
          file_size_ - 8);
    }
    if (n > kMaxHeaderBytes) bad(path_, "header length {} exceeds the 100 MiB limit", n);
    std::string text(n, '\0');
    pread_exact(fd_, path_, text.data(), n, 8, "the header");
    header_ = parse_safetensors_header(path_, text, file_size_);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      file_size_(other.file_size_),
      header_(std::move(other.header_)) {}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry& SafetensorsReader::entry(std::string_view name) const {
  const SafetensorsEntry* e = header_.find(name);
  if (e == nullptr) bad(path_, "no tensor named '{}'", name);
  return *e;
}

Tensor SafetensorsReader::read(std::string_view name) const {
  const SafetensorsEntry& e = entry(name);
  Tensor t = Tensor::empty(e.shape, e.dtype);
  read_into(name, t);
  return t;
}

void SafetensorsReader::read_into(std::string_view name, Tensor& dst) const {
  const SafetensorsEntry& e = entry(name);
  if (dst.dtype() != e.dtype || !(dst.shape() == e.shape)) {
    bad(path_, "tensor '{}' is {}{} but the destination is {}", name, dtype_name(e.dtype),
        e.shape.str(), dst.desc());
  }
  pread_exact(fd_, path_, dst.raw(), e.end - e.begin, header_.data_start + e.begin,
              fmt::format("tensor '{}'", name));
}

void SafetensorsReader::read_bytes(std::string_view name, uint64_t offset, uint64_t n,
                                   void* dst) const {
  const SafetensorsEntry& e = entry(name);
  const uint64_t size = e.end - e.begin;
  if (offset > size || n > size - offset) {
    bad(path_, "tensor '{}': byte range [{}, {}) runs past its {} bytes", name, offset, offset + n,
        size);
  }
  pread_exact(fd_, path_, dst, n, header_.data_start + e.begin + offset,
              fmt::format("bytes [{}, {}) of tensor '{}'", offset, offset + n, name));
}

std::map<std::string, Tensor> SafetensorsReader::read_all() const {
  std::map<std::string, Tensor> out;
  for (const SafetensorsEntry& e : header_.entries) out.emplace(e.name, read(e.name));
  return out;
}

}  // namespace mt
