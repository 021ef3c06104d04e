// Runs 2-D convolution (NCHW data, OIHW weights) forward, backward-data and
// backward-weight through oneDNN for the fast backend (internal to
// src/meshtrain/tensor/backends/fast).
//
// Layout choice: for every call signature (direction, sizes, bias, thread
// count) the engine builds two variants -- "plain", whose primitive reads and
// writes the caller's NCHW/OIHW buffers directly, and "blocked", where oneDNN
// picks its preferred (channel-blocked) layouts and the engine reorders
// between those and the caller's buffers. Like MatmulEngine, the first
// 2 * kTrials calls alternate between the variants, timing each whole call
// (reorders included, on trial_clock_s); the faster one serves the signature
// afterwards.
// ConvLayoutChoice::plain / blocked skip the measurement.
// Primitives, reorders and the blocked buffers are cached per signature.
//
// Callers pass validated, non-empty f32 tensors. Owned by the fast backend;
// blocks until the outputs are written; one calling thread per instance.
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "meshtrain/tensor/backend.h"
#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/backends/fast/onednn_context.h"
#include "meshtrain/tensor/kernel_checks.h"

namespace mt::fast {

// Sizes of one convolution (validated by check_conv2d in kernel_checks.h).
using ConvGeom = Conv2dDims;

class ConvEngine {
 public:
  static constexpr int kTrials = 3;

  ConvEngine(OneDnnContext& ctx, ConvLayoutChoice layout);
  ~ConvEngine();
  ConvEngine(const ConvEngine&) = delete;
  ConvEngine& operator=(const ConvEngine&) = delete;

  // bias may be undefined.
  void forward(const ConvGeom& g, const Conv2dParams& p, const Tensor& x, const Tensor& w,
               const Tensor& bias, Tensor& y, int threads);
  void backward_data(const ConvGeom& g, const Conv2dParams& p, const Tensor& dy, const Tensor& w,
                     Tensor& dx, int threads);
  // dbias may be undefined.
  void backward_weight(const ConvGeom& g, const Conv2dParams& p, const Tensor& dy, const Tensor& x,
                       Tensor& dw, Tensor& dbias, int threads);

  // "plain", "blocked" or "undecided" for a forward call of this signature.
  const char* chosen_forward_variant(const ConvGeom& g, const Conv2dParams& p, bool bias,
                                     int threads) const;

 private:
  enum class Kind : uint8_t { forward, backward_data, backward_weight };
  struct Key {
    Kind kind;
    ConvGeom g;
    int64_t sh, sw, ph, pw;
    bool bias;
    int threads;
    auto operator<=>(const Key&) const = default;
  };
  // One argument of a primitive: the caller's layout, the primitive's, and
  // the reorder plus buffer used when they differ.
  struct Arg {
    int id;  // DNNL_ARG_*
    bool output;
    dnnl::memory::desc user_md;
    std::optional<dnnl::reorder> reorder;  // user -> internal (inputs) or back (outputs)
    std::optional<dnnl::memory> internal;
  };
  struct Variant {
    std::optional<dnnl::primitive> prim;
    std::vector<Arg> args;
  };
  struct Plan {
    std::array<Variant, 2> variants;  // [0] plain, [1] blocked
    int count = 1;                    // 1 when blocked would equal plain
    int chosen = -1;                  // -1 while undecided
    int trials = 0;
    std::array<double, 2> best{1e300, 1e300};  // seconds
  };

  static Key key_of(Kind kind, const ConvGeom& g, const Conv2dParams& p, bool bias, int threads);
  Plan& plan_for(const Key& key);
  Variant make_variant(const Key& key, bool blocked, bool& same_as_plain);
  // ptrs[i] is the caller's buffer for variant.args[i].
  void execute(Variant& v, const std::vector<void*>& ptrs);
  void run(const Key& key, const std::vector<std::pair<int, void*>>& buffers);

  OneDnnContext& ctx_;
  ConvLayoutChoice layout_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace mt::fast
