// Owns the f32 master copy of every parameter of a model and its gradient.
//
// Parameters live in one flat buffer and gradients in another, in graph
// order, each tensor starting on a 64-byte boundary; per-parameter tensors are
// views into them. Flat storage is what data-parallel sync (buckets), ZeRO
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
    Tensor value;        // view into flat_values()
    Tensor grad;         // view into flat_grads()
  };

  ParamStore(const Graph& g, uint64_t seed);

  // The layout the store gives g's parameters (names, shapes, offsets in the
  // flat buffers) and the flat buffers' length in elements, without
  // allocating or initialising anything.
  static ParamLayout layout(const Graph& g, int64_t* flat_numel = nullptr);

  std::vector<Entry>& entries() { return entries_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(const std::string& name) const;
  Tensor& flat_values() { return values_; }
  Tensor& flat_grads() { return grads_; }
  int64_t numel() const { return numel_; }  // parameters, without padding

  // Binds every parameter of g (matched by name; g may be another build of
  // the same model, e.g. the evaluation graph) and, if with_grads, each
  // parameter's gradient value. Throws ShapeError for a name or shape that
  // does not match.
  void bind(Executor& ex, const Graph& g, bool with_grads);

 private:
  std::vector<Entry> entries_;
  Tensor values_;
  Tensor grads_;
  int64_t numel_ = 0;
};

}  // namespace mt
