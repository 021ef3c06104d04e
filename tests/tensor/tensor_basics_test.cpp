#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "meshtrain/tensor/memory_stats.h"
#include "meshtrain/tensor/tensor.h"

namespace mt {
namespace {

TEST(Tensor, ReshapeSharesMemoryAndChecksCount) {
  Tensor t = Tensor::zeros({2, 3}, DType::f32);
  Tensor r = t.reshape({3, 2});
  r.set_item(5, 7.0);
  EXPECT_EQ(t.item(5), 7.0);
  EXPECT_THROW(t.reshape({4, 2}), ShapeError);
}

TEST(Tensor, WrongDtypeAccessIsAnInternalError) {
  Tensor t = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(t.data<double>(), InternalError);
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(DType, F16RoundTripsAndSaturates) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f}) {
    EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v) << v;
  }
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f + 1.0f / 2048)), 1.0f);  // tie to even
}

TEST(DType, ConvertBetweenAllFloatTypes) {
  Tensor a = Tensor::full({3}, DType::f32, 1.5);
  for (DType t : {DType::f64, DType::bf16, DType::f16, DType::i32}) {
    Tensor b = a.to(t).to(DType::f32);
    EXPECT_EQ(b.item(2), t == DType::i32 ? 1.0 : 1.5) << dtype_name(t);
  }
  EXPECT_THROW(parse_dtype("f8"), ConfigError);
}

TEST(MemoryCounters, CountTaggedAllocationsUntilTheLastHandleGoes) {
  const MemoryCounters before = memory_counters();
  const int64_t opt0 = before.live_of(MemoryCategory::optimizer);
  const int64_t other0 = before.live_of(MemoryCategory::other);
  Tensor outer;
  {
    MemoryScope tag(MemoryCategory::optimizer);
    Tensor a = Tensor::zeros({100}, DType::f32);  // 400 bytes, 448 with the 64-byte rounding
    {
      MemoryScope inner(MemoryCategory::grads);
      outer = Tensor::empty({3}, DType::f64);  // 24 -> 64
    }
    Tensor b = a.clone();  // tagged like a: the scope is the optimizer's again
    EXPECT_EQ(current_memory_category(), MemoryCategory::optimizer);
    EXPECT_EQ(memory_counters().live_of(MemoryCategory::optimizer) - opt0, 2 * 448);
    Tensor view = Tensor::wrap(a.raw(), {10}, DType::f32);  // borrowed: not counted
    EXPECT_EQ(memory_counters().live_of(MemoryCategory::optimizer) - opt0, 2 * 448);
    EXPECT_GE(memory_counters().peak_of(MemoryCategory::optimizer) - opt0, 2 * 448);
  }
  EXPECT_EQ(current_memory_category(), MemoryCategory::other);
  const MemoryCounters after = memory_counters();
  EXPECT_EQ(after.live_of(MemoryCategory::optimizer), opt0);  // a and b are gone
  EXPECT_EQ(after.live_of(MemoryCategory::grads) - before.live_of(MemoryCategory::grads), 64);
  Tensor copy = outer;  // a second handle: freed with the last one only
  outer = Tensor();
  EXPECT_EQ(
      memory_counters().live_of(MemoryCategory::grads) - before.live_of(MemoryCategory::grads), 64);
  copy = Tensor();
  EXPECT_EQ(memory_counters().live_of(MemoryCategory::grads),
            before.live_of(MemoryCategory::grads));
  Tensor untagged = Tensor::zeros({16}, DType::f32);  // 64 bytes, "other"
  EXPECT_EQ(memory_counters().live_of(MemoryCategory::other) - other0, 64);
  reset_memory_peaks();
  EXPECT_EQ(memory_counters().peak_of(MemoryCategory::optimizer), opt0);
  EXPECT_EQ(memory_category_name(MemoryCategory::activations), "activations");
}

}  // namespace
}  // namespace mt
