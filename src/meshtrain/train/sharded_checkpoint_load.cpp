// Loading sharded checkpoints: plan which stored pieces cover each wanted
// range, read only the checksum blocks those ranges touch, verify, stage,
// and write the destinations only once everything (on every rank) is good.
#include <zlib.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <memory>
#include <tuple>

#include "meshtrain/train/sharded_checkpoint.h"

namespace mt {

namespace {

namespace fs = std::filesystem;

std::string hex32(uint32_t v) {
  return fmt::format("{:08x}", v);
}

// One run of elements [lo, hi) of a tensor, read from one stored piece into
// one wanted piece.
struct Read {
  const ShardedPieceRef* piece;
  int64_t lo;
  int64_t hi;
  size_t wanted;
};

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
  if (w.begin < 0 || w.begin > w.end || w.end > w.full_shape.numel()) {
    throw ConfigError(fmt::format(
        "sharded checkpoint {}: wanted range [{}, {}) of '{}' is outside shape {} ({} elements)",
        index.dir, w.begin, w.end, w.name, w.full_shape.str(), w.full_shape.numel()));
  }
  if (piece_numel(w) > 0 && (!w.data.defined() || w.data.numel() != piece_numel(w))) {
    throw ShapeError(fmt::format(
        "sharded checkpoint {}: wanted range [{}, {}) of '{}' needs {} elements but the "
        "destination is {}",
        index.dir, w.begin, w.end, w.name, piece_numel(w),
        w.data.defined() ? w.data.desc() : std::string("unset")));
  }
}

// Covers [w.begin, w.end) greedily with the stored pieces that reach
// furthest, so each element is read once.
void plan_reads(const ShardedIndex& index, const ShardPiece& w, size_t wi,
                std::vector<Read>* reads) {
  const auto& pieces = index.tensors.at(w.name).pieces;  // sorted by begin
  int64_t cur = w.begin;
  while (cur < w.end) {
    const ShardedPieceRef* best = nullptr;
    int64_t next_begin = w.end;
    for (const ShardedPieceRef& p : pieces) {
      if (p.begin > cur) {
        next_begin = std::min(next_begin, p.begin);
        break;
      }
      if (p.end > cur && (best == nullptr || p.end > best->end)) best = &p;
    }
    if (best == nullptr) {
      throw CheckpointError(fmt::format(
          "sharded checkpoint {}: tensor '{}': elements [{}, {}) of the wanted range [{}, {}) "
          "are in no piece of the checkpoint",
          index.dir, w.name, cur, next_begin, w.begin, w.end));
    }
    const int64_t hi = std::min(best->end, w.end);
    reads->push_back({best, cur, hi, wi});
    cur = hi;
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

  // Reads elements [lo, hi) of the stored piece `ref` of tensor `tensor`
  // into dst, verifying every block it touches.
  void read(const std::string& tensor, const ShardedPieceRef& ref, DType dtype, int64_t lo,
            int64_t hi, std::byte* dst) {
    const std::string& blocks = checked_blocks(tensor, ref, dtype);
    const uint64_t esize = dtype_size(dtype);
    const uint64_t piece_bytes = static_cast<uint64_t>(ref.end - ref.begin) * esize;
    const uint64_t b0 = static_cast<uint64_t>(lo - ref.begin) * esize;
    const uint64_t b1 = static_cast<uint64_t>(hi - ref.begin) * esize;
    const uint64_t B = block_bytes_;
    const uint64_t k0 = b0 / B;
    const uint64_t k1 = (b1 + B - 1) / B;
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
    std::memcpy(dst, buf_.data() + (b0 - r0), static_cast<size_t>(b1 - b0));
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

// Reads every wanted range into fresh staging tensors (one per wanted
// piece, in order; undefined for empty ones).
std::vector<Tensor> stage(const ShardedIndex& index, std::span<const ShardPiece> wanted) {
  std::vector<Read> reads;
  for (size_t i = 0; i < wanted.size(); ++i) {
    check_wanted(index, wanted[i]);
    plan_reads(index, wanted[i], i, &reads);
  }
  // Shard by shard, and in file order within one, for sequential I/O.
  std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) {
    return std::tie(a.piece->shard, a.piece->key, a.lo) <
           std::tie(b.piece->shard, b.piece->key, b.lo);
  });
  std::vector<Tensor> staged(wanted.size());
  for (size_t i = 0; i < wanted.size(); ++i) {
    if (piece_numel(wanted[i]) > 0) {
      staged[i] = Tensor::empty(Shape{piece_numel(wanted[i])}, wanted[i].data.dtype());
    }
  }
  std::unique_ptr<ShardSource> source;
  int open_shard = -1;
  for (const Read& r : reads) {
    if (r.piece->shard != open_shard) {
      source.reset();  // one shard file open at a time
      source =
          std::make_unique<ShardSource>(index, index.shards[static_cast<size_t>(r.piece->shard)]);
      open_shard = r.piece->shard;
    }
    const ShardPiece& w = wanted[r.wanted];
    auto* dst = static_cast<std::byte*>(staged[r.wanted].raw()) +
                (r.lo - w.begin) * static_cast<int64_t>(dtype_size(w.data.dtype()));
    source->read(w.name, *r.piece, w.data.dtype(), r.lo, r.hi, dst);
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
