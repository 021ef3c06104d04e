// The one place that says how meshtrain's parameters correspond to the
// tensors of equivalent PyTorch modules (the name and layout map used by
// `meshtrain export` and `train.init`; table in docs/export.md).
//
// meshtrain stores a linear layer's weight as [in, out] (x @ w); PyTorch's
// nn.Linear holds [out, in] (x @ w^T), so every matrix of a linear layer is
// transposed. Conv2d weights ([out, in, kh, kw]), embeddings ([num, dim]),
// biases and layer-norm gains are stored alike in both.
//
// Names: MLP and CNN keep meshtrain's layer names with PyTorch's attribute
// suffixes ("fc1.w" -> "fc1.weight", "conv1.b" -> "conv1.bias"), as a module
// with attributes fc1, fc2, ..., head (conv1, ..., fc1, head) has them. The
// GPT uses nanoGPT's names, all nn.Linear [out, in]: "transformer.wte.weight",
// "transformer.h.0.ln_1.weight", "transformer.h.0.attn.c_attn.weight" (q, k
// and v fused into [3C, C], in that order), ..., "transformer.ln_f.bias". The
// output head is tied to the token embedding, as in nanoGPT, so
// "lm_head.weight" is not written; a file that has it (nanoGPT's state_dict)
// loads it as the embedding's alias.
//
// Pure functions over tensors; no I/O.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/models/model.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {

// The layout recorded in an exported file's __metadata__ ("layout") and
// expected on import.
inline constexpr std::string_view kTorchLayout = "pytorch-v1";

// One meshtrain parameter inside a PyTorch tensor.
struct TorchPart {
  std::string param;       // meshtrain name, e.g. "block0.attn.q.w"
  bool transpose = false;  // a 2-D parameter held transposed by PyTorch
  Shape shape;             // meshtrain's shape of it
};

// One PyTorch tensor: its parts (after transposition) stacked along dim 0.
struct TorchTensor {
  std::string name;  // e.g. "transformer.h.0.attn.c_attn.weight"
  Shape shape;       // PyTorch's shape
  std::vector<TorchPart> parts;
  // Other names a PyTorch file may hold the same values under (a tied
  // weight), e.g. "lm_head.weight" for the GPT's token embedding.
  std::vector<std::string> aliases;
};

struct TorchNameMap {
  std::string model;                 // ModelSpec::kind
  std::string naming;                // "meshtrain" (MLP, CNN) or "nanogpt" (GPT)
  std::vector<TorchTensor> tensors;  // in the order of the model's parameters

  const TorchTensor* find(std::string_view name) const;  // by name, not alias
};

// The map for the model `spec` describes. Every parameter of the model's
// graph is in exactly one part of one tensor (checked). Throws ConfigError
// for a spec build_model refuses.
TorchNameMap torch_name_map(const ModelSpec& spec);

// Whole f32 parameters (meshtrain names and shapes) to PyTorch tensors, one
// per map entry. ShapeError naming the parameter if one is missing or has
// another shape or dtype.
std::map<std::string, Tensor> to_torch(const TorchNameMap& map,
                                       const std::map<std::string, Tensor>& params);

// Writes the f32 PyTorch tensor `value` (shape t.shape) into its parameters,
// which must be in `params` with their meshtrain shapes (e.g. views into a
// ParamStore). ShapeError on any mismatch.
void from_torch(const TorchTensor& t, const Tensor& value, std::map<std::string, Tensor>& params);

}  // namespace mt
