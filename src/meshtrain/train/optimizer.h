// Optimizers that update f32 parameters in place from their gradients.
//
// An optimizer works on a list of flat f32 slices (ParamRef): the whole of
// each parameter in plain training, or only the part of it that this rank
// owns under ZeRO, where each rank updates its shard of a flattened
// parameter buffer. Per-parameter state (momentum buffers, Adam moments) is
// keyed by the parameter's name, sized like the slice, and exposed for
// checkpoints through state()/load_state().
//
// All per-element math runs in f32 (as PyTorch does); norms are accumulated in
// double. The element-wise optimizers (SGD, AdamW) give the same result
// whether a parameter is stepped whole or as separate slices. LARS and LAMB
// also need norms of the WHOLE parameter: they gather per-slice partial
// squared norms into one vector and hand it to the NormReducer, which a
// sharded caller implements as an all-reduce (sum) over the ranks that share
// the parameters. Then every rank must pass the same names in the same order
// (a rank that holds no part of a parameter passes an empty slice).
//
// An Optimizer is owned by the trainer (or the ZeRO scheme); it is not
// thread-safe and blocks only inside the NormReducer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/tensor/tensor.h"

namespace mt {

// One parameter (or one rank's slice of it) and its gradient: contiguous f32
// tensors of equal element count, possibly views into a larger flat buffer.
// `param` is updated in place.
struct ParamRef {
  std::string name;
  Tensor param;
  Tensor grad;
  // Rank (number of dimensions) of the whole parameter, for the decay rule
  // when `param` is a flat slice of it; -1 means param.rank().
  int full_rank = -1;
  // Whether this rank's slice counts in sums over ranks (norms for clipping,
  // LARS, LAMB). False on all but one rank of a group that holds the same
  // replicated parameter (tensor parallelism's layer norms and biases), so a
  // NormReducer over the group counts it once.
  bool counted = true;

  int whole_rank() const { return full_rank >= 0 ? full_rank : param.rank(); }
};

// Sums each entry of `values` over every rank that holds a slice of the same
// parameters, in place. Empty function: a single process (identity).
using NormReducer = std::function<void(std::span<double> values)>;

// Which parameters get weight decay (and, where the optimizer offers it, the
// LARS/LAMB trust ratio). The default excludes biases and normalisation gains
// (rank < 2), the usual practice; min_rank = 0 decays every parameter, as
// PyTorch does by default.
struct DecayFilter {
  int min_rank = 2;
  // A parameter whose name contains any of these substrings is excluded.
  std::vector<std::string> exclude_names;

  bool applies(const ParamRef& p) const;
};

// Everything an optimizer remembers between steps, for checkpoints.
struct OptimizerState {
  // "<param>.<kind>" -> f32 tensor shaped like the parameter slice, e.g.
  // "fc1.w.exp_avg". Kinds contain no '.', so the parameter name is
  // everything before the last '.'.
  std::map<std::string, Tensor> tensors;
  // Parameter name -> number of updates applied to it (Adam bias correction).
  std::map<std::string, int64_t> steps;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // "sgd", "adamw", "lars", "lamb".
  virtual std::string_view name() const = 0;
  // The state kinds this optimizer keeps per parameter, e.g. {"exp_avg", "exp_avg_sq"}.
  virtual std::vector<std::string> state_kinds() const = 0;

  // Applies one update with learning rate `lr` to every parameter in
  // `params`. Throws ShapeError for a non-f32 or mismatched param/grad,
  // ConfigError for a bad lr or a repeated name, CheckpointError when loaded
  // state does not fit the parameter it belongs to.
  void step(std::span<ParamRef> params, double lr);

  void set_norm_reducer(NormReducer reducer) { reducer_ = std::move(reducer); }

  // Handles to the live state (shared memory, not copies).
  OptimizerState state() const { return {slots_, steps_}; }
  // Bytes of state tensors allocated now (0 before the first step).
  int64_t state_bytes() const;
  // Replaces all state with deep copies of `state`. Throws CheckpointError
  // for a tensor of a kind this optimizer does not keep or that is not f32.
  void load_state(const OptimizerState& state);

