#include "meshtrain/models/torch_names.h"

#include <cstring>
#include <set>

#include "meshtrain/base/error.h"

namespace mt {

namespace {

// The model's parameters with their shapes, from its own graph: the map is
// checked against what build_model really creates.
std::vector<std::pair<std::string, Shape>> model_params(const ModelSpec& spec) {
  ModelSpec s = spec;
  s.compute = DType::f32;  // names and shapes do not depend on it
  const ModelGraph m = build_model(s, 1);
  std::vector<std::pair<std::string, Shape>> out;
  for (ValueId id : m.graph.params())
    out.emplace_back(m.graph.value(id).name, m.graph.value(id).shape);
  return out;
}

// MLP and CNN: meshtrain's layer names with PyTorch's attribute suffixes.
TorchTensor image_model_tensor(const std::string& name, const Shape& shape) {
  const auto dot = name.rfind('.');
  const std::string layer = name.substr(0, dot), leaf = name.substr(dot + 1);
  if (leaf == "w" && shape.rank() == 2) {
    return TorchTensor{layer + ".weight", Shape{shape[1], shape[0]}, {{name, true, shape}}, {}};
  }
  if (leaf == "w") return TorchTensor{layer + ".weight", shape, {{name, false, shape}}, {}};
  MT_CHECK(leaf == "b", "no PyTorch name for parameter '{}'", name);
  return TorchTensor{layer + ".bias", shape, {{name, false, shape}}, {}};
}

// A part's shape as PyTorch holds it.
Shape part_shape(const Shape& param, bool transpose) {
  return transpose ? Shape{param[1], param[0]} : param;
}

// One PyTorch tensor made of `parts` stacked along dim 0, their shapes taken
// from the model's parameters.
TorchTensor fused(const std::string& name, const std::map<std::string, Shape>& params,
                  std::vector<TorchPart> parts) {
  std::vector<int64_t> dims;
  for (TorchPart& p : parts) {
    auto it = params.find(p.param);
    MT_CHECK(it != params.end(), "torch map: '{}' names unknown parameter '{}'", name, p.param);
    p.shape = it->second;
    const Shape s = part_shape(p.shape, p.transpose);
    if (dims.empty()) {
      dims = s.dims();
    } else {
      dims[0] += s[0];
    }
  }
  return TorchTensor{name, Shape(dims), std::move(parts), {}};
}

void gpt_tensors(const ModelSpec& s, const std::map<std::string, Shape>& p, TorchNameMap& map) {
  auto one = [&](const std::string& torch, const std::string& param, bool transpose) {
    map.tensors.push_back(fused(torch, p, {{param, transpose, {}}}));
  };
  one("transformer.wte.weight", "wte", false);
  map.tensors.back().aliases.push_back("lm_head.weight");  // nanoGPT ties the head
  one("transformer.wpe.weight", "wpe", false);
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string t = "transformer.h." + std::to_string(l) + ".";
    const std::string m = "block" + std::to_string(l) + ".";
    one(t + "ln_1.weight", m + "ln1.g", false);
    one(t + "ln_1.bias", m + "ln1.b", false);
    map.tensors.push_back(fused(
        t + "attn.c_attn.weight", p,
        {{m + "attn.q.w", true, {}}, {m + "attn.k.w", true, {}}, {m + "attn.v.w", true, {}}}));
    map.tensors.push_back(fused(
        t + "attn.c_attn.bias", p,
        {{m + "attn.q.b", false, {}}, {m + "attn.k.b", false, {}}, {m + "attn.v.b", false, {}}}));
    one(t + "attn.c_proj.weight", m + "attn.proj.w", true);
    one(t + "attn.c_proj.bias", m + "attn.proj.b", false);
    one(t + "ln_2.weight", m + "ln2.g", false);
    one(t + "ln_2.bias", m + "ln2.b", false);
    one(t + "mlp.c_fc.weight", m + "fc.w", true);
    one(t + "mlp.c_fc.bias", m + "fc.b", false);
    one(t + "mlp.c_proj.weight", m + "proj.w", true);
    one(t + "mlp.c_proj.bias", m + "proj.b", false);
  }
  one("transformer.ln_f.weight", "ln_f.g", false);
  one("transformer.ln_f.bias", "ln_f.b", false);
}

const Tensor& find_param(const std::map<std::string, Tensor>& params, const TorchPart& p,
                         const std::string& torch) {
  auto it = params.find(p.param);
  if (it == params.end()) {
    throw ShapeError(fmt::format("parameter '{}' (part of {}) is missing", p.param, torch));
  }
  const Tensor& t = it->second;
  if (t.dtype() != DType::f32 || !(t.shape() == p.shape)) {
    throw ShapeError(fmt::format("parameter '{}': expected f32 {}, got {} {}", p.param,
                                 p.shape.str(), dtype_name(t.dtype()), t.shape().str()));
  }
  return t;
}

// Copies `rows` x `cols` (source row-major) into dst, transposed or not.
void copy_part(const float* src, float* dst, int64_t rows, int64_t cols, bool transpose) {
  if (!transpose) {
    std::memcpy(dst, src, static_cast<size_t>(rows * cols) * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  }
}

}  // namespace

const TorchTensor* TorchNameMap::find(std::string_view name) const {
  for (const TorchTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TorchNameMap torch_name_map(const ModelSpec& spec) {
  const std::vector<std::pair<std::string, Shape>> ordered = model_params(spec);
  const std::map<std::string, Shape> params(ordered.begin(), ordered.end());
  TorchNameMap map;
  map.model = spec.kind;
  if (spec.kind == "gpt") {
    map.naming = "nanogpt";
    gpt_tensors(spec, params, map);
  } else {
    map.naming = "meshtrain";
    for (const auto& [name, shape] : ordered)
      map.tensors.push_back(image_model_tensor(name, shape));
  }
  // Every parameter exactly once, in a tensor whose parts stack to its shape.
  std::set<std::string> seen;
  for (const TorchTensor& t : map.tensors) {
    int64_t elems = 0;
    for (const TorchPart& p : t.parts) {
      auto it = params.find(p.param);
      MT_CHECK(it != params.end(), "torch map: '{}' names unknown parameter '{}'", t.name, p.param);
      MT_CHECK(seen.insert(p.param).second, "torch map: parameter '{}' mapped twice", p.param);
      MT_CHECK(!p.transpose || it->second.rank() == 2, "torch map: '{}' is not a matrix", p.param);
      elems += it->second.numel();
    }
    MT_CHECK_EQ(elems, t.shape.numel());
  }
  MT_CHECK_EQ(seen.size(), params.size());
  return map;
}

std::map<std::string, Tensor> to_torch(const TorchNameMap& map,
                                       const std::map<std::string, Tensor>& params) {
  std::map<std::string, Tensor> out;
  for (const TorchTensor& t : map.tensors) {
    Tensor value = Tensor::empty(t.shape, DType::f32);
    float* dst = value.data<float>();
    for (const TorchPart& p : t.parts) {
      const Tensor& src = find_param(params, p, t.name);
      if (p.transpose) {
        copy_part(src.data<float>(), dst, p.shape[0], p.shape[1], true);
      } else {
        copy_part(src.data<float>(), dst, 1, src.numel(), false);
      }
      dst += src.numel();
    }
    out.emplace(t.name, std::move(value));
  }
  return out;
}

void from_torch(const TorchTensor& t, const Tensor& value, std::map<std::string, Tensor>& params) {
  if (value.dtype() != DType::f32 || !(value.shape() == t.shape)) {
    throw ShapeError(fmt::format("{}: expected f32 {}, got {} {}", t.name, t.shape.str(),
                                 dtype_name(value.dtype()), value.shape().str()));
  }
  const float* src = value.data<float>();
  for (const TorchPart& p : t.parts) {
    Tensor dst = find_param(params, p, t.name);  // a handle on the caller's memory
    if (p.transpose) {
      // PyTorch holds [out, in] rows; meshtrain wants [in, out].
      copy_part(src, dst.data<float>(), p.shape[1], p.shape[0], true);
    } else {
      copy_part(src, dst.data<float>(), 1, dst.numel(), false);
    }
    src += dst.numel();
  }
}

}  // namespace mt
