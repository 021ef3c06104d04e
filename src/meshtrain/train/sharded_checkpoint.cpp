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

#include <nlohmann/json.hpp>

namespace mt {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kIndexFile = "index.json";
constexpr std::string_view kFormat = "meshtrain-sharded-1";
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
  const int64_t numel = p.full_shape.numel();
  if (p.begin < 0 || p.begin > p.end || p.end > numel) {
    throw ConfigError(fmt::format("{}: range [{}, {}) is outside shape {} ({} elements)", where(),
                                  p.begin, p.end, p.full_shape.str(), numel));
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
      const std::string key = fmt::format("{}@{}-{}", p.name, p.begin, p.end);
      const Tensor flat = p.data.reshape(Shape{piece_numel(p)});
      if (!tensors.emplace(key, flat).second) {
        throw ConfigError(fmt::format("sharded checkpoint {}: rank {} passes '{}' [{}, {}) twice",
                                      dir, rank, p.name, p.begin, p.end));
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
        t["pieces"].push_back({{"shard", shard},
                               {"key", e["key"]},
                               {"begin", e["begin"]},
                               {"end", e["end"]},
                               {"crc32", e["crc32"]}});
      }
    }
  }
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string& name = it.key();
    json& t = it.value();
    // Named only by empty pieces without data: nothing says otherwise.
    if (!t.contains("dtype")) t["dtype"] = safetensors_dtype(DType::f32);
    std::vector<json> ps(t["pieces"].begin(), t["pieces"].end());
    std::sort(ps.begin(), ps.end(), [](const json& a, const json& b) {
      return std::pair(a["begin"].get<int64_t>(), a["end"].get<int64_t>()) <
             std::pair(b["begin"].get<int64_t>(), b["end"].get<int64_t>());
    });
    int64_t numel = 1;
    for (const json& d : t["shape"]) numel *= d.get<int64_t>();
    int64_t covered = 0;
    for (const json& p : ps) {
      const auto b = p["begin"].get<int64_t>();
      if (b > covered) break;
      covered = std::max(covered, p["end"].get<int64_t>());
    }
    if (covered < numel) {
      int64_t gap_end = numel;
      for (const json& p : ps) {
        if (p["begin"].get<int64_t>() > covered) {
          gap_end = p["begin"].get<int64_t>();
          break;
        }
      }
      throw ConfigError(fmt::format(
          "sharded checkpoint {}: tensor '{}' ({} {}): elements [{}, {}) are held by no rank", dir,
          name, t["dtype"].get<std::string>(), t["shape"].dump(), covered, gap_end));
    }
    t["pieces"] = ps;
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
                               size_t n_shards) {
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
    if (ref.begin >= ref.end || ref.end > numel) {
      bad_index(path, fmt::format("{}: piece '{}' range [{}, {}) is empty or outside {} ({} "
                                  "elements)",
                                  where, ref.key, ref.begin, ref.end, info.shape.str(), numel));
    }
    info.pieces.push_back(std::move(ref));
  }
  std::sort(info.pieces.begin(), info.pieces.end(), [](const auto& a, const auto& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
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
  if (format != kFormat) {
    bad_index(path,
              fmt::format("unsupported format '{}' (this build reads '{}')", format, kFormat));
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
    index.tensors.emplace(name, parse_tensor(path, name, t, index.shards.size()));
  }
  return index;
}

}  // namespace mt
