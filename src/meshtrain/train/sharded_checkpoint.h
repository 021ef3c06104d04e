// Sharded, reshardable checkpoints: N ranks each write the pieces of tensors
// they hold (whole tensors, 1/N flat chunks, ZeRO buckets that cut tensors
// anywhere, tensor-parallel boxes such as a column shard, and 1-D ranges of
// those boxes); later any number of ranks, in any layout, read back exactly
// the elements they need. A checkpoint is a directory:
//
//   shard-<r>-of-<N>-<nonce>.safetensors
//       rank r's non-empty pieces, a checksummed checkpoint file
//       (checkpoint.h) with one tensor per piece, shaped [end - begin]
//       (the piece's elements in its order). A piece whose elements are
//       contiguous in the whole tensor's row-major order (a whole tensor, a
//       1-D range, a block of rows) is stored as that range of the whole
//       tensor, keyed "<name>@<begin>-<end>"; any other box piece (a column
//       shard: ONE stored tensor, not one per row) keeps its box, keyed
//       "<name>@<b0>:<e0>,<b1>:<e1>,...@<begin>-<end>" with [begin, end) of
//       the box's flattening. Its metadata also holds a CRC-32 per block of
//       `block_bytes` of each piece ("shard/blocks/<key>"), so a read
//       verifies only the blocks it touches.
//   index.json
//       written last, atomically, by rank 0: format ("meshtrain-sharded-2";
//       "-1", written before boxes existed, still loads: its pieces are the
//       box-less ones), writer's world size and mode, the caller's metadata,
//       each shard file with its size, and for every tensor its full shape,
//       dtype and pieces (shard, key, begin, end, "box" [[b0, e0], ...] when
//       the piece has one, CRC-32), under a CRC of the whole index. Its
//       presence marks a complete checkpoint.
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
// Loading: each rank passes the pieces it wants (any range, with or without
// a box); they are filled from whichever stored pieces overlap them,
// whatever their boxes, one read per run of elements contiguous in both
// (per row of a box at most), reading only the blocks those runs touch and
// verifying each block's checksum, and only after every wanted byte was
// read and verified (on every rank, when a communicator is given) is
// anything written into the destination views.
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
#include "meshtrain/tensor/box.h"
#include "meshtrain/train/checkpoint.h"

