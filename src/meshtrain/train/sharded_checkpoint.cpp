// Saving sharded checkpoints, the index format, and the outcome agreement.
// Loading is in sharded_checkpoint_load.cpp.
#include "meshtrain/train/sharded_checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

namespace mt {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kIndexFile = "index.json";
// Format 2 adds boxes to pieces; format 1 (no boxes) still loads.
constexpr std::string_view kFormat = "meshtrain-sharded-2";
constexpr std::string_view kFormat1 = "meshtrain-sharded-1";
constexpr std::string_view kIndexCrcKey = "index_crc32";

std::string hex32(uint32_t v) {
  return fmt::format("{:08x}", v);
}

bool parse_hex32(std::string_view s, uint32_t* out) {
  if (s.size() != 8) return false;
  uint32_t v = 0;
  for (char c : s) {
    uint32_t d;
    if (c >= '0' && c <= '9')
      d = static_cast<uint32_t>(c - '0');
    else if (c >= 'a' && c <= 'f')
      d = static_cast<uint32_t>(c - 'a' + 10);
    else
      return false;
    v = v << 4 | d;
  }
  *out = v;
  return true;
}

uint32_t crc_of(std::string_view s) {
  return static_cast<uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(s.data()), s.size()));
}

std::string shard_file_name(int rank, int size, uint64_t nonce) {
  return fmt::format("shard-{}-of-{}-{:016x}.safetensors", rank, size, nonce);
}

bool is_shard_file_name(std::string_view name) {
  return name.starts_with("shard-") && name.ends_with(".safetensors");
}

// The temporaries write_file_atomically leaves behind when a process dies
// mid-write (".<name>.tmp-<pid>-<n>").
bool is_shard_temp_name(std::string_view name) {
  return name.starts_with(".shard-") && name.find(".safetensors.tmp-") != std::string_view::npos;
}

// A fresh value per save, so that a new save never reuses the file names of
// the checkpoint it replaces (even one at the same step after a crash).
uint64_t fresh_nonce() {
  std::random_device rd;
  const uint64_t a = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  const auto t = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return a ^ (t * 0x9e3779b97f4a7c15ull);
}

// ---- agreement ---------------------------------------------------------------

// Outcome strings exchanged between ranks: "1" + payload on success,
// "0" + kind letter + message on failure.
std::string encode_failure(std::exception_ptr e) {
  char kind = 'K';
  std::string msg;
  try {
    std::rethrow_exception(e);
  } catch (const FileError& x) {
    kind = 'F', msg = x.what();
  } catch (const CheckpointError& x) {
    kind = 'K', msg = x.what();
  } catch (const ConfigError& x) {
    kind = 'C', msg = x.what();
  } catch (const ShapeError& x) {
    kind = 'S', msg = x.what();
  } catch (const TimeoutError& x) {
    kind = 'T', msg = x.what();
  } catch (const MismatchError& x) {
    kind = 'M', msg = x.what();
  } catch (const CommError& x) {
    kind = 'N', msg = x.what();
  } catch (const InternalError& x) {
    kind = 'I', msg = x.what();
  } catch (const std::exception& x) {
    kind = 'K', msg = fmt::format("unexpected error: {}", x.what());
  } catch (...) {
    kind = 'K', msg = "unexpected non-standard exception";
  }
  return std::string("0") + kind + msg;
}

[[noreturn]] void throw_kind(char kind, const std::string& msg) {
  switch (kind) {
    case 'F':
      throw FileError(msg);
    case 'C':
      throw ConfigError(msg);
    case 'S':
      throw ShapeError(msg);
    case 'T':
      throw TimeoutError(msg);
    case 'M':
      throw MismatchError(msg);
    case 'N':
      throw CommError(msg);
    case 'I':
      throw InternalError(msg);
    default:
      throw CheckpointError(msg);
  }
}

std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine,
                                        const CollectiveOptions& opts) {
  const auto n = static_cast<size_t>(comm.size());
  std::vector<int64_t> sizes(n);
  const auto my_size = static_cast<int64_t>(mine.size());
  comm.all_gather(&my_size, sizes.data(), 1, DType::i64, opts);
  std::vector<size_t> counts(n);
  size_t total = 0;
  for (size_t r = 0; r < n; ++r) {
    if (sizes[r] < 0) throw CommError(fmt::format("rank {} sent a negative length", r));
    counts[r] = static_cast<size_t>(sizes[r]);
    total += counts[r];
  }
  std::string all(total + 1, '\0');  // +1: never a null buffer
  comm.all_gatherv(mine.data(), all.data(), counts, DType::u8, opts);
  std::vector<std::string> out(n);
  size_t at = 0;
  for (size_t r = 0; r < n; ++r) {
    out[r] = all.substr(at, counts[r]);
    at += counts[r];
  }
  return out;
}

