// Owns the f32 master copy of every parameter of a model and, when asked,
// a gradient buffer (for a single-process loop that binds the executor's
// gradients itself; the Trainer does not: DataParallel owns its gradients).
//
// Parameters live in one flat buffer and gradients in another, in graph
// order, each tensor starting on a 64-byte boundary; per-parameter tensors are
// views into them. Allocations are tagged as parameters / gradients
// (tensor/memory_stats.h). The values can be dropped and allocated again
// (ZeRO-3 keeps only a shard elsewhere and needs the whole parameters only
// now and then). Flat storage is what data-parallel sync (buckets), ZeRO
// (shards of the flat buffer) and checkpoints work on. Initial values are
// drawn from each parameter's ParamInit with a random stream derived from the
// seed and the parameter's name, so they do not depend on creation order or
// on the world size. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/exec/executor.h"
#include "meshtrain/graph/graph.h"
#include "meshtrain/sync/buckets.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

class ParamStore {
 public:
  struct Entry {
    std::string name;
    Shape shape;
    int64_t offset = 0;  // element offset in the flat buffers
    Tensor value;        // view into flat_values(); undefined while dropped
    Tensor grad;         // view into flat_grads(); undefined without gradients
    ParamInit init;      // how initial_value() draws it
  };

  // with_grads: also a zero-filled gradient buffer. with_values = false:
  // the layout only, no parameter buffer (ensure_values() allocates one;
  // initial_value() draws one parameter at a time).
  ParamStore(const Graph& g, uint64_t seed, bool with_grads = false, bool with_values = true);

  // Elements [begin, end) of entry i's initial value (the same numbers the
  // constructor writes) into dst, drawing the random stream up to `end`
  // without holding the rest: fills a shard without a whole copy.
  void initial_range(size_t i, int64_t begin, int64_t end, float* dst) const;

  // Redraws entry i as a box of a larger parameter (tensor parallelism: this
  // rank's piece): the same numbers as the box starting at `begin` (one
  // offset per dimension; the box's shape is the entry's) of the parameter
  // of shape `global` drawn whole, so a split run starts exactly where the
  // unsplit one does. Holds one whole copy of the parameter meanwhile.
  void initial_box(size_t i, const Shape& global, const std::vector<int64_t>& begin);

  // The layout the store gives g's parameters (names, shapes, offsets in the
  // flat buffers) and the flat buffers' length in elements, without
  // allocating or initialising anything.
  static ParamLayout layout(const Graph& g, int64_t* flat_numel = nullptr);

  std::vector<Entry>& entries() { return entries_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(const std::string& name) const;
  Tensor& flat_values() { return values_; }
  Tensor& flat_grads() { return grads_; }
  int64_t numel() const { return numel_; }            // parameters, without padding
  int64_t flat_numel() const { return flat_numel_; }  // with padding

  // Frees the flat parameter buffer (entries' values become undefined).
  void drop_values();
  // Allocates it again (zero-filled) if dropped; returns it.
  Tensor& ensure_values();
  bool has_values() const { return values_.raw() != nullptr; }
  bool has_grads() const { return grads_.raw() != nullptr; }

  // Binds every parameter of g (matched by name; g may be another build of
  // the same model, e.g. the evaluation graph) and, if with_grads, each
  // parameter's gradient value (the store must have been built with
  // gradients). Throws ShapeError for a name or shape that
  // does not match.
  void bind(Executor& ex, const Graph& g, bool with_grads);

 private:
  std::vector<Entry> entries_;
  Tensor values_;
  Tensor grads_;
  int64_t numel_ = 0;
  int64_t flat_numel_ = 0;
  uint64_t seed_ = 0;
};

}  // namespace mt
