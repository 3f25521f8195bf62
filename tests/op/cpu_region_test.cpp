// CPU region ops: copy's dtype check, cast (bit-exact round-to-nearest-even over every pattern,
// checked against a by-value reference and, where the CPU has F16C, the hardware), check_clip
// (NaN/Inf flag, accumulation), loss_scale_update (floor, growth, cap). fill, copy and the
// unscaled-gradient clip against the reference are the sweep's rows (tests/sweep/).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kiln/core/dtype.h"
#include "op/cpu_op_test_util.h"

namespace kiln::test {
namespace {

TEST(CpuOpCopy, RejectsDtypeChanges) {
  OpHarness bad;
  const TensorId a = bad.tensor("a", {4}, Region::scalars),
                 b = bad.tensor("b", {4}, Region::scalars, DType::I32);
  bad.node(OpKind::copy, {a}, {b});
  EXPECT_THROW(compile_cpu(bad), Error);
}

// ---- cast ----------------------------------------------------------------------------------
// FP16/BF16 tensors exist only under AMP, which the CPU backend refuses, so these programs
// are compiled without validate_program: the kernel itself is what is under test (the CUDA
// backend's cast must give the same bits).

class CastProgram {
 public:
  CastProgram(int64_t n, DType from, DType to) {
    Region rf = from == DType::F32 ? Region::params_f32 : Region::params_f16;
    Region rt = to == DType::F32 ? Region::grads_f32 : Region::grads_f16;
    x_ = h_.tensor("x", {n}, rf, from);
    y_ = h_.tensor("y", {n}, rt, to);
    h_.node(OpKind::cast, {x_}, {y_});
    plan_memory(h_.program());
    backend_ = make_backend("cpu");
    backend_->prepare(h_.program());
  }
  template <typename In, typename Out>
  std::vector<Out> run(const std::vector<In>& in) {
    backend_->write(h_.program().tensor(x_), in.data());
    backend_->run(Schedule::train, 0);
    std::vector<Out> out(in.size());
    backend_->read(h_.program().tensor(y_), out.data());
    return out;
  }

 private:
  OpHarness h_;
  std::unique_ptr<Backend> backend_;
  TensorId x_, y_;
};

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Independent decoders: sign, exponent and fraction by value.
double half_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31)
    return m ? std::numeric_limits<double>::quiet_NaN()
             : s * std::numeric_limits<double>::infinity();
  return s * (e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25));
}
double bf16_value(uint16_t h) {
  return static_cast<double>(float_of(static_cast<uint32_t>(h) << 16));
}

// Inputs that exercise every rounding decision: for each 16-bit pattern's value v (the
// representable values of the target format), v itself, the midpoint to the next value
// (a tie: must go to the even neighbour), and the floats just below and above the midpoint;
// plus zeros, Inf, NaN, the overflow boundary and FP32 subnormals.
std::vector<float> rounding_probes(double (*value)(uint16_t)) {
  std::vector<float> in;
  for (uint32_t b = 0; b < 0x7c00u || (value == bf16_value && b < 0x7f80u); ++b) {
    for (uint32_t sign : {0u, 0x8000u}) {
      const double v = value(static_cast<uint16_t>(b | sign)),
                   next = value(static_cast<uint16_t>((b + 1) | sign));
      if (std::isnan(v) || std::isinf(v)) continue;
      in.push_back(static_cast<float>(v));
      if (std::isinf(next) || std::isnan(next)) continue;
      const auto mid =
          static_cast<float>((v + next) / 2);  // exact in FP32 for both formats' ranges
      in.push_back(mid);
      in.push_back(std::nextafter(mid, 0.0f));
      in.push_back(std::nextafter(mid, std::copysign(INFINITY, mid)));
    }
  }
  for (float f :
       {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 65504.0f, 65519.996f, 65520.0f, -65520.0f, 1e-8f,
        0x1p-25f, 0x1.8p-25f, 0x1p-24f, 0x1p-149f, 0x1p-130f, -0x1.fffffcp-127f, 3.4028235e38f})
    in.push_back(f);
  return in;
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t hw_half(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// f32 -> f16: the value of the result equals round-to-nearest-even of the input (ties to
// even, overflow to Inf from 65520 on, gradual underflow, signed zeros); NaN stays a quiet
// NaN. Where the CPU has F16C, the bits equal the hardware's conversion too.
TEST(CpuOpCast, F32ToF16IsRoundToNearestEvenBitExact) {
  const std::vector<float> in = rounding_probes(half_value);
  CastProgram p(static_cast<int64_t>(in.size()), DType::F32, DType::F16);
  const auto out = p.run<float, uint16_t>(in);
#if defined(__x86_64__)
  const bool f16c = __builtin_cpu_supports("f16c");
#endif
  for (size_t i = 0; i < in.size(); ++i) {
    const double want = ref::round_to_half(in[i]);
    const double got = half_value(out[i]);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got) && (out[i] & 0x200))
          << "NaN must stay a quiet NaN, input " << in[i];
      continue;
    }
    ASSERT_EQ(got, want) << "input " << in[i] << " (bits 0x" << std::hex << bits_of(in[i]) << ")";
    ASSERT_EQ(std::signbit(got), std::signbit(in[i])) << "sign of " << in[i];
#if defined(__x86_64__)
    if (f16c) ASSERT_EQ(out[i], hw_half(in[i])) << "F16C disagrees for input " << in[i];
#endif
  }
}