// Throws the agreed error if any outcome is a failure (prefix "0", or "1!"
// for a failure that nevertheless left a complete new checkpoint).
void throw_first_failure(const std::vector<std::string>& outcomes) {
  int first = -1;
  std::string others;
  int n_others = 0;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    const std::string& o = outcomes[r];
    if (!o.starts_with("0") && !o.starts_with("1!")) continue;
    if (first < 0) {
      first = static_cast<int>(r);
    } else {
      others += fmt::format("{}{}", others.empty() ? "" : ", ", r);
      ++n_others;
    }
  }
  if (first < 0) return;
  const std::string& o = outcomes[static_cast<size_t>(first)];
  const size_t skip = o.starts_with("0") ? 1 : 2;
  const char kind = o.size() > skip ? o[skip] : 'K';
  throw_kind(kind, fmt::format(
                       "{} [failed on rank {} of {}{}]", o.substr(skip + 1), first, outcomes.size(),
                       n_others == 0
                           ? std::string()
                           : fmt::format("; also on rank{} {}", n_others > 1 ? "s" : "", others)));
}

// Every rank's outcome string; throws the agreed error when any failed.
// Without a communicator, rethrows the local error as it is.
std::vector<std::string> exchange(Communicator* comm, std::exception_ptr local,
                                  const std::string& payload, const CollectiveOptions& opts) {
  if (comm == nullptr) {
    if (local) std::rethrow_exception(local);
    return {"1" + payload};
  }
  auto all = gather_strings(*comm, local ? encode_failure(local) : "1" + payload, opts);
  throw_first_failure(all);
  return all;
}

// ---- saving ------------------------------------------------------------------

// "[i, j, k]": the index in `shape` of flat element `flat`.
std::string element_index(const Shape& shape, int64_t flat) {
  std::vector<int64_t> idx(shape.dims().size());
  for (size_t d = idx.size(); d-- > 0;) {
    const int64_t n = shape.dims()[d];
    idx[d] = n > 0 ? flat % n : 0;
    flat = n > 0 ? flat / n : 0;
  }
  return Shape(idx).str();
}

int64_t piece_numel(const ShardPiece& p) {
  return p.end - p.begin;
}

void check_piece(const std::string& dir, const ShardPiece& p) {
  auto where = [&] { return fmt::format("sharded checkpoint {}: piece of '{}'", dir, p.name); };
  if (p.name.empty()) throw ConfigError(fmt::format("{}: empty tensor name", where()));
  for (int64_t d : p.full_shape.dims()) {
    if (d < 0) {
      throw ConfigError(fmt::format("{}: negative dimension in {}", where(), p.full_shape.str()));
    }
  }
  if (p.box.begin.empty() && p.box.end.empty()) {
    const int64_t numel = p.full_shape.numel();
    if (p.begin < 0 || p.begin > p.end || p.end > numel) {
      throw ConfigError(fmt::format("{}: range [{}, {}) is outside shape {} ({} elements)", where(),
                                    p.begin, p.end, p.full_shape.str(), numel));
    }
  } else {
    try {
      piece_runs(p.full_shape, p.box, p.begin, p.end);  // checks the box and the range
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}: {}", where(), e.what()));
    }
  }
  if (piece_numel(p) == 0) return;
  if (!p.data.defined() || p.data.numel() != piece_numel(p)) {
    throw ShapeError(fmt::format("{}: range [{}, {}) needs {} elements but the data is {}", where(),
                                 p.begin, p.end, piece_numel(p),
                                 p.data.defined() ? p.data.desc() : std::string("unset")));
  }
}

std::string block_checksums(const Tensor& t, uint64_t block) {
  const auto* p = static_cast<const Bytef*>(t.raw());
  const uint64_t n = t.nbytes();
  std::string out;
  out.reserve(static_cast<size_t>((n + block - 1) / block * 8));
  for (uint64_t at = 0; at < n; at += block) {
    out += hex32(static_cast<uint32_t>(crc32_z(0, p + at, std::min(block, n - at))));
  }
  return out;
}

