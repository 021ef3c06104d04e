#include "meshtrain/models/layers.h"

#include <cmath>

namespace mt::layers {

ParamInit fan_in_uniform(int64_t fan_in) {
  return ParamInit{ParamInit::Kind::uniform, 1.0 / std::sqrt(static_cast<double>(fan_in))};
}

DType activation_dtype(DType compute) {
  return compute == DType::bf16 ? DType::bf16 : DType::f32;
}

ValueId to_compute(Builder& b, ValueId v, DType compute) {
  if (compute == DType::f32) return v;
  return b.cast(v, compute);
}

ValueId linear(Builder& b, ValueId x, int64_t in, int64_t out, const std::string& name,
               DType compute, ParamInit w_init, bool bias, LinearOut out_kind) {
  b.push_scope(name);
  ValueId w = b.param("w", {in, out}, w_init);
  const DType y_dtype = out_kind == LinearOut::f32 ? DType::f32 : activation_dtype(compute);
  ValueId y = b.matmul(to_compute(b, x, compute), to_compute(b, w, compute), false, false,
                       compute == DType::f32 ? std::nullopt : std::optional<DType>(y_dtype));
  if (bias) y = b.add(y, b.cast(b.param("b", {out}, fan_in_uniform(in)), y_dtype));
  b.pop_scope();
  return y;
}

}  // namespace mt::layers
