#include "meshtrain/graph/builder.h"
#include "meshtrain/models/layers.h"
#include "meshtrain/models/model.h"

namespace mt {

ModelGraph build_cnn(const ModelSpec& spec, int64_t batch) {
  ModelGraph m;
  m.batch = batch;
  Builder b(m.graph);
  int64_t c = spec.image_channels, s = spec.image_size;
  m.x = b.input("x", {batch, c, s, s});
  m.y = b.input("y", {batch}, DType::i32);
  ValueId h = m.x;
  for (size_t i = 0; i < spec.conv_channels.size(); ++i) {
    const int64_t out = spec.conv_channels[i];
    if (s % 2 != 0) {
      throw ConfigError(
          fmt::format("model.conv_channels: block {} gets a {}x{} input, which a "
                      "2x2 pooling cannot halve",
                      i + 1, s, s));
    }
    b.push_scope("conv" + std::to_string(i + 1));
    ValueId w = b.param("w", {out, c, 3, 3}, layers::fan_in_uniform(c * 9));
    ValueId bias = b.param("b", {out}, layers::fan_in_uniform(c * 9));
    b.pop_scope();
    // Convolutions stay f32 under mixed precision (only matmuls run in bf16/f16).
    h = b.conv2d(h, w, bias, Conv2dParams{1, 1, 1, 1});
    h = b.max_pool2d(b.relu(h), Pool2dParams{});
    c = out;
    s /= 2;
  }
  const int64_t flat = c * s * s;
  h = b.reshape(h, {batch, flat});
  h = b.relu(
      layers::linear(b, h, flat, spec.fc, "fc1", spec.compute, layers::fan_in_uniform(flat)));
  m.logits = layers::linear(b, h, spec.fc, spec.classes, "head", spec.compute,
                            layers::fan_in_uniform(spec.fc), true, layers::LinearOut::f32);
  m.loss = b.cross_entropy(m.logits, m.y);
  return m;
}

}  // namespace mt