// Writes this rank's shard (if it has any data) and returns its piece list
// as JSON: {"pieces": [...], "file": ..., "bytes": ...}.
std::string write_shard(const std::string& dir, const std::string& file, int rank, int size,
                        uint64_t nonce, std::span<const ShardPiece> pieces,
                        const std::map<std::string, std::string>& metadata,
                        const SaveShardedOptions& opt, bool* wrote) {
  if (opt.block_bytes == 0) {
    throw ConfigError(fmt::format("sharded checkpoint {}: block_bytes must be at least 1", dir));
  }
  for (const auto& [k, v] : metadata) {
    if (k.starts_with("crc32/") || k.starts_with("meshtrain/")) {
      throw ConfigError(fmt::format(
          "sharded checkpoint {}: metadata key '{}' is reserved (prefixes crc32/ and meshtrain/)",
          dir, k));
    }
  }
  json list = json::array();
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> meta;
  for (const ShardPiece& p : pieces) {
    check_piece(dir, p);
    json e = {{"name", p.name}, {"shape", p.full_shape.dims()}, {"begin", p.begin}, {"end", p.end}};
    if (p.data.defined()) e["dtype"] = safetensors_dtype(p.data.dtype());
    if (piece_numel(p) > 0) {
      // Contiguous in the whole tensor: stored as that range, without a box
      // (so whole tensors and row blocks read as format 1 pieces did).
      const std::vector<ElementRun> runs = piece_runs(p.full_shape, p.box, p.begin, p.end);
      std::string key;
      std::string what;  // for messages
      if (runs.size() == 1) {
        e["begin"] = runs[0].begin;
        e["end"] = runs[0].end;
        key = fmt::format("{}@{}-{}", p.name, runs[0].begin, runs[0].end);
        what = fmt::format("[{}, {})", runs[0].begin, runs[0].end);
      } else {
        json box = json::array();
        std::string dims;
        for (size_t d = 0; d < p.box.begin.size(); ++d) {
          box.push_back({p.box.begin[d], p.box.end[d]});
          dims += fmt::format("{}{}:{}", d ? "," : "", p.box.begin[d], p.box.end[d]);
        }
        e["box"] = std::move(box);
        key = fmt::format("{}@{}@{}-{}", p.name, dims, p.begin, p.end);
        what = fmt::format("box {} [{}, {})", p.box.str(), p.begin, p.end);
      }
      const Tensor flat = p.data.reshape(Shape{piece_numel(p)});
      if (!tensors.emplace(key, flat).second) {
        throw ConfigError(fmt::format("sharded checkpoint {}: rank {} passes '{}' {} twice", dir,
                                      rank, p.name, what));
      }
      e["key"] = key;
      e["crc32"] = hex32(tensor_checksum(flat));
      meta[std::string(kShardBlocksKeyPrefix) + key] = block_checksums(flat, opt.block_bytes);
    }
    list.push_back(std::move(e));
  }
  if (opt.fault_injection) opt.fault_injection("shard", rank);
  std::error_code ec;
  fs::create_directories(dir, ec);  // a failure here surfaces as the write's error
  json out = {{"pieces", std::move(list)}};
  if (!tensors.empty()) {
    meta[std::string(kShardBlockBytesKey)] = fmt::format("{}", opt.block_bytes);
    meta["shard/rank"] = fmt::format("{}", rank);
    meta["shard/world_size"] = fmt::format("{}", size);
    meta["shard/nonce"] = fmt::format("{:016x}", nonce);
    const std::string path = (fs::path(dir) / file).string();
    save_checkpoint(path, tensors, meta);
    *wrote = true;
    const uint64_t bytes = fs::file_size(path, ec);
    if (ec)
      throw FileError(
          fmt::format("sharded checkpoint {}: stat of {}: {}", dir, path, ec.message()));
    out["file"] = file;
    out["bytes"] = bytes;
  }
  try {
    return out.dump();
  } catch (const json::exception& x) {
    throw ConfigError(
        fmt::format("sharded checkpoint {}: cannot encode piece list: {}", dir, x.what()));
  }
}

