// Loading sharded checkpoints: plan which stored pieces cover each wanted
// piece, run by run of elements contiguous in the whole tensor (a box piece
// has one per row), read only the checksum blocks those runs touch (runs
// that share or neighbour blocks in one read), verify, stage, and write the
// destinations only once everything (on every rank) is good.
#include <zlib.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <tuple>

#include "meshtrain/train/sharded_checkpoint.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

std::string hex32(uint32_t v) {
  return fmt::format("{:08x}", v);
}

// One run of n elements contiguous in the whole tensor, read from element
// `src` of a stored piece's data into element `dst` of a wanted piece's.
struct Read {
  const ShardedPieceRef* piece;
  int64_t src;
  int64_t n;
  size_t wanted;
  int64_t dst;
};

// A tensor's stored pieces as runs of the whole tensor, sorted by begin;
// reach[i] is the index of the run reaching furthest among runs[0..i].
struct StoredRuns {
  struct Run {
    int64_t begin, end, offset;
    const ShardedPieceRef* piece;
  };
  std::vector<Run> runs;
  std::vector<size_t> reach;
};

StoredRuns stored_runs(const ShardedTensorInfo& info) {
  StoredRuns s;
  for (const ShardedPieceRef& p : info.pieces) {
    for (const ElementRun& r : piece_runs(info.shape, p.box, p.begin, p.end)) {
      s.runs.push_back({r.begin, r.end, r.offset, &p});
    }
  }
  std::stable_sort(s.runs.begin(), s.runs.end(),
                   [](const auto& a, const auto& b) { return a.begin < b.begin; });
  s.reach.resize(s.runs.size());
  for (size_t i = 0; i < s.runs.size(); ++i) {
    s.reach[i] = i > 0 && s.runs[s.reach[i - 1]].end >= s.runs[i].end ? s.reach[i - 1] : i;
  }
  return s;
}

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

void check_wanted(const ShardedIndex& index, const ShardPiece& w) {
  const auto it = index.tensors.find(w.name);
  if (it == index.tensors.end()) {
    throw CheckpointError(
        fmt::format("sharded checkpoint {}: tensor '{}' (shape {}) is not in the checkpoint (it "
                    "holds {} tensors)",
                    index.dir, w.name, w.full_shape.str(), index.tensors.size()));
  }
  const ShardedTensorInfo& info = it->second;
  const bool dtype_differs = w.data.defined() && w.data.dtype() != info.dtype;
  if (dtype_differs || !(info.shape == w.full_shape)) {
    throw CheckpointError(fmt::format(
        "sharded checkpoint {}: tensor '{}' is {}{} in the checkpoint but {}{} is wanted",
        index.dir, w.name, dtype_name(info.dtype), info.shape.str(),
        dtype_name(w.data.defined() ? w.data.dtype() : info.dtype), w.full_shape.str()));
  }
  if (w.box.begin.empty() && w.box.end.empty()) {
    if (w.begin < 0 || w.begin > w.end || w.end > w.full_shape.numel()) {
      throw ConfigError(fmt::format(
          "sharded checkpoint {}: wanted range [{}, {}) of '{}' is outside shape {} ({} elements)",
          index.dir, w.begin, w.end, w.name, w.full_shape.str(), w.full_shape.numel()));
    }
  } else {
    try {
      piece_runs(w.full_shape, w.box, w.begin, w.end);  // checks the box and the range
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("sharded checkpoint {}: wanted piece of '{}': {}", index.dir,
                                    w.name, e.what()));
    }
  }
  if (piece_numel(w) > 0 && (!w.data.defined() || w.data.numel() != piece_numel(w))) {
    throw ShapeError(fmt::format(
        "sharded checkpoint {}: wanted range [{}, {}) of '{}' needs {} elements but the "
        "destination is {}",
        index.dir, w.begin, w.end, w.name, piece_numel(w),
        w.data.defined() ? w.data.desc() : std::string("unset")));
  }
}