 protected:
  // Called by step() after validation; `params` are checked f32 with
  // param.numel() == grad.numel() and unique names.
  virtual void update(std::span<ParamRef> params, double lr) = 0;

  // The state tensor "<p.name>.<kind>", created zero-filled if absent
  // (*created tells which). Throws CheckpointError if it exists with another
  // element count than p.param.
  float* slot(const ParamRef& p, const std::string& kind, bool* created = nullptr);
  // Increments and returns the parameter's update count (1 on its first step).
  int64_t next_step(const ParamRef& p);
  // Sums `values` across ranks through the reducer (no-op without one).
  void reduce(std::span<double> values) const;

 private:
  std::map<std::string, Tensor> slots_;
  std::map<std::string, int64_t> steps_;
  NormReducer reducer_;
};

// Sum of squares of `n` floats, accumulated in double.
double sum_squares(const float* x, int64_t n);

namespace detail {
// Throws ConfigError "<optimizer>: <field> must be <want>, got <value>" unless ok.
void check_option(bool ok, std::string_view optimizer, std::string_view field, double value,
                  std::string_view want);
}  // namespace detail

// torch.optim.SGD. Per element, with g the gradient and w the parameter:
//   g += weight_decay * w                       (coupled L2; if the filter applies)
//   if momentum != 0:
//     buf = g on the first step, else buf = momentum * buf + (1 - dampening) * g
//     g = nesterov ? g + momentum * buf : buf
//   w -= lr * g
// State: "momentum_buffer" (only when momentum != 0).
struct SgdOptions {
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0
  double weight_decay = 0.0;
  DecayFilter decay;
};

// torch.optim.AdamW (amsgrad off). With t the parameter's 1-based step:
//   w *= 1 - lr * weight_decay                  (decoupled; if the filter applies)
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   w -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State: "exp_avg" (m), "exp_avg_sq" (v).
struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  DecayFilter decay;
};

// LARS (You, Gitman, Ginsburg 2017) with heavy-ball momentum. For a
// parameter the filter applies to (norms over the WHOLE parameter):
//   trust = ||w|| > 0 && ||g|| > 0
//           ? trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps) : 1
//   d = trust * (g + weight_decay * w)
// otherwise d = g if exclude_from_adaptation, else the same formula with
// weight_decay = 0. Then, as SGD without dampening:
//   buf = d on the first step, else buf = momentum * buf + d
//   w -= lr * (nesterov ? d + momentum * buf : buf)
// State: "momentum_buffer" (only when momentum != 0).
struct LarsOptions {
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = 0.0;
  double trust_coefficient = 0.001;
  double eps = 0.0;
  // Parameters the decay filter excludes (biases, norm gains) also keep
  // trust = 1.
  bool exclude_from_adaptation = true;
  DecayFilter decay;
};

// LAMB (You et al. 2019) with bias correction. With t the 1-based step:
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
//   r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
//                                                (decay if the filter applies)
//   trust = ||w|| > 0 && ||r|| > 0 ? ||w|| / ||r|| : 1   (norms of the WHOLE parameter;
//           trust = 1 for excluded parameters if exclude_from_adaptation)
//   w -= lr * trust * r
// State: "exp_avg" (m), "exp_avg_sq" (v).
struct LambOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-6;
  double weight_decay = 0.01;
  bool exclude_from_adaptation = true;
  DecayFilter decay;
};

// The options of every optimizer, so that a config maps onto one struct and
// make_optimizer picks the part that the name selects.
struct OptimizerOptions {
  SgdOptions sgd;
  AdamWOptions adamw;
  LarsOptions lars;
  LambOptions lamb;
};

// Each constructor validates its options and throws ConfigError naming the
// field and value (e.g. beta1 outside [0, 1), nesterov without momentum).
std::unique_ptr<Optimizer> make_sgd(const SgdOptions& options);
std::unique_ptr<Optimizer> make_adamw(const AdamWOptions& options);
std::unique_ptr<Optimizer> make_lars(const LarsOptions& options);
std::unique_ptr<Optimizer> make_lamb(const LambOptions& options);
// name: "sgd", "adamw", "lars" or "lamb"; anything else is a ConfigError.
std::unique_ptr<Optimizer> make_optimizer(std::string_view name, const OptimizerOptions& options);

}  // namespace mt