// The index text for every rank's piece list (payloads of write_shard).
// Fills `files` with the shard files it references.
std::string build_index(const std::string& dir, const std::vector<std::string>& lists,
                        uint64_t nonce, const std::map<std::string, std::string>& metadata,
                        const SaveShardedOptions& opt, std::set<std::string>* files) {
  json shards = json::array();
  json tensors = json::object();
  std::map<std::string, int> shape_rank;  // which rank first named each tensor
  std::map<std::string, int> dtype_rank;  // which rank first gave its dtype
  for (size_t r = 0; r < lists.size(); ++r) {
    const json j = json::parse(lists[r]);
    int shard = -1;
    if (j.contains("file")) {
      shard = static_cast<int>(shards.size());
      shards.push_back({{"rank", r}, {"file", j["file"]}, {"bytes", j["bytes"]}});
      files->insert(j["file"].get<std::string>());
    }
    for (const json& e : j["pieces"]) {
      const std::string name = e["name"].get<std::string>();
      const auto [it, fresh] = shape_rank.emplace(name, static_cast<int>(r));
      json& t = tensors[name];
      if (fresh) {
        t = {{"shape", e["shape"]}, {"pieces", json::array()}};
      } else if (t["shape"] != e["shape"]) {
        throw ConfigError(fmt::format(
            "sharded checkpoint {}: tensor '{}' has shape {} on rank {} but {} on rank {}", dir,
            name, t["shape"].dump(), it->second, e["shape"].dump(), r));
      }
      if (e.contains("dtype")) {
        const auto [d, first] = dtype_rank.emplace(name, static_cast<int>(r));
        if (first) {
          t["dtype"] = e["dtype"];
        } else if (t["dtype"] != e["dtype"]) {
          throw ConfigError(fmt::format(
              "sharded checkpoint {}: tensor '{}' is {} on rank {} but {} on rank {}", dir, name,
              t["dtype"].get<std::string>(), d->second, e["dtype"].get<std::string>(), r));
        }
      }
      if (e.contains("key")) {
        json ref = {{"shard", shard},
                    {"key", e["key"]},
                    {"begin", e["begin"]},
                    {"end", e["end"]},
                    {"crc32", e["crc32"]}};
        if (e.contains("box")) ref["box"] = e["box"];
        t["pieces"].push_back(std::move(ref));
      }
    }
  }
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string& name = it.key();
    json& t = it.value();
    // Named only by empty pieces without data: nothing says otherwise.
    if (!t.contains("dtype")) t["dtype"] = safetensors_dtype(DType::f32);
    const Shape shape(t["shape"].get<std::vector<int64_t>>());
    // Each piece with its runs in the whole tensor, sorted by where it starts.
    struct Entry {
      Box box;
      int64_t begin, end;
      std::vector<ElementRun> runs;
      json ref;
    };
    std::vector<Entry> ps;
    std::vector<ElementRun> all;
    for (json& p : t["pieces"]) {
      Entry en;
      if (p.contains("box")) {
        for (const json& d : p["box"]) {
          en.box.begin.push_back(d[0].get<int64_t>());
          en.box.end.push_back(d[1].get<int64_t>());
        }
      }
      en.begin = p["begin"].get<int64_t>();
      en.end = p["end"].get<int64_t>();
      en.runs = piece_runs(shape, en.box, en.begin, en.end);
      all.insert(all.end(), en.runs.begin(), en.runs.end());
      en.ref = std::move(p);
      ps.push_back(std::move(en));
    }
    std::sort(ps.begin(), ps.end(), [](const Entry& a, const Entry& b) {
      return std::tie(a.runs.front().begin, a.box.begin, a.box.end, a.begin, a.end) <
             std::tie(b.runs.front().begin, b.box.begin, b.box.end, b.begin, b.end);
    });
    std::sort(all.begin(), all.end(),
              [](const ElementRun& a, const ElementRun& b) { return a.begin < b.begin; });
    const int64_t numel = shape.numel();
    int64_t covered = 0;
    for (const ElementRun& r : all) {
      if (r.begin > covered) break;
      covered = std::max(covered, r.end);
    }
    if (covered < numel) {
      int64_t gap_end = numel;
      for (const ElementRun& r : all) {
        if (r.begin > covered) {
          gap_end = r.begin;
          break;
        }
      }
      throw ConfigError(fmt::format(
          "sharded checkpoint {}: tensor '{}' ({} {}): elements [{}, {}) (from element {}) are "
          "held by no rank",
          dir, name, t["dtype"].get<std::string>(), t["shape"].dump(), covered, gap_end,
          element_index(shape, covered)));
    }
    json sorted = json::array();
    for (Entry& en : ps) sorted.push_back(std::move(en.ref));
    t["pieces"] = std::move(sorted);
  }
  json root = {{"format", kFormat},
               {"world_size", lists.size()},
               {"mode", opt.mode},
               {"nonce", fmt::format("{:016x}", nonce)},
               {"metadata", metadata},
               {"shards", std::move(shards)},
               {"tensors", std::move(tensors)}};
  root[std::string(kIndexCrcKey)] = hex32(crc_of(root.dump()));
  return root.dump(1);
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return {};
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Removes shard files (and dead temporaries of shard writes) that the
// current index does not reference. Best effort: leftovers are harmless.
void remove_stale_shards(const std::string& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if ((is_shard_file_name(name) && !keep.contains(name)) || is_shard_temp_name(name)) {
      std::error_code rm;
      fs::remove(it->path(), rm);
    }
  }
}

// ---- reading the index ---------------------------------------------------------

[[noreturn]] void bad_index(const std::string& path, const std::string& what) {
  throw CheckpointError(fmt::format("sharded checkpoint index {}: {}", path, what));
}

const json& field(const std::string& path, const json& obj, std::string_view key,
                  std::string_view where) {
  const auto it = obj.find(key);
  if (it == obj.end()) bad_index(path, fmt::format("{}: missing '{}'", where, key));
  return *it;
}