// f32 -> bf16: the same by-value rule with 7 fraction bits and FP32's exponent range.
TEST(CpuOpCast, F32ToBf16IsRoundToNearestEvenBitExact) {
  const std::vector<float> in = rounding_probes(bf16_value);
  CastProgram p(static_cast<int64_t>(in.size()), DType::F32, DType::BF16);
  const auto out = p.run<float, uint16_t>(in);
  for (size_t i = 0; i < in.size(); ++i) {
    const double want = ref::round_to_bf16(in[i]);
    const double got = bf16_value(out[i]);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got) && (out[i] & 0x40)) << "NaN must stay a quiet NaN";
      continue;
    }
    ASSERT_EQ(got, want) << "input " << in[i] << " (bits 0x" << std::hex << bits_of(in[i]) << ")";
    ASSERT_EQ(std::signbit(got), std::signbit(in[i]));
  }
}

// f16/bf16 -> f32 widens exactly: every one of the 65536 patterns.
TEST(CpuOpCast, WideningIsExactForEveryPattern) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (DType from : {DType::F16, DType::BF16}) {
    CastProgram p(65536, from, DType::F32);
    const auto out = p.run<uint16_t, float>(all);
    for (uint32_t i = 0; i < 65536; ++i) {
      const double want = from == DType::F16 ? half_value(all[i]) : bf16_value(all[i]);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[i])) << std::hex << i;
      } else {
        ASSERT_EQ(static_cast<double>(out[i]), want) << dtype_name(from) << " 0x" << std::hex << i;
        ASSERT_EQ(std::signbit(out[i]), (i & 0x8000u) != 0);
      }
    }
  }
}

// f16 -> bf16 goes through f32 (exact) with one rounding.
TEST(CpuOpCast, F16ToBf16RoundsOnce) {
  std::vector<uint16_t> in;
  for (uint32_t i = 0; i < 0x7c00u; i += 7) in.push_back(static_cast<uint16_t>(i));
  CastProgram p(static_cast<int64_t>(in.size()), DType::F16, DType::BF16);
  const auto out = p.run<uint16_t, uint16_t>(in);
  for (size_t i = 0; i < in.size(); ++i)
    ASSERT_EQ(bf16_value(out[i]), ref::round_to_bf16(half_value(in[i])));
}

// ---- check_clip ----------------------------------------------------------------------------

struct ClipProgram {
  OpHarness h;
  TensorId g, g2, scale, overflow;
  ClipProgram(int64_t n, float clip, bool second_accumulates) {
    g = h.tensor("g", {n}, Region::grads_f32);
    g2 = h.tensor("g2", {n}, Region::grads_f32);
    scale = h.tensor("loss_scale", {1}, Region::scalars);
    overflow = h.tensor("overflow", {1}, Region::scalars, DType::I32);
    Attrs a;
    a.clip = clip;
    h.node(OpKind::check_clip, {g, scale}, {overflow, g}, a);
    a.accumulate = second_accumulates;
    h.node(OpKind::check_clip, {g2, scale}, {overflow}, a);
    compile_cpu(h);
  }
};

// Finite gradients: no overflow, and without clipping g is untouched. One Inf, -Inf or NaN
// anywhere sets the flag.
TEST(CpuOpCheckClip, FlagsNanAndInf) {
  const int64_t n = 1001;
  ClipProgram p(n, 0.0f, true);
  const auto gv = rand_vec(n, 131, -1e4f, 1e4f);
  p.h.write(p.scale, {8192.0f});
  p.h.write(p.g, gv);
  p.h.write(p.g2, gv);
  p.h.write_i32(p.overflow, {1});  // stale flag from a previous step: the first node overwrites it
  p.h.run();
  EXPECT_EQ(p.h.read_i32(p.overflow)[0], 0);
  EXPECT_EQ(p.h.read(p.g), gv);
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    auto b = gv;
    b[n / 2] = bad;
    p.h.write(p.g, b);
    p.h.run();
    EXPECT_EQ(p.h.read_i32(p.overflow)[0], 1) << bad;
  }
}

