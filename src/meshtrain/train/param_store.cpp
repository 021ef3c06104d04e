#include "meshtrain/train/param_store.h"

#include <algorithm>

#include "meshtrain/base/random.h"
#include "meshtrain/tensor/box.h"
#include "meshtrain/tensor/memory_stats.h"

namespace mt {

namespace {
constexpr int64_t kAlignElems = 16;  // 64 bytes of f32

// Elements [begin, end) of a parameter's initial value into p (p[0] is
// element begin): the stream is drawn from its start, so every range of it
// holds the same numbers as the whole.
void init_range(float* p, int64_t begin, int64_t end, const ParamInit& init, uint64_t seed,
                const std::string& name) {
  Rng rng(Rng::derive(seed, name));
  switch (init.kind) {
    case ParamInit::Kind::zeros:
      for (int64_t i = begin; i < end; ++i) p[i - begin] = 0.0f;
      break;
    case ParamInit::Kind::ones:
      for (int64_t i = begin; i < end; ++i) p[i - begin] = 1.0f;
      break;
    case ParamInit::Kind::normal:
      for (int64_t i = 0; i < end; ++i) {
        const auto v = static_cast<float>(init.scale * rng.normal());
        if (i >= begin) p[i - begin] = v;
      }
      break;
    case ParamInit::Kind::uniform:
      for (int64_t i = 0; i < end; ++i) {
        const auto v = static_cast<float>(rng.uniform(-init.scale, init.scale));
        if (i >= begin) p[i - begin] = v;
      }
      break;
  }
}

void init_param(Tensor& t, const ParamInit& init, uint64_t seed, const std::string& name) {
  init_range(t.data<float>(), 0, t.numel(), init, seed, name);
}
}  // namespace

ParamLayout ParamStore::layout(const Graph& g, int64_t* flat_numel) {
  ParamLayout l;
  int64_t total = 0;
  for (ValueId id : g.params()) {
    const Value& v = g.value(id);
    if (v.dtype != DType::f32) {
      throw ShapeError(fmt::format("parameter '{}' is {}: master weights must be f32", v.name,
                                   dtype_name(v.dtype)));
    }
    l.push_back(ParamLayoutEntry{v.name, v.shape, total});
    total += (v.shape.numel() + kAlignElems - 1) / kAlignElems * kAlignElems;
  }
  if (flat_numel != nullptr) *flat_numel = total;
  return l;
}

ParamStore::ParamStore(const Graph& g, uint64_t seed, bool with_grads, bool with_values)
    : seed_(seed) {
  size_t i = 0;
  const std::vector<ValueId>& ids = g.params();
  for (const ParamLayoutEntry& e : layout(g, &flat_numel_)) {
    entries_.push_back(Entry{e.name, e.shape, e.offset, {}, {}, g.value(ids[i++]).init});
    numel_ += e.shape.numel();
  }
  if (with_values) {
    MemoryScope tag(MemoryCategory::params);
    values_ = Tensor::zeros({flat_numel_}, DType::f32);  // padding included
  }
  if (with_grads) {
    MemoryScope tag(MemoryCategory::grads);
    grads_ = Tensor::zeros({flat_numel_}, DType::f32);
  }
  for (Entry& e : entries_) {
    if (with_values) {
      e.value = Tensor::wrap(values_.data<float>() + e.offset, e.shape, DType::f32);
      init_param(e.value, e.init, seed, e.name);
    }
    if (with_grads) e.grad = Tensor::wrap(grads_.data<float>() + e.offset, e.shape, DType::f32);
  }
}

void ParamStore::initial_range(size_t i, int64_t begin, int64_t end, float* dst) const {
  const Entry& e = entries_.at(i);
  MT_CHECK(begin >= 0 && begin <= end && end <= e.shape.numel(),
           "initial_range [{}, {}) of '{}' with {} elements", begin, end, e.name, e.shape.numel());
  init_range(dst, begin, end, e.init, seed_, e.name);
}

void ParamStore::initial_box(size_t i, const Shape& global, const std::vector<int64_t>& begin) {
  Entry& e = entries_.at(i);
  MT_CHECK(global.rank() == e.shape.rank() && e.value.defined(),
           "initial_box of '{}': shape {} in {}", e.name, e.shape.str(), global.str());
  Box box{begin, begin};
  for (size_t d = 0; d < begin.size(); ++d) box.end[d] += e.shape[static_cast<int>(d)];
  Tensor whole = Tensor::empty(global, DType::f32);
  init_range(whole.data<float>(), 0, global.numel(), e.init, seed_, e.name);
  copy_box_out(whole, box, e.value);
}

void ParamStore::drop_values() {
  for (Entry& e : entries_) e.value = Tensor();
  values_ = Tensor();
}

Tensor& ParamStore::ensure_values() {
  if (has_values()) return values_;
  {
    MemoryScope tag(MemoryCategory::params);
    values_ = Tensor::zeros({flat_numel_}, DType::f32);  // padding stays 0
  }
  for (Entry& e : entries_) {
    e.value = Tensor::wrap(values_.data<float>() + e.offset, e.shape, DType::f32);
  }
  return values_;
}

const ParamStore::Entry* ParamStore::find(const std::string& name) const {
  for (const Entry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

void ParamStore::bind(Executor& ex, const Graph& g, bool with_grads) {
  for (ValueId id : g.params()) {
    const Value& v = g.value(id);
    const Entry* e = find(v.name);
    if (e == nullptr) {
      throw ShapeError(fmt::format("graph parameter '{}' has no stored value", v.name));
    }
    if (!(e->shape == v.shape)) {
      throw ShapeError(fmt::format("parameter '{}': graph wants {}, store holds {}", v.name,
                                   v.shape.str(), e->shape.str()));
    }
    if (e->value.raw() == nullptr && e->shape.numel() > 0) {
      throw InternalError(fmt::format("parameter '{}': the store's values were dropped", v.name));
    }
    ex.bind(id, e->value);
    if (with_grads) {
      if (!has_grads()) {
        throw InternalError("ParamStore::bind with gradients: the store has no gradient buffer");
      }
      ValueId gid = g.grad_of(id);
      if (gid != kNoValue) ex.bind(gid, e->grad);
    }
  }
}

}  // namespace mt