int64_t int_field(const std::string& path, const json& obj, std::string_view key,
                  std::string_view where) {
  const json& v = field(path, obj, key, where);
  if (!v.is_number_integer() || v.get<int64_t>() < 0) {
    bad_index(path,
              fmt::format("{}: '{}' must be a non-negative integer, got {}", where, key, v.dump()));
  }
  return v.get<int64_t>();
}

std::string str_field(const std::string& path, const json& obj, std::string_view key,
                      std::string_view where) {
  const json& v = field(path, obj, key, where);
  if (!v.is_string()) {
    bad_index(path, fmt::format("{}: '{}' must be a string, got {}", where, key, v.dump()));
  }
  return v.get<std::string>();
}

ShardedTensorInfo parse_tensor(const std::string& path, const std::string& name, const json& t,
                               size_t n_shards, bool boxes) {
  const std::string where = fmt::format("tensor '{}'", name);
  if (!t.is_object()) bad_index(path, fmt::format("{}: expected an object", where));
  ShardedTensorInfo info;
  const std::string dt = str_field(path, t, "dtype", where);
  const auto parsed = parse_safetensors_dtype(dt);
  if (!parsed) bad_index(path, fmt::format("{}: unknown dtype '{}'", where, dt));
  info.dtype = *parsed;
  const json& shape = field(path, t, "shape", where);
  if (!shape.is_array()) bad_index(path, fmt::format("{}: 'shape' must be an array", where));
  std::vector<int64_t> dims;
  for (const json& d : shape) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) {
      bad_index(path, fmt::format("{}: bad shape {}", where, shape.dump()));
    }
    dims.push_back(d.get<int64_t>());
  }
  info.shape = Shape(std::move(dims));
  const int64_t numel = info.shape.numel();
  const json& pieces = field(path, t, "pieces", where);
  if (!pieces.is_array()) bad_index(path, fmt::format("{}: 'pieces' must be an array", where));
  for (const json& p : pieces) {
    ShardedPieceRef ref;
    ref.shard = static_cast<int>(int_field(path, p, "shard", where));
    ref.key = str_field(path, p, "key", where);
    ref.begin = int_field(path, p, "begin", where);
    ref.end = int_field(path, p, "end", where);
    const std::string crc = str_field(path, p, "crc32", where);
    if (!parse_hex32(crc, &ref.crc32)) {
      bad_index(path,
                fmt::format("{}: piece '{}' has a malformed crc32 '{}'", where, ref.key, crc));
    }
    if (static_cast<size_t>(ref.shard) >= n_shards) {
      bad_index(path, fmt::format("{}: piece '{}' names shard {} but the index lists {}", where,
                                  ref.key, ref.shard, n_shards));
    }
    if (const auto b = p.find("box"); b != p.end()) {
      if (!boxes) {
        bad_index(path, fmt::format("{}: piece '{}' has a box, which format '{}' does not have",
                                    where, ref.key, kFormat1));
      }
      const bool ok = b->is_array() && std::all_of(b->begin(), b->end(), [](const json& d) {
                        return d.is_array() && d.size() == 2 && d[0].is_number_integer() &&
                               d[1].is_number_integer();
                      });
      if (!ok) {
        bad_index(path, fmt::format("{}: piece '{}' box {} is not [[begin, end], ...]", where,
                                    ref.key, b->dump()));
      }
      for (const json& d : *b) {
        ref.box.begin.push_back(d[0].get<int64_t>());
        ref.box.end.push_back(d[1].get<int64_t>());
      }
    }
    const bool has_box = !ref.box.begin.empty();
    const int64_t limit = has_box ? ref.box.elements() : numel;
    bool fits = ref.begin < ref.end && ref.end <= limit;
    if (fits && has_box) {
      try {
        piece_runs(info.shape, ref.box, ref.begin, ref.end);
      } catch (const ConfigError&) {
        fits = false;
      }
    }
    if (!fits) {
      bad_index(path, fmt::format("{}: piece '{}' range [{}, {}){} is empty or outside {} ({} "
                                  "elements)",
                                  where, ref.key, ref.begin, ref.end,
                                  has_box ? " of box " + ref.box.str() : std::string(),
                                  has_box ? "the box" : info.shape.str(), limit));
    }
    info.pieces.push_back(std::move(ref));
  }
  // By first element in the whole tensor (for box-less pieces: begin).
  std::vector<std::pair<int64_t, ShardedPieceRef>> order;
  for (ShardedPieceRef& r : info.pieces) {
    const int64_t first = piece_runs(info.shape, r.box, r.begin, r.end).front().begin;
    order.emplace_back(first, std::move(r));
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::tie(a.first, a.second.box.begin, a.second.box.end, a.second.begin, a.second.end) <
           std::tie(b.first, b.second.box.begin, b.second.box.end, b.second.begin, b.second.end);
  });
  info.pieces.clear();
  for (auto& [first, r] : order) info.pieces.push_back(std::move(r));
  return info;
}

}  // namespace

