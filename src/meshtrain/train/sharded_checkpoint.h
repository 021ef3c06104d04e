// Sharded, reshardable checkpoints: N ranks each write the pieces of tensors
// they hold (whole tensors, 1/N flat chunks, ZeRO buckets that cut tensors
// anywhere); later any number of ranks, in any layout, read back exactly the
// element ranges they need. A checkpoint is a directory:
//
//   shard-<r>-of-<N>-<nonce>.safetensors
//       rank r's non-empty pieces, a checksummed checkpoint file
//       (checkpoint.h) with one tensor per piece, keyed "<name>@<begin>-<end>"
//       and shaped [end - begin]; its metadata also holds a CRC-32 per block
//       of `block_bytes` of each piece ("shard/blocks/<key>"), so a range
//       read verifies only the blocks it touches.
//   index.json
//       written last, atomically, by rank 0: format, writer's world size and
//       mode, the caller's metadata, each shard file with its size, and for
//       every tensor its full shape, dtype and pieces (shard, key, range,
//       CRC-32), under a CRC of the whole index. Its presence marks a
//       complete checkpoint.
//
// Saving again into the same directory writes shards under a fresh nonce,
// replaces index.json atomically and only then deletes the shards the new
// index does not reference, so at every moment the index names a complete
// set of files: a save that fails anywhere (on any rank, before or after its
// shard is written) leaves the previous checkpoint loadable. Ranks agree on
// the outcome: a failure on one rank throws the same error, naming that
// rank, on every rank. (A reader that opened the old index while a new save
// deletes the old shards gets a missing-shard FileError, never wrong data.)
//
// Loading: each rank passes the pieces it wants; they are filled from
// whichever shard files overlap them, reading only the blocks needed and
// verifying each block's checksum, and only after every wanted byte was read
// and verified (on every rank, when a communicator is given) is anything
// written into the destination views.
//
// Blocking: save_sharded and load_sharded with a communicator are collective
// (every rank of the group calls them, in the same order with other
// collectives) and block on file I/O and a few small gathers, each bounded by
// the collective timeout. All other functions block on file I/O only. Not
// thread-safe per call; different directories may be used concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/sync/data_parallel.h"
#include "meshtrain/train/checkpoint.h"

