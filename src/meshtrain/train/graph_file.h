// The on-disk graph format (docs/graph_format.md): a checksummed checkpoint
// file (train/checkpoint.h: safetensors with a CRC-32 per tensor) holding
//   row_ptr    I32 [n + 1]   CSR of in-neighbours (row = destination vertex)
//   col_idx    I32 [E]       source vertex of each entry, in [0, n)
//   features   F32 [n, F]
//   labels     I32 [n]       in [0, classes)
//   train_mask, val_mask, test_mask   U8 [n], 0 or 1
// and metadata "meshtrain/graph" = "1", "classes", "name". It lives in train
// (not data) because the safetensors and checksum code it reuses lives here.
// Blocking file I/O.
#pragma once

#include <string>

#include "meshtrain/data/graph_data.h"

namespace mt {

// Writes atomically. FileError if the file cannot be written.
void save_graph(const std::string& path, const GraphData& g);
// Reads and validates everything. FileError if the file cannot be read,
// CheckpointError for a damaged file (bad checksum, missing tensor, wrong
// dtype or rank), FileError "graph file '<path>': field '<name>': ..." for
// contents that do not fit together (an out-of-range vertex id, a feature or
// label count other than the vertex count, ...).
GraphData load_graph(const std::string& path);

}  // namespace mt
