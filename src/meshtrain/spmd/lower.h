// The lowering pass: one model graph and a plan in, this rank's program out.
//
// The input is the model's forward graph with global shapes (at the batch one
// data-parallel rank trains on: the data-parallel axis "dp" and the pipeline
// axis "pp" are not lowered here; the loader and sync/DataParallel handle dp,
// the pipeline runtime pp). Every other mesh axis of the plan (in practice
// "tp") is lowered: parameters take the sharding their spec gives them, and
// each operator's sharding rule decides, from its inputs' layouts, the layout
// of its outputs and where a collective must be inserted because producer
// and consumer disagree. The output is a forward graph with this rank's local
// shapes and collective operators (graph/collective.h), which autodiff then
// differentiates like any other graph: the collectives' gradient rules make
// the backward right.
//
// Layouts (per value, per lowered axis):
//   replicated  every rank of the axis holds the whole value (one variable)
//   split       the value's row-major elements fall into `units` consecutive
//               groups of `stride` elements, repeating; rank c of the axis
//               holds units [off_c, off_c + sizes[c]) of every repetition.
//               A dimension split in whole units of u elements is one case
//               (stride u x the dimensions after it); so is a split that a
//               reshape moved into a merged dimension ([B*H] with H split).
//   partial     every rank holds a summand of the value
//
// Rules (Megatron's, derived rather than written per model):
//   element-wise ops keep a split; a replicated operand that broadcasts
//     along the split enters through f (copy_to_group), one that does not is
//     split locally (split_to_group);
//   matmul: replicated x column-split -> column-split (f on the replicated
//     input); row-split (contraction) x row-split -> partial; batch-split x
//     batch-split -> batch-split; a row-split left operand times a
//     column-split right one is all-gathered first (sequence parallelism);
//   reshape and permute move a split with its elements (or gather when a
//     reshape would cut through the split unit);
//   layer_norm / softmax keep a split outside the normalised dimension;
//   partial values become replicated through g (reduce_from_group) where a
//     non-linear consumer needs them, or, with sequence parallelism, split
//     by rows through reduce_scatter where they meet the residual stream;
//   embedding with its table split by rows (one contiguous range of the
//     vocabulary per rank, even or by ratios) looks up its own rows only
//     (ids of other ranks' rows give zeros) -> partial (Megatron's
//     vocabulary-parallel embedding);
//   cross_entropy over logits split by columns (the tied head's vocabulary)
//     runs Megatron's vocabulary-parallel cross-entropy: row maxima through
//     all_reduce_max, each rank's sum of exponentials and the label's logit
//     through g, the loss from those (replicated); no [N, V] value is
//     gathered;
//   every other operator (convolutions, pooling, sparse ops, and the two
//     above with other layouts) runs on replicated inputs: split ones are
//     gathered into one replicated value (gather_from_group) first.
//
// Pure: no communication. Throws ConfigError naming the value, the axis and
// what was expected for a plan it cannot lower.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/graph/graph.h"
#include "meshtrain/spmd/plan.h"
#include "meshtrain/spmd/sharding.h"

namespace mt {

struct Layout {
  enum class Kind : uint8_t { replicated, split, partial };
  Kind kind = Kind::replicated;
  std::string axis;            // split / partial: the mesh axis
  int64_t stride = 1;          // split: elements per unit
  int64_t units = 1;           // split: units per repetition
  std::vector<int64_t> sizes;  // split: units per coordinate of the axis

  bool replicated() const { return kind == Kind::replicated; }
  bool split() const { return kind == Kind::split; }
  bool partial() const { return kind == Kind::partial; }
  // "replicated", "split(tp, 4:2 units of 64)", "partial(tp)".
  std::string describe() const;
  bool operator==(const Layout&) const = default;
};

// One parameter of the lowered graph: this rank's box of the global tensor.
struct LoweredParam {
  std::string name;
  Shape global;
  Box box;
  std::string axis;  // the axis it is split over; "" when replicated
};

// One collective the pass inserted (for inspect, and to check bytes).
struct InsertedCollective {
  std::string node;
  OpKind op = OpKind::all_reduce;
  std::string axis;
  std::string value;  // the global value it converts
  std::string why;    // "f before matmul 'block0.attn.q.matmul'", ...
};

struct LoweredProgram {
  Graph graph;                 // this rank's forward graph
  std::vector<ValueId> local;  // global value id -> local value id
  std::vector<Layout> layout;  // global value id -> the layout of local[v]
  // The CollectiveRunner's groups (lists of world ranks), the same list on
  // every rank: for each lowered axis, its groups in mesh order.
  std::vector<std::vector<int>> groups;
  std::map<std::string, int64_t> group_of_axis;  // this rank's group id per axis
  std::vector<LoweredParam> params;              // in graph order
  std::vector<InsertedCollective> inserted;      // forward, in graph order
  int rank = 0;
  std::vector<std::string> axes;  // the lowered axes

  // Local id of global value v (replicated where `outputs` asked for it).
  ValueId operator[](ValueId v) const { return local.at(static_cast<size_t>(v)); }
  // The parameter's box, or nullptr for a name the program does not have.
  const LoweredParam* param(const std::string& name) const;
  // True when some parameter is split (the program differs from the model).
  bool sharded() const;
};

// The mesh axes the pass lowers: all but "dp" and "pp".
std::vector<std::string> lowered_axes(const Mesh& mesh);
// True when the plan needs lowering (some value split or partial over a
// lowered axis).
bool needs_lowering(const Plan& plan);

struct LowerOptions {
  // Megatron's vocabulary-parallel embedding and cross-entropy (the rules
  // above); false gathers the split table and logits first instead (exact
  // too; what the pass did before them, kept to measure them against).
  bool vocab_parallel = true;
};

// Lowers `forward` (no backward nodes yet) for `rank` of plan.mesh.
// `outputs` are global values that must be replicated in the result (the
// loss; the logits, for evaluation): where they would be split or partial, a
// gather / reduction is appended and local[] points at its result.
LoweredProgram lower(const Graph& forward, const Plan& plan, int rank,
                     const std::vector<ValueId>& outputs, const LowerOptions& options = {});

// What `meshtrain inspect --plan` prints per rank: parameters with their
// boxes, the inserted collectives and the local graph's communicating nodes
// (forward and backward when `g` has them) with their payload bytes.
std::string describe_lowered(const LoweredProgram& p, const Graph& g);

}  // namespace mt