namespace mt {

// Shard file metadata keys (see the top of this file): the block size in
// bytes, and per piece key the concatenated 8-hex-digit CRC-32s (zlib's) of
// its consecutive blocks, the last one possibly shorter.
inline constexpr std::string_view kShardBlockBytesKey = "shard/block_bytes";
inline constexpr std::string_view kShardBlocksKeyPrefix = "shard/blocks/";

// Pieces are sync's ShardPiece (sync/data_parallel.h): elements [begin,
// end) of the row-major flattening of the whole tensor `name` (shape
// full_shape), held in `data` (end - begin elements, any shape; a view that
// save reads from and load writes through). The piece's dtype is
// data.dtype(); an empty piece may leave `data` unset, and then names only
// its tensor and shape. Tensor names are the caller's, e.g. "param/fc1.w"
// and "optim/fc1.w.exp_avg" (train_state.h's names).

// The whole of `t` as one piece (a view of t's memory).
ShardPiece full_piece(std::string name, const Tensor& t);
// Elements [begin, end) of the whole tensor `t` as a piece viewing t's
// memory (which must outlive the piece). ConfigError for a range outside t.
ShardPiece slice_piece(std::string name, const Tensor& t, int64_t begin, int64_t end);
// Chunk `rank` of `size` near-equal contiguous chunks of [0, numel): the
// first numel % size chunks have one element more.
std::pair<int64_t, int64_t> even_range(int64_t numel, int rank, int size);
// Chunk `rank` of `size` of every tensor (plain data parallelism: replicas
// hold everything, each writes 1/size of it). Empty chunks are included, so
// every tensor is named on every rank.
std::vector<ShardPiece> even_pieces(const std::map<std::string, Tensor>& tensors, int rank,
                                    int size);

// The same pieces with `prefix` before each name (e.g. "param/" or "optim/"
// on DataParallel's param_pieces / state_pieces, for train_state.h's names).
std::vector<ShardPiece> with_prefix(std::vector<ShardPiece> pieces, std::string_view prefix);

struct SaveShardedOptions {
  // How the writer held its state, recorded in the index for people and
  // tools (e.g. "dp", "zero1", "zero3"); loading does not depend on it.
  std::string mode;
  // Granularity of the range checksums: a load reads and verifies whole
  // blocks around the range it needs. At least 1.
  uint64_t block_bytes = uint64_t{1} << 20;
  // Timeout and tag of the gathers that agree on pieces and outcome.
  CollectiveOptions collective;
  // Fault injection for tests: called on each rank with "shard" before it
  // writes its shard file, and on rank 0 with "index" before it writes the
  // index; an exception thrown here is handled like a failed write.
  std::function<void(std::string_view stage, int rank)> fault_injection;
};

// Collective over `comm` (nullptr: this process alone, rank 0 of 1). Writes
// this rank's pieces, then rank 0 writes `dir`/index.json listing every
// rank's pieces with `metadata`. Empty pieces write no data but name their
// tensor, so zero-size tensors and ranks without data are fine; pieces may
// overlap (replicated data), and a tensor's pieces over all ranks must cover
// it. Throws, on every rank alike: ConfigError for a bad piece (range
// outside its tensor, the same range twice on one rank), pieces that
// disagree on a tensor's shape or dtype, elements no rank holds, or a
// metadata key in a reserved namespace ("crc32/", "meshtrain/"); ShapeError
// for piece data that does not match its range or dtype; FileError when a
// file cannot be written. On any error the previous checkpoint in `dir`, if
// any, is untouched.
void save_sharded(Communicator* comm, const std::string& dir, std::span<const ShardPiece> pieces,
                  const std::map<std::string, std::string>& metadata = {},
                  const SaveShardedOptions& options = {});

// One stored piece, as index.json lists it.
struct ShardedPieceRef {
  int shard = 0;    // position in ShardedIndex::shards
  std::string key;  // tensor name inside the shard file
  int64_t begin = 0;
  int64_t end = 0;
  uint32_t crc32 = 0;  // tensor_checksum of the stored piece (checkpoint.h)
};

struct ShardedTensorInfo {
  DType dtype = DType::f32;
  Shape shape;
  std::vector<ShardedPieceRef> pieces;  // sorted by (begin, end)
};

struct ShardedFileInfo {
  int rank = 0;      // the rank that wrote it
  std::string file;  // name inside the checkpoint directory
  uint64_t bytes = 0;
};

// The parsed, verified index of a sharded checkpoint.
struct ShardedIndex {
  std::string dir;
  int world_size = 0;  // of the writer
  std::string mode;    // SaveShardedOptions::mode of the writer
  std::string nonce;   // distinguishes this save's shard files
  std::map<std::string, std::string> metadata;
  std::vector<ShardedFileInfo> shards;
  std::map<std::string, ShardedTensorInfo> tensors;
};

// "<dir>/index.json"
std::string sharded_index_path(const std::string& dir);
// True if `dir` holds an index.json (a complete sharded checkpoint, or a
// damaged one that reading will report).
bool is_sharded_checkpoint(const std::string& dir);

// Reads and verifies `dir`/index.json (format, checksum, structure: every
// piece inside its tensor and naming a listed shard). FileError if it is
// missing or unreadable, CheckpointError naming the file for anything else.
ShardedIndex read_index(const std::string& dir);

struct LoadShardedOptions {
  // Timeout and tag of the gather that agrees on the outcome.
  CollectiveOptions collective;
};

// Collective over `comm` (nullptr: this process alone). Fills every wanted
// piece's data from the shards of `dir` and returns the index. Each wanted
// piece must name a tensor of the checkpoint with the same shape and dtype,
// and its range must be covered by stored pieces. Throws, on every rank
// alike when `comm` is given: FileError for a missing index or shard file;
// CheckpointError for a tensor the checkpoint lacks or holds with another
// shape or dtype, a range the stored pieces do not cover (naming tensor and
// elements), a shard whose size differs from the index's record (naming the
// file and both sizes), or bytes that fail their checksum (naming the file
// and tensor); ConfigError for a wanted range outside its tensor; ShapeError
// for data that does not fit its range. All or nothing: on error no
// destination was written.
ShardedIndex load_sharded(Communicator* comm, const std::string& dir,
                          std::span<const ShardPiece> wanted,
                          const LoadShardedOptions& options = {});

// Every tensor whole, with the metadata (a single-process load, M = 1).
CheckpointContents load_sharded_full(const std::string& dir);
// Writes the sharded checkpoint `dir` as one single-file checkpoint `file`
// (save_checkpoint: the same tensor names and metadata, so a state saved
// with train_state.h's names loads with load_train_state).
void convert_sharded_to_checkpoint(const std::string& dir, const std::string& file);
// A single-file checkpoint, or a sharded checkpoint directory, whole.
CheckpointContents load_any_checkpoint(const std::string& path);

// Collective over `comm` (nullptr: rethrows `local` if set). Every rank
// passes the error it met (null if none); if any rank failed, every rank
// throws the same error: the type and message of the lowest failing rank's,
// with its rank and the other failing ranks named. Error types other than
// meshtrain's become CheckpointError. Used by save_sharded and load_sharded;
// exposed for callers that wrap them in larger all-or-nothing steps.
void agree_on_failure(Communicator* comm, std::exception_ptr local,
                      const CollectiveOptions& options = {});

}  // namespace mt
