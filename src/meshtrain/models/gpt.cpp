#include <cmath>

#include "meshtrain/graph/builder.h"
#include "meshtrain/models/layers.h"
#include "meshtrain/models/model.h"

namespace mt {

namespace {

// Causal multi-head self-attention over h [B*T, C]; returns [B*T, C].
ValueId attention(Builder& b, ValueId h, const ModelSpec& s, int64_t batch) {
  const int64_t C = s.d_model, T = s.seq_len, H = s.heads, D = C / H;
  const ParamInit w_init{ParamInit::Kind::normal, 0.02};
  auto heads_first = [&](ValueId v) {  // [B*T, C] -> [B*H, T, D]
    v = b.permute(b.reshape(v, {batch, T, H, D}), {0, 2, 1, 3});
    return b.reshape(v, {batch * H, T, D});
  };
  b.push_scope("attn");
  ValueId q = heads_first(layers::linear(b, h, C, C, "q", s.compute, w_init));
  ValueId k = heads_first(layers::linear(b, h, C, C, "k", s.compute, w_init));
  ValueId v = heads_first(layers::linear(b, h, C, C, "v", s.compute, w_init));
  ValueId scores = b.scale(b.matmul(layers::to_compute(b, q, s.compute),
                                    layers::to_compute(b, k, s.compute), false, true),
                           1.0 / std::sqrt(static_cast<double>(D)));
  ValueId p = b.softmax(scores, /*causal=*/true);
  // Under bf16 q, k, v and the attention output stay in bf16 (see
  // layers::activation_dtype); scores and their softmax are f32.
  ValueId o =
      b.matmul(layers::to_compute(b, p, s.compute), layers::to_compute(b, v, s.compute), false,
               false, s.compute == DType::f32 ? std::nullopt : std::optional<DType>(s.compute));
  o = b.permute(b.reshape(o, {batch, H, T, D}), {0, 2, 1, 3});
  o = b.reshape(o, {batch * T, C});
  // GPT-2 scales the residual projections' init by 1/sqrt(2 * layers).
  const ParamInit proj_init{ParamInit::Kind::normal,
                            0.02 / std::sqrt(2.0 * static_cast<double>(s.layers))};
  o = layers::linear(b, o, C, C, "proj", s.compute, proj_init, true, layers::LinearOut::f32);
  b.pop_scope();
  return o;
}

ValueId layer_norm(Builder& b, ValueId x, int64_t C, const std::string& name) {
  b.push_scope(name);
  ValueId g = b.param("g", {C}, ParamInit{ParamInit::Kind::ones, 0});
  ValueId beta = b.param("b", {C}, ParamInit{ParamInit::Kind::zeros, 0});
  b.pop_scope();
  return b.layer_norm(x, g, beta, 1e-5);
}

}  // namespace

ModelGraph build_gpt(const ModelSpec& s, int64_t batch) {
  if (s.heads <= 0 || s.d_model % s.heads != 0) {
    throw ConfigError(
        fmt::format("model.heads: d_model {} is not divisible by heads {}", s.d_model, s.heads));
  }
  ModelGraph m;
  m.batch = batch;
  Builder b(m.graph);
  const int64_t C = s.d_model, T = s.seq_len;
  const ParamInit w_init{ParamInit::Kind::normal, 0.02};
  m.x = b.input("x", {batch, T}, DType::i32);
  m.y = b.input("y", {batch * T}, DType::i32);
  ValueId pos = b.input("pos", {T}, DType::i32);
  Tensor pos_ids = Tensor::empty({T}, DType::i32);
  for (int64_t t = 0; t < T; ++t) pos_ids.data<int32_t>()[t] = static_cast<int32_t>(t);
  m.constants.emplace_back(pos, pos_ids);

  ValueId wte = b.param("wte", {s.vocab, C}, w_init);
  ValueId wpe = b.param("wpe", {T, C}, ParamInit{ParamInit::Kind::normal, 0.01});
  ValueId h = b.add(b.embedding(wte, m.x), b.embedding(wpe, pos));  // [B, T, C] + [T, C]
  h = b.reshape(h, {batch * T, C});
  for (int64_t l = 0; l < s.layers; ++l) {
    b.push_scope("block" + std::to_string(l));
    h = b.add(h, attention(b, layer_norm(b, h, C, "ln1"), s, batch));
    ValueId f = layer_norm(b, h, C, "ln2");
    f = b.gelu(layers::linear(b, f, C, 4 * C, "fc", s.compute, w_init));
    const ParamInit proj_init{ParamInit::Kind::normal,
                              0.02 / std::sqrt(2.0 * static_cast<double>(s.layers))};
    h = b.add(h, layers::linear(b, f, 4 * C, C, "proj", s.compute, proj_init, true,
                                layers::LinearOut::f32));
    b.pop_scope();
  }
  h = layer_norm(b, h, C, "ln_f");
  // Tied output head: logits = h @ wte^T.
  m.logits = b.matmul(layers::to_compute(b, h, s.compute), layers::to_compute(b, wte, s.compute),
                      false, true);
  m.loss = b.cross_entropy(m.logits, m.y);
  return m;
}

ModelGraph build_model(const ModelSpec& spec, int64_t batch) {
  if (batch <= 0)
    throw ConfigError(fmt::format("train.batch_size: must be positive, got {}", batch));
  if (spec.kind == "mlp") return build_mlp(spec, batch);
  if (spec.kind == "cnn") return build_cnn(spec, batch);
  if (spec.kind == "gpt") return build_gpt(spec, batch);
  if (is_gnn(spec.kind)) {
    throw ConfigError(fmt::format(
        "model.kind: '{}' is a graph neural network, built for a graph (build_gnn) with "
        "data.kind = \"graph\", not for batches of examples",
        spec.kind));
  }
  throw ConfigError(
      fmt::format("model.kind: unknown model '{}' (expected mlp, cnn or gpt)", spec.kind));
}

}  // namespace mt
