#include "meshtrain/tensor/kernels.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include <fmt/ranges.h>

#include "meshtrain/base/error.h"
#include "meshtrain/tensor/backends/fast/fast_backend.h"
#include "meshtrain/tensor/backends/reference/reference_backend.h"

namespace mt {

namespace {

KernelBackend& reference_instance() {
  static ReferenceBackend instance;
  return instance;
}

// The fast backend hands the dtypes it does not implement to the reference
// one. One instance per options, created on first use and kept for the process.
KernelBackend& fast_instance(const FastBackendOptions& o) {
  static std::mutex mu;
  static std::map<std::tuple<MatmulEngineChoice, ConvLayoutChoice, MatmulEngineFault>,
                  std::unique_ptr<KernelBackend>>
      instances;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = instances[{o.f32_matmul, o.conv_layout, o.faulty_engine_for_testing}];
  if (!slot) slot = make_fast_backend(reference_instance(), o);
  return *slot;
}

}  // namespace

std::vector<std::string_view> kernel_backend_names() {
  return {"reference", "fast"};
}

KernelBackend& kernels(std::string_view name, const FastBackendOptions& fast) {
  if (name == "reference") return reference_instance();
  if (name == "fast") return fast_instance(fast);
  throw ConfigError(fmt::format("unknown kernel backend '{}' (expected one of {})", name,
                                fmt::join(kernel_backend_names(), ", ")));
}

MatmulEngineChoice parse_matmul_engine(std::string_view text) {
  if (text == "measure") return MatmulEngineChoice::measure;
  if (text == "onednn") return MatmulEngineChoice::onednn;
  if (text == "openblas") return MatmulEngineChoice::openblas;
  throw ConfigError(
      fmt::format("unknown f32 matmul engine '{}' (expected measure, onednn or openblas)", text));
}

ConvLayoutChoice parse_conv_layout(std::string_view text) {
  if (text == "measure") return ConvLayoutChoice::measure;
  if (text == "plain") return ConvLayoutChoice::plain;
  if (text == "blocked") return ConvLayoutChoice::blocked;
  throw ConfigError(
      fmt::format("unknown convolution layout '{}' (expected measure, plain or blocked)", text));
}

}  // namespace mt
