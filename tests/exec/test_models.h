// Small graphs shared by the exec tests: an MLP and a one-block transformer
// that together use every forward operator the models use.
#pragma once

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "meshtrain/graph/autodiff.h"
#include "meshtrain/graph/builder.h"
#include "meshtrain/tensor/tensor.h"

namespace mt::testing_models {

struct Model {
  Graph g;
  ValueId x = kNoValue;
  ValueId labels = kNoValue;
  ValueId logits = kNoValue;
  ValueId loss = kNoValue;
  std::map<ValueId, int> int_high;  // i32 inputs: values drawn from [0, high)
};

inline const ParamInit kInit{ParamInit::Kind::normal, 0.3};

// x [batch, widths[0]] -> (matmul + bias, relu or gelu)* -> logits -> cross-entropy.
// compute bf16 (or f16): matmul operands and hidden activations (bias and
// activation function included) in that dtype, logits f32 -- the models'
// bf16 mixed precision (the models keep f16 activations in f32; here they are
// f16, which checks the 16-bit element-wise paths under f16 too).
inline Model mlp(int64_t batch, const std::vector<int64_t>& widths, bool gelu = false,
                 bool differentiate = true, DType compute = DType::f32) {
  Model m;
  Builder b(m.g);
  m.x = b.input("x", {batch, widths[0]});
  m.labels = b.input("labels", {batch}, DType::i32);
  m.int_high[m.labels] = static_cast<int>(widths.back());
  ValueId h = m.x;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    b.push_scope("fc" + std::to_string(l + 1));
    ValueId w = b.param("w", {widths[l], widths[l + 1]}, kInit);
    ValueId bias = b.param("b", {widths[l + 1]}, kInit);
    if (compute == DType::f32) {
      h = b.add(b.matmul(h, w), bias);
    } else {
      const DType out = l + 2 < widths.size() ? compute : DType::f32;
      h = b.add(b.matmul(b.cast(h, compute), b.cast(w, compute), false, false, out),
                b.cast(bias, out));
    }
    if (l + 2 < widths.size()) h = gelu ? b.gelu(h) : b.relu(h);
    b.pop_scope();
  }
  m.logits = h;
  m.loss = b.name(b.cross_entropy(h, m.labels), "loss");
  if (differentiate) build_backward(m.g, m.loss);
  return m;
}

// One pre-norm transformer block with causal attention and a tied head.
// `compute` is the matmul operand dtype (f32, or bf16/f16 for mixed precision).
inline Model tiny_transformer(DType compute, bool differentiate = true) {
  const int64_t B = 2, T = 4, C = 8, H = 2, D = C / H, V = 11;
  Model m;
  Builder b(m.g);
  auto op = [&](ValueId v) { return compute == DType::f32 ? v : b.cast(v, compute); };
  auto ln = [&](ValueId v, const std::string& name) {
    b.push_scope(name);
    ValueId gamma = b.param("g", {C}, ParamInit{ParamInit::Kind::ones, 0});
    ValueId beta = b.param("b", {C}, kInit);
    b.pop_scope();
    return b.layer_norm(v, gamma, beta);
  };
  auto heads = [&](ValueId v) {  // [B*T, C] -> [B*H, T, D]
    return b.reshape(b.permute(b.reshape(v, {B, T, H, D}), {0, 2, 1, 3}), {B * H, T, D});
  };
  m.x = b.input("ids", {B, T}, DType::i32);
  m.labels = b.input("labels", {B * T}, DType::i32);
  ValueId pos = b.input("pos", {T}, DType::i32);
  m.int_high = {
      {m.x, static_cast<int>(V)}, {m.labels, static_cast<int>(V)}, {pos, static_cast<int>(T)}};
  ValueId wte = b.param("wte", {V, C}, kInit);
  ValueId wpe = b.param("wpe", {T, C}, kInit);
  ValueId h = b.reshape(b.add(b.embedding(wte, m.x), b.embedding(wpe, pos)), {B * T, C});
  ValueId a = ln(h, "ln1");
  ValueId q = heads(b.matmul(op(a), op(b.param("wq", {C, C}, kInit))));
  ValueId k = heads(b.matmul(op(a), op(b.param("wk", {C, C}, kInit))));
  ValueId v = heads(b.matmul(op(a), op(b.param("wv", {C, C}, kInit))));
  ValueId p = b.softmax(b.scale(b.matmul(op(q), op(k), false, true), 1.0 / std::sqrt(D)), true);
  ValueId o = b.matmul(op(p), op(v));
  o = b.reshape(b.permute(b.reshape(o, {B, H, T, D}), {0, 2, 1, 3}), {B * T, C});
  h = b.add(h, b.matmul(op(o), op(b.param("wo", {C, C}, kInit))));
  ValueId f = ln(h, "ln2");
  f = b.gelu(
      b.add(b.matmul(op(f), op(b.param("w1", {C, 2 * C}, kInit))), b.param("b1", {2 * C}, kInit)));
  h = b.add(h, b.matmul(op(f), op(b.param("w2", {2 * C, C}, kInit))));
  ValueId hf = ln(h, "ln_f");
  m.logits = b.matmul(op(hf), op(wte), false, true);
  m.loss = b.name(b.cross_entropy(m.logits, m.labels), "loss");
  if (differentiate) build_backward(m.g, m.loss);
  return m;
}

// Deterministic random contents for every input and parameter of m.g.
inline std::map<ValueId, Tensor> random_bindings(const Model& m, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::map<ValueId, Tensor> out;
  std::vector<ValueId> ids = m.g.inputs();
  ids.insert(ids.end(), m.g.params().begin(), m.g.params().end());
  for (ValueId id : ids) {
    const Value& v = m.g.value(id);
    Tensor t = Tensor::empty(v.shape, v.dtype);
    if (v.dtype == DType::i32) {
      std::uniform_int_distribution<int> d(0, m.int_high.at(id) - 1);
      for (int64_t i = 0; i < t.numel(); ++i) t.data<int32_t>()[i] = d(rng);
    } else {
      std::normal_distribution<double> d(0.0, v.role == ValueRole::param ? 0.3 : 1.0);
      for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, d(rng));
    }
    out[id] = t;
  }
  return out;
}

}  // namespace mt::testing_models