// Covers each run of the wanted piece greedily with the stored runs that
// reach furthest, so each element is read once.
void plan_reads(const ShardedIndex& index, const StoredRuns& stored, const ShardPiece& w, size_t wi,
                std::vector<Read>* reads) {
  const auto& runs = stored.runs;
  for (const ElementRun& wr : piece_runs(w.full_shape, w.box, w.begin, w.end)) {
    int64_t cur = wr.begin;
    while (cur < wr.end) {
      const auto after = std::upper_bound(runs.begin(), runs.end(), cur,
                                          [](int64_t v, const auto& r) { return v < r.begin; });
      const StoredRuns::Run* best = nullptr;
      if (after != runs.begin()) {
        const auto& r = runs[stored.reach[static_cast<size_t>(after - runs.begin()) - 1]];
        if (r.end > cur) best = &r;
      }
      if (best == nullptr) {
        const int64_t next = after == runs.end() ? wr.end : std::min(after->begin, wr.end);
        const std::string from =
            w.full_shape.rank() > 1
                ? fmt::format(" (from element {})", element_index(w.full_shape, cur))
                : std::string();
        if (w.box.begin.empty()) {
          throw CheckpointError(
              fmt::format("sharded checkpoint {}: tensor '{}': elements [{}, {}){} of the "
                          "wanted range [{}, {}) are in no piece of the checkpoint",
                          index.dir, w.name, cur, next, from, w.begin, w.end));
        }
        throw CheckpointError(fmt::format(
            "sharded checkpoint {}: tensor '{}' {}: elements [{}, {}) of the whole tensor{}, "
            "wanted by the piece [{}, {}) of box {}, are in no piece of the checkpoint",
            index.dir, w.name, w.full_shape.str(), cur, next, from, w.begin, w.end, w.box.str()));
      }
      const int64_t hi = std::min(best->end, wr.end);
      reads->push_back({best->piece, best->offset + (cur - best->begin), hi - cur, wi,
                        wr.offset + (cur - wr.begin)});
      cur = hi;
    }
  }
}

// One shard file, opened and checked against the index.
class ShardSource {
 public:
  ShardSource(const ShardedIndex& index, const ShardedFileInfo& info)
      : dir_(index.dir), path_((fs::path(index.dir) / info.file).string()), reader_(open(info)) {
    const auto& meta = reader_.metadata();
    const auto bb = meta.find(std::string(kShardBlockBytesKey));
    const auto parsed = bb == meta.end()
                            ? std::from_chars_result{nullptr, std::errc::invalid_argument}
                            : std::from_chars(bb->second.data(),
                                              bb->second.data() + bb->second.size(), block_bytes_);
    if (parsed.ec != std::errc() || parsed.ptr != bb->second.data() + bb->second.size() ||
        block_bytes_ == 0) {
      throw CheckpointError(
          fmt::format("sharded checkpoint {}: shard {}: metadata '{}' is "
                      "missing or malformed",
                      dir_, path_, kShardBlockBytesKey));
    }
  }

  uint64_t block_bytes() const { return block_bytes_; }

  // Reads blocks [k0, k1) of the stored piece `ref` of tensor `tensor`,
  // verifying each, and returns them (byte k0 * block_bytes() first; valid
  // until the next call).
  const std::byte* blocks(const std::string& tensor, const ShardedPieceRef& ref, DType dtype,
                          uint64_t k0, uint64_t k1) {
    const std::string& blocks = checked_blocks(tensor, ref, dtype);
    const uint64_t esize = dtype_size(dtype);
    const uint64_t piece_bytes = static_cast<uint64_t>(ref.end - ref.begin) * esize;
    const uint64_t B = block_bytes_;
    const uint64_t r0 = k0 * B;
    const uint64_t r1 = std::min(k1 * B, piece_bytes);
    buf_.resize(static_cast<size_t>(r1 - r0));
    reader_.file().read_bytes(ref.key, r0, r1 - r0, buf_.data());
    for (uint64_t k = k0; k < k1; ++k) {
      const uint64_t off = k * B;
      const uint64_t len = std::min(B, piece_bytes - off);
      const auto got = static_cast<uint32_t>(
          crc32_z(0, reinterpret_cast<const Bytef*>(buf_.data() + (off - r0)), len));
      const std::string_view want = std::string_view(blocks).substr(8 * k, 8);
      if (hex32(got) != want) {
        throw CheckpointError(fmt::format(
            "sharded checkpoint {}: shard {}: tensor '{}' fails its checksum in bytes [{}, {}) "
            "of piece '{}' (stored {}, computed {}): the file is corrupted or was modified",
            dir_, path_, tensor, off, off + len, ref.key, want, hex32(got)));
      }
    }
    return buf_.data();
  }

