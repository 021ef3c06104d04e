#include "meshtrain/train/param_store.h"

#include "meshtrain/base/random.h"

namespace mt {

namespace {
constexpr int64_t kAlignElems = 16;  // 64 bytes of f32

void init_param(Tensor& t, const ParamInit& init, uint64_t seed, const std::string& name) {
  float* p = t.data<float>();
  const int64_t n = t.numel();
  Rng rng(Rng::derive(seed, name));
  switch (init.kind) {
    case ParamInit::Kind::zeros:
      for (int64_t i = 0; i < n; ++i) p[i] = 0.0f;
      break;
    case ParamInit::Kind::ones:
      for (int64_t i = 0; i < n; ++i) p[i] = 1.0f;
      break;
    case ParamInit::Kind::normal:
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(init.scale * rng.normal());
      break;
    case ParamInit::Kind::uniform:
      for (int64_t i = 0; i < n; ++i) {
        p[i] = static_cast<float>(rng.uniform(-init.scale, init.scale));
      }
      break;
  }
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

ParamStore::ParamStore(const Graph& g, uint64_t seed) {
  int64_t total = 0;
  for (const ParamLayoutEntry& e : layout(g, &total)) {
    entries_.push_back(Entry{e.name, e.shape, e.offset, {}, {}});
    numel_ += e.shape.numel();
  }
  values_ = Tensor::zeros({total}, DType::f32);
  grads_ = Tensor::zeros({total}, DType::f32);
  size_t i = 0;
  for (ValueId id : g.params()) {
    Entry& e = entries_[i++];
    float* vp = values_.data<float>() + e.offset;
    float* gp = grads_.data<float>() + e.offset;
    e.value = Tensor::wrap(vp, e.shape, DType::f32);
    e.grad = Tensor::wrap(gp, e.shape, DType::f32);
    init_param(e.value, g.value(id).init, seed, e.name);
  }
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
    ex.bind(id, e->value);
    if (with_grads) {
      ValueId gid = g.grad_of(id);
      if (gid != kNoValue) ex.bind(gid, e->grad);
    }
  }
}

}  // namespace mt
