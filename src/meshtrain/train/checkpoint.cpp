#include "meshtrain/train/checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

namespace mt {

namespace {

constexpr std::string_view kCrcPrefix = "crc32/";
constexpr std::string_view kReservedPrefix = "meshtrain/";
constexpr std::string_view kFormatKey = "meshtrain/format";
constexpr std::string_view kFormat = "meshtrain-checkpoint-1";
constexpr std::string_view kMetadataCrcKey = "crc32/__metadata__";

uint32_t crc_update(uint32_t crc, const void* data, size_t n) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

// Length-prefixed so that no two different maps encode alike.
uint32_t metadata_checksum(const std::map<std::string, std::string>& m) {
  uint32_t crc = 0;
  for (const auto& [k, v] : m) {
    if (k.starts_with(kCrcPrefix)) continue;
    for (const std::string* s : {&k, &v}) {
      const uint64_t n = s->size();
      crc = crc_update(crc, &n, sizeof n);
      crc = crc_update(crc, s->data(), s->size());
    }
  }
  return crc;
}

std::string hex32(uint32_t v) {
  return fmt::format("{:08x}", v);
}

bool parse_hex32(const std::string& s, uint32_t* out) {
  if (s.size() != 8) return false;
  uint32_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (c >= 'a' && c <= 'f')
      d = c - 'a' + 10;
    else
      return false;
    v = v << 4 | static_cast<uint32_t>(d);
  }
  *out = v;
  return true;
}

}  // namespace

uint32_t tensor_checksum(const Tensor& t) {
  uint32_t crc = crc_update(0, t.raw(), t.nbytes());
  const std::string desc = t.desc();
  return crc_update(crc, desc.data(), desc.size());
}

void save_checkpoint(const std::string& path, const std::map<std::string, Tensor>& tensors,
                     const std::map<std::string, std::string>& metadata) {
  std::map<std::string, std::string> meta;
  for (const auto& [k, v] : metadata) {
    if (k.starts_with(kCrcPrefix) || k.starts_with(kReservedPrefix)) {
      throw ConfigError(
          fmt::format("checkpoint {}: metadata key '{}' is reserved (prefixes {} "
                      "and {})",
                      path, k, kCrcPrefix, kReservedPrefix));
    }
    meta[k] = v;
  }
  meta[std::string(kFormatKey)] = kFormat;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) {
      throw ShapeError(fmt::format("checkpoint {}: tensor '{}' has no storage", path, name));
    }
    meta[std::string(kCrcPrefix) + name] = hex32(tensor_checksum(t));
  }
  meta[std::string(kMetadataCrcKey)] = hex32(metadata_checksum(meta));
  // Missing parent directories are created, as a sharded save creates its
  // directory: both checkpoint forms accept the same paths.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
    std::filesystem::create_directories(parent, ec);
    if (ec) {
      throw FileError(fmt::format("saving {}: cannot create directory {}: {}", path,
                                  parent.string(), ec.message()));
    }
  }
  save_safetensors(path, tensors, meta);
}

CheckpointReader::CheckpointReader(std::string path) : reader_(std::move(path)) {
  const auto& meta = reader_.header().metadata;
  auto fail = [&](const std::string& what) {
    throw CheckpointError(fmt::format("checkpoint {}: {}", reader_.path(), what));
  };
  auto fmt_it = meta.find(std::string(kFormatKey));
  if (fmt_it == meta.end()) {
    fail(fmt::format("not a meshtrain checkpoint: __metadata__ has no '{}'", kFormatKey));
  }
  if (fmt_it->second != kFormat) {
    fail(fmt::format("unsupported format '{}' (this build reads '{}')", fmt_it->second, kFormat));
  }
  auto mc = meta.find(std::string(kMetadataCrcKey));
  uint32_t want = 0;
  if (mc == meta.end() || !parse_hex32(mc->second, &want)) {
    fail(fmt::format("metadata checksum '{}' is missing or malformed", kMetadataCrcKey));
  }
  if (metadata_checksum(meta) != want) {
    fail("metadata checksum mismatch: the __metadata__ entries were modified or corrupted");
  }
  for (const auto& [k, v] : meta) {
    if (k == kMetadataCrcKey) continue;
    if (k.starts_with(kCrcPrefix)) {
      const std::string name = k.substr(kCrcPrefix.size());
      uint32_t crc = 0;
      if (!parse_hex32(v, &crc)) fail(fmt::format("tensor '{}': malformed checksum '{}'", name, v));
      if (reader_.header().find(name) == nullptr) {
        fail(fmt::format("tensor '{}' has a checksum but is not in the file", name));
      }
      checksums_[name] = crc;
    } else if (!k.starts_with(kReservedPrefix)) {
      metadata_[k] = v;
    }
  }
  for (const SafetensorsEntry& e : reader_.header().entries) {
    if (!checksums_.contains(e.name)) fail(fmt::format("tensor '{}' has no checksum", e.name));
  }
}

Tensor CheckpointReader::read(std::string_view name) const {
  Tensor t = reader_.read(name);
  const uint32_t got = tensor_checksum(t);
  const uint32_t want = checksums_.find(name)->second;
  if (got != want) {
    throw CheckpointError(
        fmt::format("checkpoint {}: tensor '{}' ({}) fails its checksum "
                    "(stored {}, computed {}): the file is corrupted or was "
                    "modified",
                    path(), name, t.desc(), hex32(want), hex32(got)));
  }
  return t;
}

std::map<std::string, Tensor> CheckpointReader::read_all() const {
  std::map<std::string, Tensor> out;
  for (const SafetensorsEntry& e : header().entries) out.emplace(e.name, read(e.name));
  return out;
}

void CheckpointReader::load_into(std::map<std::string, Tensor>& targets,
                                 std::string_view prefix) const {
  for (const SafetensorsEntry& e : header().entries) {
    if (!e.name.starts_with(prefix)) continue;
    if (!targets.contains(e.name.substr(prefix.size()))) {
      throw CheckpointError(fmt::format("checkpoint {}: tensor '{}' ({}{}) is not expected here",
                                        path(), e.name, dtype_name(e.dtype), e.shape.str()));
    }
  }
  for (const auto& [name, dst] : targets) {
    const std::string full = std::string(prefix) + name;
    const SafetensorsEntry* e = header().find(full);
    if (e == nullptr) {
      throw CheckpointError(
          fmt::format("checkpoint {}: tensor '{}' ({}) is missing", path(), full, dst.desc()));
    }
    if (e->dtype != dst.dtype() || !(e->shape == dst.shape())) {
      throw CheckpointError(fmt::format("checkpoint {}: tensor '{}' is {}{} but {} is expected",
                                        path(), full, dtype_name(e->dtype), e->shape.str(),
                                        dst.desc()));
    }
  }
  std::vector<Tensor> loaded;
  loaded.reserve(targets.size());
  for (const auto& [name, dst] : targets) loaded.push_back(read(std::string(prefix) + name));
  size_t i = 0;
  for (auto& [name, dst] : targets) convert(loaded[i++], dst);
}

CheckpointContents load_checkpoint(const std::string& path) {
  CheckpointReader r(path);
  return {r.read_all(), r.metadata()};
}

}  // namespace mt