// With accumulate, a second node ORs into the flag (a check split over several ranges);
// without, it overwrites it (one node is meant to cover the whole gradient region).
TEST(CpuOpCheckClip, AccumulateOrsTheFlag) {
  for (bool acc : {true, false}) {
    ClipProgram p(10, 0.0f, acc);
    auto gv = rand_vec(10, 132);
    p.h.write(p.scale, {1.0f});
    p.h.write(p.g2, gv);
    gv[3] = NAN;
    p.h.write(p.g, gv);
    p.h.run();
    EXPECT_EQ(p.h.read_i32(p.overflow)[0], acc ? 1 : 0);
  }
}

// ---- loss_scale_update ---------------------------------------------------------------------

struct ScaleProgram {
  OpHarness h;
  TensorId overflow, scale, good;
  explicit ScaleProgram(int64_t growth_interval) {
    overflow = h.tensor("overflow", {1}, Region::scalars, DType::I32);
    scale = h.tensor("loss_scale", {1}, Region::scalars);
    good = h.tensor("good_steps", {1}, Region::scalars, DType::I32);
    Attrs a;
    a.growth_interval = growth_interval;
    h.node(OpKind::loss_scale_update, {overflow, scale, good}, {scale, good}, a);
    compile_cpu(h);
  }
  void step(bool of) {
    h.write_i32(overflow, {of ? 1 : 0});
    h.run();
  }
  float s() { return h.read(scale)[0]; }
  int32_t k() { return h.read_i32(good)[0]; }
};

// 100 overflows from 8192: halving to 1 after 13 steps, then held at the floor of 1.
TEST(CpuOpLossScaleUpdate, HalvesOnOverflowWithAFloorOfOne) {
  ScaleProgram p(2000);
  p.h.write(p.scale, {8192.0f});
  p.h.write_i32(p.good, {5});
  ref::LossScaleState r;
  for (int i = 0; i < 100; ++i) {
    p.step(true);
    ref::loss_scale_update(r, true, 2000);
    ASSERT_EQ(p.s(), r.scale) << "after overflow " << i + 1;
    ASSERT_EQ(p.k(), 0);
  }
  EXPECT_EQ(p.s(), 1.0f);
}

// Growth: after growth_interval clean steps the scale doubles and the count restarts; an
// overflow in between resets the count. A random pattern follows the reference exactly.
TEST(CpuOpLossScaleUpdate, GrowsAfterTheIntervalAndFollowsTheReference) {
  ScaleProgram p(3);
  p.h.write(p.scale, {8192.0f});
  p.step(false);
  p.step(false);
  EXPECT_EQ(p.s(), 8192.0f);
  EXPECT_EQ(p.k(), 2);
  p.step(false);
  EXPECT_EQ(p.s(), 16384.0f);
  EXPECT_EQ(p.k(), 0);
  p.step(false);
  p.step(true);
  EXPECT_EQ(p.s(), 8192.0f);
  EXPECT_EQ(p.k(), 0);

  ref::LossScaleState r{8192.0, 0};
  Rng rng(134);
  for (int i = 0; i < 200; ++i) {
    const bool of = rng.uniform() < 0.2;
    p.step(of);
    ref::loss_scale_update(r, of, 3);
    ASSERT_EQ(p.s(), r.scale) << "step " << i;
    ASSERT_EQ(p.k(), r.good_steps) << "step " << i;
  }
}

// growth_interval 0: the scale only falls (the source's behaviour). The scale never grows
// to Inf (2^127 is the cap), from which halving could not recover.
TEST(CpuOpLossScaleUpdate, NoGrowthWhenIntervalIsZeroAndNoInfinity) {
  ScaleProgram never(0);
  never.h.write(never.scale, {4.0f});
  for (int i = 0; i < 50; ++i) never.step(false);
  EXPECT_EQ(never.s(), 4.0f);
  EXPECT_EQ(never.k(), 50);

  ScaleProgram fast(1);
  fast.h.write(fast.scale, {0x1p126f});
  for (int i = 0; i < 5; ++i) fast.step(false);
  EXPECT_EQ(fast.s(), 0x1p127f);
  fast.step(true);
  EXPECT_EQ(fast.s(), 0x1p126f);
}

}  // namespace
}  // namespace kiln::test