 private:
  CheckpointReader open(const ShardedFileInfo& info) const {
    std::error_code ec;
    const uint64_t size = fs::file_size(path_, ec);
    if (ec) {
      throw FileError(fmt::format(
          "sharded checkpoint {}: shard file {} (written by rank {}) cannot be read: {}", dir_,
          path_, info.rank, ec.message()));
    }
    if (size != info.bytes) {
      throw CheckpointError(fmt::format(
          "sharded checkpoint {}: shard file {} is {}: it has {} bytes but the index records {}",
          dir_, path_, size < info.bytes ? "truncated" : "longer than written", size, info.bytes));
    }
    return CheckpointReader(path_);
  }

  // The piece's block checksums, after checking the stored tensor is the
  // one the index describes (same shape, dtype and whole-piece checksum, so
  // a shard file of another checkpoint is not mistaken for this one's).
  const std::string& checked_blocks(const std::string& tensor, const ShardedPieceRef& ref,
                                    DType dtype) {
    if (const auto it = checked_.find(ref.key); it != checked_.end()) return it->second;
    auto fail = [&](const std::string& what) {
      throw CheckpointError(
          fmt::format("sharded checkpoint {}: shard {}: tensor '{}' piece '{}': {}", dir_, path_,
                      tensor, ref.key, what));
    };
    const SafetensorsEntry* e = reader_.header().find(ref.key);
    if (e == nullptr) fail("not in the shard file");
    const Shape want_shape{ref.end - ref.begin};
    if (e->dtype != dtype || !(e->shape == want_shape)) {
      fail(fmt::format("stored as {}{} but the index says {}{}", dtype_name(e->dtype),
                       e->shape.str(), dtype_name(dtype), want_shape.str()));
    }
    const auto& all = reader_.header().metadata;
    const auto crc = all.find("crc32/" + ref.key);
    if (crc == all.end() || crc->second != hex32(ref.crc32)) {
      fail(fmt::format("checksum {} differs from the index's {} (a shard of another checkpoint?)",
                       crc == all.end() ? std::string("(none)") : crc->second, hex32(ref.crc32)));
    }
    const auto blocks = reader_.metadata().find(std::string(kShardBlocksKeyPrefix) + ref.key);
    const uint64_t bytes = static_cast<uint64_t>(ref.end - ref.begin) * dtype_size(dtype);
    const uint64_t n_blocks = (bytes + block_bytes_ - 1) / block_bytes_;
    if (blocks == reader_.metadata().end() || blocks->second.size() != 8 * n_blocks) {
      fail(fmt::format("block checksums missing or not {} long", 8 * n_blocks));
    }
    return checked_.emplace(ref.key, blocks->second).first->second;
  }

  std::string dir_;
  std::string path_;
  CheckpointReader reader_;
  uint64_t block_bytes_ = 0;
  std::map<std::string, std::string> checked_;
  std::vector<std::byte> buf_;
};

// Reads of one stored piece whose blocks overlap or touch are served by one
// file read while it stays under this size (a single larger read is read
// whole, as before).
constexpr uint64_t kGroupBytes = uint64_t{16} << 20;

