// Cross-mesh resharding: moving one tensor from the layout it has over one
// set of ranks to another layout over another (possibly overlapping) set,
// as a pipeline boundary between stages on different meshes or a
// checkpoint loaded under another plan needs.
//
// A layout (TensorLayout) lists the ranks that hold the tensor and the box
// (tensor/box.h) each holds: ranks with equal boxes are replicas, ranks
// with different boxes hold different parts (a split along any dimension,
// evenly or by ratios, or any mix). A partial source's ranks with equal
// boxes instead hold addends: the value of an element is the sum over them.
//
// The plan (plan_reshard) is a list of routes, each moving one box:
//   - reduce: the box's value starts at the first of `reducers` (a rank
//     holding it) and, for a partial source, is passed along the others,
//     each adding its own addend, so it is complete at the last one;
//   - deliver: the last reducer then passes the value along `targets`, a
//     chain (pipelined ring broadcast, as Alpa sends once into a
//     replicated destination group and broadcasts among it), each target
//     keeping a copy.
// So every element crosses the wire once per destination rank that lacks
// it (never to a rank that already holds it: that is a local copy, a route
// with no transfer), a destination group that replicates a box is entered
// once per element, a box that k source ranks replicate is split into k
// parts sent by different ranks (load balance), and a partial source is
// reduced on the way (k - 1 transfers of the box for k addends, the work
// spread as in a reduce-scatter: each part starts at another addend).
// Minimal bytes: for a whole source, the sum over destination ranks of the
// elements of their box outside their own source box; for a partial one,
// per destination group and source box, (k - 1 + the group's ranks that do
// not end a reduction) times the elements they share.
//
// Assumptions (checked where it matters for correctness): distinct source
// boxes are disjoint or equal for a partial source (any overlap is fine
// for a whole one, the first box listed wins); destination boxes with
// distinct extents are planned independently (overlapping ones each get
// their elements, which is still correct).
//
// execute_reshard runs a plan over a communicator whose ranks the layouts
// name: collective over the ranks of either layout (others return at
// once); point-to-point only, queued as non-blocking calls in the plan's
// order (a rank waits only where it must add a received addend), which
// keeps every pair of ranks in the same order and cannot deadlock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/spmd/mesh.h"
#include "meshtrain/spmd/sharding.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

struct TensorLayout {
  std::vector<int> ranks;  // ranks of the communicator, distinct
  std::vector<Box> boxes;  // boxes[i]: what ranks[i] holds
  bool partial = false;    // ranks with equal boxes hold addends of it

  // Every rank holds the whole tensor.
  static TensorLayout replicated(const Shape& shape, std::vector<int> ranks);
  // Split along `dim` over `ranks` (evenly, or in proportion to `ratios`,
  // one per rank), whole elsewhere. ConfigError when the ranks do not split
  // the dimension (as spmd/sharding.h's validation says).
  static TensorLayout split(const Shape& shape, std::vector<int> ranks, int dim,
                            std::vector<int64_t> ratios = {});
  // Every rank holds an addend of the whole tensor.
  static TensorLayout partial_sum(const Shape& shape, std::vector<int> ranks);
  // The layout of a sharding spec over a mesh whose rank m is ranks[m] of
  // the communicator (ranks empty: m itself). For partial axes only the
  // ranks at coordinate 0 of the other unsplit axes are listed (their
  // replicas hold the same addends).
  static TensorLayout of(const Shape& shape, const ShardingSpec& spec, const Mesh& mesh,
                         std::vector<int> ranks = {});

  // The box `rank` holds, or nullptr.
  const Box* box_of(int rank) const;
  std::string describe() const;  // "partial {0: [0:4, 0:8], 1: [4:8, 0:8]}"
};

struct ReshardRoute {
  Box box;                    // elements of the whole tensor
  std::vector<int> reducers;  // at least one; the value is complete at the last
  bool last_keeps = false;    // the last reducer is a destination of this box
  std::vector<int> targets;   // the chain the value is then passed along
};

struct ReshardPlan {
  Shape shape;
  DType dtype = DType::f32;
  TensorLayout from, to;
  std::vector<ReshardRoute> routes;  // in execution order

  // Bytes `rank` sends (its hops over all routes), and over all ranks.
  uint64_t bytes_sent(int rank) const;
  uint64_t total_bytes() const;
  // One line per route: "box [0:4, 0:8]: 0 -> 2 -> 3" (partial: "0 + 1").
  std::string describe() const;
};

// Throws ConfigError naming the layout, rank and box for: a box outside the
// shape or of another rank, a rank listed twice, a partial destination,
// overlapping distinct boxes in a partial source, or destination elements
// no source box covers.
ReshardPlan plan_reshard(const Shape& shape, DType dtype, const TensorLayout& from,
                         const TensorLayout& to);

// Collective over the ranks of plan.from and plan.to in `comm`. `source`:
// this rank's piece under plan.from (its box's elements in row-major order;
// ignored on other ranks); `dest`: its piece under plan.to, written
// (ignored on other ranks). ShapeError for a piece of the wrong size or
// dtype; comm errors (timeouts) as the communicator throws them.
void execute_reshard(Communicator& comm, const ReshardPlan& plan, const Tensor& source,
                     Tensor& dest, const CollectiveOptions& options = {});

// A pipeline boundary between stages on different meshes or shardings:
// `forward` moves the value from the producer stage's layout to the
// consumer's (a partial producer, e.g. a row-parallel output whose
// all-reduce was left out, is reduced on the way); `backward` moves its
// gradient, held as the consumer holds the value, back to the producer's
// boxes (whole values: the gradient of a partial sum is the same for every
// addend).
struct BoundaryReshard {
  ReshardPlan forward, backward;
};
BoundaryReshard plan_boundary(const Shape& shape, DType dtype, const TensorLayout& producer,
                              const TensorLayout& consumer);

// A parameter several pipeline stages on different meshes hold (a tied
// embedding), each holder stage in its own layout: after the step's
// backwards its gradient pieces are summed across the meshes. to_first[k]
// moves holder stages[k + 1]'s gradient onto the boxes of stages[0], which
// adds it; from_first[k] moves the sum back onto stages[k + 1]'s boxes.
struct SharedParamReshard {
  std::string name;
  std::vector<int> stages;  // the holder stages, in order
  std::vector<ReshardPlan> to_first, from_first;

  uint64_t bytes_sent(int rank) const;  // per step
};

// Pieces of boxes, for a runtime that runs a plan's routes itself (the
// pipeline runtime, overlapping them with compute): copy box `inner` out of
// (into) `piece`, the row-major elements of box `outer` that contains it;
// add `x` into `acc` element-wise (f32, f64; a partial source's addends).
void copy_box_part(const Tensor& piece, const Box& outer, const Box& inner, Tensor& out);
void put_box_part(Tensor& piece, const Box& outer, const Box& inner, const Tensor& in);
void add_addend(Tensor& acc, const Tensor& x);

// Box helpers (exposed for tests): the intersection (empty optional-like:
// elements() == 0 when disjoint), a minus b as disjoint boxes, and `b` cut
// into at most `parts` near-equal boxes along its longest dimension.
Box intersect_boxes(const Box& a, const Box& b);
std::vector<Box> subtract_box(const Box& a, const Box& b);
std::vector<Box> split_box(const Box& b, int parts);

}  // namespace mt
