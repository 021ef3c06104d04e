#include "meshtrain/tensor/kernels.h"

#include <memory>
#include <string>

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

// The fast backend hands the dtypes it does not implement to the reference one.
KernelBackend& fast_instance() {
  // Function-local statics are initialised once, thread-safely.
  static const std::unique_ptr<KernelBackend> instance = make_fast_backend(reference_instance());
  return *instance;
}

}  // namespace

std::vector<std::string_view> kernel_backend_names() {
  return {"reference", "fast"};
}

KernelBackend& kernels(std::string_view name) {
  if (name == "reference") return reference_instance();
  if (name == "fast") return fast_instance();
  throw ConfigError(fmt::format("unknown kernel backend '{}' (expected one of {})", name,
                                fmt::join(kernel_backend_names(), ", ")));
}

}  // namespace mt