// Reads every wanted piece into fresh staging tensors (one per wanted
// piece, in order; undefined for empty ones).
std::vector<Tensor> stage(const ShardedIndex& index, std::span<const ShardPiece> wanted) {
  std::vector<Read> reads;
  std::map<std::string, StoredRuns> stored;  // per tensor, built on first use
  for (size_t i = 0; i < wanted.size(); ++i) {
    check_wanted(index, wanted[i]);
    auto it = stored.find(wanted[i].name);
    if (it == stored.end()) {
      it = stored.emplace(wanted[i].name, stored_runs(index.tensors.at(wanted[i].name))).first;
    }
    plan_reads(index, it->second, wanted[i], i, &reads);
  }
  // Shard by shard, and in file order within one, for sequential I/O.
  std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) {
    return std::tie(a.piece->shard, a.piece->key, a.src) <
           std::tie(b.piece->shard, b.piece->key, b.src);
  });
  std::vector<Tensor> staged(wanted.size());
  for (size_t i = 0; i < wanted.size(); ++i) {
    if (piece_numel(wanted[i]) > 0) {
      staged[i] = Tensor::empty(Shape{piece_numel(wanted[i])}, wanted[i].data.dtype());
    }
  }
  std::unique_ptr<ShardSource> source;
  int open_shard = -1;
  for (size_t i = 0; i < reads.size();) {
    const ShardedPieceRef* piece = reads[i].piece;
    if (piece->shard != open_shard) {
      source.reset();  // one shard file open at a time
      source =
          std::make_unique<ShardSource>(index, index.shards[static_cast<size_t>(piece->shard)]);
      open_shard = piece->shard;
    }
    const ShardPiece& w0 = wanted[reads[i].wanted];
    const DType dtype = w0.data.dtype();
    const auto esize = static_cast<uint64_t>(dtype_size(dtype));
    const uint64_t B = source->block_bytes();
    auto first_block = [&](const Read& r) { return static_cast<uint64_t>(r.src) * esize / B; };
    auto end_block = [&](const Read& r) {
      return (static_cast<uint64_t>(r.src + r.n) * esize + B - 1) / B;
    };
    // The group: following reads of this piece whose blocks overlap or
    // touch the group's, while it stays under kGroupBytes.
    const uint64_t k0 = first_block(reads[i]);
    uint64_t k1 = end_block(reads[i]);
    size_t j = i + 1;
    for (; j < reads.size() && reads[j].piece == piece; ++j) {
      const uint64_t e = std::max(k1, end_block(reads[j]));
      if (first_block(reads[j]) > k1 || (e - k0) * B > kGroupBytes) break;
      k1 = e;
    }
    const std::byte* bytes = source->blocks(w0.name, *piece, dtype, k0, k1);
    for (; i < j; ++i) {
      const Read& r = reads[i];
      auto* dst =
          static_cast<std::byte*>(staged[r.wanted].raw()) + static_cast<uint64_t>(r.dst) * esize;
      std::memcpy(dst, bytes + (static_cast<uint64_t>(r.src) * esize - k0 * B),
                  static_cast<size_t>(static_cast<uint64_t>(r.n) * esize));
    }
  }
  return staged;
}

void deliver(std::span<const ShardPiece> wanted, const std::vector<Tensor>& staged) {
  for (size_t i = 0; i < wanted.size(); ++i) {
    if (piece_numel(wanted[i]) == 0) continue;
    Tensor dst = wanted[i].data;  // a handle on the caller's memory
    std::memcpy(dst.raw(), staged[i].raw(), staged[i].nbytes());
  }
}

}  // namespace

ShardedIndex load_sharded(Communicator* comm, const std::string& dir,
                          std::span<const ShardPiece> wanted, const LoadShardedOptions& options) {
  ShardedIndex index;
  std::vector<Tensor> staged;
  std::exception_ptr err;
  try {
    index = read_index(dir);
    staged = stage(index, wanted);
  } catch (...) {
    err = std::current_exception();
  }
  agree_on_failure(comm, err, options.collective);
  deliver(wanted, staged);
  return index;
}

CheckpointContents load_sharded_full(const std::string& dir) {
  const ShardedIndex index = read_index(dir);
  CheckpointContents out;
  std::vector<ShardPiece> wanted;
  for (const auto& [name, info] : index.tensors) {
    Tensor t = Tensor::empty(info.shape, info.dtype);
    wanted.push_back(full_piece(name, t));
    out.tensors.emplace(name, std::move(t));
  }
  deliver(wanted, stage(index, wanted));
  out.metadata = index.metadata;
  return out;
}

void convert_sharded_to_checkpoint(const std::string& dir, const std::string& file) {
  const CheckpointContents c = load_sharded_full(dir);
  save_checkpoint(file, c.tensors, c.metadata);
}

CheckpointContents load_any_checkpoint(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return load_sharded_full(path);
  return load_checkpoint(path);
}

}  // namespace mt
