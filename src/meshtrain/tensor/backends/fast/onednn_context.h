// The oneDNN CPU engine and stream one fast backend instance runs its
// primitives on (internal to src/meshtrain/tensor/backends/fast). Owned by
// the backend and shared by reference with its matmul and convolution
// engines. Execution on this stream is synchronous: a primitive has finished
// when execute() returns. Not for concurrent use from several threads.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace mt::fast {

struct OneDnnContext {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
};

// A user buffer as oneDNN memory (oneDNN takes non-const handles even for
// inputs it only reads).
inline dnnl::memory wrap_memory(const dnnl::memory::desc& md, const OneDnnContext& ctx,
                                const void* p) {
  return dnnl::memory(md, ctx.engine, const_cast<void*>(p));
}

}  // namespace mt::fast
