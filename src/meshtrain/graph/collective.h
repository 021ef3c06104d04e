// Collective operators: nodes that stand for one rank's part of a collective
// call over a group of ranks. A model (or, later, the spmd lowering) builds
// one graph per rank (SPMD); the executor runs a collective node through a
// CollectiveRunner (exec/collective_runner.h), which maps the node's `group`
// id to a communicator.
//
// Gradient semantics (what autodiff over these nodes computes). The objective
// of a run over a group is the sum of every rank's loss, L = sum_r L_r, and a
// value on rank r is rank r's own variable, except where f and g say that a
// value is replicated (one variable of which every rank holds a copy):
//   all_reduce      y_r = sum_q x_q            dx_q = sum_r dy_r  (all_reduce)
//   all_gather      y_r = concat_q x_q         dx_q = piece q of sum_r dy_r  (reduce_scatter)
//   reduce_scatter  y_q = piece q of sum_r x_r dx_r = concat_q dy_q  (all_gather)
//   all_to_all      y_r = concat_q (piece r of x_q along dim) along concat_dim
//                                              dx = all_to_all(dy) with dim and concat_dim swapped
//                   (uneven, recv_sizes given: dim == concat_dim, dx = all_to_all(dy)
//                   with sizes and recv_sizes swapped)
//   copy_to_group   (f) x replicated, y_r = x: dx = sum_r dy_r  (g, an all-reduce)
//   reduce_from_group (g) y = sum_q x_q replicated, the loss reads it once
//                   (every rank computes the same loss; L counts it once):
//                   dx_q = dy  (f, the identity)
//   gather_from_group y = concat_q x_q replicated, the loss reads it once:
//                   dx_q = piece q of dy  (split_to_group, no communication)
//   split_to_group  x replicated, y_r = piece r of x (no communication):
//                   dx = concat_r dy_r  (gather_from_group)
//   all_reduce_max  y_r = max_q x_q (elementwise), replicated; no gradient:
//                   a stop-gradient, for the row maxima a softmax subtracts
//                   (the vocabulary-parallel cross-entropy), which its
//                   result does not depend on
// So all_reduce and g have the same forward and different gradients: use
// all_reduce when each rank's result feeds its own term of the loss, g when
// the result is one replicated value (Megatron's row-parallel output), and f
// where a replicated value enters rank-local partial computations (Megatron's
// column-parallel input). all_gather and gather_from_group likewise: the first
// where each rank's joined copy feeds its own partial computation (sequence
// parallelism before a column-parallel layer), the second where the joined
// value is one replicated value. Sums are sums (no averaging).
#pragma once

#include <cstdint>
#include <vector>

#include "meshtrain/graph/graph.h"

namespace mt {

// The attributes of a collective node, typed; set and read only here.
struct CollectiveAttrs {
  int64_t group = 0;  // id the CollectiveRunner maps to a group of ranks
  // all_gather / reduce_scatter: pieces are joined / split along `dim`;
  // sizes[i] is the piece of group rank i (even or not), `rank` this rank's
  // position in the group (so a per-rank graph is checkable on its own).
  int64_t dim = 0;
  std::vector<int64_t> sizes;
  int64_t rank = 0;
  // all_to_all: x is split along `dim` into even pieces (sizes[q] goes to
  // group rank q); the pieces received join along `concat_dim`.
  int64_t concat_dim = 0;
  // all_to_all with uneven pieces (e.g. a halo exchange): x's piece
  // sizes[q] goes to rank q and recv_sizes[q] comes from rank q, joined in
  // rank order along the same dimension (concat_dim == dim). A rank's
  // received shape depends on the others' sizes, so the builder of each
  // rank's graph states it. Empty: even pieces.
  std::vector<int64_t> recv_sizes = {};

  Attrs to_attrs(OpKind op) const;
  static CollectiveAttrs of(const Node& n);
  // The group's size where the node knows it (sizes.size()), else 0.
  int64_t group_size() const { return static_cast<int64_t>(sizes.size()); }
};

// True for the collective operators above.
bool is_group_op(OpKind op);
// True for those whose forward moves data between ranks (all but f).
bool communicates(OpKind op);

// Bytes of the buffer the node's forward hands to the communicator, as the
// communicator's per-collective `payload_bytes` counter records them: the
// buffer (all_reduce, g), the gathered output (all_gather), the input that is
// reduced and scattered (reduce_scatter) or exchanged (all_to_all); 0 for f
// and every other operator.
double collective_payload_bytes(const Graph& g, const Node& n);

}  // namespace mt
