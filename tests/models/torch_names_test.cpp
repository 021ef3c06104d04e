// The PyTorch name and layout map (models/torch_names.h): it covers every
// parameter of each model once, in PyTorch's shapes; values land where
// PyTorch expects them (transposed linear weights, fused q/k/v in order);
// to_torch and from_torch are exact inverses.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "meshtrain/base/error.h"
#include "meshtrain/models/torch_names.h"

namespace mt {
namespace {

using Tensors = std::map<std::string, Tensor>;

ModelSpec spec_of(const std::string& kind) {
  ModelSpec s;
  s.kind = kind;
  s.hidden = {12, 7};
  s.image_size = 8;
  s.conv_channels = {3, 5};
  s.fc = 6;
  s.layers = 2;
  s.d_model = 8;
  s.heads = 2;
  s.seq_len = 5;
  s.vocab = 11;
  return s;
}

// Random values for every parameter of the model, by meshtrain name.
Tensors random_params(const ModelSpec& spec, uint32_t seed) {
  const ModelGraph m = build_model(spec, 1);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  Tensors out;
  for (ValueId id : m.graph.params()) {
    Tensor t = Tensor::empty(m.graph.value(id).shape, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = u(rng);
    out.emplace(m.graph.value(id).name, t);
  }
  return out;
}

float at2(const Tensor& t, int64_t r, int64_t c) {
  return t.data<float>()[r * t.shape()[1] + c];
}

TEST(TorchNames, EveryParameterOnceInPyTorchShapes) {
  for (const char* kind : {"mlp", "cnn", "gpt"}) {
    const ModelSpec s = spec_of(kind);
    const TorchNameMap map = torch_name_map(s);
    const Tensors params = random_params(s, 1);
    int64_t elems = 0, mapped = 0;
    size_t parts = 0;
    for (const auto& [name, t] : params) elems += t.numel();
    for (const TorchTensor& t : map.tensors) {
      mapped += t.shape.numel();
      parts += t.parts.size();
    }
    EXPECT_EQ(mapped, elems) << kind;
    EXPECT_EQ(parts, params.size()) << kind;
  }
  const TorchNameMap mlp = torch_name_map(spec_of("mlp"));
  ASSERT_NE(mlp.find("fc1.weight"), nullptr);
  EXPECT_EQ(mlp.find("fc1.weight")->shape, Shape({12, 64}));  // [out, in]
  EXPECT_EQ(mlp.find("head.bias")->shape, Shape({10}));
  EXPECT_EQ(mlp.naming, "meshtrain");
  const TorchNameMap cnn = torch_name_map(spec_of("cnn"));
  EXPECT_EQ(cnn.find("conv2.weight")->shape, Shape({5, 3, 3, 3}));  // Conv2d as is
  EXPECT_EQ(cnn.find("fc1.weight")->shape, Shape({6, 5 * 2 * 2}));
  const TorchNameMap gpt = torch_name_map(spec_of("gpt"));
  EXPECT_EQ(gpt.naming, "nanogpt");
  EXPECT_EQ(gpt.find("transformer.wte.weight")->shape, Shape({11, 8}));
  EXPECT_EQ(gpt.find("transformer.wte.weight")->aliases,
            std::vector<std::string>{"lm_head.weight"});
  EXPECT_EQ(gpt.find("transformer.h.1.attn.c_attn.weight")->shape, Shape({24, 8}));
  EXPECT_EQ(gpt.find("transformer.h.1.attn.c_attn.bias")->shape, Shape({24}));
  EXPECT_EQ(gpt.find("transformer.h.0.mlp.c_fc.weight")->shape, Shape({32, 8}));
  EXPECT_EQ(gpt.find("transformer.h.0.mlp.c_proj.weight")->shape, Shape({8, 32}));
  EXPECT_NE(gpt.find("transformer.ln_f.bias"), nullptr);
  EXPECT_EQ(gpt.find("lm_head.weight"), nullptr);  // tied, not a tensor of its own
  EXPECT_EQ(gpt.tensors.size(), 2 + 2 * 12 + 2u);
}

TEST(TorchNames, LinearWeightsAreTransposedAndQkvFusedInOrder) {
  const ModelSpec mlp = spec_of("mlp");
  const Tensors p = random_params(mlp, 2);
  const Tensors t = to_torch(torch_name_map(mlp), p);
  const Tensor &w = p.at("fc2.w"), &tw = t.at("fc2.weight");  // [12, 7] and [7, 12]
  for (int64_t i = 0; i < 12; ++i) {
    for (int64_t o = 0; o < 7; ++o) ASSERT_EQ(at2(tw, o, i), at2(w, i, o)) << i << "," << o;
  }

  const ModelSpec gpt = spec_of("gpt");
  const Tensors g = random_params(gpt, 3);
  const Tensors tg = to_torch(torch_name_map(gpt), g);
  const Tensor& c_attn = tg.at("transformer.h.1.attn.c_attn.weight");  // [3C, C]
  const char* qkv[] = {"q", "k", "v"};
  for (int64_t part = 0; part < 3; ++part) {
    const Tensor& w2 = g.at(std::string("block1.attn.") + qkv[part] + ".w");  // [C, C] in, out
    const Tensor& b2 = g.at(std::string("block1.attn.") + qkv[part] + ".b");
    for (int64_t o = 0; o < 8; ++o) {
      EXPECT_EQ(tg.at("transformer.h.1.attn.c_attn.bias").data<float>()[part * 8 + o],
                b2.data<float>()[o]);
      for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(at2(c_attn, part * 8 + o, i), at2(w2, i, o));
    }
  }
  const Tensor& ln = tg.at("transformer.h.0.ln_2.weight");
  EXPECT_EQ(std::memcmp(ln.raw(), g.at("block0.ln2.g").raw(), ln.nbytes()), 0);
}

TEST(TorchNames, FromTorchInvertsToTorchBitwise) {
  for (const char* kind : {"mlp", "cnn", "gpt"}) {
    const ModelSpec s = spec_of(kind);
    const TorchNameMap map = torch_name_map(s);
    const Tensors src = random_params(s, 4);
    const Tensors torch = to_torch(map, src);
    Tensors dst = random_params(s, 5);
    for (const TorchTensor& t : map.tensors) from_torch(t, torch.at(t.name), dst);
    for (const auto& [name, t] : src) {
      ASSERT_EQ(std::memcmp(t.raw(), dst.at(name).raw(), t.nbytes()), 0) << kind << " " << name;
    }
  }
}

TEST(TorchNames, MismatchesAreNamed) {
  const ModelSpec s = spec_of("mlp");
  const TorchNameMap map = torch_name_map(s);
  Tensors p = random_params(s, 6);
  p["fc1.w"] = Tensor::zeros({12, 64}, DType::f32);  // transposed
  try {
    to_torch(map, p);
    FAIL() << "no error";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("fc1.w"), std::string::npos) << e.what();
  }
  p.erase("fc1.w");
  EXPECT_THROW(to_torch(map, p), ShapeError);
  Tensors dst = random_params(s, 7);
  EXPECT_THROW(from_torch(*map.find("fc1.weight"), Tensor::zeros({64, 12}, DType::f32), dst),
               ShapeError);
}

}  // namespace
}  // namespace mt