// ---- public --------------------------------------------------------------------

ShardPiece full_piece(std::string name, const Tensor& t) {
  return slice_piece(std::move(name), t, 0, t.numel());
}

ShardPiece slice_piece(std::string name, const Tensor& t, int64_t begin, int64_t end) {
  if (begin < 0 || begin > end || end > t.numel()) {
    throw ConfigError(
        fmt::format("slice_piece '{}': range [{}, {}) is outside {}", name, begin, end, t.desc()));
  }
  ShardPiece p;
  p.name = std::move(name);
  p.full_shape = t.shape();
  p.begin = begin;
  p.end = end;
  auto* base = static_cast<std::byte*>(const_cast<void*>(t.raw()));
  p.data = Tensor::wrap(
      base == nullptr ? nullptr : base + begin * static_cast<int64_t>(dtype_size(t.dtype())),
      Shape{end - begin}, t.dtype());
  return p;
}

std::pair<int64_t, int64_t> even_range(int64_t numel, int rank, int size) {
  MT_CHECK(size > 0 && rank >= 0 && rank < size, "rank {} of {}", rank, size);
  const int64_t base = numel / size;
  const int64_t extra = numel % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

std::vector<ShardPiece> even_pieces(const std::map<std::string, Tensor>& tensors, int rank,
                                    int size) {
  std::vector<ShardPiece> out;
  for (const auto& [name, t] : tensors) {
    const auto [b, e] = even_range(t.numel(), rank, size);
    out.push_back(slice_piece(name, t, b, e));
  }
  return out;
}

std::vector<ElementRun> piece_runs(const Shape& whole, const Box& box, int64_t begin, int64_t end) {
  const std::vector<int64_t>& dims = whole.dims();
  const size_t n = dims.size();
  const bool has_box = !box.begin.empty() || !box.end.empty();
  if (has_box) {
    bool fits = box.begin.size() == n && box.end.size() == n;
    for (size_t d = 0; fits && d < n; ++d) {
      fits = 0 <= box.begin[d] && box.begin[d] <= box.end[d] && box.end[d] <= dims[d];
    }
    if (!fits) {
      throw ConfigError(fmt::format("box {} does not fit shape {}", box.str(), whole.str()));
    }
  }
  const int64_t limit = has_box ? box.elements() : whole.numel();
  if (begin < 0 || begin > end || end > limit) {
    throw ConfigError(fmt::format("range [{}, {}) is outside {} ({} elements)", begin, end,
                                  has_box ? "box " + box.str() : "shape " + whole.str(), limit));
  }
  std::vector<ElementRun> out;
  if (begin >= end) return out;
  // Dimensions [inner, n) are whole in the box: a row of the box, its
  // extent in dimension inner - 1 times those, is contiguous in `whole`.
  size_t inner = has_box ? n : 0;  // no box: the whole tensor
  while (inner > 0 && box.begin[inner - 1] == 0 && box.end[inner - 1] == dims[inner - 1]) --inner;
  if (inner == 0) {
    out.push_back({begin, end, 0});
    return out;
  }
  std::vector<int64_t> stride(n, 1);
  for (size_t d = n - 1; d-- > 0;) stride[d] = stride[d + 1] * dims[d + 1];
  const size_t p = inner - 1;  // the innermost dimension the box cuts
  const int64_t row = (box.end[p] - box.begin[p]) * stride[p];
  const int64_t r0 = begin / row;
  const int64_t r1 = (end - 1) / row;
  std::vector<int64_t> idx(p);  // row r0's index in the box's dimensions [0, p)
  for (size_t d = p, rem = static_cast<size_t>(r0); d-- > 0;) {
    const auto ext = static_cast<size_t>(box.end[d] - box.begin[d]);
    idx[d] = static_cast<int64_t>(rem % ext);
    rem /= ext;
  }
  out.reserve(static_cast<size_t>(r1 - r0 + 1));
  for (int64_t r = r0; r <= r1; ++r) {
    int64_t g = box.begin[p] * stride[p];
    for (size_t d = 0; d < p; ++d) g += (box.begin[d] + idx[d]) * stride[d];
    const int64_t lo = std::max(begin, r * row);
    const int64_t hi = std::min(end, (r + 1) * row);
    out.push_back({g + lo - r * row, g + hi - r * row, lo - begin});
    for (size_t d = p; d-- > 0;) {  // the next row
      if (++idx[d] < box.end[d] - box.begin[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

ShardPiece box_piece(std::string name, const Shape& whole, const Box& box, const Tensor& data) {
  try {
    piece_runs(whole, box, 0, 0);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("box_piece '{}': {}", name, e.what()));
  }
  const int64_t n = box.elements();
  if (!data.defined() ? n != 0 : data.numel() != n) {
    throw ShapeError(fmt::format("box_piece '{}': box {} holds {} elements but the data is {}",
                                 name, box.str(), n,
                                 data.defined() ? data.desc() : std::string("unset")));
  }
  ShardPiece p;
  p.name = std::move(name);
  p.full_shape = whole;
  p.begin = 0;
  p.end = n;
  p.data = data;
  p.box = box;
  return p;
}

ShardPiece in_box(ShardPiece local, const TensorPlace& place) {
  if (!(local.full_shape == place.box.shape())) {
    throw ConfigError(fmt::format(
        "in_box '{}': the piece is of a tensor of shape {} but box {} of {} has shape {}",
        local.name, local.full_shape.str(), place.box.str(), place.whole.str(),
        place.box.shape().str()));
  }
  try {
    piece_runs(place.whole, place.box, 0, 0);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("in_box '{}': {}", local.name, e.what()));
  }
  if (local.box.begin.empty() && local.box.end.empty()) {
    local.box = place.box;
  } else {
    try {
      piece_runs(local.full_shape, local.box, 0, 0);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("in_box '{}': the piece's own {}", local.name, e.what()));
    }
    for (size_t d = 0; d < local.box.begin.size(); ++d) {
      local.box.begin[d] += place.box.begin[d];
      local.box.end[d] += place.box.begin[d];
    }
  }
  local.full_shape = place.whole;
  return local;
}

std::vector<ShardPiece> in_boxes(std::vector<ShardPiece> pieces,
                                 const std::map<std::string, TensorPlace>& places) {
  for (ShardPiece& p : pieces) {
    if (const auto it = places.find(p.name); it != places.end())
      p = in_box(std::move(p), it->second);
  }
  return pieces;
}

std::vector<ShardPiece> with_prefix(std::vector<ShardPiece> pieces, std::string_view prefix) {
  for (ShardPiece& p : pieces) p.name.insert(0, prefix);
  return pieces;
}

std::string sharded_index_path(const std::string& dir) {
  return (fs::path(dir) / kIndexFile).string();
}

bool is_sharded_checkpoint(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(sharded_index_path(dir), ec);
}

void agree_on_failure(Communicator* comm, std::exception_ptr local,
                      const CollectiveOptions& options) {
  exchange(comm, local, "", options);
}

void save_sharded(Communicator* comm, const std::string& dir, std::span<const ShardPiece> pieces,
                  const std::map<std::string, std::string>& metadata,
                  const SaveShardedOptions& opt) {
  const int rank = comm != nullptr ? comm->rank() : 0;
  const int size = comm != nullptr ? comm->size() : 1;
  uint64_t nonce = rank == 0 ? fresh_nonce() : 0;
  if (comm != nullptr) comm->broadcast(&nonce, 1, DType::i64, 0, opt.collective);
  const std::string file = shard_file_name(rank, size, nonce);

  bool wrote = false;
  auto remove_own = [&] {
    if (!wrote) return;
    std::error_code ec;
    fs::remove(fs::path(dir) / file, ec);
  };

  // Round 1: every rank writes its shard; all learn every piece list.
  std::string list;
  std::exception_ptr err;
  try {
    list = write_shard(dir, file, rank, size, nonce, pieces, metadata, opt, &wrote);
  } catch (...) {
    err = std::current_exception();
  }
  std::vector<std::string> lists;
  try {
    lists = exchange(comm, err, list, opt.collective);
  } catch (...) {
    remove_own();
    throw;
  }

  // Round 2: rank 0 replaces the index; all learn whether it did.
  std::set<std::string> keep;
  std::string outcome = "1";
  if (rank == 0) {
    std::string text;
    try {
      for (auto& l : lists) l.erase(0, 1);  // the success marker
      text = build_index(dir, lists, nonce, metadata, opt, &keep);
      if (opt.fault_injection) opt.fault_injection("index", rank);
      write_file_atomically(sharded_index_path(dir),
                            [&](const ByteSink& sink) { sink(text.data(), text.size()); });
    } catch (const json::exception& x) {
      outcome = encode_failure(std::make_exception_ptr(ConfigError(
          fmt::format("sharded checkpoint {}: cannot build the index: {}", dir, x.what()))));
    } catch (...) {
      outcome = encode_failure(std::current_exception());
      // A failure after the rename (syncing the directory) leaves the new
      // index in place: its shards must then stay.
      if (!text.empty() && slurp(sharded_index_path(dir)) == text) outcome.replace(0, 1, "1!");
    }
  }
  std::vector<std::string> outcomes{outcome};
  if (comm != nullptr) outcomes = gather_strings(*comm, outcome, opt.collective);
  if (outcomes[0].starts_with("0")) remove_own();
  if (comm == nullptr && outcome != "1") {
    // Alone: report the error as it was raised, without a rank suffix.
    throw_kind(outcome[outcome.starts_with("0") ? 1 : 2],
               outcome.substr(outcome.starts_with("0") ? 2 : 3));
  }
  throw_first_failure(outcomes);
  if (rank == 0) remove_stale_shards(dir, keep);
}

ShardedIndex read_index(const std::string& dir) {
  const std::string path = sharded_index_path(dir);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    if (!fs::exists(dir, ec)) throw FileError(fmt::format("checkpoint {} does not exist", dir));
    if (!fs::is_directory(dir, ec)) {
      throw FileError(
          fmt::format("checkpoint {}: not a directory, so not a sharded checkpoint "
                      "(a single-file checkpoint's name ends in .safetensors)",
                      dir));
    }
    // Name what is there: shards without an index are a save that stopped
    // part-way (index.json is written last), not a damaged index.
    std::vector<std::string> shards;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      if (is_shard_file_name(name)) shards.push_back(name);
    }
    std::sort(shards.begin(), shards.end());
    if (shards.empty()) {
      throw FileError(fmt::format(
          "checkpoint {}: no index.json and no shard files -- not a sharded checkpoint", dir));
    }
    constexpr size_t kShown = 8;
    std::string listed;
    for (size_t i = 0; i < std::min(shards.size(), kShown); ++i) {
      listed += (i ? ", " : "") + shards[i];
    }
    if (shards.size() > kShown) listed += fmt::format(", ... and {} more", shards.size() - kShown);
    throw FileError(fmt::format(
        "checkpoint {}: no index.json -- the save did not complete (rank shards present: {})", dir,
        listed));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FileError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  const std::string text{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  if (f.bad()) throw FileError(fmt::format("reading {} failed", path));

  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& x) {
    bad_index(path, fmt::format("not valid JSON ({} bytes): {}", text.size(), x.what()));
  }
  if (!root.is_object()) bad_index(path, "expected a JSON object");
  const std::string format = str_field(path, root, "format", "index");
  if (format != kFormat && format != kFormat1) {
    bad_index(path, fmt::format("unsupported format '{}' (this build reads '{}' and '{}')", format,
                                kFormat, kFormat1));
  }
  uint32_t want = 0;
  const std::string crc = str_field(path, root, kIndexCrcKey, "index");
  if (!parse_hex32(crc, &want))
    bad_index(path, fmt::format("malformed {} '{}'", kIndexCrcKey, crc));
  root.erase(std::string(kIndexCrcKey));
  const uint32_t got = crc_of(root.dump());
  if (got != want) {
    bad_index(path, fmt::format("checksum mismatch (stored {}, computed {}): the index was "
                                "modified or corrupted",
                                hex32(want), hex32(got)));
  }

  ShardedIndex index;
  index.dir = dir;
  index.world_size = static_cast<int>(int_field(path, root, "world_size", "index"));
  index.mode = str_field(path, root, "mode", "index");
  index.nonce = str_field(path, root, "nonce", "index");
  const json& meta = field(path, root, "metadata", "index");
  if (!meta.is_object()) bad_index(path, "'metadata' must be an object");
  for (const auto& [k, v] : meta.items()) {
    if (!v.is_string()) bad_index(path, fmt::format("metadata '{}' is not a string", k));
    index.metadata[k] = v.get<std::string>();
  }
  const json& shards = field(path, root, "shards", "index");
  if (!shards.is_array()) bad_index(path, "'shards' must be an array");
  for (const json& s : shards) {
    ShardedFileInfo info;
    info.rank = static_cast<int>(int_field(path, s, "rank", "shard"));
    info.file = str_field(path, s, "file", "shard");
    info.bytes = static_cast<uint64_t>(int_field(path, s, "bytes", "shard"));
    if (!is_shard_file_name(info.file) || info.file.find('/') != std::string::npos) {
      bad_index(path, fmt::format("shard file name '{}' is not a shard file", info.file));
    }
    index.shards.push_back(std::move(info));
  }
  const json& tensors = field(path, root, "tensors", "index");
  if (!tensors.is_object()) bad_index(path, "'tensors' must be an object");
  for (const auto& [name, t] : tensors.items()) {
    index.tensors.emplace(name,
                          parse_tensor(path, name, t, index.shards.size(), format == kFormat));
  }
  return index;
}

}  // namespace mt
