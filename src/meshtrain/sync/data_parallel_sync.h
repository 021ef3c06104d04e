#pragma once

// A ReplicaSync whose replicas' gradients, update and state pieces are a
// DataParallel's (sync/data_parallel.h): all-reduce DP with ZeRO 0-3, and
// the codec paths on top of it (sync/compressed_sync.cpp: the compressed
// all-reduce over a one-rank DataParallel, the compressed reduce-scatter
// under ZeRO). It forwards what they all hand to the DataParallel
// unchanged; a scheme overrides what it does differently (e.g. the weight
// of a micro-step, or the memory its codec adds). Internal to sync/.

#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "meshtrain/sync/data_parallel.h"
#include "meshtrain/sync/replica_sync.h"

namespace mt {

class DataParallelSync : public ReplicaSync {
 public:
  void attach(Executor& exec, const Graph& graph) override { dp().attach(exec, graph); }
  void begin_micro_step(double w) override { dp().begin_micro_step(w); }
  void end_micro_step() override { dp().end_micro_step(); }
  std::span<ParamSlice> slices() override { return dp().slices(); }
  std::function<void(std::span<double>)> norm_reducer() override { return dp().norm_reducer(); }
  void step(const std::function<void(std::span<ParamSlice>)>& update) override {
    dp().step(update);
  }
  void gather_params(Tensor& flat_out) override { dp().gather_params(flat_out); }
  std::vector<ShardPiece> param_pieces(PieceUse use) override { return dp().param_pieces(use); }
  std::vector<ShardPiece> state_pieces(const std::map<std::string, Tensor>& state,
                                       PieceUse use) const override {
    return dp().state_pieces(state, use);
  }
  std::vector<ShardPiece> new_state_pieces(std::span<const std::string> kinds) const override {
    return dp().new_state_pieces(kinds);
  }
  DataParallelMemory memory(int kinds, int64_t optimizer_bytes) const override {
    return dp().memory(kinds, optimizer_bytes);
  }
  DataParallelStats stats() const override { return dp().stats(); }
  void reset_stats() override { dp().reset_stats(); }

 protected:
  // The DataParallel this scheme runs on (a member of the derived class,
  // which decides its construction order).
  virtual DataParallel& dp() = 0;
  virtual const DataParallel& dp() const = 0;
};

}  // namespace mt