namespace mt {

// Shard file metadata keys (see the top of this file): the block size in
// bytes, and per piece key the concatenated 8-hex-digit CRC-32s (zlib's) of
// its consecutive blocks, the last one possibly shorter.
inline constexpr std::string_view kShardBlockBytesKey = "shard/block_bytes";
inline constexpr std::string_view kShardBlocksKeyPrefix = "shard/blocks/";

// Pieces are sync's ShardPiece (sync/data_parallel.h): elements [begin,
// end) of the row-major flattening of `box` (an N-d box of the whole tensor
// `name` of shape full_shape; an empty box is the whole tensor), held in
// `data` (end - begin elements, any shape; a view that save reads from and
// load writes through). The piece's dtype is data.dtype(); an empty piece
// may leave `data` unset, and then names only its tensor and shape. Tensor
// names are the caller's, e.g. "param/fc1.w" and "optim/fc1.w.exp_avg"
// (train_state.h's names).

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

// Box `box` of the whole tensor `name` (shape `whole`) as one piece: `data`
// holds the box's elements in row-major order (box.shape(), or any shape of
// box.elements() elements; a view, kept as given). ConfigError for a box
// that does not fit `whole`, ShapeError for data of another size.
ShardPiece box_piece(std::string name, const Shape& whole, const Box& box, const Tensor& data);

// Where a local tensor lies in the whole one: it is box `box` of a tensor
// of shape `whole` (spmd's LoweredParam::global and ::box).
struct TensorPlace {
  Shape whole;
  Box box;
};
// Re-anchors a piece of a local tensor (e.g. DataParallel's param_pieces /
// state_pieces, whose full_shape is the local shape and whose range indexes
// the local tensor) to the whole tensor it is box `place.box` of: the same
// name, range and data, full_shape = place.whole, and box = place.box (or,
// for a piece that already has a box inside the local tensor, that box
// shifted by place.box.begin). ConfigError naming the piece when its
// full_shape is not place.box.shape() or the box does not fit place.whole.
ShardPiece in_box(ShardPiece local, const TensorPlace& place);
// in_box() for every piece whose name `places` lists (exact names: for
// optimizer state list "<param>.<kind>" too, or map before with_prefix);
// other pieces are returned as they are (replicated tensors).
std::vector<ShardPiece> in_boxes(std::vector<ShardPiece> pieces,
                                 const std::map<std::string, TensorPlace>& places);

// A run of a piece's elements that is contiguous in the whole tensor:
// elements [begin, end) of the whole tensor's row-major flattening, held at
// data offset `offset` (in elements) of the piece.
struct ElementRun {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t offset = 0;
  bool operator==(const ElementRun&) const = default;
};
// Elements [begin, end) of the flattening of `box` of a tensor of shape
// `whole` (empty box: the whole tensor) as maximal contiguous runs of the
// whole tensor, in piece order: one run for a piece without a box, a whole
// tensor, a block of rows or any range inside one row of the box; at most
// one per row of the box otherwise (a row: the box's extent in its last
// dimension that is not whole, times the whole dimensions after it). Empty
// for an empty range. ConfigError for a box that does not fit `whole` (rank,
// begin <= end inside each dimension) or a range outside the box.
std::vector<ElementRun> piece_runs(const Shape& whole, const Box& box, int64_t begin, int64_t end);

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
// rank's pieces with `metadata`. Each non-empty piece is one stored tensor
// (see the top of this file: a piece contiguous in the whole tensor is
// stored as that range, without its box). Empty pieces write no data but
// name their tensor, so zero-size tensors and ranks without data are fine;
// pieces may overlap (replicated data), and a tensor's pieces over all
// ranks must cover it. Throws, on every rank alike: ConfigError for a bad
// piece (a box that does not fit its tensor, a range outside its box or
// tensor, the same box and range twice on one rank), pieces that
// disagree on a tensor's shape or dtype, elements no rank holds, or a
// metadata key in a reserved namespace ("crc32/", "meshtrain/"); ShapeError
// for piece data that does not match its range or dtype; FileError when a
// file cannot be written. On any error the previous checkpoint in `dir`, if
// any, is untouched.
void save_sharded(Communicator* comm, const std::string& dir, std::span<const ShardPiece> pieces,
                  const std::map<std::string, std::string>& metadata = {},
                  const SaveShardedOptions& options = {});

// One stored piece, as index.json lists it: elements [begin, end) of the
// flattening of `box` (empty: of the whole tensor).
struct ShardedPieceRef {
  int shard = 0;    // position in ShardedIndex::shards
  std::string key;  // tensor name inside the shard file
  int64_t begin = 0;
  int64_t end = 0;
  uint32_t crc32 = 0;  // tensor_checksum of the stored piece (checkpoint.h)
  Box box;             // empty for pieces contiguous in the whole tensor
};

struct ShardedTensorInfo {
  DType dtype = DType::f32;
  Shape shape;
  // Sorted by first element in the whole tensor, then box, begin, end (for
  // box-less pieces: by (begin, end)).
  std::vector<ShardedPieceRef> pieces;
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

// Reads and verifies `dir`/index.json (format 1 or 2, checksum, structure:
// every piece's box inside its tensor, its range non-empty and inside its
// box, and naming a listed shard). FileError if it is
// missing or unreadable, CheckpointError naming the file for anything else.
ShardedIndex read_index(const std::string& dir);

struct LoadShardedOptions {
  // Timeout and tag of the gather that agrees on the outcome.
  CollectiveOptions collective;
};

// Collective over `comm` (nullptr: this process alone). Fills every wanted
// piece's data from the shards of `dir` and returns the index. Each wanted
// piece must name a tensor of the checkpoint with the same shape and dtype,
// and its elements (range of its box, or of the whole tensor) must be
// covered by stored pieces, whatever their boxes. Throws, on every rank
// alike when `comm` is given: FileError for a missing index or shard file;
// CheckpointError for a tensor the checkpoint lacks or holds with another
// shape or dtype, an element the stored pieces do not cover (naming tensor,
// the uncovered elements of the whole tensor, the first one's index and the
// wanted piece), a shard whose size differs from the index's record (naming
// the file and both sizes), or bytes that fail their checksum (naming the
// file and tensor); ConfigError for a wanted box or range outside its
// tensor; ShapeError for data that does not fit its range. All or nothing:
// on error no destination was written.
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
