// The contract between a data set and the DataLoader: a data set is a fixed,
// random-access list of examples; the loader decides which indices form which
// batch (shuffle, sharding) and asks the data set to gather them into tensors.
// Data sets are immutable after construction, so one instance can be shared by
// several loaders (e.g. ranks running as threads) and gather() is thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "meshtrain/tensor/tensor.h"

namespace mt {

// Which part of a data set: the examples to train on, or the held-out ones.
enum class DataSplit { train, test };

// One micro-batch as a rank sees it. x holds the inputs (e.g. f32
// [B, 1, 28, 28] images, or i32 [B, T] token ids), y the targets (i32 [B]
// class labels, or i32 [B*T] next tokens). B may be 0 on a rank whose share of
// a short final batch is empty; weight per-rank losses by size()/global_size.
struct Batch {
  Tensor x;
  Tensor y;
  int64_t epoch = 0;
  int64_t step = 0;           // step within the epoch, 0-based
  int64_t global_size = 0;    // examples in the global batch of this step, all ranks together
  int64_t global_offset = 0;  // where this rank's slice starts within the global batch

  int64_t size() const { return x.rank() == 0 ? 0 : x.shape()[0]; }
};

class Dataset {
 public:
  virtual ~Dataset() = default;

  // Number of examples.
  virtual int64_t size() const = 0;
  // The examples at `indices` (each in [0, size())), in that order, as one batch.
  // Only x and y are filled; the loader sets the bookkeeping fields.
  virtual Batch gather(std::span<const int64_t> indices) const = 0;
  // Human-readable description for logs, e.g. "fashion-mnist train (60000 examples)".
  virtual std::string describe() const = 0;
};

}  // namespace mt
