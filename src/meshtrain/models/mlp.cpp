#include "meshtrain/graph/builder.h"
#include "meshtrain/models/layers.h"
#include "meshtrain/models/model.h"

namespace mt {

ModelGraph build_mlp(const ModelSpec& spec, int64_t batch) {
  ModelGraph m;
  m.batch = batch;
  Builder b(m.graph);
  const int64_t in = spec.image_channels * spec.image_size * spec.image_size;
  m.x = b.input("x", {batch, in});
  m.y = b.input("y", {batch}, DType::i32);
  ValueId h = m.x;
  int64_t width = in;
  for (size_t i = 0; i < spec.hidden.size(); ++i) {
    const int64_t out = spec.hidden[i];
    h = b.relu(layers::linear(b, h, width, out, "fc" + std::to_string(i + 1), spec.compute,
                              layers::fan_in_uniform(width)));
    width = out;
  }
  m.logits = layers::linear(b, h, width, spec.classes, "head", spec.compute,
                            layers::fan_in_uniform(width), true, layers::LinearOut::f32);
  m.loss = b.cross_entropy(m.logits, m.y);
  return m;
}

}  // namespace mt
